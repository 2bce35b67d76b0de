"""Read queries used by the API, pages, commands and WebSocket snapshots."""

from typing import Any

import django_filters
from django.db.models import Q, QuerySet

from engine.placement import AUTO
from mistudio.access import check_may_change, is_admin, visible_row, visible_rows
from mistudio.events import register_group_kind
from mistudio.health import database_status, redis_and_workers_status
from mistudio.workers import queue_lengths, read_heartbeats
from models_app.models import LanguageModel


class ModelFilter(django_filters.FilterSet):
    """Filters of ``GET /api/models``, the models page and ``list_models``."""

    search = django_filters.CharFilter(method="filter_search", max_length=200)

    class Meta:
        model = LanguageModel
        fields = ["status", "model_type", "source", "quantization"]

    def filter_search(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return queryset.filter(Q(name__icontains=value) | Q(identifier__icontains=value) | Q(pk=value))


def model_list(*, user, filters: dict[str, Any] | None = None) -> QuerySet[LanguageModel]:
    """Models the user may see (own, shared, system; all for ``model:admin``), filtered."""
    query = visible_rows(LanguageModel.objects.select_related("owner"), user, shareable=True)
    if filters:
        query = ModelFilter(filters, queryset=query).qs
    return query


def models_named(models: QuerySet[LanguageModel], reference: str) -> list[LanguageModel]:
    """The model whose id is ``reference``, else (up to two of) the models with that name.

    One result is a match; two mean the name is ambiguous; none, no such model.
    """
    model = models.filter(pk=reference).first()
    return [model] if model is not None else list(models.filter(name=reference)[:2])


def model_get(*, user, model_id: str) -> LanguageModel:
    return visible_row(model_list(user=user), model_id, code="MODEL_NOT_FOUND", what="model")


def model_get_to_change(*, user, model_id: str) -> LanguageModel:
    """The model, if the user may change it (404 when invisible, 403 ``NOT_OWNER`` when not theirs)."""
    model = model_get(user=user, model_id=model_id)
    check_may_change(model, user, what="model")
    return model


def model_state(model: LanguageModel) -> dict[str, Any]:
    """The live part of a model's row: what events and snapshots carry."""
    return {
        "model_id": model.id,
        "name": model.name,
        "status": model.status,
        "progress": model.progress,
        "stage": model.stage,
        "message": model.status_message,
        "quantization": model.quantization,
        "download_bytes_done": model.download_bytes_done,
        "download_bytes_total": model.download_bytes_total,
        "memory_usage_bytes": model.memory_usage_bytes,
        "load_time_seconds": model.load_time_seconds,
        "host_worker": model.host_worker,
        "pinned": model.pinned,
        "unload_reason": model.unload_reason,
        "error_code": model.error_code,
        "error_message": model.error_message,
    }


def splits_models(beat: dict) -> bool:
    """Whether the worker splits models across devices and disk (``--device auto``): it loads a
    model whatever its size, offloading what fits nowhere."""
    return beat.get("device") == AUTO


def memory_capacity(beat: dict) -> int:
    """What a worker could free for a new model: free memory plus its unpinned models (its budget too)."""
    pinned = set(
        LanguageModel.objects.filter(
            pk__in=[entry["model_id"] for entry in beat["loaded_models"]], pinned=True
        ).values_list("pk", flat=True)
    )
    evictable = sum(m["memory_usage_bytes"] for m in beat["loaded_models"] if m["model_id"] not in pinned)
    capacity = beat["memory_free_bytes"] + evictable
    if beat.get("memory_limit_bytes"):
        held = sum(m["memory_usage_bytes"] for m in beat["loaded_models"] if m["model_id"] in pinned)
        capacity = min(capacity, beat["memory_limit_bytes"] - held)
    return capacity


def model_memory_report(model: LanguageModel) -> dict[str, Any]:
    """The estimate per quantization and, per live worker, whether it fits (evicting unpinned models)."""

    workers = []
    for beat in read_heartbeats():
        capacity = memory_capacity(beat)
        workers.append(
            {
                "name": beat["name"],
                "device": beat["device"],
                "memory_free_bytes": beat["memory_free_bytes"],
                "capacity_bytes": capacity,
                "splits_models": splits_models(beat),
                "fits": {
                    option: size <= capacity or splits_models(beat)
                    for option, size in model.memory_estimates.items()
                },
            }
        )
    return {
        "model_id": model.id,
        "parameter_count": model.parameter_count,
        "estimates": {
            option: {"bytes": size, "gb": round(size / 2**30, 3)}
            for option, size in model.memory_estimates.items()
        },
        "workers": workers,
    }


def models_snapshot(user, key: str | None) -> dict[str, Any]:
    return {"models": [model_state(model) for model in model_list(user=user)]}


def model_snapshot(user, key: str | None) -> dict[str, Any] | None:
    model = model_list(user=user).filter(pk=key).first()
    return None if model is None else model_state(model)


def model_visible(user, key: str) -> bool:
    return model_list(user=user).filter(pk=key).exists()


def register_event_groups() -> None:
    register_group_kind("models", keyed=False, snapshot=models_snapshot)
    register_group_kind("model", keyed=True, snapshot=model_snapshot, visible=model_visible)


def worker_overview(*, user) -> dict[str, Any]:
    """What the workers page and ``GET /api/workers`` show ``user``: Redis and database status, each
    live worker's heartbeat, and the queue lengths.

    A worker lists only the loaded models ``user`` may see (named); the memory of the others is one
    sum, ``other_models_bytes``, so the worker's arithmetic stays whole without naming them. Host
    names and process ids are for admins and staff. Never raises for an unreachable Redis: it says
    so (``redis.ok`` false, no workers, no queues).
    """
    import time

    import redis

    redis_status, workers = redis_and_workers_status()
    queues: list[dict[str, Any]] = []
    if redis_status["ok"]:
        try:
            queues = queue_lengths(heartbeats=workers)
        except (redis.RedisError, OSError):
            redis_status, workers = {"ok": False, "error": "unreachable"}, []
    model_ids = [entry["model_id"] for beat in workers for entry in beat.get("loaded_models", [])]
    names = dict(model_list(user=user).filter(pk__in=model_ids).values_list("pk", "name"))
    operator = is_admin(user) or bool(getattr(user, "is_staff", False))
    for beat in workers:
        loaded = beat.get("loaded_models", [])
        beat["loaded_models"] = [
            {**entry, "name": names[entry["model_id"]]} for entry in loaded if entry["model_id"] in names
        ]
        beat["other_models_bytes"] = sum(
            entry.get("memory_usage_bytes") or 0 for entry in loaded if entry["model_id"] not in names
        )
        if not operator:
            beat.pop("hostname", None)
            beat.pop("pid", None)
    return {
        "redis": redis_status,
        "database": database_status(),
        "workers": workers,
        "queues": queues,
        "server_time": time.time(),  # heartbeat ages are measured on this clock, not the browser's
    }
