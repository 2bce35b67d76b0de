"""The cache format: names, constants, errors, safetensors headers and streams, the manifest,
durable writes. Importable without Django or torch."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import struct
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import xxhash

FORMAT_VERSION = 1


def _torch():
    """torch, imported when first needed: reading float32/float16 caches does not need it."""
    import torch

    return torch


def _torch_dtype(dtype: str):
    torch = _torch()
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


MANIFEST_NAME = "manifest.json"
TOKENS_DIR = "tokens"
TOKENS_FILE = "tokens.safetensors"
TOKEN_COLUMNS = ("token_ids", "sample_index", "position")


def token_columns(manifest: dict) -> tuple[str, ...]:
    """The token table columns: the standard three plus any the cache declared (extra_token_columns)."""
    return (*TOKEN_COLUMNS, *manifest.get("extra_token_columns", ()))


ACTIVATIONS_TENSOR = "activations"
STATUS_WRITING = "writing"
STATUS_COMPLETE = "complete"

CACHE_CORRUPT = "CACHE_CORRUPT"
CACHE_INCOMPLETE = "CACHE_INCOMPLETE"
CACHE_MISMATCH = "CACHE_MISMATCH"
CACHE_LOCKED = "CACHE_LOCKED"
DISK_FULL = "DISK_FULL"

# Cache dtype -> safetensors dtype code.
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_SAFETENSORS_ITEM_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# What numpy gets back for each cache dtype: numpy has no bfloat16, so bf16 widens to float32.
_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": np.float32, "float16": np.float16}

_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_HOOK_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_HOOK_DIRECTORY_MAX = 120
_RESERVED_NAMES = {TOKENS_DIR, TOKENS_FILE, MANIFEST_NAME}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# Blocks read by the streaming statistics stay near this size whatever the hook's width.
_BLOCK_BYTES = 64 * 1024 * 1024


class CacheError(Exception):
    """A cache that cannot be used as asked; ``code`` is one of the module's CACHE_* / DISK_FULL codes."""

    def __init__(self, code: str, message: str, *, details: dict[str, Any] | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}


# --- Names and paths -------------------------------------------------------------------------------


