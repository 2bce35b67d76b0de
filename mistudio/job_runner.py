"""Running job rows on a worker (``mistudio.jobs`` holds the rows and their lifecycle).

* **Fair claims.** A token's task (:func:`run_next_job`) claims the fairest queued row of its
  queue (:func:`claim_next`): the oldest row of the owner served longest ago — round robin
  between users, first come first served within one user's rows. Any token runs any row, so a
  token left by a cancelled row is a harmless no-op.
* **One task wrapper** (:func:`job_task`): a kind's task body does the work and completes the
  row; the wrapper holds the rest — the idempotency check, the worker's memory check, the time
  limit declared beside the body, and the ``except`` chain (cancelled → ``cancelled``, its
  model elsewhere → requeued, any error → ``failed`` with its code).
* **Interactive work is never stuck behind a job.** A task body asks
  :meth:`JobContext.should_cancel` between its steps; that call also serves the generation and
  worker calls waiting for this worker (:func:`mistudio.workers.serve_interactive`), with no
  hooks attached to the model at that moment.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone
from django.utils.module_loading import import_string

from mistudio.errors import ApplicationError
from mistudio.jobs import DAY, JobRow, JobStatus, job_discard, job_fail, job_kinds
from mistudio.redis_client import get_redis
from mistudio.structured_logging import job_context
from mistudio.workers import WorkerIdentity, current_worker, serve_interactive, worker_task

logger = logging.getLogger(__name__)

CANCEL_POLL_SECONDS = 0.2  # how often a running job asks Redis whether it was cancelled
INTERACTIVE_POLL_SECONDS = 0.02  # how often it looks for interactive work waiting for its worker


def _owner_key(owner_id: int | None) -> str:
    return f"user:{owner_id}" if owner_id is not None else "system"


def served_key() -> str:
    """A Redis hash: owner → when a job of theirs was last claimed (round robin between owners)."""
    return f"{settings.REDIS_KEY_PREFIX}:jobs:served"


@dataclass(order=True)
class _Waiting:
    created_at: Any
    pk: str = field(compare=False)
    owner_id: int | None = field(compare=False)
    model: type[JobRow] = field(compare=False)


def _waiting(queue_name: str) -> list[_Waiting]:
    waiting = []
    for kind in job_kinds():
        rows = kind.model.jobs().filter(status=JobStatus.QUEUED, queue_name=queue_name).order_by("created_at")
        for pk, owner_id, created_at in rows.values_list("pk", "owner_id", "created_at")[:500]:
            waiting.append(_Waiting(created_at=created_at, pk=pk, owner_id=owner_id, model=kind.model))
    return sorted(waiting)


def fairest(waiting: list[_Waiting], served: dict[str, float]) -> _Waiting:
    """The next row to run: the oldest of the owner served longest ago (never served: first),
    ties going to the owner whose oldest row waited longest."""
    oldest_by_owner: dict[int | None, _Waiting] = {}
    for entry in waiting:  # sorted oldest first
        oldest_by_owner.setdefault(entry.owner_id, entry)
    return min(
        oldest_by_owner.values(),
        key=lambda entry: (served.get(_owner_key(entry.owner_id), 0.0), entry.created_at),
    )


def claim_next(queue_name: str, *, worker_name: str) -> JobRow | None:
    """Claim the fairest queued row of ``queue_name`` for ``worker_name`` (now ``running``), or
    None when none waits. A row another worker claimed first is skipped."""
    redis_client = get_redis()
    for _ in range(10):
        waiting = _waiting(queue_name)
        if not waiting:
            return None
        served = {key.decode(): float(value) for key, value in redis_client.hgetall(served_key()).items()}
        chosen = fairest(waiting, served)
        claimed = chosen.model.objects.filter(pk=chosen.pk, status=JobStatus.QUEUED).update(
            status=JobStatus.RUNNING, host_worker=worker_name, updated_at=timezone.now()
        )
        if claimed:
            redis_client.hset(served_key(), _owner_key(chosen.owner_id), time.time())
            return chosen.model.objects.get(pk=chosen.pk)
    return None


@worker_task(timeout=8 * DAY)  # the row's own kind's limit (``job_task``) applies inside
def run_next_job(queue_name: str) -> None:
    """A token's task: run the fairest queued row of ``queue_name`` on this worker, if any."""
    close_old_connections()
    identity = current_worker()
    row = claim_next(queue_name, worker_name=identity.name)
    if row is None:
        return
    task = import_string(row.task_name())
    task.run(row)


# --- the task wrapper --------------------------------------------------------------------------


class JobCancelled(Exception):
    """The row was cancelled: the wrapper marks it ``cancelled``."""


class Requeued(Exception):
    """The row went back to a queue (its model is hosted by another worker): nothing to mark."""


class JobTimeLimit(BaseException):
    """The body ran past its kind's time limit (a BaseException: no ``except Exception`` on the
    way, in the engine or around interactive work served meanwhile, can swallow it)."""


