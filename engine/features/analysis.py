"""Feature analysis: an SAE swept over cached activations, reduced to each feature's dashboard data.

Three streaming passes over the cache's rows, memory bounded by ``chunk_rows x d_sae`` plus the
per-feature results (nothing grows with the cache):

1. each feature's density (fraction of tokens where it is > 0), max and mean of its non-zero
   values, and its ``top_k`` highest activations (rows and values);
2. a histogram of its non-zero values over ``(0, max]``; ``per_interval`` examples from each of
   ``intervals`` equal intervals of ``(0, max]`` (weak as well as strong activations), picked by a
   hash of (row, feature) so that any run, resumed or not, picks the same; and its value on every
   context token of its top examples;
3. its value on the context tokens of those interval examples: only the rows around them are
   encoded again.

The state between chunks is a set of numpy arrays (:class:`AnalysisState`), saved as safetensors
for a resumable job. Nothing here imports Django; the cache is read through ``read_rows``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import EngineError
from engine.memory import drop_mapped_pages, release_freed_heap
from engine.prefetch import prefetched

STATE_FILE = "state.safetensors"
STATE_META = "state.json"
STATE_VERSION = 1
_EMPTY = -1  # an example slot with no row, a context slot with no token
TRIM_EVERY_CHUNKS = 8


class AnalysisError(EngineError):
    pass


class AnalysisCancelled(AnalysisError):
    def __init__(self) -> None:
        super().__init__("ANALYSIS_CANCELLED", "The feature analysis was cancelled.")


@dataclass(frozen=True)
class AnalysisConfig:
    """What each feature's dashboard holds (sae-dashboard's defaults, roughly)."""

    top_k: int = 20
    intervals: int = 5
    per_interval: int = 4
    context_before: int = 8
    context_after: int = 3
    histogram_bins: int = 40
    chunk_rows: int = 2048

    @property
    def window(self) -> int:
        return self.context_before + 1 + self.context_after

    @property
    def interval_examples(self) -> int:
        return self.intervals * self.per_interval


@dataclass
class TokenTable:
    """The cache's token table (one row per cached token) and the context window of any row."""

    token_ids: np.ndarray
    sample_index: np.ndarray
    position: np.ndarray
    _order: np.ndarray | None = field(default=None, init=False, repr=False)
    _rank: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids)
        self.sample_index = np.asarray(self.sample_index)
        self.position = np.asarray(self.position)
        if not _samples_contiguous(self.sample_index, self.position):
            # A sample's rows scattered through the table (a generation's cache, written a step
            # at a time): windows go through an index (16 bytes a token).
            self._order = np.lexsort((self.position, self.sample_index))
            self._rank = np.empty_like(self._order)
            self._rank[self._order] = np.arange(len(self._order))

    def __len__(self) -> int:
        return len(self.token_ids)

    def windows(self, rows: np.ndarray, before: int, after: int) -> np.ndarray:
        """For rows [...], the rows of their context windows [..., before + 1 + after]: the tokens
        of the same sample around each, in position order, ``-1`` past the sample's ends (and for
        a row that is itself ``-1``)."""
        rows = np.asarray(rows, dtype=np.int64)
        valid = rows >= 0
        safe = np.where(valid, rows, 0)
        ranks = safe if self._rank is None else self._rank[safe]
        offsets = np.arange(-before, after + 1)
        window_ranks = ranks[..., None] + offsets
        inside = (window_ranks >= 0) & (window_ranks < len(self))
        window_ranks = np.clip(window_ranks, 0, max(0, len(self) - 1))
        window_rows = window_ranks if self._order is None else self._order[window_ranks]
        same = self.take(self.sample_index, window_rows) == self.take(self.sample_index, safe)[..., None]
        return np.where(inside & same & valid[..., None], window_rows, _EMPTY)

    def ids(self, rows: np.ndarray) -> np.ndarray:
        """Token ids of rows (``-1`` for ``-1``), int32."""
        rows = np.asarray(rows, dtype=np.int64)
        return np.where(rows >= 0, self.take(self.token_ids, np.maximum(rows, 0)), _EMPTY).astype(np.int32)

    @staticmethod
    def take(column: np.ndarray, rows: np.ndarray, block: int = 1 << 20) -> np.ndarray:
        """``column[rows]`` (rows in range, any shape), read in row order ``block`` rows of the
        table at a time, each block's pages of a memory-mapped column dropped after: the examples'
        rows are all over the table, and reading them straight would leave the whole column
        resident (8 bytes a token)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not isinstance(column, np.memmap) and not isinstance(column.base, np.memmap):
            return column[rows]
        flat = rows.reshape(-1)
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        out = np.empty(len(flat), dtype=column.dtype)
        edges = np.searchsorted(ordered, np.arange(0, len(column) + block, block))
        for low, high in itertools.pairwise(edges):
            if high > low:
                out[order[low:high]] = column[ordered[low:high]]
                drop_mapped_pages(column)
        return out.reshape(rows.shape)


def _samples_contiguous(sample_index: np.ndarray, position: np.ndarray, block: int = 1 << 20) -> bool:
    """Whether each sample's rows form one run of the table, in position order (an extraction's
    cache: samples in any order, e.g. longest first, each one's tokens together), so a row's
    context is the rows beside it. Checked ``block`` rows at a time, with one flag per sample:
    whole-table temporaries would add ~20 bytes a token to the job's peak memory."""
    seen = np.zeros(0, dtype=bool)
    for start in range(0, len(sample_index), block):
        stop = min(len(sample_index), start + block)
        samples = np.array(sample_index[max(0, start - 1) : stop])  # copies: the map's pages go back
        positions = np.array(position[max(0, start - 1) : stop])
        drop_mapped_pages(sample_index)
        drop_mapped_pages(position)
        same = samples[1:] == samples[:-1]
        if not np.all(~same | (positions[1:] > positions[:-1])):
            return False
        # The first row of each run (the block's first row counts when it starts a run).
        starts = samples[1:][~same] if start else np.concatenate([samples[:1], samples[1:][~same]])
        if len(starts):
            if starts.min() < 0:
                return False
            if starts.max() >= len(seen):
                seen = np.concatenate([seen, np.zeros(int(starts.max()) + 1 - len(seen), dtype=bool)])
            if seen[starts].any() or len(np.unique(starts)) < len(starts):
                return False
            seen[starts] = True
    return True


