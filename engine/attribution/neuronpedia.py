"""An attribution graph as the JSON that Neuronpedia's graph viewer and circuit-tracer's local
server load (circuit-tracer 0.5's ``create_graph_files``): metadata, query parameters (pinned
nodes, supernodes), the pruned graph's nodes and its links.

Node ids are circuit-tracer's: a feature ``{layer}_{feature}_{position}``, an error
``0_{layer}_{position}``, a token ``E_{token}_{position}``, a logit ``{layers + 1}_{token}_{position}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.attribution.graph import AttributionGraph
from engine.attribution.prunable import KeptNodes, PrunableGraph

__all__ = ["graph_json", "node_id"]


def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def node_id(graph: AttributionGraph | PrunableGraph, index: int) -> str:
    """The viewer's id of node ``index``."""
    return _node_id(graph, graph.node(index))


def _node_id(graph: AttributionGraph | PrunableGraph, node: dict[str, Any]) -> str:
    kind = node["kind"]
    if kind == "feature":
        return f"{node['layer']}_{node['feature']}_{node['position']}"
    if kind == "error":
        return f"0_{node['layer']}_{node['position']}"
    if kind == "token":
        return f"E_{node['token']}_{node['position']}"
    return f"{graph.n_layers + 1}_{node['token']}_{node['position']}"


def stored_positions(view: PrunableGraph, node_ids: Sequence[str]) -> list[int]:
    """Where the view stores the nodes ``node_ids`` (those it stores)."""
    wanted = set(node_ids)
    if not wanted:
        return []
    return [index for index in range(view.n_stored) if node_id(view, index) in wanted]


def _node(graph: PrunableGraph, index: int, decode: Callable[[int], str],
          labels: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    node = graph.node(index)
    kind = node["kind"]
    identifier = _node_id(graph, node)
    influence = float(graph.cumulative[index])
    label = labels.get(f"{node['layer']}_{node['feature']}", "") if kind == "feature" else ""
    base = {"node_id": identifier, "token_prob": 0.0, "is_target_logit": False, "run_idx": 0,
            "reverse_ctx_idx": 0, "clerp": label, "influence": influence, "activation": None}  # fmt: skip
    if kind == "feature":
        layer, feature, position = node["layer"], node["feature"], node["position"]
        return {**base, "feature": _cantor(layer, feature), "layer": str(layer), "ctx_idx": position,
                "feature_type": "cross layer transcoder", "jsNodeId": f"{layer}_{feature}-0",
                "activation": node["activation"]}  # fmt: skip
    if kind == "error":
        layer, position = node["layer"], node["position"]
        return {**base, "feature": -1, "layer": str(layer), "ctx_idx": position,
                "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_{position}-0"}  # fmt: skip
    if kind == "token":
        token, position = node["token"], node["position"]
        return {**base, "feature": position, "layer": "E", "ctx_idx": position, "feature_type": "embedding",
                "jsNodeId": f"E_{token}-{position}"}  # fmt: skip
    token, position, probability = node["token"], node["position"], node["probability"]
    target = graph.info.get("target") or {}
    if target.get("kind") == "difference":  # one node: logit(a) - logit(b), weighted 1
        first, second = target["tokens"]
        clerp = f'Output "{decode(first)}" minus "{decode(second)}"'
    else:
        clerp = f'Output "{decode(token)}" (p={probability:.3f})'
    return {**base, "feature": token, "layer": str(graph.n_layers + 1), "ctx_idx": position,
            "feature_type": "logit", "token_prob": probability,
            "is_target_logit": int(graph.nodes[index]) == graph.logit_start,
            "jsNodeId": f"L_{token}-{position}", "influence": None, "clerp": clerp}  # fmt: skip


def graph_json(
    graph: AttributionGraph | PrunableGraph,
    *,
    slug: str,
    scan: str,
    prompt: str,
    decode: Callable[[int], str],
    node_threshold: float = 0.8,
    edge_threshold: float = 0.98,
    pinned: Sequence[str] = (),
    supernodes: Sequence[Sequence[str]] = (),
    labels: dict[str, str] | None = None,
    kept: KeptNodes | None = None,
) -> dict[str, Any]:
    """The graph pruned at the thresholds, in the viewer's JSON, from the full graph or its
    bounded view (:mod:`engine.attribution.prunable`). ``decode`` turns a token id into text;
    ``pinned`` and ``supernodes`` (each ``[name, node_id, ...]``) become its query parameters;
    ``labels`` (``"{layer}_{feature}"`` to text) fill feature nodes' ``clerp``; ``kept``: the view
    already pruned at those thresholds (else it is pruned here)."""
    view = graph if isinstance(graph, PrunableGraph) else PrunableGraph.of(graph, covering=node_threshold)
    kept = view.prune(node_threshold, edge_threshold) if kept is None else kept
    labels = labels or {}
    positions = kept.positions.tolist()
    nodes = {
        index: _node(view, positions[index], decode, labels)
        for index in kept.nodes.nonzero().flatten().tolist()
    }
    targets, sources = kept.edges.nonzero(as_tuple=True)
    weights = kept.adjacency[targets, sources].tolist()
    links = [
        {"source": nodes[source]["node_id"], "target": nodes[target]["node_id"], "weight": weight}
        for source, target, weight in zip(sources.tolist(), targets.tolist(), weights, strict=True)
        if source in nodes and target in nodes
    ]
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    stay = {*pinned, *connected}  # a pinned node is shown even when none of its edges is
    used = [node for node in nodes.values()
            if node["node_id"] in stay or node["feature_type"] in ("embedding", "logit")]  # fmt: skip
    return {
        "metadata": {
            "slug": slug,
            "scan": scan,
            "transcoder_list": [],
            "prompt_tokens": [decode(token) for token in view.tokens],
            "prompt": prompt,
            "node_threshold": node_threshold,
            "schema_version": 1,
        },
        "qParams": {
            "pinnedIds": list(pinned),
            "supernodes": [list(group) for group in supernodes],
            "linkType": "both",
            "clickedId": "",
            "sg_pos": "",
        },
        "nodes": used,
        "links": links,
    }
