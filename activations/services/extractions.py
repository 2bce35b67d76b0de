"""Extraction workflows: cache keys, requests, admission, enqueue, cancel, resume."""

import hashlib
import json
import logging
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from activations.model_structure import skeleton
from activations.models import ActivationCache, Dataset, ExtractionJob
from engine.hooks import HookError, resolve_hook_names
from mistudio.errors import ApplicationError, rate_limited
from mistudio.events import publish, rows_audience
from mistudio.redis_client import get_redis
from mistudio.workers import cancel_if_queued, enqueue
from models_app.models import LanguageModel
from models_app.services import model_job_queue

logger = logging.getLogger(__name__)


STORAGE_DTYPES = ("float32", "bfloat16", "float16")


def cache_key(
    *,
    model: LanguageModel,
    dataset: Dataset,
    hooks: list[str],
    max_length: int,
    dtype: str,
    sample_count: int | None,
) -> dict[str, Any]:
    """What makes two extractions give the same activations (batch size and padding do not).

    This is what the cache row and its manifest keep, and users may download: a local model is
    named as users see it (relative to its root), never by its server path. A cache is found by
    :func:`cache_key_hash`, which puts the full path back.
    """
    return {
        "model": {
            "source": model.source,
            "identifier": model.display_identifier,
            "revision": model.commit_sha or model.revision,
            "quantization": model.quantization,
        },
        "dataset_content_hash": dataset.content_hash,
        "sample_count": min(sample_count or dataset.sample_count, dataset.sample_count),
        "hooks": sorted(hooks),
        "max_length": max_length,
        "dtype": dtype,
    }


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def cache_key_hash(key: dict[str, Any], *, model: LanguageModel) -> str:
    """The hash a cache is found by: of ``key`` with the model's full identifier, so that two local
    folders shown alike (one name under two roots) never share a cache, and caches made before
    keys went path-free are found again (their hash is computed just as it was)."""
    return key_hash({**key, "model": {**key["model"], "identifier": model.identifier}})


def extraction_groups(job: ExtractionJob) -> list[str]:
    return [f"extraction.{job.id}", f"model.{job.model_id}"]


def job_state(job: ExtractionJob) -> dict[str, Any]:
    return {
        "extraction_id": job.id,
        "model_id": job.model_id,
        "status": job.status,
        "progress": job.progress,
        "samples_processed": job.samples_processed,
        "total_samples": job.total_samples,
        "tokens_per_second": job.tokens_per_second,
        "eta_seconds": job.eta_seconds,
        "cache_id": job.cache_id,
        "cached": job.cached,
        "error_code": job.error_code,
        "error_message": job.error_message,
    }


def job_publish(job: ExtractionJob, event: str, fields: list[str], **extra: Any) -> None:
    publish(
        event,
        {**job_state(job), **extra},
        groups=extraction_groups(job),
        instance=job,
        fields=fields,
        # Also sent to model.<id>: only to those who may see the job (its owner, admins).
        audience=rows_audience(("extraction", job.id)),
    )


def hook_names_for(model: LanguageModel, *, hooks: list[str] | None, layers: list[int] | None) -> list[str]:
    """Validate hook names against the model's structure (built on the meta device: no weights)."""

    try:
        return resolve_hook_names(skeleton(model), hooks, layers)
    except HookError as error:
        raise ApplicationError(error.code, error.message, details=error.details) from None


