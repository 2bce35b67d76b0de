"""Model metadata and downloads from the Hugging Face Hub, through ``huggingface_hub``.

Two entry points, both importable without Django and both raising only :class:`HubError`:

* :func:`hub_metadata` reads what registering a model needs (the commit sha, the file list with
  sizes, ``config.json`` and the safetensors headers) without downloading any weights.
* :func:`download_model` puts the model's files into the ``huggingface_hub`` cache layout under a
  given folder and returns the snapshot folder ``transformers`` loads from.

Configuration, read on every call rather than at import time:

* ``HF_ENDPOINT`` chooses the Hub. ``huggingface_hub`` reads it only once, when it is imported
  (into ``huggingface_hub.constants.ENDPOINT``), so this module reads the variable itself and hands
  the endpoint explicitly to every ``huggingface_hub`` call. Setting the variable before a call is
  enough; nothing in ``huggingface_hub.constants`` needs patching.
* ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``), from the environment or from
  ``huggingface_hub.constants.HF_HUB_OFFLINE``: no request is made; a download is served from the
  cache if its snapshot is complete there.
* ``token=None`` means anonymous. The process's ``HF_TOKEN`` or saved login is deliberately not
  used, so which credential reaches the Hub is always the caller's decision. The token goes to
  ``huggingface_hub`` only and never into a message, a log line or an exception.

How downloads work. ``huggingface_hub`` 2.4 writes each download to a process-unique
``<etag>.<random>.incomplete`` file and deletes it when the download fails, so an interrupted
``hf_hub_download`` starts again from zero. A model download here is long (gigabytes), cancellable
and retried after network errors, so the bytes of each file are fetched with ``huggingface_hub``'s
own ``get_hf_file_metadata`` (the HEAD call) and ``http_get`` (the streaming GET with its retry and
``Range`` logic) into ``blobs/<etag>.incomplete``, which survives a cancel or a crash and is resumed
with a ``Range`` request on the next call. Once every blob is in place, ``snapshot_download`` builds
the snapshot folder, the ref and the tree listing as usual; it finds every blob present and
downloads nothing. The file handed to ``http_get`` reports each chunk written (progress) and checks
for cancellation after writing it, so progress and cancellation have the granularity of
``huggingface_hub``'s download chunk (``constants.DOWNLOAD_CHUNK_SIZE``, 10 MiB).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

from engine.errors import EngineError

if TYPE_CHECKING:
    from huggingface_hub.hf_api import ModelInfo

logger = logging.getLogger(__name__)

# One part of a repo id: letters, digits, '.', '_' and '-', not starting or ending with '.' or '-'.
_HUB_ID_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
HUB_ID_PATTERN = re.compile(rf"(?!.*(?:--|\.\.))(?:{_HUB_ID_PART}/)?{_HUB_ID_PART}")

# The files a model needs to load with transformers; pickled weights (*.bin, *.pt, ...) never.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "tokenizer*"]
UNSAFE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# The names transformers writes; a repo that has them may also carry other safetensors files
# (Mistral's consolidated.safetensors) that would double the download.
_TRANSFORMERS_WEIGHTS_NAME = re.compile(r"model(?:-\d+-of-\d+)?\.safetensors")

DISK_SPACE_MARGIN_BYTES = 64 * 1024 * 1024
PROGRESS_INTERVAL_SECONDS = 0.25
LOCK_POLL_SECONDS = 1.0
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


class HubError(EngineError):
    """A failure talking to the Hub or preparing a model from it.

    ``code`` is stable and machine-readable (``MODEL_NOT_FOUND_ON_HUB``, ``HUB_OFFLINE``,
    ``HUB_UNREACHABLE``, ``HUB_ERROR``, ``GATED_MODEL``, ``INSUFFICIENT_DISK``,
    ``DOWNLOAD_CANCELLED``, ``UNSAFE_WEIGHTS``, ``INVALID_MODEL``, ``INVALID_MODEL_ID``);
    ``message`` is for people and never holds the token or a path on this machine; ``transient``
    says whether trying again later may succeed (network failures, Hub downtime).
    """


def validate_hub_id(repo_id: str) -> str:
    """``repo_id`` if it is a well-formed ``name`` or ``owner/name``; else ``HubError('INVALID_MODEL_ID')``.

    Stricter than the Hub itself, because the id also ends up in folder names and URLs.
    """
    if not isinstance(repo_id, str) or not HUB_ID_PATTERN.fullmatch(repo_id):
        raise HubError(
            "INVALID_MODEL_ID",
            "A Hub model id is 'name' or 'owner/name': letters, digits, '.', '_' and '-', at most 96 "
            "characters each, not starting or ending with '.' or '-', without '--' or '..'.",
        )
    return repo_id


@dataclass
class HubFile:
    """One file of a Hub repository: its path inside the repo and its size in bytes."""

    path: str
    size: int


@dataclass
class HubModelMetadata:
    """What the Hub says about a model at one commit, read without downloading its weights.

    ``tensor_shapes`` maps each tensor name to its ``(shape, dtype)``, dtype as safetensors spells
    it (``"F32"``, ``"BF16"``, ...), read from the headers of the weight files that
    :func:`download_model` would fetch.
    """

    repo_id: str
    revision: str
    config: dict[str, Any]
    files: list[HubFile]
    tensor_shapes: dict[str, tuple[list[int], str]]

    @property
    def download_size(self) -> int:
        """Bytes :func:`download_model` fetches for this model (with an empty cache)."""
        sizes = {file.path: file.size for file in self.files}
        return sum(sizes[path] for path in files_to_download(sizes))


def files_to_download(repo_files: Iterable[str]) -> list[str]:
    """The files of a repo that :func:`download_model` fetches, in repo order.

    Top-level files matching :data:`DOWNLOAD_PATTERNS`, never pickled weights. Sub-folders hold
    other formats or copies (``onnx/``, ``original/``) that transformers does not load. When the
    repo has transformers' own weight names (``model.safetensors``, ``model-00001-of-00002...``),
    other safetensors files are left out.
    """
    candidates = [
        path
        for path in repo_files
        if "/" not in path
        and not path.endswith(UNSAFE_WEIGHT_SUFFIXES)
        and any(fnmatch(path, pattern) for pattern in DOWNLOAD_PATTERNS)
    ]
    if any(_TRANSFORMERS_WEIGHTS_NAME.fullmatch(path) for path in candidates):
        candidates = [
            path
            for path in candidates
            if not path.endswith(".safetensors") or _TRANSFORMERS_WEIGHTS_NAME.fullmatch(path)
        ]
    return candidates


def hub_metadata(repo_id: str, *, revision: str | None, token: str | None) -> HubModelMetadata:
    """Files, config and tensor shapes of ``repo_id`` at ``revision`` (default branch if None).

    Reads the file list with sizes and the resolved commit (one API call), downloads
    ``config.json`` into a throw-away folder, and reads the safetensors headers with HTTP range
    requests. Every later request is pinned to the resolved commit, so the answer is consistent
    even if the branch moves meanwhile.
    """
    from huggingface_hub import HfApi, hf_hub_download

    validate_hub_id(repo_id)
    if _offline_mode():
        raise _offline_error(repo_id, revision, cached=False)
    endpoint = _hub_endpoint()
    credential = _credential(token)
    api = HfApi(endpoint=endpoint)
    with _hub_errors(repo_id, revision):
        info = api.model_info(repo_id, revision=revision, files_metadata=True, token=credential)
        sizes = _repo_file_sizes(info)
        wanted = files_to_download(sizes)
        _check_weights(repo_id, sizes, wanted)
        if "config.json" not in sizes:
            raise HubError(
                "INVALID_MODEL",
                f"'{repo_id}' has no config.json, so transformers cannot load it.",
                details={"repo_id": repo_id, "revision": revision},
            )
        with tempfile.TemporaryDirectory(prefix="mistudio-hub-") as scratch:
            config_path = hf_hub_download(
                repo_id,
                "config.json",
                revision=info.sha,
                cache_dir=scratch,
                token=credential,
                endpoint=endpoint,
                tqdm_class=_silent_progress_bar(),
            )
            config = json.loads(Path(config_path).read_text(encoding="utf-8"))
        tensor_shapes: dict[str, tuple[list[int], str]] = {}
        for weights_file in (path for path in wanted if path.endswith(".safetensors")):
            header = api.parse_safetensors_file_metadata(
                repo_id, weights_file, revision=info.sha, token=credential
            )
            for name, tensor in header.tensors.items():
                tensor_shapes[name] = (list(tensor.shape), tensor.dtype)
    return HubModelMetadata(
        repo_id=repo_id,
        revision=info.sha,
        config=config,
        files=[HubFile(path=path, size=size) for path, size in sizes.items()],
        tensor_shapes=tensor_shapes,
    )


def download_model(
    repo_id: str,
    *,
    revision: str | None,
    cache_dir: Path,
    token: str | None,
    progress: Callable[[int, int], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> Path:
    """Download the model's files (see :func:`files_to_download`) into ``cache_dir``; return the snapshot.

    ``progress(bytes_done, bytes_total)`` is summed over all files, counts bytes already in the
    cache (complete or partial) as done, never goes back, comes at most every
    :data:`PROGRESS_INTERVAL_SECONDS` and once at the end with ``done == total``.
    ``should_cancel()`` is polled between files and after every chunk written; when it returns
    True the download stops with ``HubError('DOWNLOAD_CANCELLED')`` and the partial file stays for
    the next call to resume. Nothing is downloaded when the missing bytes do not fit on the disk.
    Offline, or when the Hub cannot be reached, a snapshot complete in ``cache_dir`` is returned.
    """
    validate_hub_id(repo_id)
    cache_dir = Path(cache_dir)
    if _offline_mode():
        cached = _complete_cached_snapshot(repo_id, revision, cache_dir)
        if cached is None:
            raise _offline_error(repo_id, revision, cached=True)
        _report_complete(progress, cached)
        return cached
    try:
        return _download_from_hub(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            progress=_ProgressReporter(progress),
            should_cancel=should_cancel or (lambda: False),
        )
    except HubError as error:
        if error.code != "HUB_UNREACHABLE":
            raise
        cached = _complete_cached_snapshot(repo_id, revision, cache_dir)
        if cached is None:
            raise
        logger.warning("The Hub is unreachable; using the complete cached snapshot of %s.", repo_id)
        _report_complete(progress, cached)
        return cached


# --- Downloading ---------------------------------------------------------------------------------


@dataclass
class _PlannedFile:
    """A file to download, with the blob name the Hub's cache layout will give it."""

    path: str
    size: int
    etag: str | None  # git blob id, or the sha256 of an LFS file: what the Hub sends as its ETag


