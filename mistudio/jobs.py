"""Long work as rows: one status machine, one lifecycle, fair scheduling, one task wrapper.

Every kind of long work — an extraction, an SAE's training or import, a feature analysis, a
steering vector, an SAE evaluation — is a row of a :class:`JobRow` subclass:

    queued ──claim──> running ──> completed | failed | cancelled
       ▲                 │
       └─── requeue ─────┘  (its model is on another worker; its worker restarted; it
                             yielded its worker at a checkpoint: a time slice, a model load)

* **Admission** (:func:`job_admit`): per-user and system caps on queued + running rows of every
  kind together, and a token budget, checked before a row is written (429 / 400). The memory
  budget is :mod:`mistudio.budgets`.
* **Scheduling: the rows are the queue.** Submitting a row puts a *token* on an RQ queue (the
  model's host worker's own queue, or the shared one); the worker that takes it claims the
  fairest queued row it runs (``mistudio.job_runner``: round robin between users), and a long
  job yields at a checkpoint to the others waiting (time slices).
* **One task wrapper** (``mistudio.job_runner.job_task``): a kind's task body does the work and
  completes the row; the wrapper holds the rest, and serves interactive work between steps.
* **Ending**: :func:`job_fail`, :func:`job_discard`, :func:`job_cancel`, and the resume of a
  starting worker's rows (:func:`jobs_resume_on_worker_start`).

A new kind is one subclass (its ``kind``, ``task``, ``noun`` and ``mark_*`` additions), one
``register_job_kind`` call in its app's ``ready`` (the row's JSON shape), and one task body.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone
from rq import Queue

from mistudio.access import check_may_change
from mistudio.errors import ApplicationError, rate_limited
from mistudio.events import publish, rows_audience
from mistudio.redis_client import get_redis
from mistudio.structured_logging import redact
from mistudio.text import check_label_text
from mistudio.transaction_locks import take_turns
from mistudio.workers import (
    WorkerIdentity,
    enqueue,
    queue_by_name,
    read_heartbeats,
    worker_queue,
)

if TYPE_CHECKING:
    from mistudio.job_apis import JobApi

logger = logging.getLogger(__name__)

DAY = 24 * 3600


class JobStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobRow(models.Model):
    """The abstract row of a kind of long work: status machine, owner, host, error, progress.

    A subclass names its ``kind`` (events ``<kind>:queued``…, group ``<kind>.<id>``), its
    ``task`` (the dotted path of its :func:`job_task` body; the web never imports it), its
    ``noun`` (for messages) and its ``failure_code`` (an unexpected error's code).
    """

    Status = JobStatus
    ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)

    kind: ClassVar[str]
    task: ClassVar[str]
    noun: ClassVar[str]
    failure_code: ClassVar[str]
    # What only the owner (or an admin) may change (``job_update``).
    OWNER_FIELDS: ClassVar[tuple[str, ...]] = ()

    status = models.CharField(
        max_length=20, choices=JobStatus.choices, default=JobStatus.QUEUED, db_index=True
    )
    progress = models.FloatField(default=0)
    eta_seconds = models.FloatField(null=True, blank=True)
    queue_name = models.CharField(max_length=255, blank=True, help_text="The RQ queue whose worker runs it")
    host_worker = models.CharField(max_length=255, blank=True)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    memory_estimate_bytes = models.BigIntegerField(
        default=0, help_text="Its estimated peak memory, checked before it was queued and before it starts"
    )
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True
        ordering = ["-created_at"]

    # --- what a kind may override ------------------------------------------------------------

    def task_name(self) -> str:
        """The dotted path of the task body that runs this row."""
        return self.task

    @classmethod
    def jobs(cls) -> models.QuerySet:
        """The rows that are jobs of their own: scheduled, counted against the caps, resumed (a
        kind whose rows may be parts of another job leaves those out)."""
        return cls.objects.all()

    def event_groups(self) -> list[str]:
        return [f"{self.kind}.{self.pk}"]

    def audience_rows(self) -> list[tuple[str, str]]:
        """The rows an event about this one is about (who may receive it: ``rows_audience``)."""
        return [(self.kind, self.pk)]

    def leftovers(self) -> list[Path]:
        """Files an unfinished row leaves behind; removed when it fails, is cancelled or deleted."""
        directory = getattr(self, "directory", None)
        return [directory] if directory is not None else []

    def release_leftovers(self) -> None:
        """Remove :meth:`leftovers` once the current transaction commits (never while it could roll
        back): when the row is deleted, and by default when it ends unfinished."""
        paths = self.leftovers()
        transaction.on_commit(lambda: [shutil.rmtree(path, ignore_errors=True) for path in paths])

    def on_ended(self) -> None:
        """What follows when the row ends ``failed`` or ``cancelled`` (its status and error are
        set): by default, what it left half-made goes."""
        self.release_leftovers()

    # --- the status machine: each returns the fields it changed ------------------------------

    def mark_queued(self, *, queue_name: str) -> list[str]:
        self.status, self.queue_name = JobStatus.QUEUED, queue_name
        return ["status", "queue_name"]

    def mark_running(self, *, host_worker: str) -> list[str]:
        self.status, self.host_worker = JobStatus.RUNNING, host_worker
        self.started_at = self.started_at or timezone.now()
        return ["status", "host_worker", "started_at"]

    def mark_completed(self) -> list[str]:
        self.status, self.progress, self.eta_seconds = JobStatus.COMPLETED, 100, None
        self.finished_at = timezone.now()
        return ["status", "progress", "eta_seconds", "finished_at"]

    def mark_failed(self, *, code: str, message: str) -> list[str]:
        # An error's text may quote what a server or a library said, credentials included (an
        # endpoint's answer to a bad key): it is stored and shown only with secrets redacted.
        self.status, self.error_code, self.error_message = JobStatus.FAILED, code, redact(message)
        self.finished_at, self.eta_seconds = timezone.now(), None
        return ["status", "error_code", "error_message", "finished_at", "eta_seconds"]

    def mark_cancelled(self) -> list[str]:
        self.status, self.finished_at, self.eta_seconds = JobStatus.CANCELLED, timezone.now(), None
        return ["status", "finished_at", "eta_seconds"]

    def elapsed_seconds(self) -> float:
        return (timezone.now() - self.started_at).total_seconds() if self.started_at else 0.0

    @property
    def cancel_key(self) -> str:
        return f"{settings.REDIS_KEY_PREFIX}:cancel:{self.kind}:{self.pk}"


# --- kinds ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobKind:
    model: type[JobRow]
    state: Callable[[Any], dict[str, Any]]  # the row's one JSON shape (API, events, snapshots)
    serializer: Any = None  # its output serializer: what the schema says its detail answers
    api: JobApi | None = None  # its HTTP edge (``mistudio.job_apis``)


_KINDS: dict[type[JobRow], JobKind] = {}


def register_job_kind(
    model: type[JobRow],
    *,
    state: Callable[[Any], dict[str, Any]],
    serializer: Any = None,
    api: JobApi | None = None,
) -> None:
    """Declare a kind of job (in its app's ``ready``): its rows are scheduled, resumed, counted
    against the caps and their files follow them from then on; with ``api``, its ``urls.py``
    routes its detail and cancel (``mistudio.job_apis.job_routes``)."""
    from django.db.models.signals import pre_delete

    _KINDS[model] = JobKind(model=model, state=state, serializer=serializer, api=api)
    pre_delete.connect(_files_follow_row, sender=model, dispatch_uid=f"job-files-{model._meta.label}")


def job_kinds() -> list[JobKind]:
    return list(_KINDS.values())


def job_kind(model: type[JobRow]) -> JobKind:
    """The registration of ``model``'s kind (LookupError when its app registered none)."""
    if model not in _KINDS:
        raise LookupError(f"{model.__name__} is not a registered kind of job.")
    return _KINDS[model]


def _files_follow_row(sender, instance: JobRow, **kwargs) -> None:
    """pre_delete of a job row, however it goes: what it left on disk goes once the deletion commits."""
    instance.release_leftovers()


# --- events ------------------------------------------------------------------------------------


def job_publish(row: JobRow, verb: str, fields: Iterable[str], **extra: Any) -> None:
    """Save ``fields`` of ``row`` and announce ``<kind>:<verb>`` with its state (on commit)."""
    publish(
        f"{row.kind}:{verb}",
        {**_KINDS[type(row)].state(row), **extra},
        groups=row.event_groups(),
        instance=row,
        fields=list(fields),
        audience=rows_audience(*row.audience_rows()),
    )


# --- admission ---------------------------------------------------------------------------------

# Any fixed 64-bit number: the PostgreSQL advisory lock new jobs take turns on at admission.
ADMISSION_LOCK = 0x6D69_5374_7564_696F  # "miStudio"
RETRY_AFTER_SECONDS = 30  # when no job holding a slot has an ETA yet


def active_jobs(*, owner=None) -> list[JobRow]:
    """Queued and running rows of every kind (of ``owner`` when given), oldest first."""
    rows: list[JobRow] = []
    for kind in job_kinds():
        active = kind.model.jobs().filter(status__in=JobRow.ACTIVE)
        rows += list(active.filter(owner=owner) if owner is not None else active)
    return sorted(rows, key=lambda row: row.created_at)


def job_admit(*, owner, tokens: int | None = None) -> None:
    """Refuse a new job while its owner or everyone has too many queued or running (429
    ``RATE_LIMITED``), or when it would process more than ``JOB_MAX_TOKENS`` tokens (400
    ``JOB_TOO_LARGE``).

    Caps: ``MAX_ACTIVE_JOBS_PER_USER`` for the owner (the operator's and system jobs have none),
    ``MAX_ACTIVE_JOBS`` for everyone; 0 turns a cap off. Call it inside the transaction that
    creates the row, just before: requests take turns here (an advisory lock on PostgreSQL;
    SQLite's transactions are already ``IMMEDIATE``), so two cannot both take the last slot.
    """
    if tokens is not None and settings.JOB_MAX_TOKENS and tokens > settings.JOB_MAX_TOKENS:
        raise ApplicationError(
            "JOB_TOO_LARGE",
            f"The job would process {tokens:,} tokens, more than the {settings.JOB_MAX_TOKENS:,} one job "
            "may (JOB_MAX_TOKENS).",
            details={"tokens": tokens, "limit": settings.JOB_MAX_TOKENS},
        )
    per_user, system = settings.MAX_ACTIVE_JOBS_PER_USER, settings.MAX_ACTIVE_JOBS
    if not per_user and not system:
        return
    take_turns(ADMISSION_LOCK)
    user = owner if getattr(owner, "is_authenticated", False) else None
    if per_user and user is not None:
        mine = active_jobs(owner=user)
        if len(mine) >= per_user:
            raise rate_limited(
                f"You have {len(mine)} jobs queued or running, the most allowed per user ({per_user}); "
                "send this one again when one of them ends.",
                retry_after_seconds=slot_retry_after(mine),
                details={
                    "scope": "user",
                    "limit": per_user,
                    "active_jobs": [{"kind": row.kind, "id": row.pk, "status": row.status} for row in mine],
                },
            )
    if system:
        everyone = active_jobs()
        if len(everyone) >= system:
            raise rate_limited(
                f"{len(everyone)} jobs are queued or running, the most allowed at once ({system}); "
                "send this one again when one of them ends.",
                retry_after_seconds=slot_retry_after(everyone),
                details={"scope": "system", "limit": system},  # other users' rows stay private
            )


def job_is_active(*, kind: str | None, job_id: str | None, owner) -> bool:
    """Whether ``owner``'s job of ``kind`` (``JobRow.kind``) and id ``job_id`` is queued or running:
    what a job's token (``mistudio.authentication``) is good for."""
    model = next((entry.model for entry in job_kinds() if entry.model.kind == kind), None)
    if model is None or not job_id:
        return False
    return model.jobs().filter(pk=job_id, owner=owner, status__in=JobRow.ACTIVE).exists()


def slot_retry_after(rows: list[JobRow]) -> float:
    """When a slot is likely to free: the soonest ETA among the running rows (at most an hour)."""
    etas = [row.eta_seconds for row in rows if row.status == JobStatus.RUNNING and row.eta_seconds]
    return min(*etas, 3600) if etas else RETRY_AFTER_SECONDS


# --- submission ------------------------------------------------------------------


def job_submit(row: JobRow, *, queue: Queue, fields: Iterable[str] = (), **extra: Any) -> None:
    """Queue a new (or requeued) row on ``queue``: ``queued`` is saved and announced (with
    ``extra`` in the event), and a token asks that queue's worker to run its fairest row once the
    transaction commits."""
    changed = [*fields, *row.mark_queued(queue_name=queue.name)]
    job_publish(row, "queued", changed, **extra)
    add_token(queue)


def add_token(queue: Queue) -> None:
    """A token on ``queue``: its worker claims the fairest row it runs (``job_runner.claim_next``)."""
    enqueue(queue, "mistudio.job_runner.run_next_job", queue.name, result_ttl=0)


def job_requeue(row: JobRow, *, queue: Queue) -> None:
    """Send a row back to a queue (its model is hosted by another worker): it runs there."""
    row.host_worker = ""
    job_submit(row, queue=queue, fields=["host_worker"])


# --- ending and cancelling ------------------------------------------------------------------------


def _still_there(row: JobRow) -> bool:
    """Whether the row still exists (a model deleted meanwhile takes its jobs with it)."""
    return type(row).objects.filter(pk=row.pk).exists()


def job_fail(row: JobRow, *, code: str, message: str) -> None:
    """``failed`` with its code and message; what it left half-made is removed."""
    if not _still_there(row):
        return
    fields = row.mark_failed(code=code, message=message)
    job_publish(row, "failed", fields, code=code, message=row.error_message)
    row.on_ended()


def job_discard(row: JobRow) -> None:
    """``cancelled``; what it left half-made is removed."""
    if not _still_there(row):
        return
    job_publish(row, "cancelled", row.mark_cancelled())
    row.on_ended()


def job_update(row: JobRow, *, actor, changes: dict[str, Any]) -> list[str]:
    """Change the row's ``OWNER_FIELDS`` among ``changes`` (a name checked as label text): its
    owner, an admin or the operator only (403 ``NOT_OWNER``); saved and announced as
    ``<kind>:updated``. Returns the fields changed."""
    check_may_change(row, actor, what=row.noun)
    if "name" in changes:
        check_label_text(changes["name"], field="name")
    fields = [field for field in row.OWNER_FIELDS if field in changes]
    for field in fields:
        setattr(row, field, changes[field])
    job_publish(row, "updated", fields)
    return fields


def job_cancel(row: JobRow, *, actor) -> JobRow:
    """Cancel a row (its owner, an admin or the operator: 403 ``NOT_OWNER`` otherwise): a queued
    one at once, a running one at its worker's next step (at once if that worker is gone)."""
    check_may_change(row, actor, what=row.noun)
    with transaction.atomic():
        row = type(row).objects.select_for_update().get(pk=row.pk)
        if row.status not in JobRow.ACTIVE:
            raise ApplicationError("NOT_RUNNING", f"The {row.noun} is not queued or running.", status=409)
        alive = {beat["name"] for beat in read_heartbeats()}
        if row.status == JobStatus.QUEUED or row.host_worker not in alive:
            job_discard(row)  # no worker will run it: claims take queued rows only
        else:
            get_redis().set(row.cancel_key, "1", ex=8 * DAY)
    return row


def jobs_resume_on_worker_start(identity: WorkerIdentity) -> None:
    """The worker hook: a starting worker re-queues, on its own queue, the rows it was running
    when it died (each resumes from what it saved), and re-tokens the rows waiting on its queues
    (a Redis that restarted empty lost their tokens)."""
    own = worker_queue(identity.name)
    waiting_queues = {own.name, settings.SHARED_QUEUE}
    for kind in job_kinds():
        # Rows queued before jobs named their queue wait on the shared one.
        kind.model.jobs().filter(status=JobStatus.QUEUED, queue_name="").update(
            queue_name=settings.SHARED_QUEUE
        )
        for row in kind.model.jobs().filter(host_worker=identity.name, status=JobStatus.RUNNING):
            job_submit(row, queue=own)
        for queue_name in (
            kind.model.jobs()
            .filter(status=JobStatus.QUEUED, queue_name__in=waiting_queues)
            .values_list("queue_name", flat=True)
        ):
            add_token(queue_by_name(queue_name))


def job_metrics() -> list:
    """``mistudio_jobs{kind, status}``: rows of every kind of job by status (a gauge)."""
    from prometheus_client.core import GaugeMetricFamily

    from mistudio.metrics import status_counts

    family = GaugeMetricFamily("mistudio_jobs", "Job rows by kind and status.", labels=["kind", "status"])
    for kind in job_kinds():
        for status, count in status_counts(kind.model.objects.all(), JobStatus.values).items():
            family.add_metric([kind.model.kind, status], count)
    return [family]
