"""Activation patching and the logit lens, on the one hook runtime.

* :func:`patching_grid`: for a clean and a corrupted prompt of the same length and a metric (the
  logit of the right answer minus the wrong one, at the last position), the metric when one hook
  point at one position of the corrupted run is replaced by the clean run's value, for every hook
  point x position. Each hook point is one batched forward pass: row ``p`` patches position ``p``
  (a per-row ``replace`` intervention).
* :func:`logit_lens`: the next-token predictions read out of each layer's residual stream (the
  model's own final norm, unembedding and any final-logit soft-cap applied to
  ``blocks.{i}.hook_resid_post``, by :func:`engine.readout.logits_from_residual`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import EngineError
from engine.extraction import extract
from engine.hooks import hook_sites, num_layers
from engine.interventions import Intervention, Interventions, Replace
from engine.placement import input_device
from engine.readout import logits_from_residual
from engine.runtime import HookRuntime, grad_free_mode

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel


class PatchingError(EngineError):
    pass


def run_with_interventions(
    model: PreTrainedModel, input_ids: Tensor, per_row: Sequence[Sequence[Intervention]]
) -> Tensor:
    """Logits [batch, tokens, vocab] of one forward pass over ``input_ids`` [batch, tokens] (no
    padding) with row ``r``'s interventions applied to row ``r``."""
    import torch

    batch, tokens = input_ids.shape
    steering = Interventions(per_row, [tokens] * batch)
    sites = hook_sites(model, steering.hooks) if steering.hooks else {}
    runtime = HookRuntime(model, sites, steering.apply, purpose="patched")
    runtime.begin_pass(batch, tokens)
    steering.begin_pass(torch.arange(tokens, device=input_ids.device).repeat(batch, 1))
    with grad_free_mode(model)(), runtime.attached():
        return model(input_ids=input_ids, use_cache=False).logits


@dataclass
class PatchingResult:
    hooks: list[str]
    clean_metric: float
    corrupted_metric: float
    # grid[h][p]: the metric with hook h at position p patched from the clean run
    grid: list[list[float]]
    # the metric with hook h patched at every position
    all_positions: list[float]


def patching_grid(
    model: PreTrainedModel,
    clean_ids: Sequence[int],
    corrupted_ids: Sequence[int],
    *,
    answer_id: int,
    wrong_id: int,
    hooks: Sequence[str],
) -> PatchingResult:
    import torch

    if len(clean_ids) != len(corrupted_ids) or not clean_ids:
        raise PatchingError(
            "PROMPT_LENGTHS_DIFFER",
            f"The clean and corrupted prompts must have the same number of tokens "
            f"({len(clean_ids)} and {len(corrupted_ids)}).",
            {"clean_tokens": len(clean_ids), "corrupted_tokens": len(corrupted_ids)},
        )
    hooks = list(hook_sites(model, list(hooks)))
    device = input_device(model)
    tokens = len(clean_ids)
    (clean_run,) = extract(model, [list(clean_ids)], [[0]], hooks=hooks, dtype="float32")
    clean = {name: clean_run.activations[name] for name in hooks}

    def metric(logits: Tensor) -> list[float]:
        """Per row of ``logits`` [rows, tokens, vocab]: the answer's logit minus the wrong one's."""
        last = logits[:, -1].float()
        return (last[:, answer_id] - last[:, wrong_id]).tolist()

    def batch_of(ids: Sequence[int], rows: int) -> Tensor:
        """``rows`` copies of ``ids``: [rows, tokens] on the model's input device."""
        return torch.tensor([list(ids)] * rows, device=device)

    (clean_metric,) = metric(run_with_interventions(model, batch_of(clean_ids, 1), [[]]))
    (corrupted_metric,) = metric(run_with_interventions(model, batch_of(corrupted_ids, 1), [[]]))
    grid, all_positions = [], []
    for name in hooks:
        values = clean[name].reshape(tokens, -1)
        per_row = [
            [Replace(name, positions=(position,), vector=values[position])] for position in range(tokens)
        ]
        grid.append(metric(run_with_interventions(model, batch_of(corrupted_ids, tokens), per_row)))
        everywhere = [
            Replace(name, positions=(position,), vector=values[position]) for position in range(tokens)
        ]
        all_positions.extend(metric(run_with_interventions(model, batch_of(corrupted_ids, 1), [everywhere])))
    return PatchingResult(hooks, clean_metric, corrupted_metric, grid, all_positions)


@dataclass
class LensResult:
    layers: list[int]
    # top[l][p] = [(token id, probability), ...] read out after layer l at position p
    top: list[list[list[tuple[int, float]]]]


def logit_lens(model: PreTrainedModel, token_ids: Sequence[int], *, top: int = 5) -> LensResult:
    import torch

    layers = list(range(num_layers(model)))
    names = [f"blocks.{layer}.hook_resid_post" for layer in layers]
    if model.get_output_embeddings() is None:
        raise PatchingError("NO_UNEMBEDDING", "The model has no output embedding to read the lens with.")
    (run,) = extract(model, [list(token_ids)], [[0]], hooks=names, dtype="float32")
    result = []
    with grad_free_mode(model)():
        for name in names:
            probabilities = torch.softmax(logits_from_residual(model, run.activations[name]), dim=-1)
            values, ids = probabilities.topk(min(top, probabilities.shape[-1]), dim=-1)
            result.append(
                [
                    list(zip(row_ids, row_values, strict=True))
                    for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
                ]
            )
    return LensResult(layers, result)
