"""Interventions in the local replacement model: set (or ablate) transcoder features and read the
new logits.

The replacement model is the one a graph linearises: attention patterns (and, by default, norm
scales) frozen from the prompt's real forward pass, and each MLP replaced by its transcoder plus
the error it made on that pass, held constant (computed as the recorded MLP output plus the
change of the transcoder's output, which is the same sum with less rounding). Without
interventions it computes the real logits; with them, each intervened feature takes its new value
at its position, and every later transcoder recomputes its features from what it now receives
(effects propagate through the transcoders). A cross-layer transcoder's changed features write
their change into their own layer's MLP output and every later one's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.attribution.frozen import FrozenRun
from engine.attribution.tracing import Transcoders, check_transcoders
from engine.readout import final_logit_cap, soft_cap

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel

__all__ = ["FeatureIntervention", "InterventionResult", "intervene"]


@dataclass(frozen=True)
class FeatureIntervention:
    """Set feature ``feature`` of layer ``layer``'s transcoder at ``position`` to ``value``."""

    layer: int
    position: int
    feature: int
    value: float


@dataclass
class InterventionResult:
    """The last position's logits [vocab] before and after (float32, CPU), and the activations
    the intervened features had (one per intervention, in their order)."""

    logits_before: Tensor
    logits_after: Tensor
    previous_values: list[float]


def intervene(
    model: PreTrainedModel,
    transcoders: Transcoders,
    tokens: Sequence[int],
    interventions: Sequence[FeatureIntervention],
    *,
    freeze_norms: bool = True,
) -> InterventionResult:
    """Run the replacement model on ``tokens`` with ``interventions`` applied."""
    import torch

    transcoders = check_transcoders(model, transcoders)
    n_positions = len(tokens)
    for item in interventions:
        if not (0 <= item.layer < transcoders.n_layers and 0 <= item.position < n_positions
                and 0 <= item.feature < transcoders.d_sae(item.layer)):  # fmt: skip
            raise ValueError(f"no feature {item.feature} at layer {item.layer}, position {item.position}")
    device = next(model.parameters()).device
    ids = torch.tensor([list(tokens)], device=device)
    run = FrozenRun(model, freeze_norms=freeze_norms)
    # Per layer: MLP input, MLP output [1, tokens, d], features [1, tokens, d_sae].
    recorded: list[tuple[Tensor, Tensor, Tensor]] = []
    finals: list[Tensor] = []  # the final norm's output [1, tokens, d], before and after
    changes: list[Tensor | None] = []  # per layer, its features' change (None: unchanged)

    def record(layer: int, x_in: Tensor, out: Tensor) -> None:
        recorded.append((x_in, out, transcoders.encode(layer, x_in)))

    def replace(layer: int, x_in: Tensor, out: Tensor) -> Tensor:
        # The recorded output plus what changed: the features reaching this MLP (re-encoded, then
        # set) through their decoders, and the skip path. An MLP whose input and features did not
        # change gives its recorded output exactly, so only the intervention's effects move the
        # logits.
        real_in, real_out, real_features = recorded[layer]
        features = transcoders.encode(layer, x_in)
        for item in interventions:
            if item.layer == layer:
                features[0, item.position, item.feature] = item.value
        changed = features - real_features
        changes.append(changed if changed.any() else None)
        delta = transcoders.decode_change(layer, changes)
        if delta is None and torch.equal(x_in, real_in):
            return real_out
        delta = torch.zeros_like(real_out, dtype=real_features.dtype) if delta is None else delta
        skip, real_skip = transcoders.skip_path(layer, x_in), transcoders.skip_path(layer, real_in)
        if skip is not None:
            delta = delta + (skip - real_skip)
        return real_out + delta.to(real_out.dtype)

    unembedding = model.get_output_embeddings()
    with torch.no_grad():
        with run.attached(mlp=record, final=finals.append):
            run.forward(ids)
        with run.attached(mlp=replace, final=finals.append):
            run.forward(ids)
        cap = final_logit_cap(model)
        before, after = (soft_cap(unembedding(final[0, -1]).float(), cap).cpu() for final in finals)
    previous = [float(recorded[item.layer][2][0, item.position, item.feature]) for item in interventions]
    return InterventionResult(before, after, previous)
