"""Activations for training, shuffled in bounded memory: a shuffle buffer over a stream of chunks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def shuffled_batches(
    chunks: Iterable[torch.Tensor], *, batch_size: int, buffer_rows: int, seed: int = 0
) -> Iterator[torch.Tensor]:
    """The rows of ``chunks`` (each [n, d_in], e.g. a cache's shards read in order) in random order,
    ``batch_size`` rows at a time, every row exactly once.

    At most ``buffer_rows`` rows (plus one chunk being added) are held: the buffer fills, is
    shuffled, gives out its first half and keeps the rest to mix with the next chunks, so rows
    that sit far apart in the cache meet in the same batches. The last batch may be smaller.
    """
    if batch_size < 1 or buffer_rows < 2 * batch_size:
        raise ValueError("need batch_size >= 1 and buffer_rows >= 2 * batch_size")
    generator = torch.Generator().manual_seed(seed)
    held: list[torch.Tensor] = []
    count = 0
    pending: torch.Tensor | None = None  # rows given out in full batches only

    def emit(rows: torch.Tensor, *, final: bool) -> Iterator[torch.Tensor]:
        nonlocal pending
        if pending is not None:
            rows = torch.cat([pending, rows])
            pending = None
        whole = len(rows) - len(rows) % batch_size
        for start in range(0, whole, batch_size):
            yield rows[start : start + batch_size]
        if whole < len(rows):
            if final:
                yield rows[whole:]
            else:
                pending = rows[whole:]

    for chunk in chunks:
        held.append(chunk)
        count += len(chunk)
        if count >= buffer_rows:
            buffer = torch.cat(held)
            buffer = buffer[torch.randperm(len(buffer), generator=generator)]
            half = len(buffer) // 2
            yield from emit(buffer[:half], final=False)
            held, count = [buffer[half:]], len(buffer) - half
    if held or pending is not None:
        buffer = torch.cat(held) if held else pending.new_zeros((0, pending.shape[1]))
        yield from emit(buffer[torch.randperm(len(buffer), generator=generator)], final=True)