def _download_from_hub(
    repo_id: str,
    *,
    revision: str | None,
    cache_dir: Path,
    token: str | None,
    progress: _ProgressReporter,
    should_cancel: Callable[[], bool],
) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.file_download import repo_folder_name

    endpoint = _hub_endpoint()
    credential = _credential(token)
    api = HfApi(endpoint=endpoint)
    cache_dir.mkdir(parents=True, exist_ok=True)
    storage_folder = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
    _raise_if_cancelled(should_cancel, repo_id, progress)
    with _hub_errors(repo_id, revision):
        # Also records refs/<revision> in the cache, so an offline call finds this commit again.
        resolved = api.resolve_revision(repo_id, revision=revision, cache_dir=cache_dir, token=credential)
        info = api.model_info(repo_id, revision=resolved.resolved, files_metadata=True, token=credential)
    plan = _plan_download(repo_id, info)
    progress.total = sum(planned.size for planned in plan)
    # Bytes of each file in the cache so far (complete blob, partial download or nothing).
    file_bytes = {planned.path: _bytes_on_disk(storage_folder, planned) for planned in plan}
    _check_disk_space(repo_id, cache_dir, progress.total - sum(file_bytes.values()))
    progress.advance_to(sum(file_bytes.values()))

    def on_file_bytes(path: str, size: int) -> None:
        file_bytes[path] = size
        progress.advance_to(sum(file_bytes.values()))

    # Small files first: a cancelled download then leaves only the weights to fetch.
    for planned in sorted(plan, key=lambda planned: planned.size):
        if planned.etag is not None and (storage_folder / "blobs" / planned.etag).exists():
            continue  # complete (a full-size partial still needs its rename, in _fetch_blob)
        _raise_if_cancelled(should_cancel, repo_id, progress)
        with _hub_errors(repo_id, revision):
            _fetch_blob(
                repo_id,
                planned,
                commit_sha=resolved.resolved,
                cache_dir=cache_dir,
                storage_folder=storage_folder,
                endpoint=endpoint,
                credential=credential,
                on_file_bytes=functools.partial(on_file_bytes, planned.path),
                should_cancel=should_cancel,
                cancelled=lambda: _cancelled_error(repo_id, progress),
            )
        on_file_bytes(planned.path, planned.size)

    _raise_if_cancelled(should_cancel, repo_id, progress)
    with _hub_errors(repo_id, revision):
        # Every blob is in place: this only links the snapshot, writes the tree listing and checks.
        snapshot = snapshot_download(
            repo_id,
            revision=resolved,
            cache_dir=cache_dir,
            token=credential,
            endpoint=endpoint,
            allow_patterns=[glob.escape(planned.path) for planned in plan],
            max_workers=1,
            tqdm_class=_silent_progress_bar(),
        )
    progress.finish()
    return Path(snapshot)