# -- state ------------------------------------------------------------------------------------------


@dataclass
class AnalysisState:
    """Everything the sweep has gathered so far, and where it is (``phase`` 1-3, ``next_row``)."""

    arrays: dict[str, np.ndarray]
    phase: int = 1
    next_row: int = 0
    num_rows: int = 0
    seconds: float = 0.0  # time spent in the passes, over resumes

    @classmethod
    def empty(cls, d_sae: int, config: AnalysisConfig, num_rows: int) -> AnalysisState:
        k, q, w = config.top_k, config.interval_examples, config.window
        return cls(
            arrays={
                "count": np.zeros(d_sae, dtype=np.int64),
                "total": np.zeros(d_sae, dtype=np.float64),
                "max": np.zeros(d_sae, dtype=np.float32),
                "top_values": np.zeros((d_sae, k), dtype=np.float32),
                "top_rows": np.full((d_sae, k), _EMPTY, dtype=np.int64),
                "histogram": np.zeros((d_sae, config.histogram_bins), dtype=np.int64),
                "interval_values": np.zeros((d_sae, q), dtype=np.float32),
                "interval_rows": np.full((d_sae, q), _EMPTY, dtype=np.int64),
                "interval_priority": np.full((d_sae, q), _EMPTY, dtype=np.int64),
                "top_context": np.full((d_sae, k, w), np.nan, dtype=np.float32),
                "interval_context": np.full((d_sae, q, w), np.nan, dtype=np.float32),
            },
            num_rows=num_rows,
        )

    def save(self, directory: Path) -> None:
        """Written to temporary names, then renamed: a crash leaves the previous state whole."""
        from safetensors.numpy import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.arrays, str(directory / f"{STATE_FILE}.tmp"))
        meta = {
            "version": STATE_VERSION, "phase": self.phase, "next_row": self.next_row,
            "num_rows": self.num_rows, "seconds": self.seconds,
        }  # fmt: skip
        (directory / f"{STATE_META}.tmp").write_text(json.dumps(meta))
        (directory / f"{STATE_FILE}.tmp").replace(directory / STATE_FILE)
        (directory / f"{STATE_META}.tmp").replace(directory / STATE_META)

    @classmethod
    def load(cls, directory: Path) -> AnalysisState | None:
        """The saved state, or None when there is none (or it is from another version)."""
        from safetensors.numpy import load_file

        try:
            meta = json.loads((directory / STATE_META).read_text())
            if meta.get("version") != STATE_VERSION:
                return None
            arrays = load_file(str(directory / STATE_FILE))
        except (OSError, ValueError):
            return None
        return cls(
            arrays=arrays, phase=meta["phase"], next_row=meta["next_row"], num_rows=meta["num_rows"],
            seconds=meta.get("seconds", 0.0),
        )  # fmt: skip


