"""How good a trained SAE is: reconstruction metrics on held-out activations, and CE loss recovered.

* :func:`evaluate_activations` streams over chunks of held-out activations ``[n, d_in]`` and keeps
  only running sums (float64), so memory does not grow with the held-out set: MSE (summed over
  ``d_in``, averaged over rows, as in training), explained variance around the held-out mean
  (per-dimension means and squared deviations merged chunk by chunk with Chan's formula, which
  stays exact when the activations have a large mean, unlike ``sum x^2 - n mean^2``), L0, and how
  often each feature fires (the density SAELens stores, as log10, in ``sparsity.safetensors``).
* :func:`ce_loss_recovered` runs a causal LM three times over token sequences (clean, with the
  SAE's reconstruction spliced in at one hook point, with that point zero-ablated) and compares
  the next-token cross-entropies: ``(zero - sae) / (zero - clean)``, 1 for a perfect SAE and 0
  for one no better than deleting the activation.

Importing this module imports torch; like the rest of the engine it needs no Django.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import EngineError
from engine.extraction import plan_batches
from engine.hooks import hook_sites
from engine.placement import input_device
from engine.runtime import HookRuntime, grad_free_mode, pad_token_id
from engine.sae.model import SparseAutoencoder

__all__ = [
    "ActivationEvaluation",
    "CeLossRecovered",
    "EvaluationCancelled",
    "EvaluationError",
    "ce_loss_recovered",
    "edited_logits",
    "evaluate_activations",
    "log_feature_density",
]

# Rows encoded at once: a chunk of the cache can be large, and its features [rows, d_sae] larger.
DEFAULT_ROWS_PER_STEP = 4096


class EvaluationError(EngineError):
    """An evaluation refused (no data, tokens the model does not have, a model without logits)."""


class EvaluationCancelled(EvaluationError):
    """``should_cancel()`` said stop; raised between batches, never in the middle of one."""

    def __init__(self) -> None:
        super().__init__("EVALUATION_CANCELLED", "The evaluation was cancelled.")


@dataclass(frozen=True)
class ActivationEvaluation:
    """Reconstruction metrics of an SAE on held-out activations."""

    tokens: int
    # Squared error summed over d_in, averaged over rows (the training loss's MSE term).
    mse: float
    # 1 - squared error / squared deviation from the held-out mean, both summed over everything.
    explained_variance: float
    fraction_of_variance_unexplained: float
    # Features active (> 0) per row, averaged.
    l0: float
    # Features that never fired on the held-out rows.
    dead_features: int
    # Features that fired on more than ``dense_threshold`` of the rows.
    dense_features: int
    dense_threshold: float
    # float32 [d_sae]: the fraction of rows each feature fired on (on the CPU).
    feature_density: torch.Tensor

    def to_dict(self) -> dict[str, float | int]:
        """The scalar metrics as JSON-able numbers (``feature_density`` is left out)."""
        return {
            "tokens": self.tokens,
            "mse": self.mse,
            "explained_variance": self.explained_variance,
            "fraction_of_variance_unexplained": self.fraction_of_variance_unexplained,
            "l0": self.l0,
            "dead_features": self.dead_features,
            "dense_features": self.dense_features,
            "dense_threshold": self.dense_threshold,
        }


@dataclass(frozen=True)
class CeLossRecovered:
    """Next-token cross-entropies (nats, averaged over predicted tokens) of three runs of a model."""

    clean_loss: float
    sae_loss: float
    zero_ablation_loss: float
    # (zero - sae) / (zero - clean); None when zero-ablating the hook point changes nothing.
    ce_loss_recovered: float | None
    # Predicted positions: every token of a sequence but its first.
    tokens: int

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "clean_loss": self.clean_loss,
            "sae_loss": self.sae_loss,
            "zero_ablation_loss": self.zero_ablation_loss,
            "ce_loss_recovered": self.ce_loss_recovered,
            "tokens": self.tokens,
        }


def log_feature_density(density: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """``log10(density + eps)``: what SAELens stores in ``sparsity.safetensors`` (dead features
    get ``log10(eps)``, -10 by default)."""
    return torch.log10(density.float() + eps)


class _Moments:
    """Per-dimension count, mean and summed squared deviation of a stream of rows (float64),
    merged batch by batch (Chan et al.'s parallel update)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.squared_deviation: torch.Tensor | None = None

    def add(self, rows: torch.Tensor) -> None:
        rows = rows.double()
        count = rows.shape[0]
        mean = rows.mean(0)
        squared_deviation = (rows - mean).pow(2).sum(0)
        if self.mean is None or self.squared_deviation is None:
            self.count, self.mean, self.squared_deviation = count, mean, squared_deviation
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean = self.mean + delta * (count / total)
        self.squared_deviation = (
            self.squared_deviation + squared_deviation + delta.pow(2) * (self.count * count / total)
        )
        self.count = total

    def total_squared_deviation(self) -> float:
        return 0.0 if self.squared_deviation is None else float(self.squared_deviation.sum())


def mean_feature_activations(sae: SparseAutoencoder, chunks: Iterable[torch.Tensor]) -> torch.Tensor:
    """The mean over every row of ``chunks`` (each [n, d_in]) of ``sae.encode(rows)``: [d_sae]
    float32 on the CPU, summed in float64 a chunk at a time, so memory follows the chunk's size
    (``engine.budgets.mean_encoding_rows`` rows for a mean ablation), never the rows'."""
    total, count = None, 0
    device = sae.W_enc.device
    with torch.no_grad():
        for chunk in chunks:
            summed = sae.encode(chunk.to(device).float()).sum(dim=0, dtype=torch.float64)
            total = summed if total is None else total + summed
            count += len(chunk)
    if total is None:
        raise EvaluationError("NO_ACTIVATIONS", "There are no rows to take means of.")
    return (total / count).float().cpu()


def evaluate_activations(
    sae: SparseAutoencoder,
    chunks: Iterable[torch.Tensor],
    *,
    dense_threshold: float = 0.1,
    rows_per_step: int = DEFAULT_ROWS_PER_STEP,
    should_cancel: Callable[[], bool] | None = None,
) -> ActivationEvaluation:
    """Reconstruction metrics of ``sae`` on the rows of ``chunks`` (each [n, d_in], any float dtype
    and device; moved to the SAE's device and encoded in float32, ``rows_per_step`` rows at a time).
    A transcoder's chunks are pairs (inputs [n, d_in], targets [n, d_out]): its output is compared
    with the targets, and the explained variance is theirs.

    Only sums are kept between chunks, so any chunking of the same rows gives the same metrics
    (up to float rounding). ``should_cancel()`` is asked before every chunk
    (:class:`EvaluationCancelled`). Raises :class:`EvaluationError` (``NO_ACTIVATIONS``) when there
    are no rows, and ``WRONG_WIDTH`` for rows of another width than ``sae.shape.d_in``.
    """
    if rows_per_step < 1:
        raise ValueError("rows_per_step must be positive")
    device = sae.W_enc.device
    d_in, d_sae = sae.shape.d_in, sae.shape.d_sae
    fire_counts = torch.zeros(d_sae, dtype=torch.long, device=device)
    squared_error = torch.zeros((), dtype=torch.float64, device=device)
    active = torch.zeros((), dtype=torch.long, device=device)
    moments = _Moments()
    with torch.inference_mode():
        for chunk in chunks:
            if should_cancel is not None and should_cancel():
                raise EvaluationCancelled
            inputs, targets = chunk if isinstance(chunk, tuple) else (chunk, chunk)
            if inputs.dim() != 2 or inputs.shape[1] != d_in:
                raise EvaluationError(
                    "WRONG_WIDTH",
                    f"Activations must be [rows, {d_in}] for this SAE, got {list(inputs.shape)}.",
                    {"expected": d_in, "shape": list(inputs.shape)},
                )
            for start in range(0, inputs.shape[0], rows_per_step):
                x = inputs[start : start + rows_per_step].to(device=device, dtype=torch.float32)
                y = targets[start : start + rows_per_step].to(device=device, dtype=torch.float32)
                features = sae.encode(x)
                fired = features > 0
                reconstruction = sae.decode(features)
                skip = sae.skip_path(x)
                if skip is not None:
                    reconstruction = reconstruction + skip
                squared_error += (reconstruction - y).pow(2).sum(dtype=torch.float64)
                fire_counts += fired.sum(0)
                active += fired.sum()
                moments.add(y)
    rows = moments.count
    if rows == 0:
        raise EvaluationError("NO_ACTIVATIONS", "There are no held-out activations to evaluate on.")
    residual = float(squared_error)
    variance = moments.total_squared_deviation()
    # Constant activations have no variance to explain; training reports 0 then too.
    explained = 1 - residual / variance if variance > 0 else 0.0
    density = (fire_counts.double() / rows).float().cpu()
    return ActivationEvaluation(
        tokens=rows,
        mse=residual / rows,
        explained_variance=explained,
        fraction_of_variance_unexplained=1 - explained,
        l0=int(active) / rows,
        dead_features=int((fire_counts == 0).sum()),
        dense_features=int((density > dense_threshold).sum()),
        dense_threshold=float(dense_threshold),
        feature_density=density,
    )


def ce_loss_recovered(
    model: Any,
    sequences: Sequence[Sequence[int]],
    *,
    hook_name: str,
    sae: SparseAutoencoder,
    batch_size: int = 8,
    should_cancel: Callable[[], bool] | None = None,
    input_hook: str | None = None,
) -> CeLossRecovered:
    """Next-token cross-entropy of causal LM ``model`` over ``sequences`` (token ids), clean, with
    ``sae``'s reconstruction spliced in at ``hook_name``, and with ``hook_name`` zero-ablated.

    A transcoder names the hook point it reads, ``input_hook``: its output, computed from what
    the model has there in the same pass, replaces ``hook_name`` (the MLP's output, say), and the
    zero ablation zeroes ``hook_name`` alone.

    Each loss is the mean over every predicted position of every sequence (a sequence of ``L``
    tokens predicts ``L - 1``; shorter than 2 tokens, it is skipped). The SAE runs in float32 on
    its own device and its reconstruction is cast back to the hook value's dtype and device.

    Sequences run ``batch_size`` at a time, grouped by length (:func:`plan_batches`) and padded on
    the right, with the attention mask and position ids of an unpadded run. Why the padding cannot
    change a loss:

    * a pad position's loss is not counted (only positions whose target is a real token are);
    * with right padding every pad comes after all real tokens of its row, so under causal
      attention (and the mask) no real position attends to one, and everything else in a block
      acts on each position alone: nothing at a pad position reaches a real position's logits;
    * the splice and the ablation still replace real-token positions only, pads keep the model's
      own value; so the edited tensor is, row by row, exactly what a run of the sequence alone
      sees, whatever the pads hold.

    ``should_cancel()`` is asked before every batch (:class:`EvaluationCancelled`). Raises
    :class:`engine.hooks.HookError` for an unknown hook point and :class:`EvaluationError` for no
    predicted token, a sequence too long for the model, token ids outside its vocabulary, a hook
    whose width is not the SAE's ``d_in``, or a model without logits.
    """
    sites = hook_sites(model, [hook_name] if input_hook is None else [input_hook, hook_name])
    kept = [index for index, ids in enumerate(sequences) if len(ids) >= 2]
    tokens = sum(len(sequences[index]) - 1 for index in kept)
    if tokens == 0:
        raise EvaluationError("NO_TOKENS", "No sequence has two tokens, so nothing is predicted.")
    _check_sequences(model, [sequences[index] for index in kept])
    plan = [
        [kept[index] for index in batch]
        for batch in plan_batches([len(sequences[i]) for i in kept], batch_size)
    ]
    parameters = inspect.signature(model.forward).parameters
    device = input_device(model)
    pad = pad_token_id(model)
    grad_free = grad_free_mode(model)
    summed = {"clean": 0.0, "sae": 0.0, "zero": 0.0}
    for batch in plan:
        if should_cancel is not None and should_cancel():
            raise EvaluationCancelled
        input_ids, attention_mask = _right_padded([sequences[index] for index in batch], pad)
        arguments: dict[str, Any] = {
            "input_ids": input_ids.to(device),
            "attention_mask": attention_mask.to(device),
        }
        if "position_ids" in parameters:
            arguments["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0).to(device)
        if "use_cache" in parameters:
            arguments["use_cache"] = False
        lengths = attention_mask.sum(-1).tolist()
        edits = _edits(sae, arguments["attention_mask"].bool(), output_hook=hook_name, input_hook=input_hook)
        with grad_free():
            for run, edit in edits.items():
                logits = edited_logits(model, sites, edit, arguments)
                summed[run] += _summed_loss(logits, arguments["input_ids"], lengths)
    clean, spliced, zero = (summed[run] / tokens for run in ("clean", "sae", "zero"))
    return CeLossRecovered(
        clean_loss=clean,
        sae_loss=spliced,
        zero_ablation_loss=zero,
        ce_loss_recovered=(zero - spliced) / (zero - clean) if zero != clean else None,
        tokens=tokens,
    )


def _edits(
    sae: SparseAutoencoder, real: torch.Tensor, *, output_hook: str, input_hook: str | None
) -> dict[str, Callable[[str, Any], Any] | None]:
    """The visitor of each run: none (clean), the SAE's reconstruction, zeros; the last two
    replace the positions where ``real`` [batch, tokens] is true and leave the pads alone. A
    transcoder's visitor keeps what it reads at ``input_hook`` for the output hook's splice."""
    read: dict[str, torch.Tensor] = {}

    def at_real_tokens(value: torch.Tensor, replacement: torch.Tensor) -> torch.Tensor:
        mask = real.to(value.device).reshape(*real.shape, *([1] * (value.dim() - 2)))
        return torch.where(mask, replacement, value)

    def splice(name: str, value: torch.Tensor) -> torch.Tensor | None:
        if name != output_hook:
            read["input"] = value
            return None
        source = value if input_hook is None else read.pop("input")
        return at_real_tokens(value, _reconstruction(sae, source, name).to(value.device, value.dtype))

    def zero(name: str, value: torch.Tensor) -> torch.Tensor | None:
        return at_real_tokens(value, torch.zeros_like(value)) if name == output_hook else None

    return {"clean": None, "sae": splice, "zero": zero}


def _check_sequences(model: Any, sequences: list[Sequence[int]]) -> None:
    longest = max(len(ids) for ids in sequences)
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(model.config, key, None)
        if isinstance(limit, int) and longest > limit:
            raise EvaluationError(
                "SEQUENCE_TOO_LONG",
                f"A sequence has {longest} tokens; the model takes at most {limit}.",
                {"longest": longest, "limit": limit},
            )
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    lowest = min(min(ids) for ids in sequences)
    highest = max(max(ids) for ids in sequences)
    if lowest < 0 or (vocab is not None and highest >= vocab):
        raise EvaluationError(
            "INVALID_TOKENS",
            f"Token ids must be in 0..{vocab - 1 if vocab else '?'} for this model.",
            {"vocab_size": vocab},
        )


def _right_padded(rows: list[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids [batch, longest] padded on the right with ``pad``, and the attention mask."""
    longest = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for number, row in enumerate(rows):
        input_ids[number, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        attention_mask[number, : len(row)] = 1
    return input_ids, attention_mask


def _reconstruction(sae: SparseAutoencoder, value: torch.Tensor, name: str) -> torch.Tensor:
    if value.shape[-1] != sae.shape.d_in:
        raise EvaluationError(
            "WRONG_WIDTH",
            f"{name} has width {value.shape[-1]}; the SAE takes {sae.shape.d_in}.",
            {"hook_width": int(value.shape[-1]), "d_in": sae.shape.d_in},
        )
    reconstruction = sae(value.to(device=sae.W_enc.device, dtype=torch.float32))
    if reconstruction.shape[-1] != sae.shape.output_width:
        raise EvaluationError("WRONG_WIDTH", f"{name}: the transcoder's output has the wrong width.")
    return reconstruction.to(device=value.device, dtype=value.dtype)


def edited_logits(
    model: Any, sites: dict, edit: Callable[[str, Any], Any] | None, arguments: dict[str, Any]
) -> torch.Tensor:
    """The model's logits on ``arguments``, with ``edit`` (a visitor) applied at ``sites``."""
    if edit is None:
        output = model(**arguments)
    else:
        runtime = HookRuntime(model, sites, edit, purpose="edited")
        runtime.begin_pass(*arguments["input_ids"].shape)
        with runtime.attached():
            output = runtime.run(model, **arguments)
        missing = runtime.missing()
        if missing:
            raise EvaluationError(
                "HOOK_NOT_REACHED",
                f"The forward pass never reached {', '.join(missing)}.",
                {"hooks": missing},
            )
    logits = getattr(output, "logits", None)
    if logits is None:
        raise EvaluationError("NOT_A_CAUSAL_LM", "CE loss needs a language model that gives logits.")
    return logits


def _summed_loss(logits: torch.Tensor, input_ids: torch.Tensor, lengths: list[int]) -> float:
    """Summed next-token cross-entropy of each row's real tokens, a row at a time so that only one
    row's logits are ever copied to float32."""
    total = 0.0
    for row, length in enumerate(lengths):
        predicted = logits[row, : length - 1].float()
        targets = input_ids[row, 1:length]
        losses = torch.nn.functional.cross_entropy(predicted, targets, reduction="none")
        total += float(losses.double().sum())
    return total