def _plan_download(repo_id: str, info: ModelInfo) -> list[_PlannedFile]:
    sizes = _repo_file_sizes(info)
    wanted = files_to_download(sizes)
    _check_weights(repo_id, sizes, wanted)
    siblings = {sibling.rfilename: sibling for sibling in info.siblings or []}
    return [
        _PlannedFile(
            path=path,
            size=sizes[path],
            etag=siblings[path].lfs.sha256 if siblings[path].lfs else siblings[path].blob_id,
        )
        for path in wanted
    ]


def _bytes_on_disk(storage_folder: Path, planned: _PlannedFile) -> int:
    """How much of ``planned`` the cache already holds: all of it, a partial download, or nothing."""
    if planned.etag is None:
        return 0
    blob = storage_folder / "blobs" / planned.etag
    if blob.exists():
        return planned.size
    partial = blob.with_name(f"{planned.etag}.incomplete")
    return min(partial.stat().st_size, planned.size) if partial.exists() else 0


def _check_disk_space(repo_id: str, cache_dir: Path, missing_bytes: int) -> None:
    available = max(shutil.disk_usage(cache_dir).free - DISK_SPACE_MARGIN_BYTES, 0)
    if missing_bytes > available:
        raise HubError(
            "INSUFFICIENT_DISK",
            f"Downloading '{repo_id}' needs {_megabytes(missing_bytes)} more on disk, but only "
            f"{_megabytes(available)} is free in the model cache.",
            details={"repo_id": repo_id, "required_bytes": missing_bytes, "available_bytes": available},
        )


