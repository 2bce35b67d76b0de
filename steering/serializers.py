"""The one JSON shape of a steering vector: the API and the admin show these."""

from typing import Any

from steering.models import SteeringVector


def iso(value) -> str | None:
    return value.isoformat() if value else None


def vector_state(vector: SteeringVector) -> dict[str, Any]:
    return {
        "id": vector.id,
        "name": vector.name,
        "source": vector.source,
        "model_id": vector.model_id,
        "hook_name": vector.hook_name,
        "width": vector.width,
        "norm": vector.norm,
        "reduction": vector.reduction,
        "positive": vector.positive,
        "negative": vector.negative,
        "status": vector.status,
        "host_worker": vector.host_worker,
        "error_code": vector.error_code,
        "error_message": vector.error_message,
        "owner": vector.owner.username if vector.owner_id else None,
        "shared": vector.shared,
        "created_at": iso(vector.created_at),
        "finished_at": iso(vector.finished_at),
    }
