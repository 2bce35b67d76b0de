"""A cache that is never written: the rows an extraction would store, computed from the model when read.

A feature analysis (and the explanations after it) reads a cache through two calls: ``tokens()``,
the token table, and ``get(hook, start, stop)``, the activations of rows ``[start, stop)``.
:class:`ModelRows` answers both for a model over tokenized samples, with the row order an
extraction of the same samples writes (:func:`engine.extraction.plan_batches` order; in each
batch, samples in ascending order, positions in order; no pad rows). The token table costs no
forward pass; a read runs the batches holding its rows, with the batches of the last reads kept
(a sweep reads chunk after chunk, so each batch runs once a pass). The same batches run as in an
extraction, so an analysis straight from the model equals one over the cache of the same tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

KEPT_BATCHES = 4


class ModelRows:
    """The rows of ``hook`` of ``model`` over ``tokenized`` samples batched as ``plan`` says,
    in ``dtype``: the reading side of an activation cache, with no file behind it."""

    def __init__(
        self,
        model: Any,
        tokenized: Sequence[Sequence[int]],
        plan: Sequence[Sequence[int]],
        *,
        hook: str,
        dtype: str = "float32",
        padding_side: str = "right",
        should_cancel: Callable[[], bool] | None = None,
    ) -> None:
        self.model, self.tokenized, self.hook = model, tokenized, hook
        self.plan = [sorted(batch) for batch in plan]
        self.dtype, self.padding_side, self.should_cancel = dtype, padding_side, should_cancel
        counts = [sum(len(tokenized[index]) for index in batch) for batch in self.plan]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._kept: OrderedDict[int, Any] = OrderedDict()
        self.forward_passes = 0

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    def tokens(self) -> dict[str, np.ndarray]:
        """``token_ids``, ``sample_index`` and ``position`` of every row, int64 (no model run)."""
        order = [index for batch in self.plan for index in batch]
        lengths = np.array([len(self.tokenized[index]) for index in order], dtype=np.int64)
        ids = [np.asarray(self.tokenized[index], dtype=np.int64) for index in order]
        return {
            "token_ids": np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64),
            "sample_index": np.repeat(np.asarray(order, dtype=np.int64), lengths),
            "position": np.concatenate([np.arange(length, dtype=np.int64) for length in lengths])
            if len(lengths)
            else np.zeros(0, dtype=np.int64),
        }

    def get(self, hook: str, start: int = 0, stop: int | None = None, *, as_torch: bool = True):
        """Rows ``[start, stop)`` of ``hook`` (a torch tensor in ``dtype``; numpy float32 without
        ``as_torch``)."""
        import torch

        if hook != self.hook:
            raise KeyError(f"These rows are of {self.hook!r}, not {hook!r}.")
        start, stop, _ = slice(start, stop).indices(self.num_tokens)
        stop = max(start, stop)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        batch = first
        while batch < len(self.plan) and self.starts[batch] < stop:
            rows = self._batch(batch)
            low = max(start, int(self.starts[batch])) - int(self.starts[batch])
            high = min(stop, int(self.starts[batch + 1])) - int(self.starts[batch])
            pieces.append(rows[low:high])
            batch += 1
        if not pieces:
            out = torch.empty((0, 0), dtype=getattr(torch, self.dtype))
        else:
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out if as_torch else out.float().numpy()

    def _batch(self, index: int):
        from engine.extraction import extract

        if index in self._kept:
            self._kept.move_to_end(index)
            return self._kept[index]
        (batch,) = extract(
            self.model,
            self.tokenized,
            [self.plan[index]],
            hooks=[self.hook],
            dtype=self.dtype,
            padding_side=self.padding_side,
            should_cancel=self.should_cancel,
        )
        self.forward_passes += 1
        rows = batch.activations[self.hook]
        self._kept[index] = rows
        while len(self._kept) > KEPT_BATCHES:
            self._kept.popitem(last=False)
        return rows
