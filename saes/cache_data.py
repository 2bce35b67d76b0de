"""An activation cache as SAE training and evaluation read it: split, streamed, never loaded whole.

The last ``HOLDOUT_FRACTION`` of a cache's tokens (from a sample boundary on) are held out:
training never sees them, evaluation reads only them, and CE loss recovered runs the model on
the token ids of those samples. Reads are shard by shard through the store's memory maps. A
training's stream opens again at the position its checkpoint saved (:func:`training_batches`): a
time-sliced training resumes reading a buffer's worth of rows, not everything it trained on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from activations.store import ActivationStore
from engine.budgets import mean_encoding_rows

if TYPE_CHECKING:
    from engine.sae.data import StreamPosition

CHUNK_ROWS = 16384  # rows per read: a few MB for the widths of small models
INIT_SAMPLE_ROWS = 8192  # rows that set the scaling factor and b_dec, spread over the training part
SHUFFLE_BUFFER_BATCHES = 16  # the shuffle buffer holds this many batches of rows
PREFETCH_BATCHES = 4  # batches read and shuffled ahead of the training step
EVALUATION_ROWS_PER_STEP = 4096  # held-out rows encoded at once, at most (engine.sae.evaluation's default)


def evaluation_rows(d_sae: int) -> int:
    """Held-out rows an evaluation encodes at once: fewer for a wide SAE, so that one step's
    [rows, d_sae] tensors stay as small as a mean ablation's (``engine.budgets``)."""
    return min(EVALUATION_ROWS_PER_STEP, mean_encoding_rows(d_sae))


def training_buffered_rows(batch_size: int) -> int:
    """Rows a training holds besides its step: the shuffle buffer, the batches read ahead and the
    chunks being read."""
    return (SHUFFLE_BUFFER_BATCHES + PREFETCH_BATCHES) * batch_size + 2 * CHUNK_ROWS


CE_MAX_SEQUENCES = 64
CE_MAX_TOKENS = 16384


@dataclass(frozen=True)
class CacheSplit:
    train_stop: int  # rows [0, train_stop) train
    holdout_start: int  # rows [holdout_start, num_tokens) evaluate
    num_tokens: int


def cache_split(store: ActivationStore, holdout_fraction: float) -> CacheSplit:
    """Where the held-out part starts: the first sample boundary at or after ``1 - fraction`` of
    the rows (or that row itself when one sample spans it all)."""
    total = store.num_tokens
    target = min(total - 1, max(1, int(total * (1 - holdout_fraction))))
    samples = np.asarray(store.tokens()["sample_index"])
    boundaries = np.flatnonzero(samples[target:] != samples[target - 1])
    start = target + int(boundaries[0]) if len(boundaries) else target
    if start >= total:  # the last sample spans the target: split inside it
        start = target
    return CacheSplit(train_stop=start, holdout_start=start, num_tokens=total)


def row_chunks(store: ActivationStore, hook: str, start: int, stop: int, *, epochs: int = 1) -> Iterator:
    """Rows ``[start, stop)`` of ``hook`` as torch tensors in the cache's dtype, ``CHUNK_ROWS`` at a
    time, ``epochs`` times over (the shuffle buffer mixes them). A bf16 or fp16 cache stays half
    the size through the shuffle buffer and the copy to the device; training and evaluation
    upcast each batch to float32 there (exactly: every bf16/fp16 value is a float32 value)."""
    for _ in range(epochs):
        for low in range(start, stop, CHUNK_ROWS):
            yield store.get(hook, low, min(stop, low + CHUNK_ROWS), as_torch=True)


def training_batches(
    store: ActivationStore,
    hook: str,
    stop: int,
    *,
    batch_size: int,
    seed: int,
    epochs: int,
    start: StreamPosition | None = None,
) -> Iterator:
    """The training's shuffled batches of rows ``[0, stop)`` of ``hook``, ``epochs`` times over,
    ``CHUNK_ROWS`` read at a time, each with its stream position (what a checkpoint keeps); from
    ``start``, a position one of them gave, the batches that followed it, reading only the rows the
    buffer held then (by number) and the cache on from there. The batches are those of
    :func:`row_chunks` through ``shuffled_batches``."""
    from engine.sae.data import RowSource, resumable_batches  # torch: the worker's, not the web's

    source = RowSource(
        count=stop,
        read=lambda low, high: store.get(hook, low, high, as_torch=True),
        gather=lambda numbers: store.gather(hook, numbers.numpy(), as_torch=True),
    )
    return resumable_batches(
        source, epochs=epochs, batch_size=batch_size, buffer_rows=SHUFFLE_BUFFER_BATCHES * batch_size,
        seed=seed, chunk_rows=CHUNK_ROWS, start=start,
    )  # fmt: skip


def spread_sample(store: ActivationStore, hook: str, stop: int, rows: int = INIT_SAMPLE_ROWS):
    """About ``rows`` rows from eight places spread over ``[0, stop)`` (for the initialisation)."""
    import torch

    pieces = 8
    per_piece = max(1, min(rows, stop) // pieces)
    starts = np.linspace(0, max(0, stop - per_piece), pieces).astype(int)
    return torch.cat(
        [
            store.get(hook, int(low), int(low) + per_piece, as_torch=True).float()
            for low in sorted(set(starts))
        ]
    )


def holdout_sequences(store: ActivationStore, split: CacheSplit) -> list[list[int]]:
    """Token ids of whole held-out samples, as the model saw them (at most ``CE_MAX_SEQUENCES``
    sequences and ``CE_MAX_TOKENS`` tokens), for CE loss recovered."""
    table = store.tokens()
    samples = np.asarray(table["sample_index"][split.holdout_start :])
    sequences: list[list[int]] = []
    tokens = 0
    for sample_index in dict.fromkeys(samples.tolist()):
        ids, positions = store.sample_tokens(int(sample_index))
        if len(ids) < 2 or positions[0] != 0:
            continue  # a sample split by the boundary, or too short to predict a token
        if tokens + len(ids) > CE_MAX_TOKENS or len(sequences) >= CE_MAX_SEQUENCES:
            break
        sequences.append([int(token) for token in ids])
        tokens += len(ids)
    return sequences
