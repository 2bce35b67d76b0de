"""Interventions applied while a model runs: each row of a batch gets its own, at the positions
they name, on the values a hook point sees (the hook runtime calls :meth:`Interventions.apply`).
What each kind writes is its own (:mod:`engine.interventions`); this module picks the rows and
tokens it writes to and keeps the rest of the batch untouched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.interventions import Intervention


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
                item.fit(rows.shape[1])
                changed = item.apply(rows)
                out[row, mask] = changed.reshape(shape)
        return out
