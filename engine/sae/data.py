"""Activations for training, shuffled in bounded memory: a shuffle buffer over a stream of rows.

The same buffer serves a cache read from disk and activations fresh from the model; what comes
out depends on the rows that go in and the seed, never on how they were cut into chunks, so a
training from the model and one from a cache of the very same activations see the same batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


class ShuffleBuffer:
    """Rows in, batches of ``batch_size`` rows out, in random order, every row exactly once.

    Rows gather until ``buffer_rows`` are held; then those are shuffled, the first half (whole
    batches) is given out and the rest stays to mix with the next rows, so rows that arrived far
    apart meet in the same batches. At most ``buffer_rows`` rows plus the last chunk added are
    held. :meth:`end` says no more rows come: what is left is shuffled and given out, the last
    batch possibly smaller. Rows may sit on any device (the training's); the permutations come
    from one CPU generator, whose state :meth:`state_dict` keeps with the rows held, so that a
    training resumed from a checkpoint sees the batches an uninterrupted one would.
    """

    def __init__(self, *, batch_size: int, buffer_rows: int, seed: int = 0) -> None:
        if batch_size < 1 or buffer_rows < 2 * batch_size:
            raise ValueError("need batch_size >= 1 and buffer_rows >= 2 * batch_size")
        self.batch_size, self.buffer_rows = batch_size, buffer_rows
        # Rows given out per refill: half the buffer, in whole batches.
        self.given_per_refill = buffer_rows // 2 // batch_size * batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._held: list[torch.Tensor] = []
        self._held_rows = 0
        self._queue: torch.Tensor | None = None  # shuffled rows being given out
        self._ended = False

    @property
    def held_rows(self) -> int:
        """Rows in the buffer, those being given out included."""
        return self._held_rows + (len(self._queue) if self._queue is not None else 0)

    def add(self, rows: torch.Tensor) -> None:
        if len(rows):
            self._held.append(rows)
            self._held_rows += len(rows)

    def end(self) -> None:
        self._ended = True

    def next_batch(self) -> torch.Tensor | None:
        """The next batch, or None when more rows must be added first (or, after :meth:`end`,
        when every row has been given out)."""
        if self._queue is None or not len(self._queue):
            self._queue = None
            if self._held_rows >= self.buffer_rows:
                held = self._take_held()
                shuffled = self._shuffled(held[: self.buffer_rows])
                self._queue = shuffled[: self.given_per_refill]
                self.add(shuffled[self.given_per_refill :])
                self.add(held[self.buffer_rows :])
            elif self._ended and self._held_rows:
                self._queue = self._shuffled(self._take_held())
            else:
                return None
        batch, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
        return batch

    def queued(self) -> torch.Tensor | None:
        """The shuffled rows about to be given out (for an initialisation sample), or None."""
        return self._queue

    def _take_held(self) -> torch.Tensor:
        held = torch.cat(self._held) if len(self._held) > 1 else self._held[0]
        self._held, self._held_rows = [], 0
        return held

    def _shuffled(self, rows: torch.Tensor) -> torch.Tensor:
        order = torch.randperm(len(rows), generator=self.generator)
        return rows[order.to(rows.device)]

    def state_dict(self) -> dict[str, Any]:
        """The rows held (those being given out first) and the generator's state, as tensors."""
        parts = [self._queue] if self._queue is not None else []
        parts += self._held
        return {
            "queued_rows": torch.tensor(len(self._queue) if self._queue is not None else 0),
            "rows": torch.cat(parts) if parts else torch.zeros(0),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any], *, device: str | torch.device = "cpu") -> None:
        rows = state["rows"].to(device)
        queued = int(state["queued_rows"])
        self._queue = rows[:queued] if queued else None
        self._held, self._held_rows = [], 0
        self.add(rows[queued:])
        self.generator.set_state(state["generator"])
        self._ended = False


def shuffled_batches(
    chunks: Iterable[torch.Tensor], *, batch_size: int, buffer_rows: int, seed: int = 0
) -> Iterator[torch.Tensor]:
    """The rows of ``chunks`` (each [n, d], e.g. a cache's shards read in order) through a
    :class:`ShuffleBuffer`: ``batch_size`` rows at a time, every row exactly once."""
    buffer = ShuffleBuffer(batch_size=batch_size, buffer_rows=buffer_rows, seed=seed)
    for chunk in chunks:
        buffer.add(chunk)
        while (batch := buffer.next_batch()) is not None:
            yield batch
    buffer.end()
    while (batch := buffer.next_batch()) is not None:
        yield batch
