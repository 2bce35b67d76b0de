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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from engine.attribution.graph import AttributionGraph, NodeOrder

__all__ = [
    "Pruned",
    "check_thresholds",
    "node_influence",
    "partial_influences",
    "prune_edges",
    "ranked",
    "threshold_rank",
]


def _normalised(matrix: Tensor, floor: float = 1e-10) -> Tensor:
    """``|matrix|`` [targets, sources] with each row divided by its sum (at least ``floor``)."""
    absolute = matrix.abs()
    return absolute.div_(absolute.sum(1, keepdim=True).clamp(min=floor))  # in place: one copy, not two


def _influence(normalised: Tensor, weights: Tensor, max_iterations: int = 1000) -> Tensor:
    """``weights @ (A + A^2 + ...)`` [nodes] for ``A`` the ``normalised`` [nodes, nodes] matrix and
    ``weights`` [nodes]; past ``max_iterations`` it fails, since only a cycle keeps it going."""
    current = weights @ normalised
    influence = current.clone()
    for _ in range(max_iterations):
        if not current.any():
            return influence
        current = current @ normalised
        influence += current
    raise RuntimeError("influence did not converge: the graph has a cycle")


def _logit_weights(graph: NodeOrder) -> Tensor:
    """Per node of ``graph`` [nodes]: its logit's probability (zero for every other node)."""
    import torch

    weights = torch.zeros(graph.n_nodes)
    weights[graph.logit_start :] = graph.logit_probabilities
    return weights


def node_influence(graph: AttributionGraph) -> Tensor:
    """Each node's influence on the logits [nodes] (see the module's docstring)."""
    return _influence(_normalised(graph.adjacency), _logit_weights(graph))


def ranked(scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``scores`` [n] largest first, where each was (int64), and the cumulative share of the total
    that the scores up to each one hold: three [n] tensors."""
    import torch

    ordered, order = torch.sort(scores, descending=True)
    return ordered, order, torch.cumsum(ordered, 0) / torch.sum(ordered)


def threshold_rank(shares: Tensor, fraction: float, count: int) -> int:
    """The rank of the smallest score kept at ``fraction``: the first whose cumulative share (of
    the ascending ``shares`` [n]) reaches it (the last of ``count`` when rounding leaves the
    shares short of it)."""
    import torch

    return min(int(torch.searchsorted(shares, fraction)), count - 1)


def _threshold(scores: Tensor, fraction: float) -> Tensor:
    """``ranked``'s threshold (a 0-d tensor) of ``scores`` [n] (on the CPU: numpy sorts them) in
    two copies of them rather than five: the values sorted in place (numpy; torch would keep the
    int64 order too), their shares divided in place. The same numbers: a sort's values are
    unique, and so is each operation's result."""
    import torch

    ordered = scores.neg()
    ordered.numpy().sort()
    ordered.neg_()  # largest first
    shares = torch.cumsum(ordered, 0)
    shares /= torch.sum(ordered)
    return ordered[threshold_rank(shares, fraction, len(ordered))]


@dataclass
class Pruned:
    """Which nodes and edges ``prune`` keeps, and each node's cumulative influence share (the
    fraction of all influence held by nodes at least as influential as it): ``nodes`` [n] and
    ``edges`` [n, n] (target, source) boolean masks, ``cumulative`` [n]."""

    nodes: Tensor
    edges: Tensor
    cumulative: Tensor


def check_thresholds(node_threshold: float, edge_threshold: float) -> None:
    if not (0.0 <= node_threshold <= 1.0 and 0.0 <= edge_threshold <= 1.0):
        raise ValueError("thresholds are fractions between 0 and 1")


def prune_edges(
    adjacency: Tensor, weights: Tensor, edge_threshold: float, *, n_features: int, n_sources: int
) -> tuple[Tensor, Tensor]:
    """The second stage of circuit-tracer's ``prune_graph``, on the adjacency among the nodes its
    first stage kept (``adjacency[kept][:, kept]`` [p, p], in the graph's order; ``weights`` [p]
    their logit weights): the edges that carry ``edge_threshold`` of the influence of that graph,
    then, until nothing changes, the feature and error nodes (the first ``n_sources``) left
    without an outgoing edge and the feature nodes (the first ``n_features``) without an incoming
    one dropped. Returns (nodes [p], edges [p, p]) boolean masks over those nodes. Only the kept
    nodes' matrix is ever made, so its memory is what a view of them needs, whatever the graph's
    size."""
    import torch

    edge_scores = _normalised(adjacency)
    edge_scores *= (_influence(edge_scores, weights) + weights)[:, None]  # in place: the normalised matrix
    edges = edge_scores >= _threshold(edge_scores.flatten(), edge_threshold)
    del edge_scores
    nodes = torch.ones(len(adjacency), dtype=torch.bool)
    previous = nodes.clone()
    nodes[:n_sources] &= edges[:, :n_sources].any(0)
    nodes[:n_features] &= edges[:n_features].any(1)
    while not torch.equal(previous, nodes):  # each round may strand more nodes
        previous = nodes.clone()
        edges[~nodes] = False
        edges[:, ~nodes] = False
        nodes[:n_sources] &= edges[:, :n_sources].any(0)
        nodes[:n_features] &= edges[:n_features].any(1)
    return nodes, edges


def partial_influences(
    rows: Tensor, logit_probabilities: Tensor, row_nodes: Tensor, max_iterations: int = 128
) -> Tensor:
    """The influence [nodes] of every column node estimated from the adjacency rows computed so
    far (``rows`` [r, nodes]; ``rows[i]`` is node ``row_nodes[i]``'s row; the logits are the last
    columns, ``logit_probabilities`` [logits] their weights): what ranks the features still to
    visit when attribution caps the feature nodes (circuit-tracer's
    ``compute_partial_influences``)."""
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
