"""``CacheWriter``: appends batches shard by shard, durably, and resumes after a crash."""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import time
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

try:  # advisory lock against two writers on one cache; absent on Windows
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

from activations.store.format import (
    _DISK_FULL_ERRNOS,
    ACTIVATIONS_TENSOR,
    CACHE_CORRUPT,
    CACHE_LOCKED,
    CACHE_MISMATCH,
    DISK_FULL,
    DTYPES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    STATUS_COMPLETE,
    STATUS_WRITING,
    TOKEN_COLUMNS,
    TOKENS_DIR,
    TOKENS_FILE,
    CacheError,
    _fsync_directory,
    _is_temp_file,
    _json_roundtrip,
    _now,
    _read_manifest,
    _remove_quietly,
    _safetensors_stream,
    _shard_file_name,
    _size_bytes,
    _torch,
    _torch_dtype,
    _write_manifest,
    hook_directory_name,
    normalize_dtype,
    token_columns,
    write_durably,
)
from activations.store.integrity import _manifest_problems, _shard_problems, _tokens_file_problems

# --- Writing ---------------------------------------------------------------------------------------


def _as_cpu_tensor(value: Any, dtype, what: str, *, owned: bool = False):
    """A private CPU copy of ``value`` (torch tensor, numpy array or list) in ``dtype``; ``value``
    itself when ``owned`` (the caller hands it over) and it is already a contiguous CPU tensor of
    ``dtype`` in pageable memory.

    Page-locked tensors (a GPU extraction's host copies) are copied out at once, so that their
    blocks go back to torch's pinned-memory cache: kept buffered until a shard is written, they
    made it pin new memory batch after batch, and extraction into a tmpfs cache ran 1.2-1.4 x
    slower on an H200 than with this copy."""
    torch = _torch()
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if (
        owned
        and tensor.device.type == "cpu"
        and tensor.dtype == dtype
        and tensor.is_contiguous()
        and not tensor.is_pinned()
    ):
        return tensor
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

    # Seconds to wait before each shard write: a slow disk, for tests and bench/extraction.py only.
    write_delay_seconds: float = 0.0

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
        and checksums right); the first shard that fails and all after it are dropped; temp files and
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

    def add_extracted(self, batch: Any) -> bool:
        """:meth:`add_batch` of one batch of ``engine.extraction.extract`` (a ``BatchActivations``,
        whose tensors the writer then keeps as they are: the batch is the caller's to give)."""
        return self.add_batch(
            batch.batch_index, token_ids=batch.token_ids, sample_index=batch.sample_index,
            positions=batch.positions, activations=batch.activations, owned=True,
        )  # fmt: skip

    def add_batch(
        self,
        batch_index: int,
        *,
        token_ids,
        sample_index,
        positions,
        activations: Mapping[str, Any],
        extra_columns: Mapping[str, Any] | None = None,
        owned: bool = False,
    ) -> bool:
        """Buffers one batch; writes a shard once the buffer holds ``shard_max_tokens`` tokens or more.

        ``token_ids``, ``sample_index`` and ``positions`` are 1-D (one entry per stored token) and each
        activation is ``[tokens, width]`` for every hook of the cache — torch tensors (any device),
        numpy arrays or lists; they are copied unless ``owned`` (the caller will not touch them
        again, so CPU tensors already in the cache's dtype are kept as they are). Returns False
        (and stores nothing) for a batch index already stored or buffered. Shards always end on a
        batch boundary. ``DISK_FULL`` leaves the batch buffered: free space and call :meth:`flush`,
        or close and resume later.
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
            "token_ids": _as_cpu_tensor(token_ids, torch.int64, "token_ids", owned=owned),
            "sample_index": _as_cpu_tensor(sample_index, torch.int64, "sample_index", owned=owned),
            "position": _as_cpu_tensor(positions, torch.int64, "positions", owned=owned),
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
            tensor = _as_cpu_tensor(activations[name], self._dtype, f"activations[{name!r}]", owned=owned)
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
        if self.write_delay_seconds:
            time.sleep(self.write_delay_seconds)
        root = self.directory
        index = len(self.manifest["shards"])
        name = _shard_file_name(index)
        written: list[Path] = []
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
            # One thread per file (a shard's files are independent): the copies into the page
            # cache and the checksums, which release the GIL, run side by side.
            with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="shard-file") as pool:
                futures = {
                    relative: pool.submit(write_durably, root / relative, _safetensors_stream(tensors))
                    for relative, tensors in parts
                }
                wait(futures.values())
            errors = {relative: future.exception() for relative, future in futures.items()}
            written = [root / relative for relative, error in errors.items() if error is None]
            for error in errors.values():
                if error is not None:
                    raise error
            files = {relative: future.result() for relative, future in futures.items()}
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
        of the recorded shapes and dtypes. Each file's checksum was computed from the very bytes
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
            checksum = write_durably(
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
            "tokens_file": {"path": TOKENS_FILE, "checksum": checksum, "num_tokens": total},
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
