"""RQ entry points. They take ids, load the row, and do the work in the current worker."""

import logging
import time

from django.conf import settings
from django.db import close_old_connections

from engine.errors import EngineError
from engine.loading import load_weights, release, warm_up
from engine.placement import Placement
from engine.registry import LOADED_MODELS, LoadedModel
from mistudio.errors import ApplicationError
from mistudio.job_runner import Requeued
from mistudio.jobs import JobRow, job_requeue
from mistudio.workers import available_memory, current_worker, device_budgets, worker_queue, worker_task
from models_app.models import LanguageModel
from models_app.services import (
    application_error,
    insufficient_memory,
    load_cancel_requested,
    model_download,
    model_file_roots,
    model_gguf_converted,
    model_gguf_file,
    model_publish,
)

logger = logging.getLogger(__name__)

MAX_LOAD_ATTEMPTS = 4  # the first try and up to 3 retries of a transient failure
# Progress at the start of each stage; the "convert" stage (a GGUF's first load) spans 5 -> 55.
STAGE_PROGRESS = {"resolve": 2, "download": 5, "convert": 5, "weights": 60, "place": 90, "warm-up": 95}
STAGE_SPAN = {"convert": 50}


class LoadCancelled(Exception):
    pass


def is_transient(error: Exception) -> bool:
    """Out of memory and network failures may pass; a bad model or path never will."""
    import torch

    if isinstance(error, torch.OutOfMemoryError | MemoryError | ConnectionError | TimeoutError):
        return True
    return isinstance(error, EngineError) and error.transient


def unload_loaded(model_id: str, *, reason: str) -> None:
    """Drop a model from this worker's memory and mark its row (if it still exists) ``unloaded``."""

    entry = LOADED_MODELS.remove(model_id)
    if entry is not None:
        release(entry)
    model = LanguageModel.objects.filter(pk=model_id).first()
    if model is not None and model.status == LanguageModel.Status.READY:
        model_publish(model, "model:unloaded", model.mark_unloaded(reason=reason), reason=reason)


# The model each job row of this worker runs on (row's model class and id -> model id), kept while
# the row is queued or running: a job that yielded its worker resumes on its model.
_JOB_MODELS: dict[tuple[type[JobRow], str], str] = {}


def models_in_use() -> set[str]:
    """The models a running job of this worker uses, or a job that yielded it and will resume
    (forgotten once the row has ended): never evicted to make room."""
    for (row_model, pk), _model_id in list(_JOB_MODELS.items()):
        if not row_model.objects.filter(pk=pk, status__in=JobRow.ACTIVE).exists():
            del _JOB_MODELS[(row_model, pk)]
    return set(_JOB_MODELS.values())


def make_room(model: LanguageModel, *, placement: Placement) -> None:
    """Evict least-recently-used models until the estimate fits and the count allows; pinned ones
    and those of jobs (:func:`models_in_use`) stay.

    On a split placement (``auto``) a model that still does not fit once nothing is left to
    evict is loaded anyway: what fits on no device goes to disk.
    """

    required = model.memory_estimates.get(model.quantization, 0)
    while True:
        available = available_memory(placement)
        too_many = settings.MAX_LOADED_MODELS and len(LOADED_MODELS) >= settings.MAX_LOADED_MODELS
        if required <= available and not too_many:
            return
        kept = {*LanguageModel.objects.filter(pinned=True).values_list("pk", flat=True), *models_in_use()}
        victims = [entry for entry in LOADED_MODELS.by_last_use() if entry.model_id not in kept]
        if not victims and placement.split and not too_many:
            return
        if not victims:
            raise insufficient_memory(required, available)
        logger.info("evicting %s to make room for %s", victims[0].model_id, model.id)
        unload_loaded(victims[0].model_id, reason="evicted")


def free_now(placement: Placement) -> dict[str, int]:
    """Bytes free now on each device of a split placement, within its budget."""
    return {device: free for device, (_, free) in device_budgets(placement).items()}


def load_once(model: LanguageModel, identity) -> LoadedModel:

    def stage(name: str, message: str, fraction: float = 0.0) -> None:
        if load_cancel_requested(model.id):
            raise LoadCancelled
        progress = STAGE_PROGRESS[name] + fraction * STAGE_SPAN.get(name, 5)
        model_publish(
            model, "model:loading", model.mark_loading(progress=progress, message=message, stage=name)
        )

    stage("resolve", "Resolving files")
    folder = model_download(model=model)
    gguf_file = model_gguf_file(model)
    if gguf_file is not None:
        # Once per file content: later loads find the converted copy at once.
        folder = model_gguf_converted(
            gguf_file=gguf_file,
            on_progress=lambda fraction: stage(
                "convert", "Converting the GGUF file to safetensors", fraction
            ),
        )
    stage("weights", "Making room")
    placement = identity.placement
    make_room(model, placement=placement)
    messages = {"weights": "Loading weights", "place": "Placing on the device", "warm-up": "Warming up"}

    def on_stage(name: str, fraction: float) -> None:
        if name in messages:
            stage(name, messages[name], fraction)

    weights = load_weights(
        folder, model_type=model.model_type, quantization=model.quantization, device=placement,
        on_stage=on_stage, roots=model_file_roots(model),
        free_memory=free_now(placement) if placement.split else None,
    )  # fmt: skip
    warm_up(weights, on_stage=on_stage)
    return LoadedModel(
        model_id=model.id,
        model=weights.model,
        tokenizer=weights.tokenizer,
        quantization=model.quantization,
        memory_usage_bytes=weights.memory_usage_bytes,
        memory_by_device=weights.bytes_by_device,
    )


