"""Reading attribution graphs: the ones a user may see, one by id, and a graph's nodes and links
as the graph page and the export show them (pruned, labelled with what the viewer may see), from
the graph's bounded view, within the web process's memory budget for graph views."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.core.cache import cache
from django.db.models import QuerySet

from circuits.models import AttributionGraph, Subgraph
from circuits.serializers import graph_state
from circuits.view_memory import MAX_LINKS, view_memory, view_memory_bytes
from features.models import Feature, FeatureAnalysis
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


def subgraph_list(*, user, graph: AttributionGraph) -> QuerySet[Subgraph]:
    """The saved subgraphs of ``graph`` (one the user may see) that the user may see: their own,
    and shared ones."""
    return visible_rows(Subgraph.objects.filter(graph=graph).select_related("owner"), user, shareable=True)


def subgraph_get(*, user, subgraph_id: str) -> Subgraph:
    """A subgraph the user may see, of a graph the user may see (404 ``SUBGRAPH_NOT_FOUND``)."""
    rows = visible_rows(Subgraph.objects.select_related("graph", "owner"), user, shareable=True)
    return visible_row(
        rows.filter(graph__in=graph_list(user=user)), subgraph_id, code="SUBGRAPH_NOT_FOUND", what="subgraph"
    )


def subgraph_export(subgraph: Subgraph) -> dict[str, Any]:
    """The subgraph in Neuronpedia's form (its ``/api/graph/subgraph/save`` body): the graph's slug
    is its id here; ``clerps`` are the annotations ([node id, text]); no density threshold."""
    graph = subgraph.graph
    return {
        "modelId": graph.model.name if graph.model else "",
        "slug": graph.id,
        "displayName": subgraph.name,
        "pinnedIds": subgraph.pinned,
        "supernodes": subgraph.supernodes,
        "clerps": [[node, text] for node, text in subgraph.annotations.items()],
        "pruningThreshold": subgraph.node_threshold,
        "densityThreshold": None,
    }


def graph_prunable(graph: AttributionGraph):
    """The graph's bounded view (``engine.attribution.prunable``; all but its matrix read), or None
    when it has none (a graph made before views were: ``services.graph_view_prepare``). 409
    ``GRAPH_FILES_MISSING`` when it is damaged. The graph's full matrix is never read here."""
    from safetensors import SafetensorError

    from engine.attribution import PrunableGraph
    from engine.attribution.prunable import VIEW_FILENAME

    if not (graph.directory / VIEW_FILENAME).is_file():
        return None
    try:
        return PrunableGraph.open(graph.directory)
    except (OSError, ValueError, KeyError, SafetensorError):
        raise graph_files_missing() from None


def graph_files_missing() -> ApplicationError:
    return ApplicationError("GRAPH_FILES_MISSING", "The graph's files are missing or damaged.", status=409)


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
        if layer >= len(graph.transcoders):  # (a cross-layer transcoder's features have no analyses yet)
            continue
        sae_id = graph.transcoders[layer]
        if not may_see(user, SparseAutoencoder, sae_id):
            continue
        sae = SparseAutoencoder.objects.get(pk=sae_id)
        if sae.is_cross_layer:
            continue
        labels = labels_by_index(user=user, sae=sae, indices=indices)
        analysis = (
            analysis_list(user=user, sae=sae)
            .filter(status=FeatureAnalysis.Status.COMPLETED)
            .order_by("-finished_at")
            .first()
        )
        explained = best_explanations(user=user, analysis=analysis, indices=indices) if analysis else {}
        found = Feature.objects.filter(analysis=analysis, index__in=indices) if analysis else None
        automatic = dict(found.values_list("index", "auto_label")) if found is not None else {}
        for index in indices:
            label = labels.get(index)
            explanation = explained.get(index)
            names[layer, index] = {
                "sae_id": sae_id,
                "label": label.label if label else "",
                "explanation": explanation["text"] if explanation else "",
                "score": explanation["score"] if explanation else None,
                # The analysis's own name for it (its most frequent top tokens): shown, marked as
                # automatic, where nobody labelled or explained it.
                "auto_label": automatic.get(index, ""),
            }
    return names


