"""The activation browser's per-hook numbers, computed once per (cache, hook) in each web process.

A hook's summary (width, norm, per-neuron extremes, the quick picks) comes from the stats the
cache stores; its histogram reads the values themselves (a prefix of a large cache), so both are
kept in a small in-process LRU rather than recomputed on every neuron or sample the page asks for.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from activations.models import ActivationCache
from activations.store import ActivationStore
from frontend.charts import histogram_svg

HISTOGRAM_BINS = 60
# The histogram reads at most this many values of a hook (the first tokens), so a first page load
# of a multi-gigabyte cache stays a few seconds; the caption says when it is a prefix.
HISTOGRAM_MAX_VALUES = 20_000_000
# How many of a hook's neurons (the highest maxima) the page offers as quick picks.
QUICK_PICKS = 10


@dataclass(frozen=True)
class HookSummary:
    """What the page needs from ``store.stats(hook)``: its width, norm and per-neuron extremes."""

    width: int
    count: int
    mean_l2_norm: float
    neuron_max: np.ndarray
    neuron_min: np.ndarray
    top_by_max: list[tuple[int, float]]

    def heat_scale(self, neuron: int) -> float:
        """The neuron's largest |value| in the cache: what a full-strength token colour means."""
        largest = max(abs(float(self.neuron_max[neuron])), abs(float(self.neuron_min[neuron])))
        return largest if math.isfinite(largest) and largest > 0 else 1.0


@dataclass(frozen=True)
class HookHistogram:
    linear_svg: str
    log_svg: str
    count: int
    nonfinite: int
    low: float | None
    high: float | None
    tokens_read: int


# A cache's files never change once it is completed, but a failed cache can be rewritten under the
# same id; the completion time in the key keeps a rewritten cache from reusing old results.
@functools.lru_cache(maxsize=256)
def hook_summary(directory: str, completed: str, hook: str) -> HookSummary:
    store = ActivationStore.open(directory)
    stats = store.stats(hook)
    maxima = np.asarray(stats["max"], dtype=np.float32)
    ranked = np.where(np.isnan(maxima), -np.inf, maxima)
    order = np.argsort(-ranked, kind="stable")[:QUICK_PICKS]
    return HookSummary(
        width=store.shape(hook)[1],
        count=int(stats["count"]),
        mean_l2_norm=float(stats["mean_l2_norm"]),
        neuron_max=maxima,
        neuron_min=np.asarray(stats["min"], dtype=np.float32),
        top_by_max=[(int(index), float(maxima[index])) for index in order if np.isfinite(ranked[index])],
    )


@functools.lru_cache(maxsize=64)
def hook_histogram(directory: str, completed: str, hook: str) -> HookHistogram:
    store = ActivationStore.open(directory)
    max_tokens = max(1, HISTOGRAM_MAX_VALUES // store.shape(hook)[1])
    result = store.histogram(hook, bins=HISTOGRAM_BINS, max_tokens=max_tokens)
    counts, edges = result["counts"].tolist(), result["edges"].tolist()
    label = f"Histogram of the values of {hook}"
    return HookHistogram(
        linear_svg=histogram_svg(counts, edges, label=label),
        log_svg=histogram_svg(counts, edges, label=f"{label} (log scale)", log_scale=True),
        count=result["count"],
        nonfinite=result["nonfinite"],
        low=result["min"],
        high=result["max"],
        tokens_read=min(store.num_tokens, max_tokens),
    )


def summary_of(cache: ActivationCache, hook: str) -> HookSummary:
    """The hook's summary, read from the cache's stats the first time this process asks."""
    return hook_summary(str(cache.directory), _completed_stamp(cache), hook)


def histogram_of(cache: ActivationCache, hook: str) -> HookHistogram:
    """The hook's value histogram (both scales), computed the first time this process asks."""
    return hook_histogram(str(cache.directory), _completed_stamp(cache), hook)


def _completed_stamp(cache: ActivationCache) -> str:
    return cache.completed_at.isoformat() if cache.completed_at else ""
