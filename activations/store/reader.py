"""``ActivationStore``: memory-mapped reads of a cache (rows by token range, per-sample views)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from activations.store.analysis import StoreAnalysis
from activations.store.format import (
    _BLOCK_BYTES,
    _NUMPY_DTYPES,
    ACTIVATIONS_TENSOR,
    CACHE_CORRUPT,
    CACHE_INCOMPLETE,
    DTYPES,
    STATUS_COMPLETE,
    TOKENS_DIR,
    TOKENS_FILE,
    CacheError,
    _inside,
    _memmap_safetensors,
    _read_header,
    _read_manifest,
    _shard_file_name,
    _size_bytes,
    _torch,
    _torch_dtype,
    token_columns,
)
from activations.store.integrity import _manifest_problems

# How each cache dtype's values lie in a shard, for numpy's memory maps: numpy has no bfloat16, so
# its 16 bits are mapped as int16 (torch views them as bfloat16; numpy widens them to float32).
_STORED_NUMPY_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<i2")}

# --- Reading ---------------------------------------------------------------------------------------


class ActivationStore(StoreAnalysis):
    """Read access to a cache: per-hook rows by token range, per-sample views, streaming statistics.

    Reads are memory-mapped (safetensors ``safe_open`` + ``get_slice``; the token table through numpy
    memory maps), so a slice never loads whole shards. numpy results come back in the stored dtype,
    except bfloat16, which numpy lacks and which is widened to float32; ``as_torch=True`` returns the
    stored dtype as a torch tensor.
    """

    def __init__(self, directory: Path, manifest: dict):
        self.directory = directory
        self.manifest = manifest
        self.dtype: str = manifest["dtype"]
        self.hooks: list[str] = [hook["name"] for hook in manifest["hooks"]]
        self.num_tokens: int = manifest["num_tokens"]
        self.num_samples: int | None = manifest.get("num_samples")
        self._widths = {hook["name"]: hook["width"] for hook in manifest["hooks"]}
        self._directories = {hook["name"]: hook["directory"] for hook in manifest["hooks"]}
        self._shards = manifest["shards"]
        self._starts = [shard["token_start"] for shard in self._shards]
        self._tokens: dict[str, np.ndarray] | None = None
        self._sample_order: np.ndarray | None = None
        self._sample_keys: np.ndarray | None = None

    @classmethod
    def open(
        cls, directory: Path | str, *, require_complete: bool = True, verify_hashes: bool = False
    ) -> ActivationStore:
        """Opens the cache at ``directory`` after checking its manifest, file shapes and sizes.

        ``verify_hashes`` also checks every file's checksum (reads the whole cache). Raises
        ``CACHE_CORRUPT`` for a damaged cache and ``CACHE_INCOMPLETE`` for one still being written
        (unless ``require_complete=False``, which reads the shards durable so far).
        """
        root = Path(directory)
        manifest = _read_manifest(root)
        problems = _manifest_problems(root, manifest, hashes=verify_hashes)
        if problems:
            raise CacheError(CACHE_CORRUPT, problems[0], details={"problems": problems})
        if require_complete and manifest.get("status") != STATUS_COMPLETE:
            raise CacheError(CACHE_INCOMPLETE, f"The cache is {manifest.get('status')!r}, not complete.")
        return cls(root, manifest)

    def __repr__(self) -> str:
        return (
            f"<ActivationStore {self.directory} {self.num_tokens} tokens, hooks={self.hooks}, {self.dtype}>"
        )

    @property
    def size_bytes(self) -> int:
        return _size_bytes(self.directory)

    def shape(self, hook: str) -> tuple[int, int]:
        return (self.num_tokens, self._width(hook))

    def _width(self, hook: str) -> int:
        try:
            return self._widths[hook]
        except KeyError:
            raise KeyError(f"The cache has no hook {hook!r}; it has {self.hooks}.") from None

    def _shard_path(self, hook: str, shard: dict) -> Path:
        return _inside(self.directory, f"{self._directories[hook]}/{_shard_file_name(shard['index'])}")

    # -- tokens --

    def tokens(self) -> dict[str, np.ndarray]:
        """The token table: ``token_ids``, ``sample_index``, ``position`` and any extra columns
        (e.g. ``generated`` in a generation's cache), int64, one row per token.

        Memory-mapped from tokens.safetensors for a complete cache; gathered from the shards otherwise.
        """
        if self._tokens is None:
            path = self.directory / TOKENS_FILE
            if self.manifest.get("tokens_file") and path.is_file():
                self._tokens = _memmap_safetensors(path)
            else:
                columns = token_columns(self.manifest)
                pieces: dict[str, list[np.ndarray]] = {column: [] for column in columns}
                for shard in self._shards:
                    mapped = _memmap_safetensors(
                        _inside(self.directory, f"{TOKENS_DIR}/{_shard_file_name(shard['index'])}")
                    )
                    for column in columns:
                        pieces[column].append(mapped[column])
                self._tokens = {
                    column: np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
                    for column, arrays in pieces.items()
                }
        return self._tokens

    def _sample_rows(self, sample_index: int) -> np.ndarray:
        """Row numbers of one sample's tokens, in position order."""
        if self._sample_keys is None:
            table = self.tokens()
            samples, positions = table["sample_index"], table["position"]
            sample_steps, position_steps = np.diff(samples), np.diff(positions)
            if np.all((sample_steps > 0) | ((sample_steps == 0) & (position_steps >= 0))):
                self._sample_order, self._sample_keys = None, samples  # already sorted: no index needed
            else:
                self._sample_order = np.lexsort((positions, samples))
                self._sample_keys = np.asarray(samples)[self._sample_order]
        low = int(np.searchsorted(self._sample_keys, sample_index, side="left"))
        high = int(np.searchsorted(self._sample_keys, sample_index, side="right"))
        if self._sample_order is None:
            return np.arange(low, high, dtype=np.int64)
        return self._sample_order[low:high]

    def sample_tokens(self, sample_index: int) -> tuple[np.ndarray, np.ndarray]:
        """The stored token ids and positions of one sample, in position order."""
        rows = self._sample_rows(sample_index)
        table = self.tokens()
        return np.asarray(table["token_ids"][rows]), np.asarray(table["position"][rows])

    # -- activations --

    def _shard_range(self, start: int, stop: int) -> Iterator[tuple[dict, int, int]]:
        """(shard, first row within it, stop row within it) for every shard overlapping [start, stop)."""
        position = max(0, bisect.bisect_right(self._starts, start) - 1)
        while position < len(self._shards) and self._starts[position] < stop:
            shard = self._shards[position]
            first = max(start, shard["token_start"]) - shard["token_start"]
            last = min(stop, shard["token_start"] + shard["num_tokens"]) - shard["token_start"]
            if first < last:
                yield shard, first, last
            position += 1

    def _framework(self, as_torch: bool) -> str:
        return "pt" if as_torch or self.dtype == "bfloat16" else "numpy"

    def _as_numpy(self, block: Any) -> np.ndarray:
        if isinstance(block, np.ndarray):
            return block
        return (block.float() if self.dtype == "bfloat16" else block).numpy()

    def get(self, hook: str, start: int = 0, stop: int | None = None, *, as_torch: bool = False):
        """Rows ``[start, stop)`` of one hook (Python slice rules), read across shards.

        numpy by default (float32 for a bfloat16 cache, the stored dtype otherwise); a torch tensor
        in the stored dtype with ``as_torch=True``.
        """
        width = self._width(hook)
        start, stop, _step = slice(start, stop).indices(self.num_tokens)
        stop = max(start, stop)
        framework = self._framework(as_torch)
        blocks = []
        for shard, first, last in self._shard_range(start, stop):
            with safe_open(self._shard_path(hook, shard), framework=framework) as handle:
                blocks.append(handle.get_slice(ACTIVATIONS_TENSOR)[first:last])
        if as_torch:
            torch = _torch()
            if not blocks:
                return torch.empty((0, width), dtype=_torch_dtype(self.dtype))
            return blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        if not blocks:
            return np.empty((0, width), dtype=_NUMPY_DTYPES[self.dtype])
        arrays = [self._as_numpy(block) for block in blocks]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def gather(self, hook: str, rows: Any, *, as_torch: bool = False):
        """Rows of ``hook`` by number (any order, repeats allowed), in the order given.

        Read through each shard's memory map, so only the pages holding them are read however far
        apart they lie (a resumed training's shuffle buffer: rows scattered over the stream). The
        values and types are :meth:`get`'s: numpy (bf16 widened to float32) or, with
        ``as_torch``, a tensor in the stored dtype."""
        width = self._width(hook)
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.num_tokens):
            raise IndexError(f"rows outside the cache's {self.num_tokens}")
        ordered, order = np.unique(rows, return_inverse=True)
        stored = np.empty((len(ordered), width), dtype=_STORED_NUMPY_DTYPES[self.dtype])
        shard_of = np.searchsorted(self._starts, ordered, side="right") - 1
        for position in np.unique(shard_of):
            picked = shard_of == position
            shard = self._shards[int(position)]
            stored[picked] = self._mapped_shard(hook, shard)[ordered[picked] - shard["token_start"]]
        values = stored[order.reshape(-1)]
        if as_torch:
            tensor = _torch().from_numpy(values)
            return tensor.view(_torch_dtype("bfloat16")) if self.dtype == "bfloat16" else tensor
        if self.dtype == "bfloat16":  # a bf16 value is the top half of the float32 of the same value
            return (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return values

    def _mapped_shard(self, hook: str, shard: dict) -> np.ndarray:
        """A read-only numpy memory map of one shard's activations (nothing read until indexed)."""
        path = self._shard_path(hook, shard)
        header, data_start = _read_header(path)
        info = header[ACTIVATIONS_TENSOR]
        begin, _end = info["data_offsets"]
        dtype = _STORED_NUMPY_DTYPES[self.dtype]
        if info["dtype"] != DTYPES[self.dtype]:
            raise CacheError(
                CACHE_CORRUPT, f"{path.name} holds {info['dtype']}, not the cache's {self.dtype}."
            )
        return np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=tuple(info["shape"]))

    def sample(self, hook: str, sample_index: int) -> np.ndarray:
        """One sample's rows of ``hook`` in position order (empty when it has no stored token)."""
        return self.gather(hook, self._sample_rows(sample_index))

    def _blocks(
        self, hook: str, stop: int, rows_per_block: int, *, column: int | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, block) over rows [0, stop), shard by shard, at most ``rows_per_block`` rows each."""
        framework = self._framework(False)
        for shard, first, last in self._shard_range(0, stop):
            with safe_open(self._shard_path(hook, shard), framework=framework) as handle:
                tensor = handle.get_slice(ACTIVATIONS_TENSOR)
                for low in range(first, last, rows_per_block):
                    high = min(last, low + rows_per_block)
                    block = tensor[low:high] if column is None else tensor[low:high, column : column + 1]
                    yield shard["token_start"] + low, self._as_numpy(block)

    def _rows_per_block(self, hook: str, bytes_per_value: int = 8) -> int:
        return max(1, _BLOCK_BYTES // (self._width(hook) * bytes_per_value))
