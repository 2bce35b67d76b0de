"""Model workflows: register, update, delete, load/unload/cancel requests, downloads, worker bookkeeping.

Every front door (REST API, pages, admin actions, management commands) calls these.
"""

import logging
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from engine import budgets
from engine.errors import EngineError
from engine.gguf import convert_gguf, find_converted
from engine.hub import download_model, hub_metadata, validate_hub_id
from engine.inspection import (
    applicable_quantizations,
    confined_folder_entries,
    describe,
    inspect_folder,
    memory_estimates,
)
from engine.inspection.gguf import GGUF_SUFFIX, inspect_gguf
from engine.registry import LOADED_MODELS
from mistudio.access import OPERATOR, audience, check_may_change, visible_rows
from mistudio.errors import ApplicationError
from mistudio.events import ProgressThrottle, publish, rows_audience
from mistudio.jobs import JobRow
from mistudio.local_paths import path_inside_roots
from mistudio.redis_client import get_redis
from mistudio.text import check_label_text
from mistudio.workers import LOAD_JOB_PREFIX, enqueue, read_heartbeats, shared_queue, worker_queue
from models_app.models import LanguageModel
from models_app.selectors import memory_capacity, model_state, splits_models

logger = logging.getLogger(__name__)

CANCEL_FLAG_TTL_SECONDS = 3600

# HTTP status for the codes the engine modules (inspection, hub) raise.
ENGINE_ERROR_STATUS = {
    "INVALID_MODEL": 400,
    "INVALID_MODEL_ID": 400,
    "UNSUPPORTED_ARCHITECTURE": 400,
    "UNSAFE_WEIGHTS": 400,
    "REMOTE_CODE_NOT_ALLOWED": 400,
    "UNSAFE_PATH": 400,
    "MODEL_NOT_FOUND_ON_HUB": 400,
    "GATED_MODEL": 403,
    "INSUFFICIENT_DISK": 507,
    "HUB_UNREACHABLE": 502,
    "HUB_OFFLINE": 503,
    "HUB_ERROR": 502,
    "DOWNLOAD_CANCELLED": 409,
    "GGUF_CONVERSION_FAILED": 422,
}


def application_error(error: "ApplicationError | EngineError") -> ApplicationError:
    """The client-facing form of an engine error (inspection, hub, loading)."""
    if isinstance(error, ApplicationError):
        return error
    return ApplicationError(
        error.code, error.message, status=ENGINE_ERROR_STATUS.get(error.code, 400), details=error.details
    )


def model_groups(model: LanguageModel) -> list[str]:
    return ["models", f"model.{model.id}"]


def model_publish(model: LanguageModel, event: str, fields: list[str], **extra: Any) -> None:
    """Save the changed fields of ``model``, then publish ``event`` with its current state."""

    publish(
        event,
        {**model_state(model), **extra},
        groups=model_groups(model),
        instance=model,
        fields=fields,
        audience=rows_audience(("model", model.id)),
    )


# --- Registering -------------------------------------------------------------------------------


def local_model_folder(raw_path: str) -> Path:
    """The real folder behind ``raw_path`` if it lies inside ``LOCAL_MODEL_ROOTS``, and so does
    every entry of it, links resolved (400 ``UNSAFE_PATH`` naming the entry otherwise). Checked
    at registration, before every load, and before the web process reads its tokenizer."""

    folder = path_inside_roots(raw_path, settings.LOCAL_MODEL_ROOTS, setting="LOCAL_MODEL_ROOTS")
    if not folder.is_dir():
        raise ApplicationError("INVALID_LOCAL_PATH", "The local path is not a folder.")
    try:
        confined_folder_entries(folder, settings.LOCAL_MODEL_ROOTS)
    except EngineError as error:
        raise application_error(error) from None
    return folder