@dataclass
class JobContext:
    """What a running task body gets besides its row: its worker, and the question to ask
    between steps."""

    row: JobRow
    worker: WorkerIdentity
    cancel_seen: bool = False
    _last_cancel_poll: float = 0.0
    _last_serve: float = 0.0

    def should_cancel(self) -> bool:
        """Whether the row was cancelled (asked of Redis at most every ``CANCEL_POLL_SECONDS``).

        Call it between steps, where no hook is attached to the model and no transaction is open:
        it first serves the interactive work waiting for this worker (generation, encoding,
        patching, the lens), so that it never waits for this job to end.
        """
        now = time.monotonic()
        if now - self._last_serve >= INTERACTIVE_POLL_SECONDS and not connection.in_atomic_block:
            serve_interactive(self.worker)
            self._last_serve = time.monotonic()
        if not self.cancel_seen and now - self._last_cancel_poll >= CANCEL_POLL_SECONDS:
            self._last_cancel_poll = now
            self.cancel_seen = bool(get_redis().exists(self.row.cancel_key))
        return self.cancel_seen

    def check_cancel(self) -> None:
        """Raise :class:`JobCancelled` if the row was cancelled."""
        if self.should_cancel():
            raise JobCancelled


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`JobTimeLimit` in this thread once ``seconds`` have passed (RQ's death
    penalties: SIGALRM in the main thread, a timer elsewhere)."""
    from rq.timeouts import TimerDeathPenalty, UnixSignalDeathPenalty

    main = threading.current_thread() is threading.main_thread()
    penalty = UnixSignalDeathPenalty if main else TimerDeathPenalty
    with penalty(max(1, int(seconds)), JobTimeLimit):
        yield


def check_worker_memory(row: JobRow) -> None:
    """The worker's own check before a row starts: its estimate must fit what this worker's
    compute device has free now (507 ``INSUFFICIENT_MEMORY`` otherwise, and the row fails)."""
    from mistudio.budgets import worker_free_bytes

    free = worker_free_bytes(current_worker())
    if row.memory_estimate_bytes and row.memory_estimate_bytes > free:
        raise ApplicationError(
            "INSUFFICIENT_MEMORY",
            f"The {row.noun} needs about {row.memory_estimate_bytes / 2**30:.2f} GiB; its worker has "
            f"{free / 2**30:.2f} GiB free now.",
            details={"estimate_bytes": row.memory_estimate_bytes, "free_bytes": free},
            status=507,
        )


def job_task(
    model: type[JobRow], *, timeout: int, failure_code: str | None = None
) -> Callable[[Callable[[Any, JobContext], None]], Any]:
    """Make ``body(row, job)`` the task of ``model``'s rows, limited to ``timeout`` seconds (and
    ``JOB_MAX_SECONDS``). The body does the work and completes the row; the wrapper does the rest
    (see the module docstring): an unexpected error fails the row with ``failure_code`` (default:
    the kind's). The task takes a row id (RQ) or, as ``task.run(row)``, a row already claimed."""

    def decorate(body: Callable[[Any, JobContext], None]) -> Any:
        def run(row: JobRow) -> None:
            with job_context(job_id=row.pk):  # the row's id on every line logged meanwhile
                logger.info("%s %s starts on %s", row.noun, row.pk, current_worker().name)
                started = time.monotonic()
                _run(row)
                logger.info(
                    "%s %s ends %s after %.1f s", row.noun, row.pk, row.status, time.monotonic() - started
                )

        def _run(row: JobRow) -> None:
            job = JobContext(row=row, worker=current_worker())
            limit = min(timeout, settings.JOB_MAX_SECONDS) if settings.JOB_MAX_SECONDS else timeout
            try:
                if get_redis().exists(row.cancel_key):
                    raise JobCancelled
                check_worker_memory(row)
                with time_limit(limit):
                    body(row, job)
            except Requeued:
                return
            except JobCancelled:
                job_discard(row)
            except JobTimeLimit:
                job_fail(
                    row,
                    code="JOB_TIMEOUT",
                    message=f"The {row.noun} ran longer than its limit of {limit:,} s and was stopped.",
                )
            except Exception as error:
                if job.cancel_seen:  # the engine stopped on the cancel in its own way
                    job_discard(row)
                    return
                code, message = getattr(error, "code", None), getattr(error, "message", None)
                if not (isinstance(code, str) and isinstance(message, str)):
                    logger.exception("%s %s failed", row.noun, row.pk)
                    code = failure_code or model.failure_code
                    message = f"The {row.noun} failed: {type(error).__name__}."
                job_fail(row, code=code, message=message)

        @functools.wraps(body)
        def task(row_id: str) -> None:
            close_old_connections()
            row = model.objects.filter(pk=row_id).first()
            if row is not None and row.status in JobRow.ACTIVE:
                run(row)

        task.run = run
        task.timeout = timeout
        return task

    return decorate