def _fetch_blob(
    repo_id: str,
    planned: _PlannedFile,
    *,
    commit_sha: str,
    cache_dir: Path,
    storage_folder: Path,
    endpoint: str,
    credential: str | bool,
    on_file_bytes: Callable[[int], None],
    should_cancel: Callable[[], bool],
    cancelled: Callable[[], HubError],
) -> None:
    """Put ``planned``'s bytes at ``blobs/<etag>``, resuming ``blobs/<etag>.incomplete`` if present."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo_id, planned.path, revision=commit_sha, endpoint=endpoint)
    metadata = get_hf_file_metadata(url, token=credential, endpoint=endpoint)
    if metadata.etag is None:
        raise HubError(
            "HUB_ERROR",
            f"The Hub sent no ETag for '{planned.path}' of '{repo_id}'; its cache entry cannot be named.",
            details={"repo_id": repo_id, "file": planned.path},
        )
    size = metadata.size if metadata.size is not None else planned.size
    blob = storage_folder / "blobs" / metadata.etag
    partial = blob.with_name(f"{metadata.etag}.incomplete")
    blob.parent.mkdir(parents=True, exist_ok=True)
    headers = build_hf_headers(token=credential)
    if _origin(metadata.location) != _origin(url):
        headers.pop("authorization", None)  # a signed CDN address: the token must not leave the Hub

    # The same lock hf_hub_download takes for this blob: two workers never append to one partial.
    lock_path = cache_dir / ".locks" / storage_folder.name / f"{metadata.etag}.lock"
    with _blob_lock(lock_path, should_cancel, cancelled):
        if blob.exists():
            return
        with partial.open("ab") as file:
            resume_from = file.tell()
            if resume_from > size:  # not a prefix of this file: start again
                file.truncate(0)
                resume_from = 0
            if resume_from:
                logger.info("Resuming %s of %s at byte %d of %d.", planned.path, repo_id, resume_from, size)
            on_file_bytes(resume_from)
            writer = _ReportingWriter(file, on_file_bytes=on_file_bytes, should_cancel=should_cancel)
            try:
                # A partial of full size: the last chunk arrived just before a cancel. Nothing to fetch.
                if resume_from < size:
                    http_get(
                        metadata.location,
                        writer,  # type: ignore[arg-type]  # http_get needs only write/tell/seek/truncate
                        resume_size=resume_from,
                        headers=headers,
                        expected_size=size,
                        displayed_filename=planned.path,
                        tqdm_class=_silent_progress_bar(),
                    )
            except _TransferCancelled:
                raise cancelled() from None
            except OSError as error:
                if error.errno == errno.ENOSPC:
                    raise _disk_full_error(repo_id) from error
                if type(error) is OSError and error.errno is None:
                    # http_get's size check (a plain OSError): the connection ended early. The partial
                    # stays for the next call to resume.
                    raise HubError(
                        "HUB_UNREACHABLE",
                        f"The download of '{planned.path}' from the Hub stopped before its end.",
                        details={"repo_id": repo_id, "file": planned.path},
                        transient=True,
                    ) from error
                raise
        os.replace(partial, blob)


class _TransferCancelled(Exception):
    """Raised inside http_get's write loop to stop the transfer; never leaves this module."""