def local_model_path(raw_path: str) -> Path:
    """The real model folder, or GGUF file, behind ``raw_path`` inside ``LOCAL_MODEL_ROOTS``.

    A ``.gguf`` file is a model by itself; so is a folder without ``config.json`` that holds
    exactly one (the file is returned). Anything else is checked as :func:`local_model_folder`.
    """
    path = path_inside_roots(raw_path, settings.LOCAL_MODEL_ROOTS, setting="LOCAL_MODEL_ROOTS")
    if path.is_file():
        if path.suffix.lower() != GGUF_SUFFIX:
            raise ApplicationError(
                "INVALID_LOCAL_PATH", "The local path is neither a folder nor a .gguf file."
            )
        return path
    folder = local_model_folder(str(path))
    if (folder / "config.json").exists():
        return folder
    gguf_files = sorted(entry for entry in folder.iterdir() if entry.suffix.lower() == GGUF_SUFFIX)
    if len(gguf_files) > 1:
        raise ApplicationError(
            "INVALID_MODEL",
            f"The folder holds {len(gguf_files)} .gguf files; register one of them by its path.",
            details={"files": [entry.name for entry in gguf_files][:20]},
        )
    return gguf_files[0].resolve() if gguf_files else folder


def model_gguf_file(model: LanguageModel) -> Path | None:
    """The GGUF file a local model was registered from (checked inside the roots), else None."""
    if model.source != LanguageModel.Source.LOCAL or not model.identifier.lower().endswith(GGUF_SUFFIX):
        return None
    return local_model_path(model.identifier)


def model_gguf_converted(*, gguf_file: Path, on_progress: Callable[[float], None] | None = None) -> Path:
    """The safetensors copy of ``gguf_file`` in ``MODEL_STORE_DIR``, converted first if there is
    none yet (worker only: it loads the whole model)."""
    return convert_gguf(gguf_file, store=settings.MODEL_STORE_DIR, on_progress=on_progress)


def model_gguf_copy(model: LanguageModel) -> Path | None:
    """The converted safetensors copy of a GGUF model's file as it is now, if a load made one
    (found without hashing the file, so the web process can read its tokenizer); else None."""
    try:
        gguf_file = model_gguf_file(model)
    except ApplicationError:
        return None
    return find_converted(settings.MODEL_STORE_DIR, gguf_file) if gguf_file is not None else None


def model_file_roots(model: LanguageModel) -> list[Path]:
    """Where the files of the model's folder may lie, links resolved: its local roots, the model
    store for a GGUF (its converted copy), or the model cache for a hub model (whose snapshot
    files link to the cache's blobs)."""
    if model.source == LanguageModel.Source.LOCAL and model.identifier.lower().endswith(GGUF_SUFFIX):
        return [settings.MODEL_STORE_DIR]
    if model.source == LanguageModel.Source.LOCAL:
        return list(settings.LOCAL_MODEL_ROOTS)
    return [settings.MODEL_CACHE_DIR]


def model_inspect_source(*, source: str, identifier: str, revision: str = "") -> tuple[Any, str, str]:
    """(ModelInfo, canonical identifier, commit sha) without loading or downloading weights."""

    try:
        if source == LanguageModel.Source.LOCAL:
            path = local_model_path(identifier)
            if path.is_file():
                return inspect_gguf(path), str(path), ""
            return inspect_folder(path, roots=settings.LOCAL_MODEL_ROOTS), str(path), ""
        repo_id = validate_hub_id(identifier)
        metadata = hub_metadata(repo_id, revision=revision or None, token=settings.HF_TOKEN)
        info = describe(metadata.config, metadata.tensor_shapes, [file.path for file in metadata.files])
        return info, repo_id, metadata.revision
    except EngineError as error:
        raise application_error(error) from None


