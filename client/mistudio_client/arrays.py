"""A completed activation cache and its hooks as lazy arrays: slicing a hook fetches only those
rows (``GET /api/activation-caches/{id}/slice`` as safetensors)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from mistudio_client.safetensors import read_safetensors

if TYPE_CHECKING:
    from mistudio_client.client import Client


class Cache:
    """A completed activation cache: ``cache[hook]`` is a :class:`HookArray`."""

    def __init__(self, client: Client, state: dict[str, Any]) -> None:
        self.client, self.state, self.id = client, state, state["id"]

    @property
    def hooks(self) -> list[str]:
        return list(self.state["hooks"])

    def __getitem__(self, hook: str) -> HookArray:
        shapes = self.state.get("activation_shapes") or {}
        if hook not in shapes:
            raise KeyError(f"{hook!r} is not in the cache (it has {', '.join(shapes)})")
        return HookArray(self.client, self.id, hook, tuple(shapes[hook]), self.state.get("dtype", "float32"))


# At most this many values per request (the server's own limit is 4M).
SLICE_VALUES = 4_000_000


class HookArray:
    """One hook of a cache, [tokens, width], read lazily: slicing rows fetches only those rows
    (as safetensors bytes, at most 4M values a request, each copied once into the result);
    ``np.asarray`` reads it all; :meth:`to_torch` gives a tensor; :meth:`chunks` streams it."""

    def __init__(self, client: Client, cache_id: str, hook: str, shape: tuple[int, ...], dtype: str) -> None:
        self.client, self.cache_id, self.hook, self.shape, self.dtype = client, cache_id, hook, shape, dtype

    def __len__(self) -> int:
        return self.shape[0]

    def _fetch(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` in one request: a read-only view of the answer's bytes."""
        data = self.client.request(
            "GET",
            f"activation-caches/{self.cache_id}/slice",
            raw=True,
            params={"hook": self.hook, "start": start, "stop": stop, "output": "safetensors"},
        )
        return read_safetensors(data, copy=False)["activations"]

    def _rows(self, start: int, stop: int) -> np.ndarray:
        step = max(1, SLICE_VALUES // max(1, self.shape[1]))
        spans = [(begin, min(stop, begin + step)) for begin in range(start, stop, step)]
        if not spans:
            return np.zeros((0, self.shape[1]), dtype=np.float32)
        first = self._fetch(*spans[0])  # its dtype is the answer's (float32 for a bfloat16 cache)
        if len(spans) == 1:
            return first.copy()
        values = np.empty((stop - start, self.shape[1]), dtype=first.dtype)
        values[: len(first)] = first
        for begin, end in spans[1:]:
            values[begin - start : end - start] = self._fetch(begin, end)
        return values

    def __getitem__(self, index: Any) -> np.ndarray:
        rows, rest = (index, ()) if not isinstance(index, tuple) else (index[0], index[1:])
        if isinstance(rows, (int, np.integer)):
            row = int(rows) + (self.shape[0] if rows < 0 else 0)
            return self._rows(row, row + 1)[0][rest] if rest else self._rows(row, row + 1)[0]
        if not isinstance(rows, slice):
            raise TypeError("index a hook's rows with an int or a slice")
        start, stop, step = rows.indices(self.shape[0])
        values = self._rows(start, stop)[::step] if stop > start else self._rows(0, 0)
        return values[(slice(None), *rest)] if rest else values

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self._rows(0, self.shape[0])
        return values if dtype is None else values.astype(dtype)

    def chunks(self, rows: int = 65536) -> Iterable[np.ndarray]:
        for start in range(0, self.shape[0], rows):
            yield self._rows(start, min(self.shape[0], start + rows))

    def to_torch(self, start: int = 0, stop: int | None = None):
        import torch

        return torch.from_numpy(self._rows(start, self.shape[0] if stop is None else stop))