def graph_view(
    *,
    user,
    graph: AttributionGraph,
    node_threshold: float | None = None,
    edge_threshold: float | None = None,
    export: bool = False,
    subgraph: Subgraph | None = None,
) -> bytes:
    """The graph pruned at the thresholds (the row's by default) in the Neuronpedia graph JSON,
    rendered: feature nodes labelled (``clerp``) with what the viewer may see, the row's pinned
    nodes and supernodes as its query parameters; plus, unless ``export``, under ``mistudio``,
    per feature node its transcoder SAE id (when the viewer may open its dashboard) and the
    thresholds the view holds.

    Pruned from the graph's bounded view, exactly as the full graph would be, at node thresholds
    up to the view's ``max_node_threshold`` (400 ``INVALID_THRESHOLD`` past it; the row's own
    threshold is taken down to it), within the web's memory budget for graph views (400
    ``GRAPH_VIEW_TOO_LARGE``, 503 ``GRAPH_VIEWS_BUSY``).

    ``subgraph`` (one of this graph's): its reading instead of the row's (pins, supernodes,
    thresholds), its annotations as the nodes' ``clerp``."""
    from engine.attribution.neuronpedia import graph_json, stored_positions

    view = graph_prunable(graph)
    if view is None:
        raise ApplicationError("GRAPH_VIEW_MISSING", "The graph's view is not made yet.", status=409)
    reading = subgraph or graph
    widest = view.max_node_threshold
    if node_threshold is None:
        node_threshold = min(reading.node_threshold, widest)
    elif node_threshold > widest:
        raise ApplicationError(
            "INVALID_THRESHOLD",
            f"node_threshold can be at most {widest:.7g} for this graph: its view keeps the "
            f"{view.n_stored - view.n_fixed} most influential nodes (GRAPH_VIEW_MAX_NODES).",
            details={"max_node_threshold": widest, "fields": {"node_threshold": [f"At most {widest:.7g}."]}},
        )
    edge_threshold = reading.edge_threshold if edge_threshold is None else edge_threshold
    # The row's own view asked again (a page reloaded, a viewer polling) is served as rendered: a
    # loop of views costs bytes, not a prune each. Only at the row's thresholds: views at any other
    # (a slider moved) would fill Redis with renders of every threshold a client can spell. Per
    # viewer (labels are what the viewer may see); the row's pins and thresholds are in its
    # updated_at, and every change of a label, explanation or transcoder's sharing changes the names
    # version (``names_changed``).
    own = node_threshold == min(reading.node_threshold, widest) and edge_threshold == reading.edge_threshold
    key = (
        f"graph-view:{graph.pk}:{graph.updated_at.timestamp()}:{getattr(user, 'pk', None)}:"
        f"{int(export)}:{cache.get(NAMES_VERSION_KEY)}"
        + (f":{subgraph.pk}:{subgraph.updated_at.timestamp()}" if subgraph else "")
    )
    if own and (cached := cache.get(key)) is not None:
        return cached
    # The pinned nodes stay whatever the thresholds (with their edges as strong as those shown).
    pinned = stored_positions(view, reading.pinned)
    count = view.kept_count_keeping(node_threshold, pinned)
    what = f"This view of {count:,} nodes"
    with view_memory(
        view_memory_bytes(count), what=what, advice="lower node_threshold.", viewer=getattr(user, "pk", None)
    ):
        kept = view.prune(node_threshold, edge_threshold, keep=pinned)
        links = int(kept.edges.sum())
        if links > MAX_LINKS:
            raise ApplicationError(
                "GRAPH_VIEW_TOO_LARGE",
                f"At these thresholds the graph keeps {links:,} links, more than the {MAX_LINKS:,} a view "
                "shows: lower edge_threshold or node_threshold.",
                details={"links": links, "limit": MAX_LINKS},
            )
        # Named: the feature nodes the pruned graph keeps (the view shows no others).
        shown = kept.positions[kept.nodes]
        shown = shown[view.nodes[shown] < view.n_features]
        features = sorted({(layer, feature) for layer, _, feature in view.features[shown].tolist()})
        names = feature_names(user=user, graph=graph, features=features)
        labels = {
            f"{layer}_{feature}": name["label"]
            or name["explanation"]
            or (f"auto: {name['auto_label']}" if name["auto_label"] else "")
            for (layer, feature), name in names.items()
        }
        body = graph_json(
            view, slug=graph.id, scan=graph.model.name if graph.model else "", prompt=graph.prompt,
            decode=lambda token: _decode(graph, token), node_threshold=node_threshold,
            edge_threshold=edge_threshold, pinned=reading.pinned, supernodes=reading.supernodes,
            labels=labels, kept=kept,
        )  # fmt: skip
        if subgraph is not None:  # the subgraph's notes on its nodes name them
            for node in body["nodes"]:
                node["clerp"] = subgraph.annotations.get(node["node_id"]) or node["clerp"]
        if not export:
            body["mistudio"] = {
                "graph_id": graph.id,
                "edge_threshold": edge_threshold,
                "max_node_threshold": widest,
                "layers": view.n_layers,
                "features": {f"{layer}_{feature}": name for (layer, feature), name in names.items()},
                "summary": graph.summary,
            }
        rendered = json.dumps(body).encode()
    if own:
        cache.set(key, rendered, GRAPH_VIEW_CACHE_SECONDS)
    return rendered


# How long a rendered view is kept to be served again (the memory it takes is Redis's, for this long).
GRAPH_VIEW_CACHE_SECONDS = 60
NAMES_VERSION_KEY = "graph-view:names-version"
# Fields of a transcoder whose change changes what a viewer may see of it.
VISIBILITY_FIELDS = frozenset({"shared", "owner"})


def names_changed(sender, instance=None, update_fields=None, **kwargs) -> None:
    """A label, an explanation, an analysis, an explanation job or a transcoder's sharing changed
    (signals connected in ``CircuitsConfig.ready``): rendered graph views name features anew."""
    if (
        sender is SparseAutoencoder
        and update_fields is not None
        and not VISIBILITY_FIELDS & set(update_fields)
    ):
        return  # a training's progress: nothing a view shows
    cache.set(NAMES_VERSION_KEY, uuid.uuid4().hex, None)


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
