"""Influence and pruning of an attribution graph, as circuit-tracer (and the paper) compute them.

A node's *influence* is the total weight of all paths from it to the logits, weighted by the
logits' probabilities, in the graph whose edge weights are normalised to absolute fractions of
each target's incoming edges: ``w @ (A + A^2 + ...)`` for ``w`` the logit weights, summed by
power iteration (the graph is acyclic, so it ends). Pruning keeps the nodes that carry
``node_threshold`` of the total influence (tokens and logits always), then the edges that carry
``edge_threshold`` of the influence of the graph that remains, then drops, until nothing changes,
feature and error nodes left without an outgoing edge and feature nodes without an incoming one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Pruned", "node_influence", "partial_influences", "prune"]


def _normalised(matrix: Any, floor: float = 1e-10) -> Any:
    absolute = matrix.abs()
    return absolute / absolute.sum(1, keepdim=True).clamp(min=floor)


def _influence(normalised: Any, weights: Any, max_iterations: int = 1000) -> Any:
    current = weights @ normalised
    influence = current.clone()
    for _ in range(max_iterations):
        if not current.any():
            return influence
        current = current @ normalised
        influence += current
    raise RuntimeError("influence did not converge: the graph has a cycle")


def _logit_weights(graph: Any) -> Any:
    import torch

    weights = torch.zeros(graph.n_nodes)
    weights[graph.logit_start :] = graph.logit_probabilities
    return weights


def node_influence(graph: Any) -> Any:
    """Each node's influence on the logits (see the module's docstring)."""
    return _influence(_normalised(graph.adjacency), _logit_weights(graph))


def _threshold(scores: Any, fraction: float) -> Any:
    import torch

    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, 0) / torch.sum(ordered)
    index = min(int(torch.searchsorted(cumulative, fraction)), len(cumulative) - 1)
    return ordered[index]


@dataclass
class Pruned:
    """Which nodes and edges ``prune`` keeps, and each node's cumulative influence share (the
    fraction of all influence held by nodes at least as influential as it)."""

    nodes: Any
    edges: Any
    cumulative: Any


def prune(graph: Any, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """circuit-tracer's ``prune_graph`` of ``graph`` (an :class:`AttributionGraph`)."""
    import torch

    if not (0.0 <= node_threshold <= 1.0 and 0.0 <= edge_threshold <= 1.0):
        raise ValueError("thresholds are fractions between 0 and 1")
    weights = _logit_weights(graph)
    influence = _influence(_normalised(graph.adjacency), weights)
    nodes = influence >= _threshold(influence, node_threshold)
    nodes[graph.token_start :] = True
    kept = graph.adjacency.clone()
    kept[~nodes] = 0
    kept[:, ~nodes] = 0
    normalised = _normalised(kept)
    edge_scores = normalised * (_influence(normalised, weights) + weights)[:, None]
    edges = edge_scores >= _threshold(edge_scores.flatten(), edge_threshold)
    sources = graph.token_start  # feature and error nodes need an outgoing edge
    n_features = graph.n_features
    previous = nodes.clone()
    nodes[:sources] &= edges[:, :sources].any(0)
    nodes[:n_features] &= edges[:n_features].any(1)
    while not torch.equal(previous, nodes):  # each round may strand more nodes
        previous = nodes.clone()
        edges[~nodes] = False
        edges[:, ~nodes] = False
        nodes[:sources] &= edges[:, :sources].any(0)
        nodes[:n_features] &= edges[:n_features].any(1)
    ordered, order = torch.sort(influence, descending=True)
    cumulative = torch.zeros_like(influence)
    cumulative[order] = torch.cumsum(ordered, 0) / torch.sum(ordered)
    return Pruned(nodes, edges, cumulative)


def partial_influences(rows: Any, logit_probabilities: Any, row_nodes: Any, max_iterations: int = 128) -> Any:
    """The influence of every column node estimated from the adjacency rows computed so far
    (``rows[i]`` is node ``row_nodes[i]``'s row): what ranks the features still to visit when
    attribution caps the feature nodes (circuit-tracer's ``compute_partial_influences``)."""
    import torch

    normalised = _normalised(rows, 1e-8)
    influence = torch.zeros(rows.shape[1])
    current = torch.zeros(rows.shape[1])
    current[-len(logit_probabilities) :] = logit_probabilities
    for _ in range(max_iterations):
        current = current[row_nodes] @ normalised
        if not current.any():
            return influence
        influence += current
    raise RuntimeError("influence did not converge")
