"""Jobs: an extraction, an SAE's training, a feature analysis, a steering vector, an attribution
graph. :meth:`Job.wait` polls the row (a tqdm progress bar when tqdm is installed and ``progress``
is on) until it ends, and raises :class:`~mistudio_client.errors.JobFailed` with the job's error
code when it did not complete; :meth:`Job.cancel`; reattach to a running job with
``client.job(id)``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mistudio_client.errors import JobFailed, MistudioError

if TYPE_CHECKING:
    from mistudio_client.client import Cache, Client

# kind -> (the row's API path, its cancel path); an id's prefix names its kind.
_KINDS = {
    "extraction": ("extractions/{id}", "extractions/{id}/cancel"),
    "sae": ("saes/{id}", "saes/{id}/cancel"),
    "graph": ("graphs/{id}", "graphs/{id}/cancel"),
    "vector": ("steering-vectors/{id}", "steering-vectors/{id}/cancel"),
    "sae_group": ("saes/groups/{id}", "saes/groups/{id}/cancel"),
}
_PREFIXES = {"ext": "extraction", "sae": "sae", "ag": "graph", "sv": "vector", "grp": "sae_group"}
ACTIVE = ("queued", "running")


class Job:
    """A job row on the server, by kind and id."""

    def __init__(self, client: Client, kind: str, job_id: str, state: dict[str, Any] | None = None) -> None:
        if kind not in _KINDS:
            raise MistudioError(f"Unknown kind of job {kind!r}.")
        self.client, self.kind, self.id = client, kind, job_id
        self.state: dict[str, Any] = state or {}

    @classmethod
    def for_id(cls, client: Client, job_id: str) -> Job:
        kind = _PREFIXES.get(job_id.split("_", 1)[0])
        if kind is None:
            raise MistudioError(
                f"{job_id!r} is not the id of a job this client follows ({', '.join(_PREFIXES)}_…)."
            )
        return cls(client, kind, job_id)

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

    def refresh(self) -> dict[str, Any]:
        if not self._finished:
            self.state = self.client.request("GET", _KINDS[self.kind][0].format(id=self.id))
        return self.state

    def cancel(self) -> dict[str, Any]:
        self.state = self.client.request("POST", _KINDS[self.kind][1].format(id=self.id), json={})
        return self.state

    def wait(self, *, timeout: float = 24 * 3600, interval: float = 0.5, progress: bool = True) -> Job:
        """Poll until the job ends; raise :class:`JobFailed` unless it completed."""
        bar = _progress_bar(f"{self.kind} {self.id}") if progress else None
        deadline = time.monotonic() + timeout
        try:
            while True:
                state = self.refresh()
                if bar is not None:
                    bar.n = float(state.get("progress") or 0)
                    bar.refresh()
                if state.get("status") not in ACTIVE:
                    break
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

    def cache(self) -> Cache:
        """An extraction's cache (after :meth:`wait`)."""
        from mistudio_client.client import Cache

        cache_id = self.state.get("cache_id")
        if not cache_id:
            raise MistudioError(f"{self!r} has no cache (yet).")
        return Cache(self.client, self.client.request("GET", f"activation-caches/{cache_id}"))


def _progress_bar(description: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=100, desc=description, unit="%", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}%")
