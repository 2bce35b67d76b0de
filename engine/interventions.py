"""Interventions: writes into a model's activations at hook points while it runs.

An :class:`Intervention` is resolved: its vectors and SAE are tensors and modules, its hook point
a name of the model's vocabulary (``engine.hooks``). The JSON shape that names them by id (a
stored steering vector, an SAE row, a cache's means) is the apps' to parse and resolve; this
module applies them. Kinds:

* ``add``: ``x + coefficient * vector`` (with ``normalize``, the vector scaled to unit norm and
  then to each token's own norm: ``x + coefficient * |x| * v / |v|``);
* ``clamp_feature``: an SAE feature set to ``value``, the SAE's reconstruction error kept:
  ``x + (value - f_i(x)) * W_dec[i]`` (decoding is linear, so this is encode -> set -> decode plus
  the error ``x - decode(encode(x))``; clamping a feature to its own value changes nothing);
* ``ablate``: neurons (entries of ``x``) or SAE features set to zero or to a mean (``means``);
* ``replace``: ``x`` set to ``vector`` (activation patching).

Each applies at ``positions`` of its row's sequence: ``all``, ``prompt`` (the prompt's tokens),
``generated`` (tokens fed back after being generated) or a list of absolute positions (0 is the
prompt's first token). An intervention applies to its own row of a batch only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError

KINDS = ("add", "clamp_feature", "ablate", "replace")
POSITION_KINDS = ("all", "prompt", "generated")


class InterventionError(EngineError):
    """An intervention that cannot apply (``INVALID_INTERVENTION``, naming it by its index)."""


def invalid_intervention(index: int, message: str, **details: Any) -> InterventionError:
    return InterventionError(
        "INVALID_INTERVENTION", f"Intervention {index}: {message}", {"intervention": index, **details}
    )


@dataclass(frozen=True)
class Intervention:
    kind: str
    hook: str
    positions: str | tuple[int, ...] = "all"
    # add / replace: [width]
    vector: Any = None
    coefficient: float = 1.0
    normalize: bool = False
    # clamp_feature / ablate (of features): the SAE and its features
    sae: Any = None
    features: tuple[int, ...] = ()
    value: float = 0.0
    # ablate (of neurons): their indices
    neurons: tuple[int, ...] = ()
    # ablate with a mean: [width] (neurons) or [d_sae] (features); None for zero ablation
    means: Any = None
    index: int = field(default=0, compare=False)  # its place in the request, for errors


def check_interventions(interventions: Sequence[Intervention], widths: dict[str, int]) -> None:
    """Shapes and values against the hook points' widths (None: a ``module:`` path, whose width
    shows when it runs); ``INVALID_INTERVENTION`` else."""
    import torch

    for item in interventions:
        fail = lambda message, item=item, **details: invalid_intervention(item.index, message, **details)  # noqa: E731
        if item.kind not in KINDS:
            raise fail(f"kind must be one of {', '.join(KINDS)}.")
        if item.hook not in widths:
            raise fail(f"unknown hook point {item.hook!r}.", hook=item.hook)
        width = widths[item.hook]
        if isinstance(item.positions, str):
            if item.positions not in POSITION_KINDS:
                raise fail(f"positions must be one of {', '.join(POSITION_KINDS)} or a list of positions.")
        elif not item.positions or any(position < 0 for position in item.positions):
            raise fail("positions must list positions >= 0.")
        if not math.isfinite(item.coefficient) or not math.isfinite(item.value):
            raise fail("coefficient and value must be finite numbers.")
        if item.kind in ("add", "replace"):
            if (
                item.vector is None
                or item.vector.dim() != 1
                or (width is not None and len(item.vector) != width)
            ):
                got = None if item.vector is None else list(item.vector.shape)
                raise fail(f"the vector must have the hook's width {width}.", width=width, got=got)
            if not bool(torch.isfinite(item.vector).all()):
                raise fail("the vector has non-finite values.")
        uses_sae = item.kind == "clamp_feature" or (item.kind == "ablate" and item.sae is not None)
        if uses_sae:
            if width is not None and item.sae.shape.d_in != width:
                raise fail(
                    f"the SAE reads a width of {item.sae.shape.d_in}, the hook has {width}.", width=width
                )
            if not item.features or any(not 0 <= f < item.sae.shape.d_sae for f in item.features):
                raise fail(f"features must be in [0, {item.sae.shape.d_sae}).")
        if item.kind == "ablate":
            limit = width if width is not None else math.inf
            if item.sae is None and (not item.neurons or any(not 0 <= n < limit for n in item.neurons)):
                raise fail(f"neurons must be in [0, {width}).")
            expected = item.sae.shape.d_sae if item.sae is not None else width
            if item.means is not None and (
                (expected is not None and tuple(item.means.shape) != (expected,))
                or not bool(torch.isfinite(item.means).all())
            ):
                raise fail(f"the means must be {expected} finite numbers.")


def position_mask(positions: str | tuple[int, ...], absolute: Any, prompt_length: int) -> Any:
    """Which of a row's tokens ``absolute`` [tokens] (their positions in the row's sequence;
    negative for padding) an intervention touches: bool [tokens]."""
    import torch

    real = absolute >= 0
    if positions == "all":
        return real
    if positions == "prompt":
        return real & (absolute < prompt_length)
    if positions == "generated":
        return absolute >= prompt_length
    wanted = torch.tensor(positions, device=absolute.device, dtype=absolute.dtype)
    return torch.isin(absolute, wanted)


def feature_values(sae: Any, x: Any, features: tuple[int, ...]) -> Any:
    """``encode(x)[..., features]`` [tokens, n]; one encoder column each where the activation of a
    feature depends on its own pre-activation only (not TopK's choice among all)."""
    if sae.architecture == "topk":
        return sae.encode(x)[..., list(features)]
    columns = list(features)
    sae_in = x.to(sae.W_enc.dtype)
    if sae.shape.apply_b_dec_to_input:
        sae_in = sae_in - sae.b_dec
    hidden_pre = sae_in @ sae.W_enc[:, columns] + sae.b_enc[columns]
    if sae.architecture == "standard":
        return hidden_pre.relu()
    threshold = sae.threshold[columns]
    return hidden_pre * (hidden_pre > threshold)


def _check_width(item: Intervention, width: int) -> None:
    """Refuse an intervention that does not fit the width its hook has here (a ``module:`` hook's
    width shows only when it runs): a clear ``INVALID_INTERVENTION``, not an error deep in torch."""
    if item.kind in ("add", "replace"):
        needed = len(item.vector)
    elif item.sae is not None:
        needed = item.sae.shape.d_in
    else:
        needed = max(item.neurons) + 1 if item.means is None else len(item.means)
        if item.means is None and needed <= width:
            return
    if needed != width:
        raise invalid_intervention(
            item.index, f"{item.hook} has a width of {width} here; the intervention needs {needed}.",
            width=width, needs=needed,
        )  # fmt: skip


def _apply_one(item: Intervention, x: Any) -> Any:
    """The intervention on rows ``x`` [tokens, width] (a copy: ``x`` is left alone)."""
    if item.kind == "add":
        vector = item.vector.to(device=x.device, dtype=x.dtype)
        if item.normalize:
            direction = vector / vector.norm().clamp_min(1e-12)
            return x + item.coefficient * x.norm(dim=-1, keepdim=True) * direction
        return x + item.coefficient * vector
    if item.kind == "replace":
        return item.vector.to(device=x.device, dtype=x.dtype).expand_as(x).clone()
    if item.kind == "ablate" and item.sae is None:
        out = x.clone()
        neurons = list(item.neurons)
        if item.means is None:
            out[:, neurons] = 0
        else:
            out[:, neurons] = item.means.to(device=x.device, dtype=x.dtype)[neurons]
        return out
    # Features: clamp_feature, or ablate of features (to zero or to their means).
    current = feature_values(item.sae, x, item.features)  # [tokens, n]
    if item.kind == "clamp_feature":
        target = current.new_full(current.shape, item.value)
    elif item.means is None:
        target = current.new_zeros(current.shape)
    else:
        target = item.means.to(device=current.device, dtype=current.dtype)[list(item.features)].expand_as(
            current
        )
    directions = item.sae.W_dec[list(item.features)]  # [n, width]
    return x + ((target - current) @ directions).to(x.dtype)


class Interventions:
    """The interventions of each row of a batch, applied to the values a hook point sees.

    ``per_row[r]`` are row ``r``'s, in order; ``prompt_lengths[r]`` its prompt's length. Each
    forward pass declares the absolute positions of its tokens (:meth:`begin_pass`)."""

    def __init__(self, per_row: Sequence[Sequence[Intervention]], prompt_lengths: Sequence[int]) -> None:
        self.per_row = [list(items) for items in per_row]
        self.prompt_lengths = list(prompt_lengths)
        self.hooks = list(dict.fromkeys(item.hook for items in self.per_row for item in items))
        self._absolute: Any = None

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def begin_pass(self, absolute: Any) -> None:
        """``absolute`` [batch, tokens]: each token's position in its row's sequence (< 0: padding)."""
        self._absolute = absolute

    def apply(self, name: str, tensor: Any) -> Any:
        """``tensor`` [batch, tokens, ...] with the interventions at ``name`` applied (a new
        tensor), or None when none applies here."""
        out = None
        for row, items in enumerate(self.per_row):
            for item in items:
                if item.hook != name:
                    continue
                mask = position_mask(item.positions, self._absolute[row], self.prompt_lengths[row])
                if not bool(mask.any()):
                    continue
                if out is None:
                    out = tensor.clone()
                values = out[row][mask]
                shape = values.shape
                rows = values.reshape(shape[0], -1)
                _check_width(item, rows.shape[1])
                changed = _apply_one(item, rows)
                out[row, mask] = changed.reshape(shape)
        return out