def extraction_request(
    *,
    model_id: str,
    dataset_id: str,
    owner,
    hooks: list[str] | None = None,
    layers: list[int] | None = None,
    sample_count: int | None = None,
    batch_size: int = 16,
    max_length: int = 512,
    dtype: str = "float32",
) -> ExtractionJob:
    """Answer from the cache, join the identical job in flight, or queue a new one.

    A model that is not loaded is loaded first, in the worker that takes the job.
    """
    model = LanguageModel.objects.get(pk=model_id)
    dataset = Dataset.objects.filter(pk=dataset_id).first()
    if dataset is None:
        raise ApplicationError("DATASET_NOT_FOUND", "No such dataset.", status=404)
    names = hook_names_for(model, hooks=hooks, layers=layers)
    key = cache_key(
        model=model,
        dataset=dataset,
        hooks=names,
        max_length=max_length,
        dtype=dtype,
        sample_count=sample_count,
    )
    digest = cache_key_hash(key, model=model)
    job_fields = {
        "model": model,
        "dataset": dataset,
        "hooks": names,
        "sample_count": key["sample_count"],
        "batch_size": batch_size,
        "max_length": max_length,
        "dtype": dtype,
        "owner": owner,
    }
    with transaction.atomic():
        cache = ActivationCache.objects.select_for_update().filter(key_hash=digest).first()
        if (
            cache is not None
            and cache.status == ActivationCache.Status.COMPLETED
            and cache.directory.exists()
        ):
            cache.last_accessed_at = timezone.now()
            cache.save(update_fields=["last_accessed_at"])
            job = ExtractionJob.objects.create(**job_fields, total_samples=cache.num_samples)
            job.mark_completed(cache=cache, cached=True)
            job.samples_processed = cache.num_samples
            job.save()
            return job
        if cache is not None:
            running = cache.jobs.filter(status__in=ExtractionJob.ACTIVE).first()
            if running is not None:
                return joined(running, owner=owner)  # an identical request is in flight: one job
            cache.status, cache.error_code, cache.error_message = ActivationCache.Status.WRITING, "", ""
            cache.save(update_fields=["status", "error_code", "error_message"])
        else:
            try:
                with transaction.atomic():
                    cache = ActivationCache.objects.create(
                        key_hash=digest,
                        key=key,
                        model=model,
                        dataset=dataset,
                        hooks=names,
                        max_length=max_length,
                        dtype=dtype,
                        sample_count=key["sample_count"],
                        owner=owner,
                    )
            except IntegrityError:  # the identical request that raced us won: join its job
                cache = ActivationCache.objects.get(key_hash=digest)
                running = cache.jobs.filter(status__in=ExtractionJob.ACTIVE).first()
                if running is not None:
                    return joined(running, owner=owner)
        extraction_capacity_check(owner=owner)  # only a new job counts against the caps
        job = ExtractionJob.objects.create(**job_fields, cache=cache, total_samples=key["sample_count"])
        job.rq_job_id = f"extract-{job.id}"
        job.save(update_fields=["rq_job_id"])
        job_publish(job, "extraction:queued", [])
        extraction_enqueue(job)  # queued once this transaction commits
    return job


def joined(running: ExtractionJob, *, owner) -> ExtractionJob:
    """The identical job in flight, if it is the requester's own; another user's job stays private
    (409: its cache is reused by the same request once it completes)."""
    if running.owner_id == getattr(owner, "pk", None):
        return running
    raise ApplicationError(
        "EXTRACTION_IN_PROGRESS",
        "Another user's identical extraction is running; send the request again when it completes "
        "and its cached activations will be reused.",
        status=409,
    )


# Any fixed 64-bit number: the PostgreSQL advisory lock that new extraction jobs take turns on.
EXTRACTION_ADMISSION_LOCK = 0x6D69_5374_7564_696F  # "miStudio"
EXTRACTION_RETRY_AFTER_SECONDS = 30  # when no job holding a slot has an ETA yet