class _ReportingWriter:
    """The file handed to ``http_get``: reports the file's size after each chunk and stops on cancel.

    The chunk is written before cancellation is checked, so every byte received stays in the
    partial file for the next call to resume from.
    """

    def __init__(
        self, file: BinaryIO, *, on_file_bytes: Callable[[int], None], should_cancel: Callable[[], bool]
    ) -> None:
        self._file = file
        self._on_file_bytes = on_file_bytes
        self._should_cancel = should_cancel

    def write(self, chunk: bytes) -> int:
        written = self._file.write(chunk)
        self._on_file_bytes(self._file.tell())
        if self._should_cancel():
            self._file.flush()
            raise _TransferCancelled
        return written

    def tell(self) -> int:
        return self._file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        return self._file.truncate(size)

    def flush(self) -> None:
        self._file.flush()


@contextlib.contextmanager
def _blob_lock(
    lock_path: Path, should_cancel: Callable[[], bool], cancelled: Callable[[], HubError]
) -> Iterator[None]:
    """huggingface_hub's lock for one blob, waited for in short steps so a cancel is not stuck behind it."""
    from filelock import Timeout
    from huggingface_hub.utils import WeakFileLock

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        while True:
            try:
                stack.enter_context(WeakFileLock(lock_path, timeout=LOCK_POLL_SECONDS))
                break
            except Timeout:
                if should_cancel():
                    raise cancelled() from None
        yield


class _ProgressReporter:
    """Byte progress of one download: never decreasing, throttled, exact at the end."""

    def __init__(self, callback: Callable[[int, int], None] | None) -> None:
        self._callback = callback
        self.total = 0
        self.done = 0
        self._last_call: float | None = None

    def advance_to(self, done: int) -> None:
        self.done = min(max(done, self.done), self.total)
        now = time.monotonic()
        if self._callback is not None and (
            self._last_call is None or now - self._last_call >= PROGRESS_INTERVAL_SECONDS
        ):
            self._last_call = now
            self._callback(self.done, self.total)

    def finish(self) -> None:
        self.done = self.total
        if self._callback is not None:
            self._callback(self.total, self.total)


