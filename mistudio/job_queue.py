"""Where a queued job stands: its place in line, what runs and waits ahead of it, and when it may start.

The scheduler (:mod:`mistudio.job_runner`) gives a worker the fairest queued row of its lanes (its
own queue and the shared one): the oldest row of the owner served longest ago. The line is that
choice repeated over the rows waiting now, until the row comes up; ahead of it are also the rows
running on the workers it may run on (its queue's worker, or for the shared queue every worker).
What the caller may not see is shown by its kind alone ("another user's analysis"). The start is
estimated from the ETAs of what runs and waits ahead: unknown when any of them has none.
"""

from __future__ import annotations

from typing import Any

from mistudio.access import may_see
from mistudio.job_runner import _owner_key, _waiting, fairest, served_key, worker_job_queues
from mistudio.jobs import JobRow, JobStatus, job_kinds
from mistudio.redis_client import get_redis
from mistudio.workers import read_heartbeats, shared_queue

SHOWN_AHEAD = 20  # entries listed ahead of a row (its position counts them all)


def _entry(row: JobRow, viewer, *, status: str) -> dict[str, Any]:
    """One job ahead, as ``viewer`` may see it: its kind always; its id and owner only if theirs to see."""
    visible = may_see(viewer, type(row), row.pk)
    mine = visible and getattr(viewer, "pk", None) is not None and row.owner_id == viewer.pk
    owner = "you" if mine else (row.owner.username if visible and row.owner_id else "another user")
    return {
        "kind": row.noun,
        "id": row.pk if visible else None,
        "owner": owner,
        "status": status,
        "eta_seconds": row.eta_seconds,
    }


def _live_workers() -> list[str]:
    return [beat["name"] for beat in read_heartbeats()]


def _running_on(workers: list[str]) -> list[JobRow]:
    """The rows of every kind running on ``workers`` now."""
    return [
        found
        for kind in job_kinds()
        for found in kind.model.jobs()
        .filter(status=JobStatus.RUNNING, host_worker__in=workers)
        .select_related("owner")
    ]


def queue_position(row: JobRow, *, viewer) -> dict[str, Any] | None:
    """``{position, ahead: [...], running: [...], starts_in_seconds}`` for a queued ``row`` (None
    otherwise): ``position`` 1 is next; ``starts_in_seconds`` None when some job ahead has no ETA."""
    if not isinstance(row, JobRow) or row.status != JobStatus.QUEUED or not row.queue_name:
        return None  # running or ended, or a row that is not scheduled as a job (a generation)
    shared = shared_queue().name
    if row.queue_name == shared:
        workers = _live_workers()
        lanes = sorted({name for worker in workers for name in worker_job_queues(worker)} | {shared})
    else:
        worker = row.queue_name.rsplit(".", 1)[-1]
        workers, lanes = [worker], worker_job_queues(worker)
    waiting = _waiting(lanes)
    served = {key.decode(): float(value) for key, value in get_redis().hgetall(served_key()).items()}
    ahead: list[JobRow] = []
    turn = max(served.values(), default=0.0)
    while waiting:
        chosen = fairest(waiting, served)
        if chosen.pk == row.pk and chosen.model is type(row):
            break
        waiting.remove(chosen)
        turn += 1.0
        served[_owner_key(chosen.owner_id)] = turn  # as the claim marks its owner served
        ahead.append(chosen)
    rows = [entry.model.objects.select_related("owner").get(pk=entry.pk) for entry in ahead[:SHOWN_AHEAD]]
    running = _running_on(workers)
    known = [each.eta_seconds for each in [*running, *rows]]
    per_worker = max(1, len(workers))
    starts = None if any(eta is None for eta in known) or len(ahead) > len(rows) else sum(known) / per_worker
    return {
        "position": len(ahead) + 1,
        "ahead": [_entry(each, viewer, status="queued") for each in rows],
        "running": [_entry(each, viewer, status="running") for each in running],
        "workers": len(workers),
        "starts_in_seconds": round(starts, 1) if starts is not None else None,
    }


def running_jobs(*, viewer) -> dict[str, Any]:
    """What the live workers run now (``running``, as :func:`queue_position` lists it): what a
    queued model load waits for (the running job yields to it at its next checkpoint)."""
    workers = _live_workers()
    running = [_entry(found, viewer, status="running") for found in _running_on(workers)]
    return {
        "position": None, "ahead": [], "running": running, "workers": len(workers), "starts_in_seconds": None,
    }  # fmt: skip