@worker_task(timeout=6 * 3600)  # a large hub download is part of the load
def load_model(model_id: str) -> None:
    """Load the model into this worker, which becomes its host.

    Idempotent: a retried or stale job for a model that is not ``loading`` does nothing. Transient
    failures (out of memory, network) are retried up to 3 times with exponential backoff; anything
    else fails the row at once with its code. The row never stays ``loading``.
    """
    close_old_connections()
    identity = current_worker()
    model = LanguageModel.objects.filter(pk=model_id).first()
    if model is None or model.status != LanguageModel.Status.LOADING:
        return
    model.host_worker = identity.name  # so a worker lost mid-load is noticed (WORKER_LOST)
    model.save(update_fields=["host_worker"])
    started = time.monotonic()
    for attempt in range(1, MAX_LOAD_ATTEMPTS + 1):
        try:
            loaded = load_once(model, identity)
            break
        except Exception as error:
            if isinstance(error, LoadCancelled) or getattr(error, "code", None) == "DOWNLOAD_CANCELLED":
                fields = model.mark_failed(code="LOAD_CANCELLED", message="Cancelled.")
                model_publish(model, "model:failed", fields)
                return
            if is_transient(error) and attempt < MAX_LOAD_ATTEMPTS:
                delay = settings.LOAD_RETRY_BASE_SECONDS * 2 ** (attempt - 1)
                logger.warning("load of %s failed (%s); retry %d in %.1f s", model_id, error, attempt, delay)
                message = f"Retrying after a transient error (attempt {attempt + 1})"
                model_publish(
                    model, "model:loading", model.mark_loading(progress=model.progress, message=message)
                )
                time.sleep(delay)
                continue
            if isinstance(error, ApplicationError | EngineError):
                failure = application_error(error)
            else:
                logger.exception("loading %s failed", model_id)
                failure = ApplicationError("MODEL_LOAD_FAILED", f"Loading failed: {type(error).__name__}.")
            fields = model.mark_failed(code=failure.code, message=failure.message, details=failure.details)
            model_publish(model, "model:failed", fields)
            return
    if not LanguageModel.objects.filter(pk=model_id).exists():  # deleted while loading
        release(loaded)
        return
    LOADED_MODELS.add(loaded)
    fields = model.mark_ready(
        host_worker=identity.name,
        memory_usage_bytes=loaded.memory_usage_bytes,
        memory_by_device=loaded.memory_by_device,
        load_time_seconds=round(time.monotonic() - started, 3),
    )
    model_publish(model, "model:ready", fields)


@worker_task(timeout=300)
def unload_model(model_id: str, reason: str = "requested") -> None:
    """Drop the model from this worker's memory and mark it ``unloaded`` with ``reason``."""
    close_old_connections()
    unload_loaded(model_id, reason=reason)


def model_loaded_here(model_id: str):
    """The model as this worker holds it, for interactive work routed to its host (409
    ``MODEL_NOT_LOADED`` when it is not loaded here)."""
    loaded = LOADED_MODELS.get(model_id)
    if loaded is None:
        raise ApplicationError("MODEL_NOT_LOADED", "The model is not loaded in this worker.", status=409)
    return loaded


def model_in_this_worker(model_id: str, row: JobRow, *, purpose: str):
    """The model, loaded in this worker, for a job row that needs it (an extraction, an evaluation).

    Loaded here already: returned. Hosted (or being loaded) by another worker: the row goes to
    that worker's queue and :class:`~mistudio.jobs.Requeued` is raised. Loaded nowhere: loaded
    here first (this worker becomes its host; documented behaviour), or the load's error is raised.
    The model is the row's until the row ends: no load evicts it (:func:`models_in_use`).
    """
    worker_name = current_worker().name
    loaded = LOADED_MODELS.get(model_id)
    if loaded is not None:
        _JOB_MODELS[(type(row), row.pk)] = model_id
        return loaded
    model = LanguageModel.objects.get(pk=model_id)
    hosted = {LanguageModel.Status.READY, LanguageModel.Status.LOADING}
    if model.status in hosted and model.host_worker not in {"", worker_name}:
        if model.status == LanguageModel.Status.LOADING:
            time.sleep(1)  # let that load finish, then follow the model to its host
        job_requeue(row, queue=worker_queue(model.host_worker))
        raise Requeued
    if model.status != LanguageModel.Status.LOADING:
        model.save(update_fields=model.mark_loading(progress=0, message=f"Loading for {purpose}"))
    load_model(model.id)
    loaded = LOADED_MODELS.get(model_id)
    if loaded is None:
        model.refresh_from_db()
        raise ApplicationError(
            model.error_code or "MODEL_LOAD_FAILED", model.error_message or "The model did not load."
        )
    _JOB_MODELS[(type(row), row.pk)] = model_id
    return loaded
