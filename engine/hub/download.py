"""Resumable, cancellable model downloads into the huggingface_hub cache layout, with progress."""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import urlsplit

from engine.hub.cache import _complete_cached_snapshot
from engine.hub.configuration import _credential, _hub_endpoint, _offline_mode, _silent_progress_bar
from engine.hub.errors import HubError, _disk_full_error, _hub_errors, _offline_error
from engine.hub.metadata import _check_weights, _repo_file_sizes, files_to_download, validate_hub_id

if TYPE_CHECKING:
    from huggingface_hub.hf_api import ModelInfo

logger = logging.getLogger(__name__)

DISK_SPACE_MARGIN_BYTES = 64 * 1024 * 1024
PROGRESS_INTERVAL_SECONDS = 0.25
LOCK_POLL_SECONDS = 1.0


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


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def _megabytes(size: int) -> str:
    return f"{size / 1_000_000:,.1f} MB"
