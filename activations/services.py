"""Dataset and extraction workflows, and activation cache management.

Every front door (REST API, pages, admin, management commands) calls these.
"""

import hashlib
import json
import logging
import shutil
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from activations.model_structure import skeleton
from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.store import CacheWriter, shard_tokens_for, verify, write_durably
from engine.datasets import GUESS_HEAD_BYTES, content_hash, guess_format, parse_bytes, parse_path, preview
from engine.errors import EngineError
from engine.hooks import HookError, resolve_hook_names
from mistudio.access import check_may_change
from mistudio.errors import ApplicationError, rate_limited
from mistudio.events import publish, rows_audience
from mistudio.local_paths import path_inside_roots, path_shown
from mistudio.redis_client import get_redis
from mistudio.workers import enqueue, shared_queue, worker_queue, worker_queue_name
from models_app.models import LanguageModel

logger = logging.getLogger(__name__)

DATASET_ERROR_STATUS = {"DATASET_TOO_LARGE": 413}
STORAGE_DTYPES = ("float32", "bfloat16", "float16")


# --- Datasets --------------------------------------------------------------------------------------


def dataset_error(error: EngineError) -> ApplicationError:
    return ApplicationError(
        error.code, error.message, status=DATASET_ERROR_STATUS.get(error.code, 400), details=error.details
    )


def local_data_path(raw_path: str) -> Path:
    """The real file or folder behind ``raw_path`` if it lies inside ``LOCAL_DATA_ROOTS``."""
    return path_inside_roots(raw_path, settings.LOCAL_DATA_ROOTS, setting="LOCAL_DATA_ROOTS")


def dataset_create_from_texts(
    *,
    name: str,
    texts: Iterable[str],
    owner,
    source: str,
    original_name: str = "",
    format: str = "",
    field: str = "",
    shared: bool = False,
) -> Dataset:
    """Store the non-empty samples as JSON Lines and register them as a dataset."""

    samples = [text for text in texts if text.strip()]
    if not samples:
        raise ApplicationError("EMPTY_DATASET", "The dataset has no non-empty samples.")
    payload = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in samples).encode()
    settings.DATASET_DIR.mkdir(parents=True, exist_ok=True)
    with transaction.atomic():
        dataset = Dataset(
            name=name,
            source=source,
            original_name=original_name,
            format=format,
            field=field,
            sample_count=len(samples),
            size_bytes=len(payload),
            content_hash=content_hash(samples),
            preview=preview(samples),
            owner=owner,
            shared=shared,
        )
        write_durably(dataset.storage_path, [payload])
        dataset.save()
    return dataset


def dataset_create_from_upload(
    *,
    name: str,
    data: bytes,
    filename: str,
    owner,
    format: str | None = None,
    field: str | None = None,
    shared: bool = False,
) -> Dataset:
    """Parse an uploaded file (plain text, JSONL, CSV) into a dataset."""

    try:
        chosen = format or guess_format(filename, data[:GUESS_HEAD_BYTES])
        parsed = parse_bytes(
            data,
            format=chosen,
            field=field,
            max_bytes=settings.DATASET_MAX_UPLOAD_BYTES,
            max_sample_bytes=settings.DATASET_MAX_SAMPLE_BYTES,
        )
    except EngineError as error:
        raise dataset_error(error) from None
    return dataset_create_from_texts(
        name=name or filename,
        texts=parsed.samples,
        owner=owner,
        source=Dataset.Source.UPLOAD,
        original_name=filename,
        format=parsed.format,
        field=parsed.field or "",
        shared=shared,
    )


def dataset_create_from_local(
    *,
    name: str,
    path: str,
    owner,
    format: str | None = None,
    field: str | None = None,
    shared: bool = False,
) -> Dataset:
    """A file or folder under LOCAL_DATA_ROOTS: text / JSONL / CSV files or a ``save_to_disk`` folder."""

    resolved = local_data_path(path)
    try:
        parsed = parse_path(
            resolved,
            format=format,
            field=field,
            max_bytes=settings.DATASET_MAX_LOCAL_BYTES,
            max_sample_bytes=settings.DATASET_MAX_SAMPLE_BYTES,
        )
    except EngineError as error:
        raise dataset_error(error) from None
    return dataset_create_from_texts(
        name=name or resolved.name,
        texts=parsed.samples,
        owner=owner,
        source=Dataset.Source.LOCAL,
        original_name=path_shown(resolved, settings.LOCAL_DATA_ROOTS),
        format=parsed.format,
        field=parsed.field or "",
        shared=shared,
    )


