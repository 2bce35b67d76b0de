"""RQ entry points. They take ids, load the row, and do the work in the current worker."""

import logging
import time
from pathlib import Path

from django.db import close_old_connections

from models_app.engine.registry import LOADED_MODELS, LoadedModel
from models_app.models import LanguageModel
from models_app.services import model_publish

logger = logging.getLogger(__name__)


def current_worker():
    from models_app import workers

    if workers.CURRENT_WORKER is None:
        raise RuntimeError("model jobs run only inside a miStudio worker (manage.py worker)")
    return workers.CURRENT_WORKER


def model_files(model: LanguageModel) -> Path:
    """Stage 'resolve': the folder holding the model's files (downloaded first for hub models)."""
    if model.source == LanguageModel.Source.LOCAL:
        from models_app.services import local_model_folder

        return local_model_folder(model.identifier)
    from django.conf import settings
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            model.identifier,
            revision=model.revision or None,
            cache_dir=settings.MODEL_CACHE_DIR,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"],
            token=settings.HF_TOKEN,
        )
    )


def load_model(model_id: str) -> None:
    """Load the model into this worker, which becomes its host. Idempotent for a retried job."""
    from models_app.engine.loading import load_weights, warm_up

    close_old_connections()
    identity = current_worker()
    model = LanguageModel.objects.get(pk=model_id)
    if model.status == LanguageModel.Status.READY and LOADED_MODELS.get(model_id) is not None:
        return
    started = time.monotonic()
    try:
        model_publish(model, "model:loading", model.mark_loading(progress=5, message="Resolving files"))
        folder = model_files(model)
        model_publish(model, "model:loading", model.mark_loading(progress=20, message="Loading weights"))
        weights = load_weights(
            folder, model_type=model.model_type, quantization=model.quantization, device=identity.device
        )
        model_publish(model, "model:loading", model.mark_loading(progress=90, message="Warming up"))
        warm_up(weights)
    except Exception as error:
        logger.exception("loading %s failed", model_id)
        code = getattr(error, "code", "MODEL_LOAD_FAILED")
        message = getattr(error, "message", None) or f"Loading failed: {type(error).__name__}."
        model_publish(model, "model:failed", model.mark_failed(code=code, message=message))
        return
    LOADED_MODELS.add(
        LoadedModel(
            model_id=model_id,
            model=weights.model,
            tokenizer=weights.tokenizer,
            quantization=model.quantization,
            memory_usage_bytes=weights.memory_usage_bytes,
        )
    )
    fields = model.mark_ready(
        host_worker=identity.name,
        memory_usage_bytes=weights.memory_usage_bytes,
        load_time_seconds=round(time.monotonic() - started, 3),
    )
    model_publish(model, "model:ready", fields)


def unload_model(model_id: str) -> None:
    """Drop the model from this worker's memory and mark it ``unloaded``."""
    close_old_connections()
    LOADED_MODELS.remove(model_id)
    import gc

    gc.collect()
    model = LanguageModel.objects.get(pk=model_id)
    if model.status == LanguageModel.Status.READY:
        model_publish(model, "model:unloaded", model.mark_unloaded())