@functools.cache
def _silent_progress_bar() -> type:
    """A tqdm class for huggingface_hub's bars that shows nothing: workers report through callbacks."""
    from tqdm.std import tqdm

    class SilentProgressBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    return SilentProgressBar


def _report_complete(progress: Callable[[int, int], None] | None, snapshot: Path) -> None:
    if progress is not None:
        total = sum(path.stat().st_size for path in snapshot.iterdir() if path.is_file())
        progress(total, total)


def _raise_if_cancelled(should_cancel: Callable[[], bool], repo_id: str, progress: _ProgressReporter) -> None:
    if should_cancel():
        raise _cancelled_error(repo_id, progress)


def _cancelled_error(repo_id: str, progress: _ProgressReporter) -> HubError:
    return HubError(
        "DOWNLOAD_CANCELLED",
        f"The download of '{repo_id}' was cancelled; the next download resumes where it stopped.",
        details={"repo_id": repo_id, "bytes_done": progress.done, "bytes_total": progress.total},
    )


# --- Cache ---------------------------------------------------------------------------------------


def _complete_cached_snapshot(repo_id: str, revision: str | None, cache_dir: Path) -> Path | None:
    """The snapshot of ``repo_id`` at ``revision`` if every file a download fetches is in the cache.

    Uses no network: the commit comes from the cached ref, the expected files from the tree listing
    that ``snapshot_download`` cached, and ``snapshot_download(local_files_only=True)`` checks them.
    """
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        tree = get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)
    except CachedRepoTreeNotFoundError:
        return None
    wanted = files_to_download(entry.path for entry in tree)
    if not any(path.endswith(".safetensors") for path in wanted):
        return None
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=True,
            allow_patterns=[glob.escape(path) for path in wanted],
        )
    except LocalEntryNotFoundError:  # also IncompleteSnapshotError
        return None
    return Path(snapshot)


# --- Settings ------------------------------------------------------------------------------------