def extraction_capacity_check(*, owner) -> None:
    """Refuse a new job (429 ``RATE_LIMITED``) while too many are queued or running.

    Caps: ``MAX_ACTIVE_EXTRACTIONS_PER_USER`` for the owner, ``MAX_ACTIVE_EXTRACTIONS`` for
    everyone (0: no cap). Called inside ``extraction_request``'s transaction just before the
    job row is created, so a request answered from the cache or joining an identical job in
    flight never counts, and a refusal rolls back the cache row it may have started. Requests
    take turns here (an advisory lock on PostgreSQL; SQLite transactions are already
    ``IMMEDIATE``), so two cannot both take the last slot.
    """
    per_user, system = settings.MAX_ACTIVE_EXTRACTIONS_PER_USER, settings.MAX_ACTIVE_EXTRACTIONS
    if not per_user and not system:
        return
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [EXTRACTION_ADMISSION_LOCK])
    active = ExtractionJob.objects.filter(status__in=ExtractionJob.ACTIVE).order_by("created_at")
    if per_user and owner is not None:
        mine = list(active.filter(owner=owner))
        if len(mine) >= per_user:
            raise rate_limited(
                f"You have {len(mine)} extractions queued or running, the most allowed per user "
                f"({per_user}); send this one again when one of them ends.",
                retry_after_seconds=extraction_retry_after(mine),
                details={"scope": "user", "limit": per_user, "active_extractions": [job.id for job in mine]},
            )
    if system:
        everyone = list(active)
        if len(everyone) >= system:
            raise rate_limited(
                f"{len(everyone)} extractions are queued or running, the most allowed at once "
                f"({system}); send this one again when one of them ends.",
                retry_after_seconds=extraction_retry_after(everyone),
                details={"scope": "system", "limit": system},  # other users' job ids stay private
            )


def extraction_retry_after(jobs: list[ExtractionJob]) -> float:
    """When a slot is likely to free: the soonest ETA among the running jobs (at most an hour)."""
    etas = [job.eta_seconds for job in jobs if job.status == ExtractionJob.Status.RUNNING and job.eta_seconds]
    return min(*etas, 3600) if etas else EXTRACTION_RETRY_AFTER_SECONDS


def extraction_enqueue(job: ExtractionJob, *, worker_name: str | None = None) -> None:
    """To the model's host worker if it is loaded, else to the shared queue (the taker loads it)."""
    queue = model_job_queue(job.model_id, worker_name=worker_name)
    enqueue(queue, "activations.tasks.run_extraction", job.id, job_id=job.rq_job_id)


def extraction_cancel_key(job_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:cancel:extraction:{job_id}"


def extraction_cancel_requested(job_id: str) -> bool:
    return bool(get_redis().exists(extraction_cancel_key(job_id)))


def extraction_cancel(*, job_id: str) -> ExtractionJob:
    """A queued job is cancelled at once; a running one stops after its current batch."""
    with transaction.atomic():
        job = ExtractionJob.objects.select_for_update().get(pk=job_id)
        if job.status not in ExtractionJob.ACTIVE:
            raise ApplicationError("NOT_RUNNING", "The extraction is not queued or running.", status=409)
        get_redis().set(extraction_cancel_key(job.id), "1", ex=24 * 3600)
        queued = cancel_if_queued(job.rq_job_id)
        if queued:
            extraction_discard(job)
    return job


def extraction_discard(job: ExtractionJob) -> None:
    """Mark a job cancelled and remove its unfinished cache (files included)."""
    cache = job.cache
    job_publish(job, "extraction:cancelled", job.mark_cancelled())
    if cache is not None and cache.status != ActivationCache.Status.COMPLETED:
        cache.delete()  # its files follow on commit (cache_files_follow_row)


def extraction_resume_on_worker_start(identity) -> None:
    """The worker hook: a starting worker resumes the extractions it was running when it died."""
    extraction_resume_after_restart(worker_name=identity.name)


def extraction_resume_after_restart(*, worker_name: str) -> list[str]:
    """A restarted worker re-queues the extractions it was running when it died; they resume
    from their last complete shard. Returns their ids."""
    import uuid

    resumed = []
    for job in ExtractionJob.objects.filter(host_worker=worker_name, status=ExtractionJob.Status.RUNNING):
        # A fresh RQ id: the dead worker's entry for the old one is cleaned up as abandoned by RQ.
        job.rq_job_id = f"extract-{job.id}-{uuid.uuid4().hex[:6]}"
        job.save(update_fields=["rq_job_id"])
        extraction_enqueue(job, worker_name=worker_name)
        resumed.append(job.id)
    return resumed
