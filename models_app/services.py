"""Model workflows: register, request a load or unload, reconcile lost workers.

Every front door (REST API, pages, admin actions, management commands) calls these.
"""

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings
from django.db import transaction

from mistudio.errors import ApplicationError
from mistudio.events import publish
from models_app.models import LanguageModel

logger = logging.getLogger(__name__)

LOAD_JOB_TIMEOUT_SECONDS = 3600
UNLOAD_JOB_TIMEOUT_SECONDS = 300


def model_groups(model: LanguageModel) -> list[str]:
    return ["models", f"model.{model.id}"]


def model_publish(model: LanguageModel, event: str, fields: list[str], **extra) -> None:
    """Save the changed fields of ``model``, then publish ``event`` with its current state."""
    from models_app.selectors import model_state

    publish(event, {**model_state(model), **extra}, groups=model_groups(model), instance=model, fields=fields)


def local_model_folder(raw_path: str) -> Path:
    """The real folder behind ``raw_path`` if it lies inside ``LOCAL_MODEL_ROOTS``.

    Symlinks are followed before the check, so a link pointing out of a root is refused.
    """
    if not raw_path or "\x00" in raw_path:
        raise ApplicationError("INVALID_LOCAL_PATH", "The local path is empty or contains a NUL byte.")
    folder = Path(raw_path).expanduser().resolve()
    if not any(folder.is_relative_to(root) for root in settings.LOCAL_MODEL_ROOTS):
        raise ApplicationError(
            "INVALID_LOCAL_PATH", "The local path is outside the configured model roots (LOCAL_MODEL_ROOTS)."
        )
    if not folder.is_dir():
        raise ApplicationError("INVALID_LOCAL_PATH", "The local path is not a folder.")
    return folder


def model_config_summary(folder: Path) -> dict:
    """Fields of the row that come from config.json and the safetensors headers (no weights read)."""
    from safetensors import safe_open

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ApplicationError("INVALID_MODEL", "The folder has no config.json.")
    config = json.loads(config_file.read_text())
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise ApplicationError(
            "UNSAFE_WEIGHTS", "The folder has no .safetensors weights; pickle files are refused."
        )
    parameter_count = 0
    for weight_file in weight_files:
        with safe_open(str(weight_file), framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                shape = handle.get_slice(key).get_shape()
                count = 1
                for size in shape:
                    count *= size
                parameter_count += count
    return {
        "config": config,
        "model_type": config.get("model_type", ""),
        "architecture": (config.get("architectures") or [""])[0],
        "hidden_size": config.get("hidden_size") or config.get("n_embd") or config.get("d_model"),
        "num_layers": config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers"),
        "vocab_size": config.get("vocab_size"),
        "parameter_count": parameter_count,
    }


def language_model_register_local(
    *, path: str, name: str, owner, quantization: str = "none"
) -> LanguageModel:
    """Register a model from a folder under ``LOCAL_MODEL_ROOTS`` (status ``pending``)."""
    folder = local_model_folder(path)
    summary = model_config_summary(folder)
    return LanguageModel.objects.create(
        name=name, source=LanguageModel.Source.LOCAL, identifier=str(folder), quantization=quantization,
        owner=owner, **summary,
    )  # fmt: skip


def model_load_request(*, model_id: str, quantization: str | None = None) -> LanguageModel:
    """Mark the model ``loading`` and queue its load on the shared queue.

    A model that is already loading or ready answers 409 (``ALREADY_LOADING`` /
    ``ALREADY_LOADED``): two concurrent requests give exactly one load.
    """
    from models_app.workers import shared_queue

    with transaction.atomic():
        model = LanguageModel.objects.select_for_update().get(pk=model_id)
        if model.status == LanguageModel.Status.LOADING:
            raise ApplicationError("ALREADY_LOADING", "The model is already loading.", status=409)
        if model.status == LanguageModel.Status.READY:
            raise ApplicationError("ALREADY_LOADED", "The model is already loaded.", status=409)
        fields = model.mark_loading(progress=0, message="Queued")
        if quantization is not None and quantization != model.quantization:
            model.quantization = quantization
            fields.append("quantization")
        model_publish(model, "model:loading", fields)

        def enqueue() -> None:
            job = shared_queue().enqueue(
                "models_app.tasks.load_model", model.id, job_timeout=LOAD_JOB_TIMEOUT_SECONDS
            )
            LanguageModel.objects.filter(pk=model.id).update(rq_job_id=job.id)

        transaction.on_commit(enqueue)
    return model


def model_unload_request(*, model_id: str) -> LanguageModel:
    """Queue the unload on the host worker's own queue (only a ready model can be unloaded)."""
    from models_app.workers import worker_queue

    model = LanguageModel.objects.get(pk=model_id)
    if model.status != LanguageModel.Status.READY or not model.host_worker:
        raise ApplicationError("MODEL_NOT_LOADED", "The model is not loaded.", status=409)
    host = model.host_worker
    transaction.on_commit(
        lambda: worker_queue(host).enqueue(
            "models_app.tasks.unload_model", model.id, job_timeout=UNLOAD_JOB_TIMEOUT_SECONDS
        )
    )
    return model


def worker_release_models(
    *, worker_name: str, holding: Iterable[str] = (), code: str = "", message: str = ""
) -> None:
    """Mark ``unloaded`` the models rows say ``worker_name`` hosts, except those it is ``holding``.

    Called when a worker process starts (it holds nothing it did not load itself) and when it stops.
    """
    hosted = LanguageModel.objects.filter(
        host_worker=worker_name, status__in=[LanguageModel.Status.READY, LanguageModel.Status.LOADING]
    ).exclude(pk__in=list(holding))
    for model in hosted:
        model_publish(model, "model:unloaded", model.mark_unloaded(code=code, message=message))


def worker_lost_reconcile() -> list[str]:
    """Mark models whose host worker has no heartbeat ``unloaded`` with ``WORKER_LOST``; return their ids."""
    from models_app.workers import read_heartbeats

    alive = {beat["name"] for beat in read_heartbeats()}
    lost = []
    hosted = LanguageModel.objects.filter(
        status__in=[LanguageModel.Status.READY, LanguageModel.Status.LOADING]
    )
    for model in hosted.exclude(host_worker="").exclude(host_worker__in=alive):
        fields = model.mark_unloaded(code="WORKER_LOST", message="The worker hosting this model stopped.")
        model_publish(model, "model:unloaded", fields)
        lost.append(model.id)
    return lost
