"""The OpenAPI description of an intervention object (``mistudio.interventions``): one component
per kind of :mod:`engine.interventions`, joined as the polymorphic ``Intervention`` (``oneOf``,
told apart by ``type``).

The serializers here only describe: the request bodies keep the object as JSON and each kind's
``normalized_json`` checks it against the model (hook widths, SAEs, stored vectors), which a
serializer cannot. A client builds against this component (mistudio-client's builders are tested
against it), and a test checks that each registered kind's component names exactly the fields the
kind reads.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import PolymorphicProxySerializer, extend_schema_field
from rest_framework import serializers

from engine.hooks import MAX_HOOK_NAME_LENGTH
from engine.intervention_json import (
    MAX_INDICES,
    MAX_MAGNITUDE,
    MAX_POSITIONS,
    MAX_VECTOR,
    POSITION_KINDS,
    UNITS,
)
from engine.interventions import Ablate, Add, ClampFeature, Replace

ROW_ID_LENGTH = 64  # what a row's id column holds
MAX_FEATURE_INDEX = 2**31 - 1


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": list(POSITION_KINDS)},
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0},
                "minItems": 1,
                "maxItems": MAX_POSITIONS,
            },
        ],
        "description": "Where it applies: all tokens, the prompt's, the generated ones, or absolute "
        "positions (0 is the prompt's first token).",
    }
)
class PositionsField(serializers.JSONField):
    pass


def _kind(kind: str) -> serializers.Field:
    """The ``type`` field of one kind: the one string that names it."""
    field = extend_schema_field({"type": "string", "enum": [kind]})(
        type(f"{kind}KindField", (serializers.CharField,), {})
    )
    return field(max_length=len(kind))


def _amount(**options: Any) -> serializers.FloatField:
    return serializers.FloatField(min_value=-MAX_MAGNITUDE, max_value=MAX_MAGNITUDE, **options)


def _hook(**options: Any) -> serializers.CharField:
    return serializers.CharField(max_length=MAX_HOOK_NAME_LENGTH, **options)


def _row_id(help_text: str, **options: Any) -> serializers.CharField:
    """A stored row's id (``sae_…``, ``sv_…``, ``act_…``)."""
    return serializers.CharField(max_length=ROW_ID_LENGTH, help_text=help_text, **options)


def _feature(**options: Any) -> serializers.IntegerField:
    return serializers.IntegerField(min_value=0, max_value=MAX_FEATURE_INDEX, **options)


def _indices(**options: Any) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.IntegerField(min_value=0), min_length=1, max_length=MAX_INDICES, **options
    )


def _vector(**options: Any) -> serializers.ListField:
    return serializers.ListField(child=_amount(), min_length=1, max_length=MAX_VECTOR, **options)


HOOK_HELP = "A hook point of the model; by default where the SAE's features or the stored vector are."
UNIT_HELP = (
    "An SAE feature's amount in units of its max activation (the default when an analysis gives one) or raw."
)


class AddInterventionSerializer(serializers.Serializer):
    """``x + coefficient * v`` where ``v`` is one of ``vector``, ``steering_vector``, or ``sae`` and
    ``feature`` (its decoder row)."""

    type = _kind(Add.kind)
    hook = _hook(required=False, help_text=HOOK_HELP)
    positions = PositionsField(required=False)
    vector = _vector(required=False)
    steering_vector = _row_id("A stored steering vector's id.", required=False)
    sae = _row_id("An SAE's (or transcoder's) id.", required=False)
    feature = _feature(required=False)
    coefficient = _amount(required=False, default=1.0)
    normalize = serializers.BooleanField(required=False, default=False)
    unit = serializers.ChoiceField(choices=UNITS, required=False, help_text=UNIT_HELP)


class ClampFeatureInterventionSerializer(serializers.Serializer):
    """An SAE feature set to ``value``, the SAE's reconstruction error kept."""

    type = _kind(ClampFeature.kind)
    hook = _hook(required=False, help_text=HOOK_HELP)
    positions = PositionsField(required=False)
    sae = _row_id("An SAE's id.")
    feature = _feature()
    value = _amount()
    unit = serializers.ChoiceField(choices=UNITS, required=False, help_text=UNIT_HELP)


class AblateInterventionSerializer(serializers.Serializer):
    """``neurons`` of ``hook``, or ``features`` of ``sae``, set to zero (or to their mean over the
    cache ``mean_from``)."""

    type = _kind(Ablate.kind)
    hook = _hook(required=False, help_text=HOOK_HELP)
    positions = PositionsField(required=False)
    sae = _row_id("An SAE's id.", required=False)
    features = _indices(required=False)
    neurons = _indices(required=False)
    mean_from = _row_id("A completed activation cache's id.", required=False)


class ReplaceInterventionSerializer(serializers.Serializer):
    """``hook``'s activation set to ``vector`` (activation patching)."""

    type = _kind(Replace.kind)
    hook = _hook(help_text="A hook point of the model.")
    positions = PositionsField(required=False)
    vector = _vector()


# One description per registered kind, by its type name.
KIND_SERIALIZERS: dict[str, type[serializers.Serializer]] = {
    Add.kind: AddInterventionSerializer,
    ClampFeature.kind: ClampFeatureInterventionSerializer,
    Ablate.kind: AblateInterventionSerializer,
    Replace.kind: ReplaceInterventionSerializer,
}


def intervention_schema(*, many: bool = False) -> PolymorphicProxySerializer:
    """The ``Intervention`` component (a list of them with ``many``)."""
    return PolymorphicProxySerializer(
        component_name="Intervention",
        serializers=KIND_SERIALIZERS,
        resource_type_field_name="type",
        many=many,
    )


@extend_schema_field(intervention_schema(many=True))
class InterventionsField(serializers.JSONField):
    """A list of intervention objects, kept as JSON: the kinds check them against the model."""


@extend_schema_field(intervention_schema())
class InterventionField(serializers.JSONField):
    """One intervention object, kept as JSON."""