def model_register(
    *,
    source: str,
    identifier: str,
    owner,
    name: str = "",
    revision: str = "",
    quantization: str = LanguageModel.Quantization.NONE,
    model_type: str = "",
    auto_load: bool = False,
    pinned: bool = False,
    shared: bool = False,
    keep_alive_seconds: int | None = None,
) -> LanguageModel:
    """Inspect the model (config and safetensors headers only) and create its row, ``pending``.

    ``source`` decides how ``identifier`` is read: a hub id is a hub id even when a local folder
    of that name exists. With ``auto_load`` the load is queued at once.
    """
    check_label_text(name, field="name")

    info, identifier, commit_sha = model_inspect_source(
        source=source, identifier=identifier, revision=revision
    )
    if model_type and model_type != info.model_type:
        raise ApplicationError(
            "VALIDATION_ERROR",
            f"model_type {model_type!r} does not match the model's config ({info.model_type!r}).",
            details={"fields": {"model_type": [f"The model's config says {info.model_type!r}."]}},
        )
    check_quantization(info, quantization)
    try:
        with transaction.atomic():
            model = LanguageModel.objects.create(
                name=name or identifier.rstrip("/").rsplit("/", 1)[-1],
                source=source,
                identifier=identifier,
                revision=revision,
                commit_sha=commit_sha,
                quantization=quantization,
                owner=owner,
                config=info.config,
                model_type=info.model_type,
                architecture=info.architecture,
                hidden_size=info.hidden_size,
                num_layers=info.num_layers,
                vocab_size=info.vocab_size,
                context_length=info.context_length,
                parameter_count=info.parameter_count,
                memory_estimates=memory_estimates(info),
                pinned=pinned,
                shared=shared,
                keep_alive_seconds=keep_alive_seconds,
            )
    except IntegrityError:
        existing = LanguageModel.objects.filter(
            source=source, identifier=identifier, revision=revision, quantization=quantization
        ).first()
        # The id only for a row the registering user may see: another user's private model stays hidden.
        visible = existing is not None and (
            owner is None
            or visible_rows(LanguageModel.objects.filter(pk=existing.pk), owner, shareable=True).exists()
        )
        raise ApplicationError(
            "MODEL_ALREADY_REGISTERED",
            "This model is already registered with that revision and quantization.",
            status=409,
            details={"model_id": existing.id if visible else None},
        ) from None
    model_publish(model, "model:registered", [])
    if auto_load:
        model = model_load_request(model_id=model.id, actor=owner or OPERATOR)
    return model


def check_quantization(info, quantization: str) -> None:

    options = applicable_quantizations(info)
    if quantization not in options:
        raise ApplicationError(
            "UNSUPPORTED_QUANTIZATION",
            f"{quantization} is not available for this model; choose one of {', '.join(options)}.",
            details={"supported": options},
        )


def model_update(*, model_id: str, actor, **changes: Any) -> LanguageModel:
    """Change the owner's fields (``LanguageModel.OWNER_FIELDS``: name, pinned, shared,
    keep_alive_seconds, quantization — the last only while not loaded or loading).

    Every route that changes one of them comes here, so the ownership rule is the same whatever
    the route: ``actor`` must own the model (or be an admin or the ``OPERATOR``), else 403 ``NOT_OWNER``.
    """
    with transaction.atomic():
        model = LanguageModel.objects.select_for_update().get(pk=model_id)
        check_may_change(model, actor, what="model")
        if "name" in changes:
            check_label_text(changes["name"], field="name")
        quantization = changes.get("quantization")
        changing_quantization = quantization is not None and quantization != model.quantization
        if changing_quantization and model.status in {
            LanguageModel.Status.LOADING,
            LanguageModel.Status.READY,
        }:
            raise ApplicationError(
                "MODEL_BUSY", "Unload the model before changing its quantization.", status=409
            )
        fields = []
        for field in LanguageModel.OWNER_FIELDS:
            if field in changes and getattr(model, field) != changes[field]:
                setattr(model, field, changes[field])
                fields.append(field)
        if fields:
            try:
                with transaction.atomic():
                    model_publish(model, "model:updated", fields)
            except IntegrityError:
                raise ApplicationError(
                    "MODEL_ALREADY_REGISTERED", "Another row has this model at that quantization.", status=409
                ) from None
    return model