def _hub_endpoint() -> str:
    """``HF_ENDPOINT`` as it is now; huggingface_hub's own copy is frozen at its import."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _offline_mode() -> bool:
    from huggingface_hub import constants

    from_environment = any(
        os.environ.get(name, "").upper() in _TRUE_VALUES
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    return constants.HF_HUB_OFFLINE or from_environment


def _credential(token: str | None) -> str | bool:
    """What huggingface_hub's ``token=`` gets: the token, or False (never the machine's saved login)."""
    return token or False


# --- Errors --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """Turn huggingface_hub's and the network's exceptions into :class:`HubError`.

    Messages are written here rather than taken from the exceptions, which carry URLs and paths.
    """
    import httpx2
    from huggingface_hub import errors as hub_errors

    details: dict[str, Any] = {"repo_id": repo_id, "revision": revision}
    at_revision = f" at revision '{revision}'" if revision else ""
    try:
        yield
    except HubError:
        raise
    except hub_errors.OfflineModeIsEnabled as error:
        raise _offline_error(repo_id, revision, cached=False) from error
    except hub_errors.GatedRepoError as error:
        raise _gated_error(repo_id, details, error.response.status_code) from error
    except hub_errors.RevisionNotFoundError as error:
        raise HubError(
            "MODEL_NOT_FOUND_ON_HUB",
            f"The Hub has '{repo_id}' but no revision '{revision or 'main'}'.",
            details=details,
        ) from error
    except hub_errors.RepositoryNotFoundError as error:
        raise HubError(
            "MODEL_NOT_FOUND_ON_HUB",
            f"There is no model '{repo_id}' on the Hub (or it is private to others).",
            details=details,
        ) from error
    except hub_errors.RemoteEntryNotFoundError as error:
        raise HubError(
            "MODEL_NOT_FOUND_ON_HUB",
            f"A file of '{repo_id}'{at_revision} has disappeared from the Hub.",
            details=details,
        ) from error
    except hub_errors.HfHubHTTPError as error:
        raise _http_error(repo_id, details, error.response.status_code) from error
    except (
        hub_errors.RevisionResolutionError,
        hub_errors.LocalEntryNotFoundError,
        httpx2.TransportError,
    ) as error:
        # LocalEntryNotFoundError: hf_hub_download could not reach the Hub and has no cached copy.
        raise _unreachable_error(repo_id, details) from error
    except hub_errors.FileMetadataError as error:
        raise HubError(
            "HUB_ERROR",
            "The Hub endpoint answered without the headers of a Hugging Face Hub; check HF_ENDPOINT "
            "and any proxy.",
            details=details,
        ) from error
    except (hub_errors.SafetensorsParsingError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HubError(
            "INVALID_MODEL",
            f"'{repo_id}'{at_revision} has a config.json or safetensors header that cannot be read.",
            details=details,
        ) from error
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise _disk_full_error(repo_id) from error
        raise


def _http_error(repo_id: str, details: dict[str, Any], status: int) -> HubError:
    details = {**details, "http_status": status}
    if status in (401, 403):
        return _gated_error(repo_id, details, status)
    if status == 404:
        return HubError(
            "MODEL_NOT_FOUND_ON_HUB", f"There is no model '{repo_id}' on the Hub.", details=details
        )
    if status in (408, 429) or status >= 500:
        return _unreachable_error(repo_id, details)
    return HubError(
        "HUB_ERROR", f"The Hub refused a request for '{repo_id}' (HTTP {status}).", details=details
    )


def _gated_error(repo_id: str, details: dict[str, Any], status: int) -> HubError:
    return HubError(
        "GATED_MODEL",
        f"'{repo_id}' is gated on the Hub: accept its conditions on the model page and give miStudio "
        "a token of that account (HF_TOKEN)." + (" The token given was refused." if status == 403 else ""),
        details={**details, "http_status": status},
    )


def _unreachable_error(repo_id: str, details: dict[str, Any]) -> HubError:
    return HubError(
        "HUB_UNREACHABLE",
        f"The Hub could not be reached for '{repo_id}'; try again later.",
        details=details,
        transient=True,
    )


def _offline_error(repo_id: str, revision: str | None, *, cached: bool) -> HubError:
    reason = " and the model is not completely in the cache" if cached else ""
    return HubError(
        "HUB_OFFLINE",
        f"Hub access is switched off (HF_HUB_OFFLINE){reason}, so '{repo_id}' cannot be fetched.",
        details={"repo_id": repo_id, "revision": revision},
    )


def _disk_full_error(repo_id: str) -> HubError:
    return HubError(
        "INSUFFICIENT_DISK",
        f"The disk of the model cache filled up while downloading '{repo_id}'.",
        details={"repo_id": repo_id},
    )


def _check_weights(repo_id: str, repo_files: Iterable[str], wanted: list[str]) -> None:
    if any(path.endswith(".safetensors") for path in wanted):
        return
    if any(path.endswith(UNSAFE_WEIGHT_SUFFIXES) for path in repo_files):
        raise HubError(
            "UNSAFE_WEIGHTS",
            f"'{repo_id}' has weights only in pickle formats (.bin, .pt, .ckpt), which can run code "
            "when loaded; miStudio loads safetensors weights only.",
            details={"repo_id": repo_id},
        )
    raise HubError(
        "INVALID_MODEL",
        f"'{repo_id}' has no safetensors weights at its top level.",
        details={"repo_id": repo_id},
    )


def _repo_file_sizes(info: ModelInfo) -> dict[str, int]:
    return {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def _megabytes(size: int) -> str:
    return f"{size / 1_000_000:,.1f} MB"


__all__ = [
    "DOWNLOAD_PATTERNS",
    "HUB_ID_PATTERN",
    "HubError",
    "HubFile",
    "HubModelMetadata",
    "download_model",
    "files_to_download",
    "hub_metadata",
    "validate_hub_id",
]
