"""Jobs: an extraction, an SAE's training, a steering vector, an attribution graph, a group of SAEs.

:meth:`Job.wait` follows the job until it ends (a tqdm progress bar when tqdm is installed and
``progress`` is on): from the server's WebSocket events (``/ws/events/``, with the ``live`` extra's
``websockets``), or by polling the row when the socket cannot be opened (a proxy that blocks
WebSockets, no ``websockets`` installed) or misses an event. It raises
:class:`~mistudio_client.errors.JobFailed` with the job's error code when the job did not
complete. :meth:`Job.cancel`; reattach to a running job with ``client.job(id)``."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from mistudio_client.errors import JobFailed, MistudioError

if TYPE_CHECKING:
    from mistudio_client.arrays import Cache
    from mistudio_client.client import Client

# The kinds of job, their id prefixes and paths come from the server (``Client.job_kinds``). An
# analysis's and an explanation job's paths go through their SAE (``sae``: the ``sae_id`` parameter).
SAE_PARAMETER = "sae_id"
ACTIVE = ("queued", "running")

# Seconds without an event after which the row is read over REST (an event lost on the way).
EVENT_SILENCE = 15.0


def _through_sae(entry: dict[str, str]) -> bool:
    """Whether a kind's rows are reached through their SAE (an SAE's own id is not such a parent)."""
    return entry["id_parameter"] != SAE_PARAMETER and f"{{{SAE_PARAMETER}}}" in entry["path"]


class Job:
    """A job row on the server, by kind and id."""

    def __init__(
        self,
        client: Client,
        kind: str,
        job_id: str,
        state: dict[str, Any] | None = None,
        *,
        sae: str | None = None,
    ) -> None:
        kinds = client.job_kinds()
        if kind not in kinds:
            raise MistudioError(f"Unknown kind of job {kind!r} (the server has {', '.join(kinds)}).")
        if _through_sae(kinds[kind]) and not sae:
            raise MistudioError(f"A {kind} job is reached through its SAE: pass sae=.")
        self.client, self.kind, self.id, self.sae = client, kind, job_id, sae
        self.state: dict[str, Any] = state or {}

    @classmethod
    def for_id(cls, client: Client, job_id: str, *, sae: str | None = None) -> Job:
        prefixes = {entry["id_prefix"]: kind for kind, entry in client.job_kinds().items()}
        kind = prefixes.get(job_id.split("_", 1)[0])
        if kind is None:
            raise MistudioError(f"{job_id!r} is not the id of a job ({', '.join(prefixes)}_…).")
        return cls(client, kind, job_id, sae=sae)

    def _path(self, which: str) -> str:
        """The row's ``path`` or ``cancel_path`` under ``/api/``."""
        entry = self.client.job_kinds()[self.kind]
        return entry[which].format(**{SAE_PARAMETER: self.sae, entry["id_parameter"]: self.id})

    @classmethod
    def done(cls, client: Client, kind: str, job_id: str | None, answer: dict[str, Any]) -> Job:
        """A job the server answered at once (an extraction whose cache exists)."""
        job = cls(client, kind, job_id or "", {**answer, "status": "completed"})
        job._finished = True
        return job

    _finished = False

    def __repr__(self) -> str:
        return f"Job({self.kind} {self.id}: {self.status})"

    @property
    def status(self) -> str:
        return self.state.get("status", "unknown")

    @property
    def queue(self) -> dict[str, Any] | None:
        """Where the job stands while queued, read now: ``position`` (1: next), what is ``running``
        and waiting ``ahead`` of it (another user's by its kind alone), ``starts_in_seconds`` (None:
        unknown); None once it runs."""
        return self.refresh().get("queue")

    def refresh(self) -> dict[str, Any]:
        if not self._finished:
            self.state = self.client.request("GET", self._path("path"))
        return self.state

    def cancel(self) -> dict[str, Any]:
        self.state = self.client.request("POST", self._path("cancel_path"), json={})
        return self.state

    def wait(
        self,
        *,
        timeout: float = 24 * 3600,
        interval: float = 0.5,
        progress: bool = True,
        events: bool = True,
    ) -> Job:
        """Follow the job until it ends (its events, else polling every ``interval`` s); raise
        :class:`JobFailed` unless it completed, ``TimeoutError`` after ``timeout`` s (the job goes on)."""
        bar = _progress_bar(f"{self.kind} {self.id}") if progress else None
        deadline = time.monotonic() + timeout

        def show(state: dict[str, Any]) -> bool:
            """Record ``state``; True once the job has ended."""
            self.state = state
            if bar is not None:
                bar.n = float(state.get("progress") or 0)
                bar.set_postfix_str(_where(state), refresh=False)
                bar.refresh()
            return state.get("status") not in ACTIVE

        try:
            if self._finished:
                show(self.state)
            elif events and self._follow_events(show, deadline):
                show(self.refresh())  # the row is the truth: the final state as REST answers it
            else:
                while not show(self.refresh()):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self!r} is still {self.status} (it goes on on the server)")
                    time.sleep(interval)
        finally:
            if bar is not None:
                bar.close()
        if self.status != "completed":
            raise JobFailed(
                self.kind,
                self.id,
                self.status,
                self.state.get("error_code") or self.status.upper(),
                self.state.get("error_message") or "",
            )
        return self

    def _follow_events(self, show, deadline: float) -> bool:
        """Follow the job's event group until it ends: True; False when the socket cannot be opened
        or fails, or an event was missed (the caller then polls). ``TimeoutError`` past ``deadline``."""
        try:
            from websockets.exceptions import WebSocketException
            from websockets.sync.client import connect
        except ImportError:
            return False
        url = self.client.url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        group = f"{self.kind}.{self.id}"
        try:
            with connect(
                f"{url}/ws/events/",
                additional_headers={"Authorization": self.client._http.headers["Authorization"]},
                open_timeout=10,
                max_size=2**22,
            ) as socket:
                socket.send(json.dumps({"action": "subscribe", "groups": [group]}))
                sequence = None
                while time.monotonic() < deadline:
                    try:
                        message = json.loads(
                            socket.recv(timeout=min(EVENT_SILENCE, deadline - time.monotonic()))
                        )
                    except TimeoutError:
                        if show(self.refresh()):  # quiet for a while: check the row itself
                            return True
                        continue
                    if message.get("group") != group or message.get("type") not in ("snapshot", "event"):
                        return False  # an error (UNKNOWN_GROUP) or a skip: poll instead
                    seq = message.get("seq") or 0
                    if sequence is not None and seq <= sequence:
                        continue  # sent while subscribing: the snapshot already holds it
                    if sequence is not None and seq > sequence + 1:
                        return False  # an event was missed
                    sequence = seq
                    if show(message["data"]):
                        return True
                raise TimeoutError(f"{self!r} is still {self.status} (it goes on on the server)")
        except (OSError, WebSocketException):
            return False

    def cache(self) -> Cache:
        """An extraction's cache (after :meth:`wait`)."""
        cache_id = self.state.get("cache_id")
        if not cache_id:
            raise MistudioError(f"{self!r} has no cache (yet).")
        return self.client.caches.get(cache_id)