def dataset_samples(dataset: Dataset, *, limit: int | None = None) -> list[str]:
    samples = []
    with open(dataset.storage_path, encoding="utf-8") as handle:
        for line in handle:
            samples.append(json.loads(line)["text"])
            if limit is not None and len(samples) >= limit:
                break
    return samples


def dataset_update(*, dataset_id: str, actor, **changes: Any) -> Dataset:
    """Rename or share / unshare a dataset (``Dataset.OWNER_FIELDS``): ``actor`` must own it (or be
    an admin or the ``OPERATOR``), else 403 ``NOT_OWNER``."""
    dataset = Dataset.objects.get(pk=dataset_id)
    check_may_change(dataset, actor, what="dataset")
    fields = [field for field in Dataset.OWNER_FIELDS if field in changes]
    for field in fields:
        setattr(dataset, field, changes[field])
    dataset.save(update_fields=fields)
    return dataset


def dataset_delete(*, dataset_id: str) -> None:
    dataset = Dataset.objects.get(pk=dataset_id)
    if dataset.extractions.filter(status__in=ExtractionJob.ACTIVE).exists():
        raise ApplicationError("DATASET_IN_USE", "An extraction over this dataset is running.", status=409)
    path = dataset.storage_path
    dataset.delete()
    path.unlink(missing_ok=True)


# --- Extraction requests ------------------------------------------------------------------------


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


def extraction_enqueue(job: ExtractionJob, *, queue_name: str | None = None) -> None:
    """To the model's host worker if it is loaded, else to the shared queue (the taker loads it)."""
    from rq import Queue

    model = LanguageModel.objects.get(pk=job.model_id)
    if queue_name:
        queue = Queue(queue_name, connection=get_redis())
    elif model.status == LanguageModel.Status.READY and model.host_worker:
        queue = worker_queue(model.host_worker)
    else:
        queue = shared_queue()
    enqueue(queue, "activations.tasks.run_extraction", job.id, job_id=job.rq_job_id)


