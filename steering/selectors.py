"""Reading steering vectors: the ones a user may see, one by id, and the file for export."""

from typing import Any

from django.db.models import QuerySet

from generation.interventions import VectorReference
from mistudio.access import check_may_change, completed_row, visible_row, visible_rows
from mistudio.events import register_group_kind
from steering.models import SteeringVector
from steering.serializers import vector_state


def vector_list(*, user, model_id: str | None = None) -> QuerySet[SteeringVector]:
    """Vectors the user may see: their own, shared ones and system ones (all for ``model:admin``)."""
    vectors = visible_rows(SteeringVector.objects.select_related("owner"), user, shareable=True)
    return vectors.filter(model_id=model_id) if model_id else vectors


def vector_get(*, user, vector_id: str) -> SteeringVector:
    return visible_row(
        vector_list(user=user), vector_id, code="STEERING_VECTOR_NOT_FOUND", what="steering vector"
    )


def vector_get_to_change(*, user, vector_id: str) -> SteeringVector:
    vector = vector_get(user=user, vector_id=vector_id)
    check_may_change(vector, user, what="steering vector")
    return vector


def completed_vector(*, user, vector_id: str) -> SteeringVector:
    return completed_row(
        vector_get(user=user, vector_id=vector_id), code="STEERING_VECTOR_NOT_READY", what="steering vector"
    )


def vector_reference(user, vector_id: str) -> VectorReference | None:
    """What an intervention needs of a completed vector the user can see; None otherwise."""
    vector = vector_list(user=user).filter(pk=vector_id, status=SteeringVector.Status.COMPLETED).first()
    if vector is None:
        return None
    return VectorReference(id=vector.id, hook_name=vector.hook_name, width=vector.width)


def vector_snapshot(user, key: str | None) -> dict[str, Any] | None:
    vector = vector_list(user=user).filter(pk=key).first()
    return None if vector is None else vector_state(vector, viewer=user, with_prompts=False)


def register_event_groups() -> None:
    register_group_kind(
        "vector",
        keyed=True,
        snapshot=vector_snapshot,
        visible=lambda user, key: vector_list(user=user).filter(pk=key).exists(),
    )