def _progress_bar(description: str):
    """One bar updated in place: tqdm's (its notebook widget where ipywidgets is installed); in a
    notebook without ipywidgets, one display line updated in place (tqdm's text bar there printed
    a line per update)."""
    if _in_notebook() and not _has_widgets():
        return _NotebookLine(description)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(
        total=100, desc=description, unit="%", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}% {postfix}"
    )


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _has_widgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class _NotebookLine:
    """A progress line in a notebook cell, drawn once and updated in place (``display_id``)."""

    def __init__(self, description: str) -> None:
        from IPython.display import display

        self.description, self.n, self.postfix = description, 0.0, ""
        self.handle = display(self._text(), display_id=True)

    def _text(self):
        from IPython.display import Pretty

        filled = int(self.n / 100 * 20)
        return Pretty(
            f"{self.description}: [{'#' * filled}{'.' * (20 - filled)}] {self.n:.0f}% {self.postfix}"
        )

    def set_postfix_str(self, postfix: str, refresh: bool = True) -> None:
        self.postfix = postfix
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        self.handle.update(self._text())

    def close(self) -> None:
        self.refresh()


def _where(state: dict[str, Any]) -> str:
    """A bar's postfix: the status, and while queued its place in line when the state says it."""
    place = (state.get("queue") or {}).get("position")
    status = state.get("status", "")
    return f"queued, #{place} in line" if status == "queued" and place else status
