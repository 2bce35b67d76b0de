"""The activation cache on disk: a resumable writer, a verifier and a memory-mapped reader.

Importable without Django, so a researcher can read a cache from a notebook::

    from activations.store import ActivationStore

    store = ActivationStore.open("/data/activation_cache/act_123")
    block = store.get("blocks.6.hook_resid_post", 0, 4096)

Layout of one cache directory (safetensors only, no pickle anywhere)::

    manifest.json                          # key, provenance, hooks, dtype, status, shards with sha256
    tokens/00000.safetensors               # per shard: token_ids, sample_index, position (int64)
    <hook directory>/00000.safetensors     # per shard: "activations" [tokens_in_shard, width]
    tokens.safetensors                     # at finalize: the whole token table, one row per token

Durability: every file is written to a temporary name in its own directory, fsynced and renamed,
and the directory is fsynced after the renames. The manifest is rewritten (the same way) only
after a shard's files are durable, so a crash at any moment leaves the previous manifest or the
new one, never one that lists a missing or partial file. Files a crash leaves behind that no
manifest lists are removed when the writer resumes.

torch is imported lazily: writing needs it, reading float32/float16 caches does not.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import errno
import hashlib
import json
import os
import re
import secrets
import struct
import weakref
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from safetensors import safe_open

try:  # advisory lock against two writers on one cache; absent on Windows
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

FORMAT_VERSION = 1

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


def write_durably(final: Path, chunks: Iterable[bytes]) -> str:
    """Writes the chunks to a temp file beside ``final``, fsyncs it and renames it; returns the sha256.

    On any failure the temp file is removed and ``final`` is untouched. The caller fsyncs the
    directory once all of a shard's renames are done.
    """
    temporary = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    digest = hashlib.sha256()
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
    return digest.hexdigest()


def _write_manifest(root: Path, manifest: dict) -> None:
    """Atomically replaces manifest.json; once this returns (or the rename happened) it is the truth."""
    data = (json.dumps(manifest, indent=2) + "\n").encode()
    write_durably(root / MANIFEST_NAME, [data])


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


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


def _header_problems(path: Path, relative: str, expected: dict[str, tuple[str, list[int]]]) -> list[str]:
    """Checks tensor names, dtypes, shapes and the file size against what the manifest implies."""
    try:
        header, data_start = _read_header(path)
        if set(header) != set(expected):
            return [
                f"{CACHE_CORRUPT}: {relative}: holds tensors {sorted(header)}, expected {sorted(expected)}"
            ]
        problems = []
        data_end = 0
        for name, (dtype, shape) in expected.items():
            info = header[name]
            if info["dtype"] != dtype or list(info["shape"]) != shape:
                problems.append(
                    f"{CACHE_CORRUPT}: {relative}: {name} is {info['dtype']} {info['shape']}, "
                    f"the manifest implies {dtype} {shape}"
                )
            data_end = max(data_end, int(info["data_offsets"][1]))
        size = path.stat().st_size
        if size != data_start + data_end:
            problems.append(f"{CACHE_CORRUPT}: {relative}: {size} bytes, expected {data_start + data_end}")
        return problems
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        return [f"{CACHE_CORRUPT}: {relative}: unreadable safetensors file ({error})"]


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


def _shard_problems(
    root: Path, manifest: dict, shard: Any, *, position: int, token_start: int, first_batch: int, hashes: bool
) -> list[str]:
    """Everything wrong with one shard entry and its files (empty when it is sound)."""
    label = f"shard {position}"
    if not isinstance(shard, dict):
        return [f"{CACHE_CORRUPT}: {label}: malformed manifest entry"]
    num_tokens = shard.get("num_tokens")
    last_batch = shard.get("last_batch")
    problems = []
    if shard.get("index") != position:
        problems.append(f"{CACHE_CORRUPT}: {label}: index is {shard.get('index')!r}")
    if shard.get("token_start") != token_start:
        problems.append(
            f"{CACHE_CORRUPT}: {label}: token_start {shard.get('token_start')!r}, expected {token_start}"
        )
    if shard.get("first_batch") != first_batch:
        problems.append(
            f"{CACHE_CORRUPT}: {label}: first_batch {shard.get('first_batch')!r}, expected {first_batch}"
        )
    if not isinstance(last_batch, int) or last_batch < first_batch:
        problems.append(f"{CACHE_CORRUPT}: {label}: last_batch {last_batch!r} is before its first batch")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        return [*problems, f"{CACHE_CORRUPT}: {label}: num_tokens {num_tokens!r}"]

    name = _shard_file_name(position)
    expected = {f"{TOKENS_DIR}/{name}": {column: ("I64", [num_tokens]) for column in token_columns(manifest)}}
    for hook in manifest["hooks"]:
        expected[f"{hook['directory']}/{name}"] = {
            ACTIVATIONS_TENSOR: (DTYPES[manifest["dtype"]], [num_tokens, hook["width"]])
        }
    files = shard.get("files")
    if not isinstance(files, dict) or set(files) != set(expected):
        return [*problems, f"{CACHE_CORRUPT}: {label}: its file list is not the expected {sorted(expected)}"]
    for relative, tensors in expected.items():
        path = root / relative
        if not path.is_file():
            problems.append(f"{CACHE_CORRUPT}: {relative}: missing")
            continue
        header_problems = _header_problems(path, relative, tensors)
        if header_problems:
            problems.extend(header_problems)
        elif hashes and _sha256_file(path) != files[relative]:
            problems.append(f"{CACHE_CORRUPT}: {relative}: sha256 mismatch")
    return problems


def _tokens_file_problems(root: Path, manifest: dict, *, hashes: bool) -> list[str]:
    entry = manifest.get("tokens_file")
    if not isinstance(entry, dict) or entry.get("path") != TOKENS_FILE:
        return [f"{CACHE_CORRUPT}: the manifest does not record {TOKENS_FILE}"]
    path = root / TOKENS_FILE
    if not path.is_file():
        return [f"{CACHE_CORRUPT}: {TOKENS_FILE}: missing"]
    expected = {column: ("I64", [manifest["num_tokens"]]) for column in token_columns(manifest)}
    problems = _header_problems(path, TOKENS_FILE, expected)
    if not problems and hashes and _sha256_file(path) != entry.get("sha256"):
        problems.append(f"{CACHE_CORRUPT}: {TOKENS_FILE}: sha256 mismatch")
    return problems


def _manifest_problems(root: Path, manifest: dict, *, hashes: bool) -> list[str]:
    """Structural problems of a cache (status aside); with ``hashes`` every file's sha256 is checked."""
    try:
        if manifest.get("format_version") != FORMAT_VERSION:
            return [f"{CACHE_CORRUPT}: unsupported format_version {manifest.get('format_version')!r}"]
        if manifest.get("dtype") not in DTYPES:
            return [f"{CACHE_CORRUPT}: unsupported dtype {manifest.get('dtype')!r}"]
        _hook_table(manifest)
        shards = manifest.get("shards")
        if not isinstance(shards, list):
            return [f"{CACHE_CORRUPT}: the manifest has no shard list"]
        problems = []
        token_start = first_batch = 0
        for position, shard in enumerate(shards):
            problems += _shard_problems(
                root,
                manifest,
                shard,
                position=position,
                token_start=token_start,
                first_batch=first_batch,
                hashes=hashes,
            )
            if isinstance(shard, dict):
                token_start += shard.get("num_tokens") if isinstance(shard.get("num_tokens"), int) else 0
                first_batch = shard.get("last_batch", first_batch - 1) + 1
        if manifest.get("num_tokens") != token_start:
            problems.append(
                f"{CACHE_CORRUPT}: the manifest says {manifest.get('num_tokens')!r} tokens, "
                f"its shards hold {token_start}"
            )
        if manifest.get("status") == STATUS_COMPLETE:
            problems += _tokens_file_problems(root, manifest, hashes=hashes)
            if not isinstance(manifest.get("num_samples"), int):
                problems.append(f"{CACHE_CORRUPT}: a complete cache without num_samples")
        return problems
    except CacheError as error:
        return [f"{error.code}: {error.message}"]
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        return [f"{CACHE_CORRUPT}: the manifest is malformed ({error!r})"]


