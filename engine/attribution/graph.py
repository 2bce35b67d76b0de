"""An attribution graph: its nodes, its adjacency matrix, and how it is stored.

Nodes are kept in circuit-tracer's order, so a graph and its adjacency read the same in both
tools: the selected feature nodes (``active_features[selected_features]``, by layer, position
and feature), then one error node per layer and position (layer-major), one node per input
token, and the logit nodes (most probable first). ``adjacency[target, source]`` is the direct
effect of ``source`` on ``target``.

``bias`` holds, for each node that has incoming edges (features and logits), what the node's
value is when every source is zero: the constant part of the linearised model. Its edges plus
its bias give its value (a feature's pre-activation, a logit minus the mean logit), which
:meth:`AttributionGraph.completeness_error` checks.

On disk: ``graph.safetensors`` (the tensors) and ``graph.json`` (the rest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

TENSORS_FILENAME = "graph.safetensors"
META_FILENAME = "graph.json"
_TENSOR_FIELDS = (
    "active_features",
    "activation_values",
    "selected_features",
    "adjacency",
    "logit_tokens",
    "logit_probabilities",
    "bias",
    "values",
)


class NodeOrder:
    """Where each kind of node sits in a graph's order (see the module's docstring), and what a
    node is: shared by the full graph and its bounded view (``engine.attribution.prunable``), which
    need ``n_features``, ``n_layers``, ``tokens``, ``logit_tokens`` and ``logit_probabilities``."""

    n_features: int
    n_layers: int
    tokens: list[int]
    # [n_logits] token ids and their probabilities, most probable first.
    logit_tokens: Tensor
    logit_probabilities: Tensor

    @property
    def n_positions(self) -> int:
        return len(self.tokens)

    @property
    def n_logits(self) -> int:
        return len(self.logit_tokens)

    @property
    def error_start(self) -> int:
        return self.n_features

    @property
    def token_start(self) -> int:
        return self.n_features + self.n_layers * self.n_positions

    @property
    def logit_start(self) -> int:
        return self.token_start + self.n_positions

    @property
    def n_nodes(self) -> int:
        return self.logit_start + self.n_logits

    def describe(
        self, index: int, feature: Tensor | None = None, activation: float | Tensor = 0.0
    ) -> dict[str, Any]:
        """What node ``index`` is: kind ("feature", "error", "token", "logit"), layer, position,
        and the feature or token id; a feature node's (layer, position, feature) row [3] and
        activation (a number or a 0-d tensor) are given by the caller, who knows where its features
        are kept. Plain ints, floats and strings, ready for JSON."""
        if index < self.error_start:
            layer, position, feature_id = (int(v) for v in feature)
            return {"kind": "feature", "layer": layer, "position": position, "feature": feature_id,
                    "activation": float(activation)}  # fmt: skip
        if index < self.token_start:
            layer, position = divmod(index - self.error_start, self.n_positions)
            return {"kind": "error", "layer": layer, "position": position}
        if index < self.logit_start:
            position = index - self.token_start
            return {"kind": "token", "position": position, "token": self.tokens[position]}
        rank = index - self.logit_start
        return {"kind": "logit", "position": self.n_positions - 1, "token": int(self.logit_tokens[rank]),
                "probability": float(self.logit_probabilities[rank])}  # fmt: skip


@dataclass
class AttributionGraph(NodeOrder):
    """The graph of one prompt; tensors on the CPU."""

    tokens: list[int]
    n_layers: int
    # [n_active, 3] int64 (layer, position, feature) of every active transcoder feature, and
    # [n_active] float32 their activations.
    active_features: Tensor
    activation_values: Tensor
    # [n_features] int64 indices into active_features of the feature nodes kept (all of them
    # without a cap).
    selected_features: Tensor
    # [n_nodes, n_nodes] float32, (target, source).
    adjacency: Tensor
    # [n_logits] token ids and their probabilities (float32), most probable first.
    logit_tokens: Tensor
    logit_probabilities: Tensor
    # [n_nodes] float32 per node (zero where a node has no incoming edges): the constant part, and
    # the value.
    bias: Tensor
    values: Tensor
    # Counts and flags about the run, stored as JSON in graph.json (any JSON value: Any).
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_features(self) -> int:
        return len(self.selected_features)

    def node(self, index: int) -> dict[str, Any]:
        """What node ``index`` is (:meth:`NodeOrder.describe`)."""
        if index < self.error_start:
            chosen = self.selected_features[index]
            return self.describe(index, self.active_features[chosen], self.activation_values[chosen])
        return self.describe(index)

    def completeness_error(self) -> float:
        """The largest gap, over feature and logit nodes, between a node's value and its incoming
        edges plus its bias (0 for an exact linearisation), relative to the sum of the magnitudes
        added up (the edges' and the bias'), the scale at which a float32 sum is exact: a node's
        value is often a small difference of large direct effects."""
        import torch

        targets = torch.cat([torch.arange(self.n_features), torch.arange(self.logit_start, self.n_nodes)])
        if not len(targets):
            return 0.0
        edges = self.adjacency[targets].double()
        bias = self.bias[targets].double()
        gap = (edges.sum(1) + bias - self.values[targets].double()).abs()
        scale = edges.abs().sum(1) + bias.abs()
        return float((gap / scale.clamp_min(1e-12)).max())

    def save(self, folder: Path | str) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(
            {name: getattr(self, name).contiguous() for name in _TENSOR_FIELDS}, folder / TENSORS_FILENAME
        )
        meta = {"tokens": self.tokens, "n_layers": self.n_layers, "info": self.info}
        (folder / META_FILENAME).write_text(json.dumps(meta))
        return folder

    @classmethod
    def load(cls, folder: Path | str) -> AttributionGraph:
        from safetensors.torch import load_file

        folder = Path(folder)
        tensors = load_file(folder / TENSORS_FILENAME)
        meta = json.loads((folder / META_FILENAME).read_text())
        return cls(**meta, **tensors)
