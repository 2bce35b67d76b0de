"""Reading attribution graphs: the ones a user may see, one by id, and a graph's nodes and links
as the graph page and the export show them (pruned, labelled with what the viewer may see)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from circuits.models import AttributionGraph
from circuits.serializers import graph_state
from features.models import FeatureAnalysis
from features.selectors import analysis_list, best_explanations, labels_by_index
from mistudio.access import check_may_change, completed_row, may_see, visible_row, visible_rows
from mistudio.errors import ApplicationError
from mistudio.events import register_group_kind
from saes.models import SparseAutoencoder


def graph_list(*, user, model_id: str | None = None) -> QuerySet[AttributionGraph]:
    """Graphs the user may see: their own and shared ones (all for an admin)."""
    graphs = visible_rows(AttributionGraph.objects.select_related("owner"), user, shareable=True)
    return graphs.filter(model_id=model_id) if model_id else graphs


def graph_get(*, user, graph_id: str) -> AttributionGraph:
    return visible_row(graph_list(user=user), graph_id, code="GRAPH_NOT_FOUND", what="attribution graph")


def graph_get_to_change(*, user, graph_id: str) -> AttributionGraph:
    graph = graph_get(user=user, graph_id=graph_id)
    check_may_change(graph, user, what="attribution graph")
    return graph


def completed_graph(*, user, graph_id: str) -> AttributionGraph:
    return completed_row(graph_get(user=user, graph_id=graph_id), code="GRAPH_NOT_READY", what="graph")


def graph_file(graph: AttributionGraph):
    """The engine's graph from the row's files (409 ``GRAPH_FILES_MISSING`` when they are gone)."""
    from engine.attribution import AttributionGraph as EngineGraph

    try:
        return EngineGraph.load(graph.directory)
    except (OSError, ValueError, KeyError):
        raise ApplicationError(
            "GRAPH_FILES_MISSING", "The graph's files are missing or damaged.", status=409
        ) from None


def feature_names(
    *, user, graph: AttributionGraph, features: list[tuple[int, int]]
) -> dict[tuple[int, int], dict]:
    """For each (layer, feature) of ``features``: the label or best explanation the user may see
    of that feature of the layer's transcoder, and whether its dashboard is theirs to open."""
    names: dict[tuple[int, int], dict] = {}
    by_layer: dict[int, list[int]] = {}
    for layer, feature in features:
        by_layer.setdefault(layer, []).append(feature)
    for layer, indices in by_layer.items():
        if layer >= len(graph.transcoders):
            continue
        sae_id = graph.transcoders[layer]
        if not may_see(user, SparseAutoencoder, sae_id):
            continue
        sae = SparseAutoencoder.objects.get(pk=sae_id)
        labels = labels_by_index(user=user, sae=sae, indices=indices)
        analysis = (
            analysis_list(user=user, sae=sae)
            .filter(status=FeatureAnalysis.Status.COMPLETED)
            .order_by("-finished_at")
            .first()
        )
        explained = best_explanations(user=user, analysis=analysis, indices=indices) if analysis else {}
        for index in indices:
            label = labels.get(index)
            explanation = explained.get(index)
            names[layer, index] = {
                "sae_id": sae_id,
                "label": label.label if label else "",
                "explanation": explanation["text"] if explanation else "",
                "score": explanation["score"] if explanation else None,
            }
    return names


def graph_view(
    *, user, graph: AttributionGraph, node_threshold: float | None = None, edge_threshold: float | None = None
) -> dict[str, Any]:
    """The graph pruned at the thresholds (the row's by default) in the Neuronpedia graph JSON,
    feature nodes labelled (``clerp``) with what the viewer may see, the row's pinned nodes and
    supernodes as its query parameters; plus, per feature node, its transcoder SAE id (when the
    viewer may open its dashboard) under ``mistudio``."""
    from engine.attribution import prune
    from engine.attribution.neuronpedia import graph_json

    node_threshold = graph.node_threshold if node_threshold is None else node_threshold
    edge_threshold = graph.edge_threshold if edge_threshold is None else edge_threshold
    engine_graph = graph_file(graph)
    pruned = prune(engine_graph, node_threshold, edge_threshold)
    # Named: the feature nodes the pruned graph keeps (the view shows no others).
    kept = pruned.nodes[: engine_graph.n_features].nonzero().flatten()
    chosen = engine_graph.active_features[engine_graph.selected_features[kept]].tolist()
    features = sorted({(int(layer), int(feature)) for layer, _, feature in chosen})
    names = feature_names(user=user, graph=graph, features=features)
    labels = {
        f"{layer}_{feature}": name["label"] or name["explanation"] for (layer, feature), name in names.items()
    }
    view = graph_json(
        engine_graph, slug=graph.id, scan=graph.model.name if graph.model else "", prompt=graph.prompt,
        decode=lambda token: _decode(graph, token), node_threshold=node_threshold,
        edge_threshold=edge_threshold, pinned=graph.pinned, supernodes=graph.supernodes, labels=labels,
        pruned=pruned,
    )  # fmt: skip
    view["mistudio"] = {
        "graph_id": graph.id,
        "edge_threshold": edge_threshold,
        "layers": engine_graph.n_layers,
        "features": {f"{layer}_{feature}": name for (layer, feature), name in names.items()},
        "summary": graph.summary,
    }
    return view


def _decode(graph: AttributionGraph, token: int) -> str:
    """A token's text: from the prompt's own tokens, or the logit targets the job recorded."""
    known = dict(zip(graph.tokens, graph.token_strings, strict=False))
    known.update((logit["token_id"], logit["token"]) for logit in graph.summary.get("logits", []))
    return known.get(int(token), f"<{token}>")


def graph_snapshot(user, key: str | None) -> dict[str, Any] | None:
    graph = graph_list(user=user).filter(pk=key).first()
    return None if graph is None else graph_state(graph, viewer=user)


def register_event_groups() -> None:
    register_group_kind(
        "graph",
        keyed=True,
        snapshot=graph_snapshot,
        visible=lambda user, key: graph_list(user=user).filter(pk=key).exists(),
    )