@dataclass(frozen=True)
class AnalysisProgress:
    phase: int
    fraction: float  # of the whole analysis, 0..1
    rows_done: int  # rows of the cache swept (passes 1 and 2 over all of it)
    rows_per_second: float


# -- the sweep --------------------------------------------------------------------------------------


def analyze(
    encode: Callable[[Any], Any],
    read_rows: Callable[[int, int], Any],
    tokens: TokenTable,
    *,
    d_sae: int,
    config: AnalysisConfig = AnalysisConfig(),
    resume: AnalysisState | None = None,
    on_progress: Callable[[AnalysisProgress], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_checkpoint: Callable[[AnalysisState], None] | None = None,
    checkpoint_seconds: float = 60.0,
    checkpoint_due: Callable[[], bool] | None = None,
) -> AnalysisState:
    """Sweep ``encode`` (float32 torch rows [n, d_in] → feature activations [n, d_sae]) over rows
    ``[0, len(tokens))`` as ``read_rows(start, stop)`` gives them; return the finished state
    (``phase`` 4). ``resume`` continues a saved state; ``on_checkpoint`` is offered the state
    every ``checkpoint_seconds``, and after any chunk where ``checkpoint_due()`` says so (an
    exception it raises stops the sweep: a job yielding its worker); ``should_cancel`` is asked
    before every chunk."""
    import torch

    num_rows = len(tokens)
    state = resume if resume is not None else AnalysisState.empty(d_sae, config, num_rows)
    if state.num_rows != num_rows or state.arrays["count"].shape != (d_sae,):
        raise AnalysisError("ANALYSIS_STATE_MISMATCH", "The saved analysis state is of another cache or SAE.")
    started = time.monotonic() - state.seconds
    call_started = last_checkpoint = time.monotonic()
    rows_at_start = _rows_done(state)
    chunks_done = 0

    def step(phase: int, next_row: int, rows_done: int, total: float) -> None:
        nonlocal last_checkpoint, chunks_done
        state.phase, state.next_row = phase, next_row
        state.seconds = time.monotonic() - started
        if on_progress is not None:
            on_progress(
                AnalysisProgress(
                    phase=phase,
                    fraction=min(1.0, rows_done / total) if total else 1.0,
                    rows_done=rows_done,
                    rows_per_second=(rows_done - rows_at_start) / max(1e-9, time.monotonic() - call_started),
                )
            )
        chunks_done += 1
        if chunks_done % TRIM_EVERY_CHUNKS == 0:
            release_freed_heap()  # the chunks' temporaries fragment the heap (see engine.memory)
        periodic = time.monotonic() - last_checkpoint >= checkpoint_seconds
        if on_checkpoint is not None and (periodic or (checkpoint_due is not None and checkpoint_due())):
            on_checkpoint(state)
            last_checkpoint = time.monotonic()

    def check_cancel() -> None:
        if should_cancel is not None and should_cancel():
            raise AnalysisCancelled

    # The third pass re-encodes only the rows around the interval examples: weigh it by those.
    total_work = 2.0 * num_rows + (num_rows * 0.25)
    with torch.no_grad():
        if state.phase == 1:
            chunks = _read_ahead(read_rows, state.next_row, num_rows, config.chunk_rows)
            with contextlib.closing(chunks):  # a cancel stops the reading thread at once
                for first, stop, rows in chunks:
                    check_cancel()
                    _first_pass(state, encode(rows), first, config)
                    step(1, stop, stop, total_work)
            state.phase, state.next_row = 2, 0
        if state.phase == 2:
            gather = _ContextGather(
                tokens.windows(state.arrays["top_rows"], config.context_before, config.context_after),
                state.arrays["top_context"],
            )
            chunks = _read_ahead(read_rows, state.next_row, num_rows, config.chunk_rows)
            with contextlib.closing(chunks):
                for first, stop, rows in chunks:
                    check_cancel()
                    activations = encode(rows)
                    _second_pass(state, activations, first, config)
                    gather.take(activations, first, stop)
                    step(2, stop, num_rows + stop, total_work)
            state.phase, state.next_row = 3, 0
        if state.phase == 3:
            gather = _ContextGather(
                tokens.windows(state.arrays["interval_rows"], config.context_before, config.context_after),
                state.arrays["interval_context"],
            )
            for first in range(state.next_row, num_rows, config.chunk_rows):
                stop = min(num_rows, first + config.chunk_rows)
                needed = gather.rows_in(first, stop)
                if len(needed):
                    check_cancel()
                    block = read_rows(first, stop)
                    gather.take_rows(encode(block[torch.from_numpy(needed - first)]), needed)
                step(3, stop, 2 * num_rows + int(0.25 * stop), total_work)
            state.phase, state.next_row = 4, num_rows
    state.seconds = time.monotonic() - started
    return state


def _read_ahead(
    read_rows: Callable[[int, int], Any], start: int, num_rows: int, chunk_rows: int
) -> Iterator[tuple[int, int, Any]]:
    """``(first, stop, read_rows(first, stop))`` chunk by chunk from ``start``, the next chunk
    read on a thread while the caller encodes this one (one chunk ahead: memory stays flat)."""
    spans = ((first, min(num_rows, first + chunk_rows)) for first in range(start, num_rows, chunk_rows))
    return prefetched(((first, stop, read_rows(first, stop)) for first, stop in spans), depth=1)


def _rows_done(state: AnalysisState) -> int:
    return {1: 0, 2: state.num_rows, 3: 2 * state.num_rows}.get(state.phase, 2 * state.num_rows) + (
        state.next_row if state.phase in (1, 2) else int(0.25 * state.next_row)
    )


def _first_pass(state: AnalysisState, activations, first: int, config: AnalysisConfig) -> None:
    """Density counts, sums, maxima and the running top-k of one chunk."""
    import torch

    arrays = state.arrays
    # Reductions over dim 0 of a [rows, d_sae] chunk: amax (not max, which also finds indices)
    # and a float32 sum per chunk, added up in float64 across chunks, are each ~10x faster
    # than max(dim=0) and a float64 sum here; the top-k runs along contiguous rows of the
    # transpose (topk along dim 0 strides through memory: 2.5x slower even with the copy).
    arrays["count"] += (activations > 0).sum(dim=0, dtype=torch.int32).numpy()
    arrays["total"] += activations.sum(dim=0).numpy()
    np.maximum(arrays["max"], activations.amax(dim=0).numpy(), out=arrays["max"])

    k = min(config.top_k, activations.shape[0])
    values, rows = activations.T.contiguous().topk(k, dim=1)  # [d_sae, k]
    candidates = np.concatenate([arrays["top_values"], values.numpy()], axis=1)
    candidate_rows = np.concatenate([arrays["top_rows"], rows.numpy() + first], axis=1)
    candidates = np.where(candidate_rows >= 0, candidates, -np.inf)
    # Highest value first; among equal values the lower row (stable sort over rows that come in order).
    by_row = np.argsort(
        np.where(candidate_rows >= 0, candidate_rows, np.iinfo(np.int64).max), axis=1, kind="stable"
    )
    candidates = np.take_along_axis(candidates, by_row, axis=1)
    candidate_rows = np.take_along_axis(candidate_rows, by_row, axis=1)
    best = np.argsort(-candidates, axis=1, kind="stable")[:, : config.top_k]
    top_values = np.take_along_axis(candidates, best, axis=1)
    top_rows = np.take_along_axis(candidate_rows, best, axis=1)
    keep = top_values > 0  # a zero is no activation: those slots stay empty
    arrays["top_values"] = np.where(keep, top_values, 0).astype(np.float32)
    arrays["top_rows"] = np.where(keep, top_rows, _EMPTY)


def interval_of(values: np.ndarray, maxima: np.ndarray, intervals: int) -> np.ndarray:
    """Which of ``intervals`` equal intervals of ``(0, max]`` each positive value falls in."""
    scaled = np.ceil(values / np.maximum(maxima, 1e-30) * intervals).astype(np.int64) - 1
    return np.clip(scaled, 0, intervals - 1)


def row_feature_hash(rows: np.ndarray, features: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random priority per (row, feature) (splitmix64's finaliser), as int64 ≥ 0:
    the interval examples are the highest priorities of each interval, whatever the chunking."""
    with np.errstate(over="ignore"):
        x = rows.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + features.astype(np.uint64)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(1)).astype(np.int64)


def _second_pass(state: AnalysisState, activations, first: int, config: AnalysisConfig) -> None:
    """Histogram counts and the interval examples of one chunk."""
    arrays = state.arrays
    d_sae = activations.shape[1]
    local_rows, features = (index.numpy() for index in activations.nonzero(as_tuple=True))
    if not len(features):
        return
    values = activations[local_rows, features].numpy()
    maxima = arrays["max"][features]
    bins = config.histogram_bins
    cells = features * bins + interval_of(values, maxima, bins)
    arrays["histogram"] += np.bincount(cells, minlength=d_sae * bins).reshape(d_sae, bins)

    # Interval examples: keep, per (feature, interval), the per_interval highest priorities.
    per, q = config.per_interval, config.intervals
    rows = local_rows.astype(np.int64) + first
    priority = row_feature_hash(rows, features)
    interval = interval_of(values, maxima, q)
    slots = arrays["interval_priority"].reshape(d_sae * q, per)
    key = features * q + interval
    # Only candidates above their (feature, interval)'s current lowest kept priority can enter.
    floor = slots.min(axis=1)
    entering = priority > floor[key]
    if not entering.any():
        return
    key, priority, rows, values = key[entering], priority[entering], rows[entering], values[entering]
    touched = np.unique(key)
    old_priority = slots[touched]
    old_rows = arrays["interval_rows"].reshape(d_sae * q, per)[touched]
    old_values = arrays["interval_values"].reshape(d_sae * q, per)[touched]
    position = np.searchsorted(touched, key)
    all_keys = np.concatenate([np.repeat(np.arange(len(touched)), per), position])
    all_priority = np.concatenate([old_priority.reshape(-1), priority])
    all_rows = np.concatenate([old_rows.reshape(-1), rows])
    all_values = np.concatenate([old_values.reshape(-1), values])
    order = np.lexsort((-all_priority, all_keys))
    all_keys, all_priority = all_keys[order], all_priority[order]
    all_rows, all_values = all_rows[order], all_values[order]
    starts = np.searchsorted(all_keys, np.arange(len(touched)))
    rank = np.arange(len(all_keys)) - starts[all_keys]
    kept = rank < per
    target = all_keys[kept] * per + rank[kept]
    new_priority = np.full(len(touched) * per, _EMPTY, dtype=np.int64)
    new_rows = np.full(len(touched) * per, _EMPTY, dtype=np.int64)
    new_values = np.zeros(len(touched) * per, dtype=np.float32)
    new_priority[target], new_rows[target], new_values[target] = (
        all_priority[kept], all_rows[kept], all_values[kept],
    )  # fmt: skip
    slots[touched] = new_priority.reshape(-1, per)
    arrays["interval_rows"].reshape(d_sae * q, per)[touched] = new_rows.reshape(-1, per)
    arrays["interval_values"].reshape(d_sae * q, per)[touched] = new_values.reshape(-1, per)


class _ContextGather:
    """The values of each example's feature on its context rows, filled in as chunks go by."""

    def __init__(self, windows: np.ndarray, out: np.ndarray) -> None:
        # windows [d_sae, examples, window] of rows (-1: none); out has the same shape.
        d_sae = windows.shape[0]
        flat = windows.reshape(-1)
        wanted = np.flatnonzero(flat >= 0)
        per_feature = windows.shape[1] * windows.shape[2]
        order = np.argsort(flat[wanted], kind="stable")
        self.rows = flat[wanted][order]
        self.features = (wanted[order] // per_feature).astype(np.int64)
        self.targets = wanted[order]
        self.out = out.reshape(-1)
        assert self.features.max(initial=0) < max(1, d_sae)

    def _span(self, first: int, stop: int) -> tuple[int, int]:
        return int(np.searchsorted(self.rows, first)), int(np.searchsorted(self.rows, stop))

    def take(self, activations, first: int, stop: int) -> None:
        low, high = self._span(first, stop)
        if high > low:
            local = self.rows[low:high] - first
            self.out[self.targets[low:high]] = activations.numpy()[local, self.features[low:high]]

    def rows_in(self, first: int, stop: int) -> np.ndarray:
        low, high = self._span(first, stop)
        return np.unique(self.rows[low:high])

    def take_rows(self, activations, rows: np.ndarray) -> None:
        """``activations`` are of ``rows`` (sorted, unique) only."""
        if not len(rows):
            return
        low, high = self._span(int(rows[0]), int(rows[-1]) + 1)
        local = np.searchsorted(rows, self.rows[low:high])
        self.out[self.targets[low:high]] = activations.numpy()[local, self.features[low:high]]


# -- results ----------------------------------------------------------------------------------------


def feature_arrays(state: AnalysisState, tokens: TokenTable, config: AnalysisConfig) -> dict[str, np.ndarray]:
    """The stored per-feature arrays (row ``f`` of each is feature ``f``): statistics, examples
    with their token ids and sample/position, interval examples sorted strongest first."""
    arrays = state.arrays
    num_rows = max(1, state.num_rows)
    count = arrays["count"]
    mean = np.where(count > 0, arrays["total"] / np.maximum(count, 1), 0.0)
    # Interval examples strongest first (empty slots last).
    interval_values = np.where(arrays["interval_rows"] >= 0, arrays["interval_values"], -np.inf)
    order = np.argsort(-interval_values, axis=1, kind="stable")
    interval_rows = np.take_along_axis(arrays["interval_rows"], order, axis=1)
    interval_context = np.take_along_axis(arrays["interval_context"], order[..., None], axis=1)
    out = {
        "density": (count / num_rows).astype(np.float32),
        "nonzero_count": count,
        "max": arrays["max"],
        "mean": mean.astype(np.float32),
        "histogram": arrays["histogram"].astype(np.int32),
        "top_values": arrays["top_values"],
        "top_rows": arrays["top_rows"],
        "top_context": arrays["top_context"].astype(np.float16),
        "interval_values": np.take_along_axis(arrays["interval_values"], order, axis=1),
        "interval_rows": interval_rows,
        "interval_context": interval_context.astype(np.float16),
    }
    for prefix, rows in (("top", arrays["top_rows"]), ("interval", interval_rows)):
        windows = tokens.windows(rows, config.context_before, config.context_after)
        out[f"{prefix}_context_tokens"] = tokens.ids(windows)
        safe = np.maximum(rows, 0)
        out[f"{prefix}_sample"] = np.where(rows >= 0, tokens.take(tokens.sample_index, safe), _EMPTY).astype(
            np.int64
        )
        out[f"{prefix}_position"] = np.where(rows >= 0, tokens.take(tokens.position, safe), _EMPTY).astype(
            np.int32
        )
    return out


def analysis_summary(state: AnalysisState, config: AnalysisConfig) -> dict[str, Any]:
    count = state.arrays["count"]
    return {
        "config": asdict(config),
        "tokens": state.num_rows,
        "features": len(count),
        "dead": int((count == 0).sum()),
        "seconds": round(state.seconds, 3),
    }
