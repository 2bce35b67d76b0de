"""Extraction workflows: cache keys, requests, admission, enqueue, cancel, resume."""

import hashlib
import json
import logging
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from activations.model_structure import skeleton
from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.store import cache_bytes_per_token
from engine import budgets
from engine.hooks import HookError, list_hook_points, resolve_hook_names
from engine.loading import torch_dtype_for
from mistudio import jobs
from mistudio.budgets import memory_budget_check
from mistudio.errors import ApplicationError
from models_app.models import LanguageModel
from models_app.services import model_heads, model_job_queue, model_worker_name

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
        "memory_estimate_bytes": job.memory_estimate_bytes,
        "error_code": job.error_code,
        "error_message": job.error_message,
    }


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
    max_length: int | None = None,
    dtype: str | None = None,
) -> ExtractionJob:
    """Answer from the cache, join the identical job in flight, or queue a new one.

    ``dtype`` is the stored dtype; by default the model's compute dtype (:func:`storage_dtype_for`).
    Neither ``hooks`` nor ``layers`` given: :func:`default_extraction_hook` (an empty list is a 400).
    ``max_length`` defaults to :data:`DEFAULT_MAX_LENGTH` tokens and never exceeds the model's
    context (a longer sample is truncated to the context rather than failing the job).
    A model that is not loaded is loaded first, in the worker that takes the job.
    """
    model = LanguageModel.objects.get(pk=model_id)
    dtype = dtype or storage_dtype_for(model)
    max_length = default_max_length(model, max_length or DEFAULT_MAX_LENGTH)
    dataset = Dataset.objects.filter(pk=dataset_id).first()
    if dataset is None:
        raise ApplicationError("DATASET_NOT_FOUND", "No such dataset.", status=404)
    if hooks is None and layers is None:
        hooks = [default_extraction_hook(model)]
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
        # Only a new job counts against the caps and budgets.
        jobs.job_admit(owner=owner, tokens=key["sample_count"] * max_length)
        estimate = memory_budget_check(
            extraction_memory(model, hooks=names, batch_size=batch_size, max_length=max_length, dtype=dtype),
            what="this extraction",
            worker_name=model_worker_name(model),
        )
        job = ExtractionJob.objects.create(
            **job_fields, cache=cache, total_samples=key["sample_count"], memory_estimate_bytes=estimate
        )
        jobs.job_submit(job, queue=model_job_queue(model.id))  # its token goes out on commit
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


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_MAX_LENGTH = 512


def default_extraction_hook(model: LanguageModel) -> str:
    """Where an extraction reads when it names no hook point or layer: the middle block's residual
    stream (the usual first SAE site), ``blocks.{layers // 2}.hook_resid_post``."""
    return f"blocks.{(model.num_layers or 1) // 2}.hook_resid_post"


def default_max_length(model: LanguageModel, wanted: int = DEFAULT_MAX_LENGTH) -> int:
    """``wanted`` tokens per sample (by default 512), or the model's whole context if shorter."""
    return min(wanted, model.context_length or wanted)


def storage_dtype_for(model: LanguageModel) -> str:
    """The dtype a model's activations are cached in unless the request names one: the dtype the
    model computes in (float32, or bfloat16/float16 for a half-precision or quantized model), so
    a cache holds the bytes the model produced, not twice as many. float32 is a choice."""
    return str(torch_dtype_for(model.quantization)).removeprefix("torch.")


def hook_widths_of(model: LanguageModel, hooks: list[str]) -> list[int]:
    """The width of each hook point, from the model's structure (built on the meta device)."""
    widths = {info.name: info.width for info in list_hook_points(skeleton(model))}
    return [widths.get(name) or model.hidden_size or 0 for name in hooks]


def cache_size_estimate(job: ExtractionJob) -> int:
    """At most how many bytes the job's cache takes: every sample at ``max_length`` tokens."""
    tokens = (job.total_samples or 0) * job.max_length
    return tokens * cache_bytes_per_token(hook_widths_of(job.model, job.hooks), job.dtype)


def extraction_memory(
    model: LanguageModel, *, hooks: list[str], batch_size: int, max_length: int, dtype: str
) -> budgets.MemoryEstimate:
    """The estimated peak of an extraction (``engine.budgets.extraction``)."""
    return budgets.extraction(
        batch_size=batch_size,
        max_length=max_length,
        widths=hook_widths_of(model, hooks),
        dtype_bytes=DTYPE_BYTES.get(dtype, 4),
        hidden=model.hidden_size or 0,
        layers=model.num_layers or 0,
        heads=model_heads(model),
        shard_bytes=settings.ACTIVATION_SHARD_MAX_BYTES,
    )


def extraction_cancel(*, job: ExtractionJob, actor) -> ExtractionJob:
    """A queued job is cancelled at once; a running one stops after its current batch."""
    return jobs.job_cancel(job, actor=actor)
