"""Read queries used by the API, pages, commands and WebSocket snapshots."""

from typing import Any

from django.db.models import QuerySet

from mistudio.errors import ApplicationError
from mistudio.events import register_group_kind
from models_app import roles
from models_app.models import LanguageModel


def model_list(*, user) -> QuerySet[LanguageModel]:
    """Models the user may read. (Per-owner visibility arrives with the ownership work.)"""
    if not user.has_perm(roles.READ):
        return LanguageModel.objects.none()
    return LanguageModel.objects.all()


def model_get(*, user, model_id: str) -> LanguageModel:
    model = model_list(user=user).filter(pk=model_id).first()
    if model is None:
        raise ApplicationError("MODEL_NOT_FOUND", "No such model.", status=404)
    return model


def model_state(model: LanguageModel) -> dict[str, Any]:
    """The live part of a model's row: what events and snapshots carry."""
    return {
        "model_id": model.id,
        "name": model.name,
        "status": model.status,
        "progress": model.progress,
        "message": model.status_message,
        "quantization": model.quantization,
        "memory_usage_bytes": model.memory_usage_bytes,
        "load_time_seconds": model.load_time_seconds,
        "host_worker": model.host_worker,
        "error_code": model.error_code,
        "error_message": model.error_message,
    }


def models_snapshot(user, key: str | None) -> dict[str, Any]:
    return {"models": [model_state(model) for model in model_list(user=user)]}


def model_snapshot(user, key: str | None) -> dict[str, Any] | None:
    model = model_list(user=user).filter(pk=key).first()
    return None if model is None else model_state(model)


def register_event_groups() -> None:
    register_group_kind("models", keyed=False, snapshot=models_snapshot)
    register_group_kind("model", keyed=True, snapshot=model_snapshot)
