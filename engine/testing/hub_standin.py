"""A local stand-in for the Hugging Face Hub, so tests run the real ``huggingface_hub`` code path.

:class:`LocalHub` is an HTTP server on 127.0.0.1 (a free port) that answers the requests
``huggingface_hub`` 2.4 makes for model repositories, as the Hub answers them:

* ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}`` (``model_info``,
  ``repo_info``, ``resolve_revision``): ``sha`` and ``siblings``; with ``?blobs=true``
  (``files_metadata=True``) each sibling has ``size``, ``blobId`` and ``lfs``.
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...`` (``list_repo_tree``, which
  ``snapshot_download`` uses), one page.
* ``HEAD`` and ``GET /{repo}/resolve/{rev}/{filename}`` (``hf_hub_download``, ``http_get``,
  ``get_hf_file_metadata``, ``parse_safetensors_file_metadata``): ``X-Repo-Commit``, ``ETag``
  (the git blob id, or the sha256 for LFS files, which also get ``X-Linked-Etag`` and
  ``X-Linked-Size``), ``Content-Length``, ``Accept-Ranges``; ``Range: bytes=a-b`` / ``a-`` / ``-n``
  answered ``206`` with ``Content-Range`` (resumed downloads, safetensors header reads). Files are
  served directly (``200``), never redirected to a CDN, and no ``X-Xet-*`` header is sent, so
  ``huggingface_hub`` downloads over plain HTTP even when ``hf_xet`` is installed.
* Errors carry the ``X-Error-Code`` header ``huggingface_hub`` maps to its exceptions:
  ``RepoNotFound`` (401 without a token, 404 with one, as on the Hub), ``RevisionNotFound``
  (404), ``EntryNotFound`` (404), ``GatedRepo`` (401 without a token, 403 with a wrong one). As on
  the Hub, the metadata and the file list of a gated repo are public; only its files are gated.

Pointing ``huggingface_hub`` at it. ``huggingface_hub`` reads ``HF_ENDPOINT`` once, at import,
into ``huggingface_hub.constants.ENDPOINT`` (and ``HUGGINGFACE_CO_URL_TEMPLATE``), so setting the
variable later changes nothing for code that relies on the default. Three ways that work:

* ``engine.hub`` reads ``HF_ENDPOINT`` on every call and passes ``endpoint=`` to
  ``huggingface_hub``: ``monkeypatch.setenv("HF_ENDPOINT", hub.url)`` is enough.
* Direct ``huggingface_hub`` calls: pass ``endpoint=hub.url`` (``HfApi(endpoint=...)``,
  ``hf_hub_download(..., endpoint=...)``, ``snapshot_download(..., endpoint=...)``).
* Code you cannot change (``transformers.from_pretrained("owner/name")``): start a subprocess with
  ``HF_ENDPOINT`` in its environment, or monkeypatch both ``huggingface_hub.constants.ENDPOINT`` and
  ``huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE`` (``hf_hub_url`` builds URLs from the
  template).

Offline mode is read the same way: ``constants.HF_HUB_OFFLINE`` at import, from ``HF_HUB_OFFLINE``
or ``TRANSFORMERS_OFFLINE``; ``huggingface_hub`` refuses requests when it is True. The test
settings (``mistudio/settings_test.py``) set ``HF_HUB_OFFLINE=1``, so tests that use this server
must switch it off: ``monkeypatch.delenv("HF_HUB_OFFLINE")`` and
``monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)``.

For tests: ``throttle_bytes_per_second`` slows file bodies down so progress and cancellation can
be observed in the middle of a file; :attr:`LocalHub.bytes_served` counts the body bytes sent per
``"{repo_id}/{filename}"`` and :attr:`LocalHub.requests` records each file request (method,
``Range`` header, status, bytes), which shows what was downloaded and what was resumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

# Files the Hub keeps in LFS (so the ETag is their sha256): weights by extension, anything big.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".model")
LFS_MIN_SIZE = 10 * 1024 * 1024
SEND_SLICE_BYTES = 64 * 1024
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class HostedFile:
    """One file of a hosted commit, with the identifiers the Hub gives it."""

    path: str
    size: int
    blob_id: str  # git's sha1 of the blob
    sha256: str | None  # set for LFS files
    location: Path  # the frozen copy on disk

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id


@dataclass
class HostedRepo:
    """A repository: its commits (sha -> files by path) and the commit ``main`` points to."""

    repo_id: str
    main: str = ""
    commits: dict[str, dict[str, HostedFile]] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision == "main":
            return self.main
        return revision if revision in self.commits else None


@dataclass(frozen=True)
class ServedRequest:
    """One request for a file: what was asked and how much of the body was sent."""

    method: str
    repo_id: str
    filename: str
    range: str | None
    status: int
    bytes_sent: int


class LocalHub:
    """The stand-in Hub; a context manager that starts and stops the server.

    ``root`` is where added repositories are copied (so a test may change its source folder
    afterwards). ``gated`` maps repo ids to the one token allowed to download their files.
    """

    def __init__(
        self,
        root: Path,
        *,
        throttle_bytes_per_second: int | None = None,
        gated: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.throttle_bytes_per_second = throttle_bytes_per_second
        self.gated = dict(gated or {})
        self.repos: dict[str, HostedRepo] = {}
        self.bytes_served: dict[str, int] = {}
        self.requests: list[ServedRequest] = []
        self._lock = threading.Lock()
        self._server: _HubServer | None = None
        self._thread: threading.Thread | None = None

    # --- Lifecycle ---

    def __enter__(self) -> LocalHub:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self._server = _HubServer(("127.0.0.1", 0), _HubRequestHandler, hub=self)
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hub", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and cut open connections, so pooled keep-alive clients cannot reach it either."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server.close_open_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the local hub is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # --- Content ---

    def add_repo(self, repo_id: str, folder: Path) -> str:
        """Publish the files of ``folder`` as a new commit of ``repo_id`` (``main`` moves to it); its sha."""
        sources = sorted(path for path in Path(folder).rglob("*") if path.is_file())
        digests = {source: _digests(source) for source in sources}
        listing = "\n".join(
            f"{source.relative_to(folder).as_posix()} {digests[source][0]}" for source in sources
        )
        commit = hashlib.sha1(f"{repo_id}\n{listing}".encode(), usedforsecurity=False).hexdigest()
        storage = self.root / repo_id.replace("/", "--") / commit
        files: dict[str, HostedFile] = {}
        for source in sources:
            path = source.relative_to(folder).as_posix()
            location = storage / path
            location.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, location)
            blob_id, sha256 = digests[source]
            is_lfs = path.endswith(LFS_SUFFIXES) or source.stat().st_size >= LFS_MIN_SIZE
            files[path] = HostedFile(
                path=path,
                size=source.stat().st_size,
                blob_id=blob_id,
                sha256=sha256 if is_lfs else None,
                location=location,
            )
        with self._lock:
            repo = self.repos.setdefault(repo_id, HostedRepo(repo_id))
            repo.commits[commit] = files
            repo.main = commit
        return commit

    def served(self, repo_id: str, filename: str) -> int:
        """Body bytes sent so far for one file (0 if never requested)."""
        return self.bytes_served.get(f"{repo_id}/{filename}", 0)

    def file_requests(self, repo_id: str, filename: str, method: str = "GET") -> list[ServedRequest]:
        return [
            request
            for request in self.requests
            if (request.repo_id, request.filename, request.method) == (repo_id, filename, method)
        ]

    def _count(self, repo_id: str, filename: str, sent: int) -> None:
        with self._lock:
            key = f"{repo_id}/{filename}"
            self.bytes_served[key] = self.bytes_served.get(key, 0) + sent

    def _record(self, request: ServedRequest) -> None:
        with self._lock:
            self.requests.append(request)


class _HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *, hub: LocalHub):
        super().__init__(address, handler)
        self.hub = hub
        self.open_connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()

    def close_open_connections(self) -> None:
        with self.connections_lock:
            connections = list(self.open_connections)
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by the client
                connection.shutdown(socket.SHUT_RDWR)


class _HubRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's pooled client expects
    server: _HubServer

    def setup(self) -> None:
        super().setup()
        with self.server.connections_lock:
            self.server.open_connections.add(self.connection)

    def finish(self) -> None:
        with self.server.connections_lock:
            self.server.open_connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet test output

    def do_GET(self) -> None:
        self._route(send_body=True)

    def do_HEAD(self) -> None:
        self._route(send_body=False)

    # --- Routing ---

    @property
    def hub(self) -> LocalHub:
        return self.server.hub

    def _route(self, *, send_body: bool) -> None:
        url = urlsplit(self.path)
        segments = url.path.lstrip("/").split("/")
        if segments[:2] == ["api", "models"] and len(segments) > 2:
            self._api(segments[2:], parse_qs(url.query))
        elif "resolve" in segments[1:] and len(segments) >= segments.index("resolve") + 3:
            at = segments.index("resolve")
            repo_id = "/".join(segments[:at])
            revision = unquote(segments[at + 1])
            filename = unquote("/".join(segments[at + 2 :]))
            self._file(repo_id, revision, filename, send_body=send_body)
        else:
            self._error(404, None, "Not found")

    def _api(self, segments: list[str], query: dict[str, list[str]]) -> None:
        repo, rest = self._split_repo(segments)
        if repo is None:
            return
        if not rest:
            self._model_info(repo, "main", query)
        elif rest[0] == "revision" and len(rest) == 2:
            self._model_info(repo, unquote(rest[1]), query)
        elif rest[0] == "tree" and len(rest) >= 2:
            self._tree(repo, unquote(rest[1]), unquote("/".join(rest[2:])), query)
        else:
            self._error(404, None, "Not found")

    def _split_repo(self, segments: list[str]) -> tuple[HostedRepo | None, list[str]]:
        """The repo a path names (``owner/name`` or ``name``) and the segments after it."""
        two_parts = "/".join(segments[:2])
        if len(segments) >= 2 and two_parts in self.hub.repos:
            return self.hub.repos[two_parts], segments[2:]
        if segments[0] in self.hub.repos:
            return self.hub.repos[segments[0]], segments[1:]
        self._repo_not_found()
        return None, []

    # --- API answers ---

    def _model_info(self, repo: HostedRepo, revision: str, query: dict[str, list[str]]) -> None:
        commit = self._resolve(repo, revision)
        if commit is None:
            return
        with_blobs = query.get("blobs", ["false"])[0].lower() in ("true", "1")
        siblings = []
        for hosted in repo.commits[commit].values():
            sibling: dict[str, Any] = {"rfilename": hosted.path}
            if with_blobs:
                sibling.update(size=hosted.size, blobId=hosted.blob_id)
                if hosted.sha256:
                    sibling["lfs"] = {"size": hosted.size, "sha256": hosted.sha256, "pointerSize": 134}
            siblings.append(sibling)
        self._json(
            {
                "_id": commit[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "sha": commit,
                "private": False,
                "disabled": False,
                "gated": "manual" if repo.repo_id in self.hub.gated else False,
                "tags": [],
                "siblings": siblings,
                "lastModified": "2025-01-01T00:00:00.000Z",
                "createdAt": "2025-01-01T00:00:00.000Z",
            }
        )

    def _tree(self, repo: HostedRepo, revision: str, folder: str, query: dict[str, list[str]]) -> None:
        commit = self._resolve(repo, revision)
        if commit is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for hosted in repo.commits[commit].values():
            if not hosted.path.startswith(prefix):
                continue
            parts = hosted.path[len(prefix) :].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                folder_path = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    entries[folder_path] = {
                        "type": "directory",
                        "oid": _folder_oid(folder_path),
                        "path": folder_path,
                    }
            if recursive or len(parts) == 1:
                entry: dict[str, Any] = {
                    "type": "file",
                    "oid": hosted.blob_id,
                    "size": hosted.size,
                    "path": hosted.path,
                }
                if hosted.sha256:
                    entry["lfs"] = {"oid": hosted.sha256, "size": hosted.size, "pointerSize": 134}
                entries[hosted.path] = entry
        self._json([entries[path] for path in sorted(entries)])

    # --- Files ---

    def _file(self, repo_id: str, revision: str, filename: str, *, send_body: bool) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._repo_not_found()
            return
        if not self._may_download(repo_id):
            return
        commit = self._resolve(repo, revision)
        if commit is None:
            return
        hosted = repo.commits[commit].get(filename)
        if hosted is None:
            self._error(404, "EntryNotFound", f'{filename} does not exist on "{revision}"', commit=commit)
            return
        start, end = 0, hosted.size - 1
        range_header = self.headers.get("Range")
        status = 200
        if range_header:
            parsed = _parse_range(range_header, hosted.size)
            if parsed is None:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{hosted.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.hub._record(ServedRequest(self.command, repo_id, filename, range_header, 416, 0))
                return
            (start, end), status = parsed, 206
        length = max(end - start + 1, 0)
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hosted.etag}"')
        if hosted.sha256:
            self.send_header("X-Linked-Etag", f'"{hosted.sha256}"')
            self.send_header("X-Linked-Size", str(hosted.size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length if send_body else hosted.size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{hosted.size}")
        self.end_headers()
        sent = self._send_file_body(hosted, start, length, repo_id) if send_body else 0
        self.hub._record(ServedRequest(self.command, repo_id, filename, range_header, status, sent))

    def _send_file_body(self, hosted: HostedFile, start: int, length: int, repo_id: str) -> int:
        """Send ``length`` bytes from ``start``, at the throttled rate; return how many went out."""
        rate = self.hub.throttle_bytes_per_second
        began = time.monotonic()
        sent = 0
        with hosted.location.open("rb") as file:
            file.seek(start)
            while sent < length:
                piece = file.read(min(SEND_SLICE_BYTES, length - sent))
                if not piece:
                    break
                try:
                    self.wfile.write(piece)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client hung up (a cancelled download)
                    break
                sent += len(piece)
                self.hub._count(repo_id, hosted.path, len(piece))
                if rate:
                    ahead = sent / rate - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)
        return sent

    def _may_download(self, repo_id: str) -> bool:
        """Whether the request may read ``repo_id``'s files; answers 401/403 ``GatedRepo`` when not."""
        required = self.hub.gated.get(repo_id)
        if required is None:
            return True
        given = self.headers.get("Authorization", "")
        if given == f"Bearer {required}":
            return True
        if not given:
            self._error(
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated.",
            )
        else:
            self._error(
                403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in the list."
            )
        return False

    def _resolve(self, repo: HostedRepo, revision: str) -> str | None:
        commit = repo.resolve(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    # --- Responses ---

    def _repo_not_found(self) -> None:
        # The Hub answers 401 to anonymous requests for unknown repos (it might be private), 404 otherwise.
        status = 404 if self.headers.get("Authorization") else 401
        self._error(status, "RepoNotFound", "Repository not found")

    def _json(self, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, error_code: str | None, message: str, *, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if error_code:
            self.send_header("X-Error-Code", error_code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """Inclusive ``(start, end)`` of a single ``bytes=`` range, clamped to the file; None if unsatisfiable."""
    match = _RANGE.fullmatch(header.strip())
    if match is None or not any(match.groups()):
        return None
    first, last = match.groups()
    if not first:  # the last N bytes
        start, end = max(size - int(last), 0), size - 1
    else:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        return None
    return start, end


def _digests(path: Path) -> tuple[str, str]:
    """The git blob id (sha1 of ``blob <size>\\0`` + content) and the sha256 of a file."""
    blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    content = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1024 * 1024), b""):
            blob.update(chunk)
            content.update(chunk)
    return blob.hexdigest(), content.hexdigest()


def _folder_oid(path: str) -> str:
    return hashlib.sha1(f"tree {path}".encode(), usedforsecurity=False).hexdigest()