def verify(directory: Path | str) -> list[str]:
    """Every problem of the cache at ``directory``; ``[]`` when it is complete and sound.

    Reads every file to check its sha256. Each problem starts with the error code it amounts to:
    ``CACHE_CORRUPT`` (missing file, sha256 or shape mismatch, bad manifest) or ``CACHE_INCOMPLETE``
    (status is not complete).
    """
    root = Path(directory)
    try:
        manifest = _read_manifest(root)
    except CacheError as error:
        return [f"{error.code}: {error.message}"]
    problems = _manifest_problems(root, manifest, hashes=True)
    if manifest.get("status") != STATUS_COMPLETE:
        problems.append(f"{CACHE_INCOMPLETE}: status is {manifest.get('status')!r}, not complete")
    return problems


def iter_files(directory: Path | str) -> list[Path]:
    """Every regular file under a cache directory, sorted (for archiving and size accounting)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(path for path in root.rglob("*") if path.is_file() and not path.is_symlink())


def _size_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in iter_files(directory))


# --- Writing ---------------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def _torch_dtype(dtype: str):
    torch = _torch()
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _as_cpu_tensor(value: Any, dtype, what: str):
    """A private CPU copy of ``value`` (torch tensor, numpy array or list) in ``dtype``."""
    torch = _torch()
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    try:
        return tensor.to(device="cpu", dtype=dtype, copy=True).contiguous()
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{what} cannot be converted to {dtype}: {error}") from error


def _lock_directory(directory: Path) -> int | None:
    """An exclusive advisory lock on the cache directory, held until the writer closes."""
    if fcntl is None:  # pragma: no cover
        return None
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise CacheError(CACHE_LOCKED, "Another writer has this cache open.") from error
        raise
    return descriptor


def _release_lock(descriptor: int | None) -> None:
    if descriptor is not None:
        with contextlib.suppress(OSError):
            os.close(descriptor)


class CacheWriter:
    """Appends batches of activations to a cache, shard by shard, and can resume after a crash.

    Batches must arrive in order, numbered from 0. Idempotence rule for :meth:`add_batch`: a batch
    index below :attr:`next_batch` is already stored or buffered and is ignored (``add_batch``
    returns False), so a retried job can replay batches without duplicating data; an index above it
    (a gap) raises ValueError.

    Attributes: ``next_batch`` is the next batch index ``add_batch`` expects (buffered batches
    included); ``durable_next_batch`` is the first batch not yet on disk; ``num_tokens`` counts the
    tokens on disk and ``pending_tokens`` those buffered. After a resume ``next_batch`` equals
    ``durable_next_batch``. ``complete`` is True once finalized (also when resuming a complete cache).
    """

    def __init__(self, directory: Path, manifest: dict, *, shard_max_tokens: int, lock: int | None):
        self.directory = directory
        self.manifest = manifest
        self.shard_max_tokens = shard_max_tokens
        self._hooks = [(hook["name"], hook["width"], hook["directory"]) for hook in manifest["hooks"]]
        self._dtype = _torch_dtype(manifest["dtype"])
        self._pending: list[dict[str, Any]] = []
        self._pending_tokens = 0
        self._lock = lock
        self._closed = False
        self._release = weakref.finalize(self, _release_lock, lock)

    # -- opening --

    @classmethod
    def create_or_resume(
        cls,
        directory: Path | str,
        *,
        key: dict,
        provenance: dict,
        hooks: Mapping[str, int],
        dtype: str,
        shard_max_tokens: int = 65536,
        extra_token_columns: tuple[str, ...] = (),
    ) -> CacheWriter:
        """Starts a cache in ``directory`` or resumes the one there.

        ``extra_token_columns`` names int64 columns the token table carries besides the standard
        three (a generation's cache marks prompt vs generated tokens with ``generated``); every
        :meth:`add_batch` then gives them in ``extra_columns``.

        A directory without a manifest gets a fresh one (status ``writing``). A manifest with the
        same key, hooks and dtype is resumed: every listed shard is verified (files present, shapes
        and sha256 right); the first shard that fails and all after it are dropped; temp files and
        shard files the manifest does not list (left by a crash) are deleted. A complete cache that
        verifies stays complete. A different key, hook set or dtype raises ``CACHE_MISMATCH``; a
        directory holding other files raises ``CACHE_CORRUPT``; a cache another writer holds open
        raises ``CACHE_LOCKED``.
        """
        root = Path(directory)
        dtype = normalize_dtype(dtype)
        key = _json_roundtrip(key, "key")
        provenance = _json_roundtrip(provenance, "provenance")
        if not isinstance(shard_max_tokens, int) or shard_max_tokens <= 0:
            raise ValueError("shard_max_tokens must be a positive integer.")
        hook_widths = dict(hooks)
        if not hook_widths:
            raise ValueError("A cache needs at least one hook.")
        for name, width in hook_widths.items():
            if not isinstance(width, int) or isinstance(width, bool) or width <= 0:
                raise ValueError(f"Hook {name!r} needs a positive integer width, not {width!r}.")
        directories = {name: hook_directory_name(name) for name in hook_widths}
        if len({directory.lower() for directory in directories.values()}) != len(directories):
            raise ValueError("Two hook names map to the same directory; rename one.")

        root.mkdir(parents=True, exist_ok=True)
        lock = _lock_directory(root)
        writer = None
        try:
            if (root / MANIFEST_NAME).exists():
                manifest = _read_manifest(root)
                _check_same_cache(manifest, key=key, hooks=hook_widths, dtype=dtype)
                writer = cls(root, manifest, shard_max_tokens=shard_max_tokens, lock=lock)
                writer._recover()
            else:
                _remove_quietly(
                    path for path in root.iterdir() if path.is_file() and _is_temp_file(path.name)
                )
                others = sorted(path.name for path in root.iterdir())
                if others:
                    raise CacheError(
                        CACHE_CORRUPT,
                        "The directory is not an activation cache (no manifest) and is not empty.",
                        details={"entries": others[:20]},
                    )
                manifest = {
                    "format_version": FORMAT_VERSION,
                    "key": key,
                    "provenance": provenance,
                    "dtype": dtype,
                    "hooks": [
                        {"name": name, "width": width, "dtype": dtype, "directory": directories[name]}
                        for name, width in hook_widths.items()
                    ],
                    "status": STATUS_WRITING,
                    "shard_max_tokens": shard_max_tokens,
                    **({"extra_token_columns": list(extra_token_columns)} if extra_token_columns else {}),
                    "num_tokens": 0,
                    "num_samples": None,
                    "shards": [],
                    "tokens_file": None,
                    "created": _now(),
                    "updated": _now(),
                    "completed": None,
                }
                # The manifest comes first, so any later leftover lies in a directory that has one.
                _write_manifest(root, manifest)
                for name in [TOKENS_DIR, *directories.values()]:
                    (root / name).mkdir(exist_ok=True)
                _fsync_directory(root)
                writer = cls(root, manifest, shard_max_tokens=shard_max_tokens, lock=lock)
        except BaseException as error:
            if writer is None:
                _release_lock(lock)
            else:
                writer.close()  # the writer owns the lock now; closing twice would hit a reused descriptor
            if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
                raise CacheError(DISK_FULL, "The disk is full; the cache could not be opened.") from error
            raise
        return writer

    def _recover(self) -> None:
        """Keeps the verified prefix of shards, rewrites the manifest if that changed, removes strays."""
        root = self.directory
        manifest = self.manifest
        problems = _manifest_problems(
            root, {**manifest, "shards": [], "num_tokens": 0, "status": STATUS_WRITING}, hashes=False
        )
        if problems:
            raise CacheError(CACHE_CORRUPT, "The manifest cannot be resumed.", details={"problems": problems})
        shards = manifest.get("shards") or []
        kept: list[dict] = []
        token_start = first_batch = 0
        for position, shard in enumerate(shards):
            if _shard_problems(
                root,
                manifest,
                shard,
                position=position,
                token_start=token_start,
                first_batch=first_batch,
                hashes=True,
            ):
                break
            kept.append(shard)
            token_start += shard["num_tokens"]
            first_batch = shard["last_batch"] + 1
        recovered = {**manifest, "shards": kept, "num_tokens": token_start}
        # The shards were just hashed; a complete cache also needs a sound token table.
        complete = (
            manifest.get("status") == STATUS_COMPLETE
            and len(kept) == len(shards)
            and isinstance(manifest.get("num_samples"), int)
            and not _tokens_file_problems(root, recovered, hashes=True)
        )
        if not complete:
            recovered.update(status=STATUS_WRITING, tokens_file=None, num_samples=None, completed=None)
        if recovered != manifest:
            recovered["updated"] = _now()
            _write_manifest(root, recovered)
            _fsync_directory(root)
            self.manifest = recovered
        self._remove_strays()

    def _remove_strays(self) -> None:
        """Deletes temp files and any shard file the manifest does not list (a crash's leftovers)."""
        root = self.directory
        listed = {relative for shard in self.manifest["shards"] for relative in shard["files"]}
        for name in [TOKENS_DIR, *(directory for _name, _width, directory in self._hooks)]:
            folder = root / name
            folder.mkdir(exist_ok=True)
            strays = [
                path for path in folder.iterdir() if path.is_file() and f"{name}/{path.name}" not in listed
            ]
            _remove_quietly(strays)
            if strays:
                _fsync_directory(folder)
        strays = [path for path in root.iterdir() if path.is_file() and _is_temp_file(path.name)]
        if self.manifest["status"] != STATUS_COMPLETE:
            strays.append(root / TOKENS_FILE)
        _remove_quietly(strays)
        _fsync_directory(root)

    # -- state --

    @property
    def complete(self) -> bool:
        return self.manifest["status"] == STATUS_COMPLETE

    @property
    def durable_next_batch(self) -> int:
        shards = self.manifest["shards"]
        return shards[-1]["last_batch"] + 1 if shards else 0

    @property
    def next_batch(self) -> int:
        return self.durable_next_batch + len(self._pending)

    @property
    def num_tokens(self) -> int:
        return self.manifest["num_tokens"]

    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    @property
    def size_bytes(self) -> int:
        """Bytes on disk of every file in the cache directory."""
        return _size_bytes(self.directory)

    # -- writing --

    def add_batch(
        self,
        batch_index: int,
        *,
        token_ids,
        sample_index,
        positions,
        activations: Mapping[str, Any],
        extra_columns: Mapping[str, Any] | None = None,
    ) -> bool:
        """Buffers one batch; writes a shard once the buffer holds ``shard_max_tokens`` tokens or more.

        ``token_ids``, ``sample_index`` and ``positions`` are 1-D (one entry per stored token) and each
        activation is ``[tokens, width]`` for every hook of the cache — torch tensors (any device),
        numpy arrays or lists. Returns False (and stores nothing) for a batch index already stored
        or buffered. Shards always end on a batch boundary. ``DISK_FULL`` leaves the batch buffered:
        free space and call :meth:`flush`, or close and resume later.
        """
        if batch_index < self.next_batch:
            return False
        if self.complete:
            raise ValueError("The cache is complete; it takes no more batches.")
        self._check_writable()
        if batch_index > self.next_batch:
            raise ValueError(f"Batch {batch_index} arrived before batch {self.next_batch}.")
        torch = _torch()
        columns = {
            "token_ids": _as_cpu_tensor(token_ids, torch.int64, "token_ids"),
            "sample_index": _as_cpu_tensor(sample_index, torch.int64, "sample_index"),
            "position": _as_cpu_tensor(positions, torch.int64, "positions"),
        }
        extra = dict(extra_columns or {})
        declared = token_columns(self.manifest)[len(TOKEN_COLUMNS) :]
        if set(extra) != set(declared):
            raise ValueError(f"The cache's extra token columns are {list(declared)}, got {sorted(extra)}.")
        for name in declared:
            columns[name] = _as_cpu_tensor(extra[name], torch.int64, name)
        count = columns["token_ids"].shape[0] if columns["token_ids"].dim() == 1 else -1
        for name, column in columns.items():
            if column.dim() != 1 or column.shape[0] != count:
                raise ValueError(f"{name} must be 1-D with one entry per token, like token_ids.")
        expected_hooks = {name for name, _width, _directory in self._hooks}
        if set(activations) != expected_hooks:
            raise ValueError(f"Activations are needed for exactly the hooks {sorted(expected_hooks)}.")
        tensors = {}
        for name, width, _directory in self._hooks:
            tensor = _as_cpu_tensor(activations[name], self._dtype, f"activations[{name!r}]")
            if tuple(tensor.shape) != (count, width):
                raise ValueError(
                    f"activations[{name!r}] is {tuple(tensor.shape)}, expected ({count}, {width})."
                )
            tensors[name] = tensor
        self._pending.append({"index": batch_index, "columns": columns, "activations": tensors})
        self._pending_tokens += count
        if self._pending_tokens >= self.shard_max_tokens:
            self.flush()
        return True

    def flush(self) -> None:
        """Writes the buffered batches as one shard now and records it in the manifest.

        Called by the job on cancel and periodically, so progress survives a crash. Nothing to do
        when no batch is buffered. On ``DISK_FULL`` (or any other error) the shard's files are
        removed, the manifest is unchanged and the batches stay buffered.
        """
        self._check_writable()
        if not self._pending:
            return
        root = self.directory
        index = len(self.manifest["shards"])
        name = _shard_file_name(index)
        written: list[Path] = []
        files: dict[str, str] = {}
        pending = self._pending
        count = self._pending_tokens
        parts = [
            (
                f"{TOKENS_DIR}/{name}",
                [
                    (column, "I64", [count], [batch["columns"][column] for batch in pending])
                    for column in token_columns(self.manifest)
                ],
            )
        ]
        parts += [
            (
                f"{directory}/{name}",
                [
                    (
                        ACTIVATIONS_TENSOR,
                        DTYPES[self.manifest["dtype"]],
                        [count, width],
                        [batch["activations"][hook] for batch in pending],
                    )
                ],
            )
            for hook, width, directory in self._hooks
        ]
        try:
            for relative, tensors in parts:
                final = root / relative
                files[relative] = write_durably(final, _safetensors_stream(tensors))
                written.append(final)
            for folder in {path.parent for path in written}:
                _fsync_directory(folder)
            shard = {
                "index": index,
                "first_batch": self._pending[0]["index"],
                "last_batch": self._pending[-1]["index"],
                "num_tokens": self._pending_tokens,
                "token_start": self.manifest["num_tokens"],
                "files": files,
            }
            manifest = {
                **self.manifest,
                "shards": [*self.manifest["shards"], shard],
                "num_tokens": self.manifest["num_tokens"] + self._pending_tokens,
                "updated": _now(),
            }
            _write_manifest(root, manifest)
        except BaseException as error:
            # The manifest was not replaced, so these files are orphans: remove them now.
            _remove_quietly(written)
            if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
                raise CacheError(DISK_FULL, "The disk is full; the shard was not written.") from error
            raise
        self.manifest = manifest
        self._pending = []
        self._pending_tokens = 0
        _fsync_directory(root)

    def finalize(self, *, num_samples: int) -> dict:
        """Flushes, writes tokens.safetensors, verifies every file, marks the cache complete.

        Verification checks that every listed file is present with the recorded size and a header
        of the recorded shapes and dtypes. Each file's sha256 was computed from the very bytes
        written and fsynced, so reading everything back again here would only double the disk
        work (``verify()`` and ``cleanup_caches --verify`` do re-read and re-hash).

        Returns (a copy of) the manifest. Finalizing a complete cache returns its manifest again.
        Raises ``CACHE_CORRUPT`` (cache left ``writing``) when verification finds a problem, and
        ValueError when a stored sample_index is not below ``num_samples``.
        """
        if self.complete:
            return copy.deepcopy(self.manifest)
        self._check_writable()
        if not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError("num_samples must be a non-negative integer.")
        self.flush()
        root = self.directory
        shards = self.manifest["shards"]
        token_paths = [root / TOKENS_DIR / _shard_file_name(shard["index"]) for shard in shards]
        largest_sample = -1

        def column_chunks(column: str) -> Iterator[np.ndarray]:
            nonlocal largest_sample
            for path in token_paths:
                with safe_open(path, framework="numpy") as handle:
                    values = handle.get_tensor(column)
                if column == "sample_index" and len(values):
                    largest_sample = max(largest_sample, int(values.max()))
                yield values

        total = self.manifest["num_tokens"]
        try:
            sha = write_durably(
                root / TOKENS_FILE,
                _safetensors_stream(
                    [
                        (column, "I64", [total], column_chunks(column))
                        for column in token_columns(self.manifest)
                    ]
                ),
            )
            _fsync_directory(root)
        except OSError as error:
            if error.errno in _DISK_FULL_ERRNOS:
                raise CacheError(DISK_FULL, f"The disk is full; {TOKENS_FILE} was not written.") from error
            raise
        if largest_sample >= num_samples:
            (root / TOKENS_FILE).unlink(missing_ok=True)
            raise ValueError(
                f"A stored token belongs to sample {largest_sample}, beyond num_samples={num_samples}."
            )
        manifest = {
            **self.manifest,
            "status": STATUS_COMPLETE,
            "num_samples": num_samples,
            "tokens_file": {"path": TOKENS_FILE, "sha256": sha, "num_tokens": total},
        }
        problems = _manifest_problems(root, manifest, hashes=False)
        if problems:
            raise CacheError(CACHE_CORRUPT, "The cache failed verification.", details={"problems": problems})
        manifest["completed"] = manifest["updated"] = _now()
        try:
            _write_manifest(root, manifest)
        except OSError as error:
            if error.errno in _DISK_FULL_ERRNOS:
                raise CacheError(DISK_FULL, "The disk is full; the manifest was not updated.") from error
            raise
        _fsync_directory(root)
        self.manifest = manifest
        self.close()
        return copy.deepcopy(manifest)

    def close(self) -> None:
        """Releases the writer's lock without flushing (buffered batches are dropped)."""
        self._closed = True
        self._release()

    def _check_writable(self) -> None:
        if self._closed:
            raise ValueError("This writer is closed.")

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _check_same_cache(manifest: dict, *, key: Any, hooks: dict[str, int], dtype: str) -> None:
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CacheError(
            CACHE_MISMATCH,
            f"The cache has format version {manifest.get('format_version')!r}, not {FORMAT_VERSION}.",
        )
    existing_hooks = {
        hook.get("name"): hook.get("width") for hook in manifest.get("hooks") or [] if isinstance(hook, dict)
    }
    differences = [
        field
        for field, mine, theirs in (
            ("key", key, manifest.get("key")),
            ("hooks", hooks, existing_hooks),
            ("dtype", dtype, manifest.get("dtype")),
        )
        if mine != theirs
    ]
    if differences:
        raise CacheError(
            CACHE_MISMATCH,
            f"The directory holds a different cache ({', '.join(differences)} differ).",
            details={"fields": differences},
        )


# --- Reading ---------------------------------------------------------------------------------------


class ActivationStore:
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

        ``verify_hashes`` also checks every file's sha256 (reads the whole cache). Raises
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

    def _gather(self, hook: str, rows: np.ndarray) -> np.ndarray:
        """The given rows (any order), reading each contiguous run once."""
        width = self._width(hook)
        if len(rows) == 0:
            return np.empty((0, width), dtype=_NUMPY_DTYPES[self.dtype])
        ordered = np.unique(rows)
        breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
        runs = np.split(ordered, breaks)
        values = np.concatenate([self.get(hook, int(run[0]), int(run[-1]) + 1) for run in runs])
        return values[np.searchsorted(ordered, rows)]

    def sample(self, hook: str, sample_index: int) -> np.ndarray:
        """One sample's rows of ``hook`` in position order (empty when it has no stored token)."""
        return self._gather(hook, self._sample_rows(sample_index))

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