def normalize_dtype(dtype: str) -> str:
    """The canonical cache dtype name (``float32``, ``bfloat16``, ``float16``); accepts bf16/fp16/fp32."""
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES:
        raise ValueError(f"Unsupported cache dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    return name


DEFAULT_SHARD_MAX_BYTES = 64 * 2**20


def shard_tokens_for(
    hooks: Mapping[str, int], dtype: str, *, max_bytes: int = DEFAULT_SHARD_MAX_BYTES
) -> int:
    """Tokens per shard so that one shard of every hook together holds about ``max_bytes``.

    The writer buffers a shard in memory before writing it, so this bounds the extraction's
    memory whatever the dataset size or the number and width of the hooks.
    """
    item = _SAFETENSORS_ITEM_BYTES[DTYPES[normalize_dtype(dtype)]]
    bytes_per_token = sum(hooks.values()) * item + 3 * _SAFETENSORS_ITEM_BYTES["I64"]  # + token table
    return max(1, max_bytes // bytes_per_token)


def cache_bytes_per_token(widths: Iterable[int], dtype: str) -> int:
    """Bytes a cache holds per token: each hook's row in ``dtype``, and the three int64 token
    columns twice (in each shard's token file and in tokens.safetensors, written at the end)."""
    item = _SAFETENSORS_ITEM_BYTES[DTYPES[normalize_dtype(dtype)]]
    return sum(widths) * item + 2 * len(TOKEN_COLUMNS) * _SAFETENSORS_ITEM_BYTES["I64"]


def hook_directory_name(hook: str) -> str:
    """The directory a hook's shards live in: one safe path component, stable for a given name.

    Names made only of ``[A-Za-z0-9._-]`` (``blocks.6.hook_resid_post``) are used as they are.
    Anything else (``module:transformer.h.0.mlp``, ``../../x``, a reserved name, a leading dot, a very
    long name) has every other character replaced by ``_``, leading dots stripped, and a short hash
    of the real name appended, so two hooks never share a directory and no name leaves the cache.
    """
    if not isinstance(hook, str) or not hook:
        raise ValueError("A hook name must be a non-empty string.")
    safe = _HOOK_NAME_UNSAFE.sub("_", hook).lstrip(".")
    if safe == hook and safe not in _RESERVED_NAMES and len(safe) <= _HOOK_DIRECTORY_MAX:
        return safe
    digest = hashlib.sha256(hook.encode()).hexdigest()[:10]
    return f"{safe[:_HOOK_DIRECTORY_MAX] or 'hook'}-{digest}"


def _shard_file_name(index: int) -> str:
    return f"{index:05d}.safetensors"


def _inside(root: Path, relative: str) -> Path:
    """``root / relative`` for a manifest-supplied path, refusing any path that could leave ``root``."""
    parts = PurePosixPath(relative).parts if isinstance(relative, str) else ()
    if (
        not parts
        or relative.startswith("/")
        or "\\" in relative
        or "\x00" in relative
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise CacheError(CACHE_CORRUPT, f"The manifest names a path outside the cache: {relative!r}.")
    return root.joinpath(*parts)


def _is_temp_file(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _json_roundtrip(value: Any, what: str) -> Any:
    """The value as it will read back from the manifest (tuples become lists), or ValueError."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as error:
        raise ValueError(f"The cache {what} must be JSON-serialisable: {error}") from error


# --- Durable file writes ---------------------------------------------------------------------------


def _write_bytes(handle, data: bytes) -> None:
    """Writes ``data`` to an open binary file: the one place cache bytes reach the disk."""
    handle.write(data)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# --- Checksums -------------------------------------------------------------------------------------
#
# A file's checksum in a manifest names its algorithm: "xxh3_128:<32 hex digits>" (what the writer
# records: xxh3 hashes at memory speed, so it never sets an extraction's pace) or a bare 64-digit
# sha256 (caches written before; still read and verified).

CHECKSUM_ALGORITHM = "xxh3_128"
_SHA256_HEX_DIGITS = 64
_FILE_READ_BYTES = 8 * 2**20


def _hasher(algorithm: str):
    if algorithm == CHECKSUM_ALGORITHM:
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"Unknown checksum algorithm {algorithm!r}.")


def _checksum_text(algorithm: str, hexdigest: str) -> str:
    return hexdigest if algorithm == "sha256" else f"{algorithm}:{hexdigest}"


def checksum_algorithm(recorded: Any) -> str:
    """The algorithm of a recorded checksum; ValueError for one this format does not know."""
    if isinstance(recorded, str):
        algorithm, colon, _digits = recorded.partition(":")
        if colon and algorithm == CHECKSUM_ALGORITHM:
            return algorithm
        if not colon and len(recorded) == _SHA256_HEX_DIGITS:
            return "sha256"
    raise ValueError(f"unrecognised checksum {recorded!r}")


def file_checksum(path: Path, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """The checksum of a file's bytes as a manifest records it."""
    digest = _hasher(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(_FILE_READ_BYTES):
            digest.update(chunk)
    return _checksum_text(algorithm, digest.hexdigest())


def checksum_matches(path: Path, recorded: Any) -> bool:
    """Whether the file's bytes have the recorded checksum (in the algorithm it names)."""
    try:
        algorithm = checksum_algorithm(recorded)
    except ValueError:
        return False
    return file_checksum(path, algorithm) == recorded


def write_durably(final: Path, chunks: Iterable[Any], *, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Writes the chunks to a temp file beside ``final``, fsyncs it and renames it; returns the
    checksum of the bytes written (``algorithm``, as :func:`file_checksum` gives it).

    The checksum is computed from the very buffers handed to ``write``, as they go. On any
    failure the temp file is removed and ``final`` is untouched. The caller fsyncs the directory
    once all of a shard's renames are done.
    """
    temporary = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    digest = _hasher(algorithm)
    try:
        with open(temporary, "xb") as handle:
            for chunk in chunks:
                digest.update(chunk)
                _write_bytes(handle, chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
    except BaseException:
        # The original error matters more; a resume removes a temp file left here.
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise
    return _checksum_text(algorithm, digest.hexdigest())


def _write_manifest(root: Path, manifest: dict) -> None:
    """Atomically replaces manifest.json; once this returns (or the rename happened) it is the truth."""
    data = (json.dumps(manifest, indent=2) + "\n").encode()
    write_durably(root / MANIFEST_NAME, [data])


def _remove_quietly(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _raw_bytes(chunk: Any) -> np.ndarray:
    """The bytes of a numpy array or CPU torch tensor as a flat uint8 array, without a copy when contiguous.

    bfloat16 tensors are reinterpreted as bytes, so their bits reach the file unchanged.
    """
    if not isinstance(chunk, np.ndarray):
        torch = _torch()
        chunk = chunk.contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)


def _safetensors_stream(tensors: list[tuple[str, str, list[int], Iterable[Any]]]) -> Iterator[Any]:
    """A safetensors file produced piece by piece: (name, dtype code, shape, chunks) per tensor.

    The format is a little-endian u64 header length, a JSON header (padded to 8 bytes) giving each
    tensor's dtype, shape and byte range, then the tensors' bytes back to back. Writing it this way
    streams each buffered batch straight to the file: no concatenated copy of a shard, no
    serialised copy of it either. The chunks must be little-endian, as numpy and torch are here.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, _chunks in tensors:
        size = _SAFETENSORS_ITEM_BYTES[dtype] * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield struct.pack("<Q", len(text)) + text
    for name, _dtype, _shape, chunks in tensors:
        begin, end = header[name]["data_offsets"]
        written = 0
        for chunk in chunks:
            data = _raw_bytes(chunk)
            written += data.nbytes
            yield data
        if written != end - begin:
            raise CacheError(
                CACHE_CORRUPT, f"{name}: {written} bytes where the header promises {end - begin}."
            )


# --- Reading safetensors headers -------------------------------------------------------------------


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header and the offset its data starts at; ValueError when malformed."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES:
            raise ValueError("implausible safetensors header length")
        raw = handle.read(length)
        if len(raw) != length:
            raise ValueError("truncated safetensors header")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not an object")
    header.pop("__metadata__", None)
    return header, 8 + length


def _memmap_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read-only numpy memory maps of a file's int64 tensors (nothing is read until used)."""
    header, data_start = _read_header(path)
    arrays = {}
    for name, info in header.items():
        if info["dtype"] != "I64":
            raise CacheError(CACHE_CORRUPT, f"{path.name}: {name} is {info['dtype']}, expected I64.")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == begin:  # numpy cannot map zero bytes
            arrays[name] = np.zeros(shape, dtype="<i8")
        else:
            arrays[name] = np.memmap(path, dtype="<i8", mode="r", offset=data_start + begin, shape=shape)
    return arrays


# --- Manifest checks -------------------------------------------------------------------------------


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise CacheError(CACHE_CORRUPT, "The cache has no manifest.json.") from error
    except (OSError, ValueError) as error:
        raise CacheError(CACHE_CORRUPT, f"manifest.json is unreadable: {error}") from error
    if not isinstance(manifest, dict):
        raise CacheError(CACHE_CORRUPT, "manifest.json is not a JSON object.")
    return manifest


def _hook_table(manifest: dict) -> list[dict]:
    """The manifest's hooks, checked: unique names, positive widths, the directory we would choose."""
    hooks = manifest.get("hooks")
    if not isinstance(hooks, list) or not hooks:
        raise CacheError(CACHE_CORRUPT, "The manifest lists no hooks.")
    seen = set()
    for hook in hooks:
        name = hook.get("name") if isinstance(hook, dict) else None
        width = hook.get("width") if isinstance(hook, dict) else None
        if not isinstance(name, str) or not isinstance(width, int) or width <= 0:
            raise CacheError(CACHE_CORRUPT, f"The manifest has a malformed hook entry: {hook!r}.")
        if hook.get("directory") != hook_directory_name(name):
            raise CacheError(CACHE_CORRUPT, f"The manifest maps hook {name!r} to an unexpected directory.")
        if name in seen:
            raise CacheError(CACHE_CORRUPT, f"The manifest lists hook {name!r} twice.")
        seen.add(name)
    return hooks


def iter_files(directory: Path | str) -> list[Path]:
    """Every regular file under a cache directory, sorted (for archiving and size accounting)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(path for path in root.rglob("*") if path.is_file() and not path.is_symlink())


def _size_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in iter_files(directory))
