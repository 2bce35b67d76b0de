"""The one JSON shape of a steering vector: the API, its events and snapshots show these."""

from typing import Any

from rest_framework import serializers

from activations.models import Dataset
from mistudio.access import AUDIENCE, linked_id
from mistudio.serializers import JobOutputSerializer, OutputSerializer
from steering.models import SteeringVector


def iso(value) -> str | None:
    return value.isoformat() if value else None


def vector_state(vector: SteeringVector, *, viewer=AUDIENCE, with_prompts: bool = True) -> dict[str, Any]:
    """A vector as ``GET /api/steering-vectors/{id}`` shows it to ``viewer`` (an event's: everyone it
    reaches): a dataset it was built from only if they may see that dataset. Lists and events
    leave the prompts out (``with_prompts=False``)."""
    state = {
        "id": vector.id,
        "name": vector.name,
        "source": vector.source,
        "model_id": vector.model_id,
        "hook_name": vector.hook_name,
        "width": vector.width,
        "norm": vector.norm,
        "reduction": vector.reduction,
        "positive_dataset_id": linked_id(viewer, vector, Dataset, vector.positive_dataset_id),
        "negative_dataset_id": linked_id(viewer, vector, Dataset, vector.negative_dataset_id),
        "status": vector.status,
        "progress": vector.progress,
        "memory_estimate_bytes": vector.memory_estimate_bytes,
        "host_worker": vector.host_worker,
        "error_code": vector.error_code,
        "error_message": vector.error_message,
        "owner": vector.owner.username if vector.owner_id else None,
        "shared": vector.shared,
        "created_at": iso(vector.created_at),
        "started_at": iso(vector.started_at),
        "finished_at": iso(vector.finished_at),
    }
    if with_prompts:
        state["positive"], state["negative"] = vector.positive, vector.negative
    return state


def vector_event_state(vector: SteeringVector) -> dict[str, Any]:
    return vector_state(vector, with_prompts=False)


class VectorOutputSerializer(JobOutputSerializer):
    """:func:`vector_state` (the prompts only on a vector's own detail)."""

    id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    source = serializers.CharField()
    model_id = serializers.CharField(allow_null=True)
    hook_name = serializers.CharField()
    width = serializers.IntegerField(allow_null=True)
    norm = serializers.FloatField(allow_null=True)
    reduction = serializers.CharField()
    positive_dataset_id = serializers.CharField(allow_null=True)
    negative_dataset_id = serializers.CharField(allow_null=True)
    memory_estimate_bytes = serializers.IntegerField()
    positive = serializers.ListField(child=serializers.CharField(allow_blank=True), required=False)
    negative = serializers.ListField(child=serializers.CharField(allow_blank=True), required=False)


class VectorListOutputSerializer(OutputSerializer):
    """``GET /api/steering-vectors``: without their prompts, and how many there are."""

    vectors = VectorOutputSerializer(many=True)
    total = serializers.IntegerField()


class PatchingOutputSerializer(OutputSerializer):
    """Activation patching's answer: per hook and position, the logit difference patched in (and
    normalized: 0 corrupted, 1 clean; null when both runs agree)."""

    tokens = serializers.ListField(child=serializers.CharField(allow_blank=True))
    corrupted_tokens = serializers.ListField(child=serializers.CharField(allow_blank=True))
    answer_id = serializers.IntegerField()
    wrong_id = serializers.IntegerField()
    hooks = serializers.ListField(child=serializers.CharField())
    clean_metric = serializers.FloatField()
    corrupted_metric = serializers.FloatField()
    grid = serializers.ListField(child=serializers.ListField(child=serializers.FloatField()))
    normalized = serializers.ListField(
        child=serializers.ListField(child=serializers.FloatField(allow_null=True))
    )
    all_positions = serializers.ListField(child=serializers.FloatField())


class LensTokenOutputSerializer(OutputSerializer):
    token_id = serializers.IntegerField()
    token = serializers.CharField(allow_blank=True)
    probability = serializers.FloatField()


class LogitLensOutputSerializer(OutputSerializer):
    """The logit lens: per layer and position, the top next tokens read off the residual stream."""

    tokens = serializers.ListField(child=serializers.CharField(allow_blank=True))
    layers = serializers.ListField(child=serializers.IntegerField())
    top = serializers.ListField(child=serializers.ListField(child=LensTokenOutputSerializer(many=True)))
