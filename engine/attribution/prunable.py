"""A bounded view of an attribution graph: all that a prune up to a node threshold can show.

The full graph's adjacency is n x n (a 46-token graph is 39 MB; one sized to a worker's budget
may be gigabytes), but a prune at ``node_threshold`` reads only two things from it:

- the ranking of every node's influence (which nodes the first stage keeps), and
- the adjacency among the nodes it keeps (the edge stage runs on nothing else).

The nodes kept at a threshold are the tokens, the logits and every node at least as influential
as the one whose cumulative share reaches it: a set that only grows with the threshold. So a
view stores the tokens, the logits and the most influential other nodes (at most ``max_nodes``,
ties kept together), their adjacency and the head of the ranking. Every prune with
``node_threshold`` up to :attr:`PrunableGraph.max_node_threshold` (the share the stored nodes
hold; 1 when they are all of them), at any edge threshold, is then the full graph's: the same
arithmetic on the same numbers. :func:`prune` of a full graph is the view that covers its
threshold, pruned.

Stored order: the tokens and logits (in the graph's order), then the other nodes, most
influential first, so that the nodes a prune keeps are a prefix of the matrix, read without the
rest (:meth:`PrunableGraph.open`). On disk: ``view.safetensors``, the rest as JSON in its metadata.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.attribution.graph import AttributionGraph, NodeOrder
from engine.attribution.pruning import (
    Pruned,
    check_thresholds,
    node_influence,
    prune_edges,
    ranked,
    threshold_rank,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import Tensor

__all__ = [
    "VIEW_FILENAME",
    "KeptNodes",
    "PrunableGraph",
    "ThresholdOutOfRange",
    "prune",
    "prune_memory_bytes",
]

VIEW_FILENAME = "view.safetensors"
VIEW_FORMAT = 1
_TENSOR_FIELDS = (
    "logit_tokens", "logit_probabilities", "nodes", "influence", "cumulative", "features", "activations",
    "ranking", "shares",
)  # fmt: skip
# The bytes a prune of p kept nodes holds at its peak, per cell of their p x p matrix: the matrix
# (4, and 4 more while it is put in the graph's order), the edge scores (4, the normalised matrix
# scaled in place), their sorted copy and cumulative shares (4 + 4) and the edge mask (1); 20 was
# measured at 1,330 nodes (engine/tests/test_attribution_prunable.py), plus what torch's first
# calls in a process take.
PRUNE_BYTES_PER_CELL = 24
PRUNE_BASE_BYTES = 16 * 2**20


def prune_memory_bytes(kept: int) -> int:
    """The peak memory of a prune of a view that keeps ``kept`` nodes."""
    return PRUNE_BYTES_PER_CELL * kept * kept + PRUNE_BASE_BYTES


class ThresholdOutOfRange(ValueError):
    """A node threshold past what a view stores (its ``max_node_threshold``)."""


@dataclass
class KeptNodes:
    """What a prune of a view keeps: ``positions`` [p] (int64), the stored nodes its first stage
    kept, in the graph's order; ``nodes`` [p] (a boolean mask), those its edge stage leaves;
    ``edges`` [p, p] (boolean, target x source); ``adjacency`` [p, p] among them (the edges'
    weights)."""

    positions: Tensor
    nodes: Tensor
    edges: Tensor
    adjacency: Tensor


@dataclass
class PrunableGraph(NodeOrder):
    """The bounded view of one graph (see the module's docstring); tensors on the CPU. Node
    indices into it are *stored positions*; ``nodes[i]`` is that node's index in the full graph."""

    tokens: list[int]
    n_layers: int
    # The full graph's feature nodes (node indices below this are features).
    n_features: int
    # [n_logits] token ids and their probabilities (float32), most probable first.
    logit_tokens: Tensor
    logit_probabilities: Tensor
    # [m] int64: each stored node's index in the full graph; [m] its influence.
    nodes: Tensor
    influence: Tensor
    # [m] each node's cumulative influence share in the full graph (``Pruned.cumulative``).
    cumulative: Tensor
    # For feature nodes: [m, 3] int64 (layer, position, feature) and [m] the activation (zeros for
    # the others).
    features: Tensor
    activations: Tensor
    # [r] the full graph's largest influences, largest first, and [r] their cumulative shares.
    ranking: Tensor
    shares: Tensor
    # [m, m], or None when opened from a file: read a kept prefix at a time (``kept_adjacency``).
    adjacency: Tensor | None = None
    path: Path | None = None
    # What its maker notes about it, stored as JSON in the file's metadata (any JSON value: Any).
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_fixed(self) -> int:
        """The tokens and logits, kept by every prune, stored first."""
        return self.n_positions + self.n_logits

    @property
    def n_stored(self) -> int:
        return len(self.nodes)

    @property
    def max_node_threshold(self) -> float:
        """The largest node threshold whose prune this view holds exactly: at most 1 (a float32
        cumulative share can round just past 1, and then every threshold's prune is a stored prefix)."""
        return 1.0 if len(self.ranking) == self.n_nodes else min(1.0, float(self.shares[-1]))

    def node(self, index: int) -> dict[str, Any]:
        """What stored node ``index`` is (:meth:`NodeOrder.describe`)."""
        original = int(self.nodes[index])
        if original < self.n_features:
            return self.describe(original, self.features[index], self.activations[index])
        return self.describe(original)

    # --- made by the worker, from the full graph ----------------------------------------------------

    @classmethod
    def of(
        cls,
        graph: AttributionGraph,
        *,
        max_nodes: int | None = None,
        covering: float | None = None,
        influence: Tensor | None = None,
    ) -> PrunableGraph:
        """The view of ``graph`` holding at most ``max_nodes`` nodes besides the tokens and logits
        (all of them when None), or just those a prune at ``covering`` keeps. ``influence``: the
        graph's :func:`node_influence` [n_nodes], when it is already known."""
        import torch

        influence = node_influence(graph) if influence is None else influence
        ordered, order, shares = ranked(influence)
        total, fixed = graph.n_nodes, graph.token_start
        if covering is not None:
            ranks = threshold_rank(shares, covering, total) + 1
        elif max_nodes is None:
            ranks = total
        else:
            # The most ranks whose nodes, ties included, other than tokens and logits fit max_nodes.
            ends = torch.searchsorted(-ordered, -ordered, right=True)
            counted = torch.cumsum(order < fixed, 0)
            ranks = max(1, int((counted[ends - 1] <= max_nodes).sum()))
        chosen = order[(ordered >= ordered[ranks - 1]) & (order < fixed)]
        stored = torch.cat([torch.arange(fixed, total), chosen])
        cumulative = torch.empty_like(influence)
        cumulative[order] = shares
        features = torch.zeros(len(stored), 3, dtype=torch.int64)
        activations = torch.zeros(len(stored))
        is_feature = stored < graph.n_features
        selected = graph.selected_features[stored[is_feature]]
        features[is_feature] = graph.active_features[selected].to(torch.int64)
        activations[is_feature] = graph.activation_values[selected].float()
        return cls(
            tokens=list(graph.tokens), n_layers=graph.n_layers, n_features=graph.n_features,
            logit_tokens=graph.logit_tokens.clone(), logit_probabilities=graph.logit_probabilities.clone(),
            nodes=stored, influence=influence[stored], cumulative=cumulative[stored], features=features,
            activations=activations, ranking=ordered[:ranks].clone(), shares=shares[:ranks].clone(),
            adjacency=graph.adjacency.index_select(0, stored).index_select(1, stored),
        )  # fmt: skip

    def save(self, folder: Path | str) -> Path:
        """``view.safetensors`` in ``folder``, written under a temporary name and renamed: a reader
        finds the whole file or none."""
        from safetensors.torch import save_file

        path = Path(folder) / VIEW_FILENAME
        meta = {"format": VIEW_FORMAT, "tokens": self.tokens, "n_layers": self.n_layers,
                "n_features": self.n_features, "info": self.info}  # fmt: skip
        tensors = {name: getattr(self, name).contiguous() for name in _TENSOR_FIELDS}
        tensors["adjacency"] = self.adjacency.contiguous()
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            save_file(tensors, temporary, metadata={"view": json.dumps(meta)})
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        return path

    @classmethod
    def open(cls, folder: Path | str) -> PrunableGraph:
        """The view saved in ``folder``, all but its matrix read (a prune reads the rows it keeps)."""
        from safetensors import safe_open

        path = Path(folder) / VIEW_FILENAME
        with safe_open(str(path), framework="pt") as stored:
            meta = json.loads((stored.metadata() or {})["view"])
            if meta.pop("format") != VIEW_FORMAT:
                raise ValueError(f"{path} is a view of another format")
            tensors = {name: stored.get_tensor(name) for name in _TENSOR_FIELDS}
        return cls(**meta, **tensors, path=path)

    # --- pruned, by whoever shows it ----------------------------------------------------------------

    def kept_count(self, node_threshold: float) -> int:
        """How many stored nodes (a prefix) the first stage of a prune at ``node_threshold`` keeps
        (ThresholdOutOfRange past :attr:`max_node_threshold`)."""
        if node_threshold > self.max_node_threshold:
            raise ThresholdOutOfRange(
                f"node_threshold {node_threshold} is past {self.max_node_threshold:.4f}, the most this "
                "graph's view holds"
            )
        floor = self.ranking[threshold_rank(self.shares, node_threshold, self.n_nodes)]
        return self.n_fixed + int((self.influence[self.n_fixed :] >= floor).sum())

    def kept_adjacency(self, count: int) -> Tensor:
        """The matrix [count, count] among the first ``count`` stored nodes, read from the file
        when it is not held: only those rows and columns."""
        if self.adjacency is not None:
            return self.adjacency[:count, :count]
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as stored:
            return stored.get_slice("adjacency")[:count, :count]

    def prune(
        self, node_threshold: float = 0.8, edge_threshold: float = 0.98, *, keep: Sequence[int] = ()
    ) -> KeptNodes:
        """circuit-tracer's ``prune_graph`` of the full graph, from the view (see the module's
        docstring); its memory is :func:`prune_memory_bytes` of :meth:`kept_count` (of
        :meth:`kept_count_keeping` with ``keep``).

        ``keep``: stored nodes (a researcher's pinned ones) that stay whatever the thresholds,
        with their edges to the other nodes shown that are at least as strong as the weakest edge
        the prune keeps. Without them the prune is circuit-tracer's exactly."""
        import torch

        check_thresholds(node_threshold, edge_threshold)
        count = self.kept_count(node_threshold)
        in_order = torch.argsort(self.nodes[:count])
        originals = self.nodes[:count][in_order]
        adjacency = self.kept_adjacency(count).index_select(0, in_order).index_select(1, in_order)
        weights = torch.zeros(count)
        weights[count - self.n_logits :] = self.logit_probabilities
        nodes, edges = prune_edges(
            adjacency, weights, edge_threshold, n_features=int((originals < self.n_features).sum()),
            n_sources=int((originals < self.token_start).sum()),
        )  # fmt: skip
        kept = KeptNodes(positions=in_order, nodes=nodes, edges=edges, adjacency=adjacency)
        keep = sorted({int(index) for index in keep if 0 <= int(index) < self.n_stored})
        shown = set(in_order[nodes].tolist())
        if all(index in shown for index in keep):
            return kept
        return self._keeping(kept, count, keep)

    def kept_count_keeping(self, node_threshold: float, keep: Sequence[int]) -> int:
        """The stored prefix a prune keeping ``keep`` reads."""
        stored = [int(index) + 1 for index in keep if int(index) < self.n_stored]
        return max([self.kept_count(node_threshold), *stored])

    def _keeping(self, kept: KeptNodes, count: int, keep: list[int]) -> KeptNodes:
        """``kept`` with the stored nodes ``keep`` added (see :meth:`prune`)."""
        import torch

        wider = max(count, keep[-1] + 1)
        in_order = torch.argsort(self.nodes[:wider])
        place = torch.empty(wider, dtype=torch.long)
        place[in_order] = torch.arange(wider)
        adjacency = self.kept_adjacency(wider).index_select(0, in_order).index_select(1, in_order)
        old = place[kept.positions]  # where the first prune's nodes are now
        nodes = torch.zeros(wider, dtype=torch.bool)
        nodes[old[kept.nodes]] = True
        edges = torch.zeros(wider, wider, dtype=torch.bool)
        edges[old[:, None], old[None, :]] = kept.edges
        forced = torch.zeros(wider, dtype=torch.bool)
        forced[place[torch.tensor(keep)]] = True
        nodes |= forced
        weakest = kept.adjacency[kept.edges].abs().min() if kept.edges.any() else torch.tensor(0.0)
        touching = (forced[:, None] | forced[None, :]) & nodes[:, None] & nodes[None, :]
        edges |= touching & (adjacency.abs() >= weakest) & (adjacency != 0)
        return KeptNodes(positions=in_order, nodes=nodes, edges=edges, adjacency=adjacency)


def prune(graph: AttributionGraph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """circuit-tracer's ``prune_graph`` of ``graph``: the view that covers ``node_threshold``,
    pruned, its masks laid over the full graph's nodes."""
    import torch

    check_thresholds(node_threshold, edge_threshold)
    influence = node_influence(graph)
    view = PrunableGraph.of(graph, covering=node_threshold, influence=influence)
    kept = view.prune(node_threshold, edge_threshold)
    originals = view.nodes[kept.positions]
    nodes = torch.zeros(graph.n_nodes, dtype=torch.bool)
    nodes[originals[kept.nodes]] = True
    edges = torch.zeros(graph.n_nodes, graph.n_nodes, dtype=torch.bool)
    edges[originals[:, None], originals[None, :]] = kept.edges
    _, order, shares = ranked(influence)
    cumulative = torch.empty_like(influence)
    cumulative[order] = shares
    return Pruned(nodes, edges, cumulative)
