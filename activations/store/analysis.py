"""Streaming statistics over a cache (per-neuron stats, top-k tokens, histograms), mixed into
``ActivationStore``."""

from __future__ import annotations

from typing import Any

import numpy as np

from activations.store.format import _BLOCK_BYTES


class StoreAnalysis:
    """Statistics over ``self``, an :class:`~activations.store.reader.ActivationStore`."""

    def stats(self, hook: str, *, chunk_tokens: int = 65536) -> dict[str, Any]:
        """Per-neuron mean, std (population), max and min, the mean L2 norm per token, and the count.

        Streams over the shards (at most ``chunk_tokens`` rows, about 64 MiB, at a time) with
        float64 accumulators merged chunk by chunk (Chan et al.), so memory stays flat. Per-neuron
        results are float32 numpy arrays (``.tolist()`` for JSON); NaN when the cache is empty.
        """
        width = self._width(hook)
        rows = max(1, min(chunk_tokens, self._rows_per_block(hook)))
        count = 0
        mean = np.zeros(width)
        squares = np.zeros(width)  # sum of squared deviations from the mean
        largest = np.full(width, -np.inf)
        smallest = np.full(width, np.inf)
        norm_sum = 0.0
        for _first, block in self._blocks(hook, self.num_tokens, rows):
            values = block.astype(np.float64)
            size = len(values)
            block_mean = values.mean(axis=0)
            block_squares = ((values - block_mean) ** 2).sum(axis=0)
            delta = block_mean - mean
            total = count + size
            mean += delta * (size / total)
            squares += block_squares + delta**2 * (count * size / total)
            count = total
            largest = np.maximum(largest, values.max(axis=0))
            smallest = np.minimum(smallest, values.min(axis=0))
            norm_sum += float(np.sqrt((values * values).sum(axis=1)).sum())
        if count == 0:
            nan = np.full(width, np.nan, dtype=np.float32)
            return {
                "count": 0,
                "mean": nan,
                "std": nan.copy(),
                "max": nan.copy(),
                "min": nan.copy(),
                "mean_l2_norm": float("nan"),
            }
        return {
            "count": count,
            "mean": mean.astype(np.float32),
            "std": np.sqrt(squares / count).astype(np.float32),
            "max": largest.astype(np.float32),
            "min": smallest.astype(np.float32),
            "mean_l2_norm": norm_sum / count,
        }

    def top_k(self, hook: str, neuron: int, k: int = 20, *, context: int = 8) -> list[dict[str, Any]]:
        """The ``k`` highest activations of one neuron, highest first (ties: lower row first).

        Each: ``value``, ``row`` (global token index), ``sample_index``, ``position``, ``token_id``,
        ``context_token_ids`` and ``context_positions`` (up to ``context`` stored tokens either side
        from the same sample, in position order) and ``center`` (the token's index in the context).
        Streams the neuron's column shard by shard; NaN never ranks.
        """
        width = self._width(hook)
        if not 0 <= neuron < width:
            raise IndexError(f"Neuron {neuron} is outside hook {hook!r} (width {width}).")
        if k <= 0:
            return []
        best_values = np.empty(0, dtype=np.float32)
        best_rows = np.empty(0, dtype=np.int64)
        rows_per_block = max(1, _BLOCK_BYTES // 8)
        for first, block in self._blocks(hook, self.num_tokens, rows_per_block, column=neuron):
            values = block.reshape(-1).astype(np.float32)
            values = np.where(np.isnan(values), -np.inf, values)
            candidates = np.concatenate([best_values, values])
            rows = np.concatenate([best_rows, np.arange(first, first + len(values), dtype=np.int64)])
            best_values, best_rows = _top_rows(candidates, rows, k)
        order = np.lexsort((best_rows, -best_values))
        table = self.tokens()
        results = []
        for value, row in zip(best_values[order], best_rows[order], strict=True):
            row = int(row)
            sample = int(table["sample_index"][row])
            sample_rows = self._sample_rows(sample)
            center = int(np.flatnonzero(sample_rows == row)[0])
            low = max(0, center - context)
            window = sample_rows[low : center + context + 1]
            results.append(
                {
                    "value": float(value),
                    "row": row,
                    "sample_index": sample,
                    "position": int(table["position"][row]),
                    "token_id": int(table["token_ids"][row]),
                    "context_token_ids": [int(token) for token in table["token_ids"][window]],
                    "context_positions": [int(position) for position in table["position"][window]],
                    "center": center - low,
                }
            )
        return results

    def histogram(self, hook: str, *, bins: int = 50, max_tokens: int | None = None) -> dict[str, Any]:
        """Counts of all finite values of ``hook`` (the first ``max_tokens`` rows) in ``bins`` equal bins.

        Two streaming passes (range, then counts). Returns numpy ``counts`` (int64) and ``edges``
        (float64, ``bins + 1``), ``count`` (values counted), ``nonfinite`` (NaN/inf left out),
        ``min`` and ``max``.
        """
        if bins <= 0:
            raise ValueError("bins must be positive.")
        stop = self.num_tokens if max_tokens is None else max(0, min(self.num_tokens, max_tokens))
        rows = self._rows_per_block(hook, 4)
        low, high, nonfinite = np.inf, -np.inf, 0
        for _first, block in self._blocks(hook, stop, rows):
            finite = block[np.isfinite(block)]
            nonfinite += block.size - finite.size
            if finite.size:
                low, high = min(low, float(finite.min())), max(high, float(finite.max()))
        if low > high:  # nothing finite
            edges = np.linspace(0.0, 1.0, bins + 1)
            return {
                "counts": np.zeros(bins, dtype=np.int64),
                "edges": edges,
                "count": 0,
                "nonfinite": nonfinite,
                "min": None,
                "max": None,
            }
        edges = np.histogram_bin_edges(np.array([low, high]), bins=bins)
        counts = np.zeros(bins, dtype=np.int64)
        for _first, block in self._blocks(hook, stop, rows):
            counts += np.histogram(block[np.isfinite(block)], bins=edges)[0]
        return {
            "counts": counts,
            "edges": edges,
            "count": int(counts.sum()),
            "nonfinite": nonfinite,
            "min": low,
            "max": high,
        }


def _top_rows(values: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest values with their rows; among equal values the lower rows win (deterministic)."""
    if len(values) <= k:
        return values, rows
    threshold = np.partition(values, len(values) - k)[len(values) - k]
    above = np.flatnonzero(values > threshold)
    ties = np.flatnonzero(values == threshold)
    ties = ties[np.argsort(rows[ties], kind="stable")][: k - len(above)]
    keep = np.concatenate([above, ties])
    return values[keep], rows[keep]