def extraction_cancel_key(job_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:cancel:extraction:{job_id}"


def extraction_cancel_requested(job_id: str) -> bool:
    return bool(get_redis().exists(extraction_cancel_key(job_id)))


def extraction_cancel(*, job_id: str) -> ExtractionJob:
    """A queued job is cancelled at once; a running one stops after its current batch."""
    from rq.exceptions import NoSuchJobError
    from rq.job import Job, JobStatus

    with transaction.atomic():
        job = ExtractionJob.objects.select_for_update().get(pk=job_id)
        if job.status not in ExtractionJob.ACTIVE:
            raise ApplicationError("NOT_RUNNING", "The extraction is not queued or running.", status=409)
        get_redis().set(extraction_cancel_key(job.id), "1", ex=24 * 3600)
        try:
            rq_job = Job.fetch(job.rq_job_id, connection=get_redis())
            queued = rq_job.get_status() == JobStatus.QUEUED
            if queued:
                rq_job.cancel()
        except NoSuchJobError:
            queued = True  # not enqueued yet, or gone: nothing will run it
        if queued:
            extraction_discard(job)
    return job


def extraction_discard(job: ExtractionJob) -> None:
    """Mark a job cancelled and remove its unfinished cache (files included)."""
    cache = job.cache
    job_publish(job, "extraction:cancelled", job.mark_cancelled())
    if cache is not None and cache.status != ActivationCache.Status.COMPLETED:
        cache_delete_files(cache)
        cache.delete()


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
        extraction_enqueue(job, queue_name=worker_queue_name(worker_name))
        resumed.append(job.id)
    return resumed


# --- Caches -------------------------------------------------------------------------------------


def cache_store_open(
    cache: ActivationCache,
    *,
    provenance: dict[str, Any],
    hooks: dict[str, int],
    extra_token_columns: tuple[str, ...] = (),
):
    """The writer of ``cache``'s files (started, or resumed after a crash), shards sized by settings.

    The one way extraction and generation capture write a cache: open here, ``add_batch`` and
    ``finalize`` on the writer, then :func:`cache_store_completed` or :func:`cache_store_failed`.
    """

    return CacheWriter.create_or_resume(
        cache.directory,
        key=cache.key,
        provenance=provenance,
        hooks=hooks,
        dtype=cache.dtype,
        shard_max_tokens=min(
            settings.ACTIVATION_SHARD_MAX_TOKENS,
            shard_tokens_for(hooks, cache.dtype, max_bytes=settings.ACTIVATION_SHARD_MAX_BYTES),
        ),
        extra_token_columns=extra_token_columns,
    )


def cache_store_completed(cache: ActivationCache, *, manifest: dict[str, Any], size_bytes: int) -> None:
    """The row says ``completed``, with the sizes of the finalized files (never before they are)."""
    cache.save(update_fields=cache.mark_completed(manifest=manifest, size_bytes=size_bytes))


def cache_store_failed(
    cache: ActivationCache, *, code: str, message: str, remove_files: bool = False
) -> None:
    """The row says ``failed`` with a code and message; ``remove_files`` deletes what was written."""
    cache.save(update_fields=cache.mark_failed(code=code, message=message))
    if remove_files:
        cache_delete_files(cache)


def cache_delete_files(cache: ActivationCache) -> None:
    shutil.rmtree(cache.directory, ignore_errors=True)


def cache_files_follow_row(sender, instance: ActivationCache, **kwargs) -> None:
    """pre_delete of a cache row, however it goes (a model's deletion cascades to its caches):
    its files are removed once the deletion commits, never while it could still roll back."""
    directory = instance.directory  # read now: a deleted row has no id
    transaction.on_commit(lambda: shutil.rmtree(directory, ignore_errors=True))


def reading_lease_key(cache_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:reading:{cache_id}"


def cache_touch(cache: ActivationCache, *, lease_seconds: int = 300) -> None:
    """Note a read: last_accessed for LRU, and a short lease so eviction leaves it alone meanwhile."""
    cache.last_accessed_at = timezone.now()
    cache.save(update_fields=["last_accessed_at"])
    get_redis().set(reading_lease_key(cache.id), "1", ex=lease_seconds)


def cache_delete(*, cache_id: str) -> None:
    cache = ActivationCache.objects.get(pk=cache_id)
    if cache.status == ActivationCache.Status.WRITING:
        raise ApplicationError(
            "CACHE_BUSY", "The cache is being written; cancel its extraction first.", status=409
        )
    cache_delete_files(cache)
    cache.delete()


def cache_cleanup(*, dry_run: bool = False, verify_checksums: bool = False) -> dict[str, list[str]]:
    """Expire, evict (LRU under ACTIVATION_CACHE_MAX_BYTES), remove orphan files, fail broken rows.

    Never touches a cache being written or read (a reading lease in Redis).
    """

    report: dict[str, list[str]] = {"expired": [], "evicted": [], "orphans": [], "failed": []}
    connection = get_redis()

    def removable(cache: ActivationCache) -> bool:
        return cache.status != ActivationCache.Status.WRITING and not connection.exists(
            reading_lease_key(cache.id)
        )

    def remove(cache: ActivationCache, bucket: str) -> None:
        report[bucket].append(cache.id)
        if not dry_run:
            cache_delete_files(cache)
            cache.delete()

    completed = ActivationCache.objects.filter(status=ActivationCache.Status.COMPLETED)
    for cache in completed:
        missing = not (cache.directory / "manifest.json").exists()
        problems = ["missing files"] if missing else (verify(cache.directory) if verify_checksums else [])
        if problems:
            report["failed"].append(cache.id)
            if not dry_run:
                cache_store_failed(cache, code="CACHE_CORRUPT", message="; ".join(problems)[:2000])

    expiry = timezone.now() - timedelta(days=settings.ACTIVATION_CACHE_EXPIRY_DAYS)
    for cache in ActivationCache.objects.filter(last_accessed_at__lt=expiry).exclude(status="writing"):
        if removable(cache):
            remove(cache, "expired")

    remaining = ActivationCache.objects.exclude(pk__in=report["expired"]).order_by("last_accessed_at")
    total = sum(cache.file_size_bytes for cache in remaining)
    for cache in remaining:
        if total <= settings.ACTIVATION_CACHE_MAX_BYTES:
            break
        if cache.status == ActivationCache.Status.COMPLETED and removable(cache):
            total -= cache.file_size_bytes
            remove(cache, "evicted")

    known = set(ActivationCache.objects.values_list("pk", flat=True))
    for path in sorted(settings.ACTIVATION_CACHE_DIR.iterdir()):
        if path.is_dir() and path.name.startswith("act_") and path.name not in known:
            report["orphans"].append(path.name)
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)
    return report


def cache_cleanup_daily() -> dict[str, list[str]] | None:
    """Run the cleanup at most once a day across all workers (the first to take the Redis key)."""
    if not get_redis().set(f"{settings.REDIS_KEY_PREFIX}:cache-cleanup-daily", "1", nx=True, ex=24 * 3600):
        return None
    report = cache_cleanup()
    logger.info("daily cache cleanup: %s", {bucket: len(ids) for bucket, ids in report.items()})
    return report
