"""Activations for training, shuffled in bounded memory: a shuffle buffer over a stream of rows.

The same buffer serves a cache read from disk and activations fresh from the model; what comes
out depends on the rows that go in and the seed, never on how they were cut into chunks, so a
training from the model and one from a cache of the very same activations see the same batches.

A stream of rows that can be read again by number (a cache) is opened in the middle by
:func:`resumable_batches`: each batch comes with its :class:`StreamPosition`, which a training
checkpoint keeps, and a training resumed from it reads the rows its buffer held and the source on
from where the buffer stopped, never the batches it trained on before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RowSource:
    """Rows numbered ``0 .. count - 1`` (a cache's training part) that can be read in order,
    ``read(low, high)`` giving rows ``[low, high)``, and by number, ``gather(numbers)`` giving
    those rows in that order: what a stream needs to be opened again in the middle."""

    count: int
    read: Callable[[int, int], torch.Tensor]
    gather: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StreamPosition:
    """Where a :func:`resumable_batches` stream stands after a batch: all that opening it there
    again needs, and no activations: the shuffle buffer is kept as the numbers of the rows it
    holds (8 bytes a row, whatever the width) with its generator's state."""

    batches: int  # batches given out so far
    rows_given: int  # rows in them (a training's tokens)
    rows_taken: int  # rows of the source the buffer has taken, epochs included
    buffer: dict[str, torch.Tensor]  # ShuffleBuffer.state_dict() of the rows' numbers


def resumable_batches(
    source: RowSource,
    *,
    epochs: int,
    batch_size: int,
    buffer_rows: int,
    seed: int = 0,
    chunk_rows: int,
    start: StreamPosition | None = None,
) -> Iterator[tuple[torch.Tensor, StreamPosition]]:
    """:func:`shuffled_batches` of ``source``'s rows, ``epochs`` times over, read ``chunk_rows`` at a
    time: each batch with the position after it. From ``start`` (a position this stream gave, of
    the same source and arguments), the batches are those that followed it.

    Beside the rows, a second buffer with the same seed shuffles their numbers: it takes the same
    sizes, so it draws the same permutations and holds the numbers of the rows the first holds, in
    their order. Its state is the position's; opening at a position loads it, gathers the rows it
    names and reads the source on from ``rows_taken``: a buffer's worth of rows, however far the
    stream had gone. Reads start on multiples of ``chunk_rows`` within an epoch, as they would
    have without the stop (what comes out does not depend on it, but the reads stay aligned)."""
    if source.count < 1 or epochs < 1:
        raise ValueError("need a source with rows and epochs >= 1")
    rows = ShuffleBuffer(batch_size=batch_size, buffer_rows=buffer_rows, seed=seed)
    numbers = ShuffleBuffer(batch_size=batch_size, buffer_rows=buffer_rows, seed=seed)
    batches = rows_given = rows_taken = 0
    if start is not None:
        held = start.buffer["rows"].long()
        if start.rows_taken > epochs * source.count or (len(held) and int(held.max()) >= source.count):
            raise ValueError("the position is not one of this stream: it names rows the source lacks")
        numbers.load_state_dict(start.buffer)
        rows.load_state_dict({**start.buffer, "rows": source.gather(held) if len(held) else held})
        batches, rows_given, rows_taken = start.batches, start.rows_given, start.rows_taken

    def positioned(batch: torch.Tensor) -> tuple[torch.Tensor, StreamPosition]:
        nonlocal batches, rows_given
        numbers.next_batch()  # the same batch's numbers: the buffers move together
        batches += 1
        rows_given += len(batch)
        return batch, StreamPosition(batches, rows_given, rows_taken, numbers.state_dict())

    while True:  # the batches the buffer can give before reading (opened midway: maybe some)
        while (batch := rows.next_batch()) is not None:
            yield positioned(batch)
        if rows_taken == epochs * source.count:
            break
        low = rows_taken % source.count
        high = min(source.count, (low // chunk_rows + 1) * chunk_rows)
        chunk = source.read(low, high)
        if len(chunk) != high - low:  # the buffers would no longer move together
            raise ValueError(f"the source gave {len(chunk)} rows for [{low}, {high})")
        rows.add(chunk)
        numbers.add(torch.arange(low, high))
        rows_taken += high - low
    rows.end()
    numbers.end()
    while (batch := rows.next_batch()) is not None:
        yield positioned(batch)