def model_delete(*, model_id: str) -> None:
    """Delete the row; a loaded model is unloaded from its worker first (in the worker's queue order).

    Downloaded files stay in MODEL_CACHE_DIR: the hub cache is shared by every row of that repo.
    The model's activation caches go with it (a cascade), and their files once the deletion
    commits (the activations app's pre_delete rule for cache rows).
    """

    with transaction.atomic():
        model = LanguageModel.objects.select_for_update().get(pk=model_id)
        if model.status == LanguageModel.Status.LOADING:
            set_cancel_flag(model.id)
        host = model.host_worker if model.status == LanguageModel.Status.READY else ""
        groups = model_groups(model)
        receivers = audience(model, shareable=True)
        if model.extractions.filter(status__in=JobRow.ACTIVE).exists():
            raise ApplicationError(
                "MODEL_BUSY", "An extraction with this model is running; cancel it first.", status=409
            )
        model.delete()
        if host:
            enqueue(worker_queue(host), "models_app.tasks.unload_model", model_id, reason="deleted")
    publish("model:deleted", {"model_id": model_id}, groups=groups, audience=receivers)


# --- Loading and unloading --------------------------------------------------------------------


def cancel_flag_key(model_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:cancel:model:{model_id}"


def set_cancel_flag(model_id: str) -> None:
    get_redis().set(cancel_flag_key(model_id), "1", ex=CANCEL_FLAG_TTL_SECONDS)


def load_cancel_requested(model_id: str) -> bool:
    return bool(get_redis().exists(cancel_flag_key(model_id)))


def insufficient_memory(required: int, available: int) -> ApplicationError:
    return ApplicationError(
        "INSUFFICIENT_MEMORY",
        "Not enough memory for this model on any worker, even after unloading idle unpinned models.",
        status=409,
        details={
            "required_gb": round(required / 2**30, 3),
            "available_gb": round(max(available, 0) / 2**30, 3),
        },
    )


def model_host(model: LanguageModel | None, *, needed_for: str = "") -> str:
    """The worker hosting ``model``, or 409 ``MODEL_NOT_LOADED`` when it is not ready on one.

    The one check behind every request that needs a loaded model (generation, patching, the lens,
    live encoding); ``needed_for`` completes the message ("live encoding runs it up to the SAE's
    hook")."""
    if model is not None and model.status == LanguageModel.Status.READY and model.host_worker:
        return model.host_worker
    status = model.status if model is not None else "missing"
    state = "still loading" if status == LanguageModel.Status.LOADING else status
    load = f" (POST /api/models/{model.id}/load)" if model is not None else ""
    raise ApplicationError(
        "MODEL_NOT_LOADED",
        f"The model is {state}; load it first{load}{': ' + needed_for if needed_for else ''}.",
        details={"model_id": model.id if model is not None else None, "status": status},
        status=409,
    )


def model_load_request(*, model_id: str, actor, quantization: str | None = None) -> LanguageModel:
    """Mark the model ``loading`` and queue its load on the shared queue; return the row (with rq_job_id).

    A model that is already loading or ready answers 409 (``ALREADY_LOADING`` / ``ALREADY_LOADED``):
    two concurrent requests give exactly one load. When workers are alive and none could make
    room for the estimate, 409 ``INSUFFICIENT_MEMORY`` at once (the worker checks again).

    Loading a visible model is using it, open to any writer; choosing another ``quantization``
    changes the row, which only its owner may (``model_update`` checks ``actor``).
    """

    with transaction.atomic():
        model = LanguageModel.objects.select_for_update().get(pk=model_id)
        if model.status == LanguageModel.Status.LOADING:
            raise ApplicationError("ALREADY_LOADING", "The model is already loading.", status=409)
        if model.status == LanguageModel.Status.READY:
            raise ApplicationError("ALREADY_LOADED", "The model is already loaded.", status=409)
        if quantization is not None and quantization != model.quantization:
            model_update(model_id=model.id, actor=actor, quantization=quantization)
            model.refresh_from_db()
        required = model.memory_estimates.get(model.quantization)
        beats = read_heartbeats()
        if required and beats and not any(splits_models(beat) for beat in beats):
            best = max(memory_capacity(beat) for beat in beats)
            if best < required:
                raise insufficient_memory(required, best)
        get_redis().delete(cancel_flag_key(model.id))
        job_id = f"{LOAD_JOB_PREFIX}{model.id}-{uuid.uuid4().hex[:10]}"
        model_publish(
            model, "model:loading", model.mark_loading(progress=0, message="Queued", rq_job_id=job_id)
        )
        # Ahead of the batch jobs' tokens: a person waits on it (a running job yields to it).
        enqueue(shared_queue(), "models_app.tasks.load_model", model.id, job_id=job_id, at_front=True)
    return model


def model_unload_request(*, model_id: str) -> LanguageModel:
    """Queue the unload on the host worker's own queue (only a ready model can be unloaded)."""

    model = LanguageModel.objects.get(pk=model_id)
    if model.status != LanguageModel.Status.READY or not model.host_worker:
        raise ApplicationError("MODEL_NOT_LOADED", "The model is not loaded.", status=409)
    enqueue(worker_queue(model.host_worker), "models_app.tasks.unload_model", model.id, reason="requested")
    return model


def model_cancel_load(*, model_id: str) -> LanguageModel:
    """Cancel a load: a queued job is dropped at once; a running one stops at its next check
    (during the download, or between stages). The row ends ``failed`` with ``LOAD_CANCELLED``.
    """
    from rq.exceptions import NoSuchJobError
    from rq.job import Job, JobStatus

    with transaction.atomic():
        model = LanguageModel.objects.select_for_update().get(pk=model_id)
        if model.status != LanguageModel.Status.LOADING:
            raise ApplicationError("NOT_LOADING", "The model is not loading.", status=409)
        set_cancel_flag(model.id)
        try:
            job = Job.fetch(model.rq_job_id, connection=get_redis())
            queued = job.get_status() in {JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED}
            if queued:
                job.cancel()
        except NoSuchJobError:
            queued = True  # not enqueued yet (or already gone): nothing will run it
        if queued:
            model_publish(
                model, "model:failed", model.mark_failed(code="LOAD_CANCELLED", message="Cancelled.")
            )
    return model


def model_download(*, model: LanguageModel, on_progress: Callable[[int, int], None] | None = None) -> Path:
    """The folder with the model's files: a local folder (or GGUF file) as is, a hub model
    downloaded into MODEL_CACHE_DIR with byte progress published as ``model:downloading`` (throttled).

    Raises the hub's ``EngineError`` as is: the load task needs to know whether it is transient.
    """

    if model.source == LanguageModel.Source.LOCAL:
        return local_model_path(model.identifier)
    throttle = ProgressThrottle()

    def progress(done: int, total: int) -> None:
        if on_progress is not None:
            on_progress(done, total)
        if throttle.ready(100 * done / total if total else 100, final=done >= total):
            model_publish(
                model, "model:downloading", model.mark_downloading(bytes_done=done, bytes_total=total)
            )

    return download_model(
        model.identifier,
        revision=model.commit_sha or model.revision or None,
        cache_dir=settings.MODEL_CACHE_DIR,
        token=settings.HF_TOKEN,
        progress=progress,
        should_cancel=lambda: load_cancel_requested(model.id),
    )


# --- Workers ------------------------------------------------------------------------------------


def worker_release_models(
    *, worker_name: str, reason: str, holding: Iterable[str] = (), code: str = "", message: str = ""
) -> None:
    """Mark ``unloaded`` the models rows say ``worker_name`` hosts, except those it is ``holding``.

    Called when a worker process starts (it holds nothing it did not load itself) and when it stops.
    """
    hosted = LanguageModel.objects.filter(
        host_worker=worker_name, status__in=[LanguageModel.Status.READY, LanguageModel.Status.LOADING]
    ).exclude(pk__in=list(holding))
    for model in hosted:
        fields = model.mark_unloaded(reason=reason, code=code, message=message)
        model_publish(model, "model:unloaded", fields, reason=reason)


def worker_started(identity) -> None:
    """A worker (re)starting holds no model it did not load itself: the rows that still name it
    as host become ``unloaded`` (``WORKER_LOST``)."""
    worker_release_models(
        worker_name=identity.name,
        reason="worker_lost",
        holding=[entry["model_id"] for entry in LOADED_MODELS.summary()],
        code="WORKER_LOST",
        message="The worker hosting this model restarted.",
    )


# Per worker: the models whose idle unload is queued and not yet done (so it is queued once).
_IDLE_UNLOADS_QUEUED: dict[str, set[str]] = {}


def unload_idle_models(identity) -> None:
    """Queue an unload (reason ``idle``) for each model unused for longer than its keep_alive.

    The unload runs as a job on this worker's own queue, so it never races a job using the model.
    """
    queued = _IDLE_UNLOADS_QUEUED.setdefault(identity.name, set())
    idle = {entry["model_id"]: entry["idle_seconds"] for entry in LOADED_MODELS.summary()}
    expiring = LanguageModel.objects.filter(
        pk__in=list(idle), status=LanguageModel.Status.READY, keep_alive_seconds__isnull=False
    ).values_list("pk", "keep_alive_seconds")
    for model_id, keep_alive in expiring:
        if idle[model_id] > keep_alive and model_id not in queued:
            queued.add(model_id)
            enqueue(worker_queue(identity.name), "models_app.tasks.unload_model", model_id, reason="idle")
    queued &= set(idle)


def worker_lost_reconcile() -> list[str]:
    """Mark models whose host worker has no heartbeat ``unloaded`` with ``WORKER_LOST``; return their ids."""

    alive = {beat["name"] for beat in read_heartbeats()}
    lost = []
    hosted = LanguageModel.objects.filter(
        status__in=[LanguageModel.Status.READY, LanguageModel.Status.LOADING]
    )
    for model in hosted.exclude(host_worker="").exclude(host_worker__in=alive):
        fields = model.mark_unloaded(
            reason="worker_lost", code="WORKER_LOST", message="The worker hosting this model stopped."
        )
        model_publish(model, "model:unloaded", fields, reason="worker_lost")
        lost.append(model.id)
    return lost


def model_heads(model: LanguageModel) -> int:
    """Attention heads per layer, from the model's config (1 when it does not say)."""
    config = model.config or {}
    return int(config.get("num_attention_heads") or config.get("n_head") or 1)


def model_probe_memory(model: LanguageModel, *, tokens: int, longest: int, runs: int = 2):
    """The estimated peak of ``runs`` forward passes of ``model`` over ``tokens`` tokens
    (``engine.budgets.model_probe``)."""
    return budgets.model_probe(
        tokens=tokens, longest=longest, hidden=model.hidden_size or 0, layers=model.num_layers or 0,
        heads=model_heads(model), runs=runs,
    )  # fmt: skip


def model_worker_name(model: LanguageModel | None) -> str | None:
    """The worker hosting ``model`` when it is ready on one; None otherwise."""
    if model is not None and model.status == LanguageModel.Status.READY and model.host_worker:
        return model.host_worker
    return None


def model_job_queue(model_id: str | None, *, worker_name: str | None = None):
    """The queue for a job that needs a model: ``worker_name``'s own when given (a restarted worker
    taking back its jobs), else the model's host when it is loaded, else the shared queue (the
    worker that takes the job loads the model)."""
    if worker_name:
        return worker_queue(worker_name)
    model = LanguageModel.objects.filter(pk=model_id).first() if model_id else None
    host = model_worker_name(model)
    return worker_queue(host) if host else shared_queue()
