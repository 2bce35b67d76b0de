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
* **Time slices.** A job that has run ``JOB_QUANTUM_SECONDS`` while another user's row waits for
  its worker, or any job while a model load waits for it (a person waits on a load), yields at its
  next checkpoint (:meth:`JobContext.should_yield`, :meth:`JobContext.checkpoint_saved`): the row
  goes back to ``queued`` behind the other owners (:func:`job_yield`) and later resumes from what
  it saved, as after a worker restart. A kind that cannot checkpoint never yields.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone
from django.utils.module_loading import import_string

from mistudio.errors import ApplicationError
from mistudio.jobs import (
    DAY,
    JobRow,
    JobStatus,
    add_token,
    job_discard,
    job_fail,
    job_kinds,
    job_publish,
    job_submit,
)
from mistudio.redis_client import get_redis, reset_redis_pools
from mistudio.structured_logging import job_context
from mistudio.worker_clock import CLOCK
from mistudio.workers import (
    IDLE_WORKER_GRACE_SECONDS,
    WorkerIdentity,
    current_worker,
    loads_waiting,
    queue_by_name,
    serve_interactive,
    shared_queue,
    worker_queue,
    worker_task,
)

logger = logging.getLogger(__name__)

CANCEL_POLL_SECONDS = 0.2  # how often a running job asks Redis whether it was cancelled
INTERACTIVE_POLL_SECONDS = 0.02  # how often it looks for interactive work waiting for its worker
YIELD_POLL_SECONDS = 1.0  # how often it looks whether it should yield (database and Redis reads)


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


def worker_job_queues(worker_name: str) -> list[str]:
    """The queues whose rows ``worker_name`` runs: its own and the shared one."""
    return [worker_queue(worker_name).name, shared_queue().name]


def _queued(model: type[JobRow], queue_names: list[str]):
    return model.jobs().filter(status=JobStatus.QUEUED, queue_name__in=queue_names)


def _waiting(queue_names: list[str]) -> list[_Waiting]:
    waiting = []
    for kind in job_kinds():
        rows = _queued(kind.model, queue_names).order_by("created_at")
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
    """Claim, for a token taken off ``queue_name``, the fairest queued row among those
    ``worker_name`` runs (its own queue's and the shared queue's: one round robin over both, so a
    row that yielded on one queue goes behind another owner's row on the other); now ``running``.
    None when none waits. A row another worker claimed first is skipped. A row of the other queue
    leaves the token's queue a token again, for the row it would have run."""
    redis_client = get_redis()
    for _ in range(10):
        waiting = _waiting(worker_job_queues(worker_name))
        if not waiting:
            return None
        served = {key.decode(): float(value) for key, value in redis_client.hgetall(served_key()).items()}
        chosen = fairest(waiting, served)
        claimed = chosen.model.objects.filter(pk=chosen.pk, status=JobStatus.QUEUED).update(
            status=JobStatus.RUNNING, host_worker=worker_name, updated_at=timezone.now()
        )
        if claimed:
            redis_client.hset(served_key(), _owner_key(chosen.owner_id), time.time())
            row = chosen.model.objects.get(pk=chosen.pk)
            if row.queue_name != queue_name:
                add_token(queue_by_name(queue_name))
            return row
    return None


def waiting_owners() -> set[int | None]:
    """The owners of the rows waiting for this worker (its own queue and the shared one): the
    worker's ``batch_owners`` hook (``mistudio.workers.batch_turn``)."""
    return {entry.owner_id for entry in _waiting(worker_job_queues(current_worker().name))}


def others_waiting(row: JobRow, *, worker_name: str) -> bool:
    """Whether another owner's row waits for ``worker_name`` (on its own or the shared queue), and
    has waited ``IDLE_WORKER_GRACE_SECONDS``: no idle worker took it."""
    cutoff = timezone.now() - timedelta(seconds=IDLE_WORKER_GRACE_SECONDS)
    for kind in job_kinds():
        rows = _queued(kind.model, worker_job_queues(worker_name)).filter(updated_at__lte=cutoff)
        if row.owner_id is None:
            rows = rows.filter(owner__isnull=False)
        else:
            rows = rows.exclude(owner_id=row.owner_id)
        if rows.exists():
            return True
    return False


def job_yield(row: JobRow, *, reason: str, ran_seconds: float) -> None:
    """The body saved its state and gave its worker up (``reason``: ``model_load`` or
    ``time_slice``): the row goes back to ``queued`` on its queue (after a time slice its owner
    counts as served now, so the fair claim runs the other owners' rows first), and resumes from
    what it saved, as after a worker restart. ``ran_seconds`` counts against its time limit."""
    redis_client = get_redis()
    if reason == "time_slice":  # made room for a model load: its owner was not served more
        redis_client.hset(served_key(), _owner_key(row.owner_id), time.time())
    key = _ran_key(row)
    redis_client.incrbyfloat(key, ran_seconds)
    redis_client.expire(key, 8 * DAY)
    logger.info("%s %s yields (%s) after %.1f s", row.noun, row.pk, reason, ran_seconds)
    job_submit(row, queue=queue_by_name(row.queue_name or settings.SHARED_QUEUE), yielded=reason)


def _ran_key(row: JobRow) -> str:
    """A Redis float: the seconds a row ran in its earlier slices (its time limit covers them all)."""
    return f"{settings.REDIS_KEY_PREFIX}:jobs:ran:{row.kind}:{row.pk}"


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


class JobYielded(Exception):
    """The body saved its state and gives its worker up (:meth:`JobContext.checkpoint_saved`):
    the wrapper puts the row back in the queue (:func:`job_yield`)."""


@dataclass
class JobContext:
    """What a running task body gets besides its row: its worker, and the questions to ask
    between steps (cancelled? time to yield?)."""

    row: JobRow
    worker: WorkerIdentity
    cancel_seen: bool = False
    started: float = field(default_factory=time.monotonic)
    yield_reason: str | None = None  # why it should yield, once it should
    _last_cancel_poll: float = 0.0
    _last_serve: float = 0.0
    _last_charge: float = field(default_factory=time.monotonic)
    _last_yield_poll: float = 0.0

    def should_cancel(self) -> bool:
        """Whether the row was cancelled (asked of Redis at most every ``CANCEL_POLL_SECONDS``).

        Call it between steps, where no hook is attached to the model and no transaction is open:
        it first serves the interactive work waiting for this worker (generation, encoding,
        patching, the lens) when it is that work's turn (``mistudio.workers.interactive_turn``:
        whoever had less of the worker's time goes first), so that it never waits for this job to
        end, nor takes all of its time.
        """
        now = time.monotonic()
        CLOCK.charge(now - self._last_charge, [self.row.owner_id])  # the job's own steps
        self._last_charge = now
        if now - self._last_serve >= INTERACTIVE_POLL_SECONDS and not connection.in_atomic_block:
            serve_interactive(self.worker, owner=self.row.owner_id)
            # Time lent to interactive work was charged to its owners (mistudio.worker_clock).
            self._last_serve = self._last_charge = time.monotonic()
        if not self.cancel_seen and now - self._last_cancel_poll >= CANCEL_POLL_SECONDS:
            self._last_cancel_poll = now
            self.cancel_seen = bool(get_redis().exists(self.row.cancel_key))
        return self.cancel_seen

    def check_cancel(self) -> None:
        """Raise :class:`JobCancelled` if the row was cancelled."""
        if self.should_cancel():
            raise JobCancelled

    def should_yield(self) -> bool:
        """Whether the body should save its state now and give its worker up: a model load waits
        for this worker (a person waits on it; no quantum), or the job has run
        ``JOB_QUANTUM_SECONDS`` in this slice and another owner's row waits for this worker.
        Asked of Redis and the database at most every ``YIELD_POLL_SECONDS``.

        A body that checkpoints passes it to its engine as ``checkpoint_due`` (a checkpoint at the
        next step when it says so) and calls :meth:`checkpoint_saved` after every save.
        """
        now = time.monotonic()
        if self.yield_reason is None and now - self._last_yield_poll >= YIELD_POLL_SECONDS:
            self._last_yield_poll = now
            quantum = settings.JOB_QUANTUM_SECONDS
            if loads_waiting(shared_queue(), grace_seconds=IDLE_WORKER_GRACE_SECONDS):
                self.yield_reason = "model_load"
            elif (
                quantum
                and now - self.started >= quantum
                and others_waiting(self.row, worker_name=self.worker.name)
            ):
                self.yield_reason = "time_slice"
        return self.yield_reason is not None

    def checkpoint_saved(self) -> None:
        """The body's state is saved (it resumes from there): yield now if it should, raising
        :class:`JobYielded` (the wrapper requeues the row)."""
        if self.should_yield():
            raise JobYielded


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


def job_start(row: JobRow, *, worker_name: str) -> None:
    """``running`` on ``worker_name``, saved and announced as ``<kind>:started`` before the body runs
    (each time it runs: a resumed row starts again). The claim already wrote the status; this adds
    its start time and tells the row's watchers. What a kind learns only once it runs (its totals,
    where it resumed from) its body saves and announces as progress."""
    job_publish(row, "started", JobRow.mark_running(row, host_worker=worker_name))


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
                job_start(row, worker_name=job.worker.name)
                ran_before = float(get_redis().get(_ran_key(row)) or 0)
                with time_limit(limit - ran_before):
                    body(row, job)
            except Requeued:
                return
            except JobYielded:
                job_yield(
                    row, reason=job.yield_reason or "time_slice", ran_seconds=time.monotonic() - job.started
                )
                return
            except JobCancelled:
                job_discard(row)
            except JobTimeLimit:
                # The limit's exception may have landed anywhere, a Redis pool's lock included.
                reset_redis_pools()
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
