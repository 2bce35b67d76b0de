"""The one JSON shape of an SAE row and of an evaluation: the API, events and snapshots use them."""

import re
from typing import Any

from rest_framework import serializers

from activations.models import ActivationCache, Dataset
from engine.configs import config_from_dict
from engine.sae_architectures import ARCHITECTURES
from mistudio.access import AUDIENCE, linked_id
from mistudio.serializers import JobOutputSerializer, OutputSerializer, StrictSerializer
from saes.groups import GroupMember, GroupSettings, Variant, clt_member, group_members
from saes.models import SaeEvaluation, SaeGroup, SparseAutoencoder


def iso(value) -> str | None:
    return value.isoformat() if value else None


def sae_state(sae: SparseAutoencoder, *, viewer=AUDIENCE, with_history: bool = True) -> dict[str, Any]:
    """An SAE as ``GET /api/saes/{id}``, ``sae:*`` events and snapshots show it to ``viewer`` (an
    event's: everyone it reaches): the id of the cache it was trained or evaluated on only if they
    may see that cache. The list leaves out the bulky fields (``with_history=False``: the training
    curves)."""
    evaluation = dict(sae.evaluation)
    if "cache_id" in evaluation:
        evaluation["cache_id"] = linked_id(viewer, sae, ActivationCache, evaluation["cache_id"])
    state = {
        "id": sae.id,
        "name": sae.name,
        "source": sae.source,
        "model_id": sae.model_id,
        "model_name": sae.model_name,
        "cache_id": linked_id(viewer, sae, ActivationCache, sae.cache_id),
        "dataset_id": linked_id(viewer, sae, Dataset, sae.dataset_id),
        "group_id": sae.group_id,
        "hook_name": sae.hook_name,
        "hook_name_out": sae.hook_name_out or None,
        "feature_hook": sae.feature_hook,
        "architecture": sae.architecture,
        "d_in": sae.d_in,
        "d_out": sae.d_out,
        "d_sae": sae.d_sae,
        "n_layers": sae.n_layers,
        "k": sae.k,
        "hyperparameters": sae.hyperparameters,
        "scaling_factor": sae.scaling_factor,
        "status": sae.status,
        "progress": sae.progress,
        "step": sae.step,
        "total_steps": sae.total_steps,
        "tokens_seen": sae.tokens_seen,
        "total_tokens": sae.total_tokens,
        "tokens_per_second": sae.tokens_per_second,
        "eta_seconds": sae.eta_seconds,
        "metrics": sae.metrics,
        "evaluation": evaluation,
        "evaluation_status": sae.evaluation_status,
        "warnings": sae.warnings,
        "memory_estimate_bytes": sae.memory_estimate_bytes,
        "file_size_bytes": sae.file_size_bytes,
        "host_worker": sae.host_worker,
        "error_code": sae.error_code,
        "error_message": sae.error_message,
        "owner": sae.owner.username if sae.owner_id else None,
        "shared": sae.shared,
        "created_at": iso(sae.created_at),
        "started_at": iso(sae.started_at),
        "finished_at": iso(sae.finished_at),
        "training_time_seconds": sae.training_time_seconds,
    }
    if with_history:
        state["history"] = sae.history
    return state


def sae_event_state(sae: SparseAutoencoder) -> dict[str, Any]:
    """What ``sae:*`` events carry: the state without the curves (events carry new ``points``)."""
    return sae_state(sae, with_history=False)


def evaluation_state(evaluation: SaeEvaluation, *, viewer=AUDIENCE) -> dict[str, Any]:
    """An evaluation as its ``evaluation:*`` events (on its SAE's group) show it."""
    return {
        "evaluation_id": evaluation.id,
        "sae_id": evaluation.sae_id,
        # Its events reach everyone who sees the SAE: the SAE decides who may see the cache's id.
        "cache_id": linked_id(viewer, evaluation.sae, ActivationCache, evaluation.cache_id),
        "status": evaluation.status,
        "progress": evaluation.progress,
        "results": evaluation.results,
        "memory_estimate_bytes": evaluation.memory_estimate_bytes,
        "host_worker": evaluation.host_worker,
        "error_code": evaluation.error_code,
        "error_message": evaluation.error_message,
        "created_at": iso(evaluation.created_at),
        "finished_at": iso(evaluation.finished_at),
    }


# What a group shows of each member's held-out evaluation (the frontier plot's axes and more).
MEMBER_METRICS = ("l0", "explained_variance", "ce_loss_recovered", "dead_features", "mse")


def group_member_state(sae: SparseAutoencoder) -> dict[str, Any]:
    """A member as its group lists it: what tells it from the others, and its results."""
    return {
        "id": sae.id,
        "name": sae.name,
        "hook_name": sae.hook_name,
        "hook_name_out": sae.hook_name_out or None,
        "architecture": sae.architecture,
        "d_sae": sae.d_sae,
        "k": sae.k,
        "lr": sae.hyperparameters.get("lr"),
        "status": sae.status,
        "step": sae.step,
        "metrics": sae.metrics,
        "evaluation": {key: sae.evaluation.get(key) for key in MEMBER_METRICS},
    }


def sae_group_state(group: SaeGroup, *, viewer=AUDIENCE) -> dict[str, Any]:
    """A group as ``GET /api/saes/groups/{id}``, ``sae_group:*`` events and snapshots show it:
    the dataset's id only to those who may see the dataset."""
    return {
        "id": group.id,
        "name": group.name,
        "model_id": group.model_id,
        "dataset_id": linked_id(viewer, group, Dataset, group.dataset_id),
        "settings": group.settings,
        "status": group.status,
        "progress": group.progress,
        "step": group.step,
        "total_steps": group.total_steps,
        "tokens_seen": group.tokens_seen,
        "total_tokens": group.total_tokens,
        "tokens_per_second": group.tokens_per_second,
        "eta_seconds": group.eta_seconds,
        "memory_estimate_bytes": group.memory_estimate_bytes,
        "host_worker": group.host_worker,
        "error_code": group.error_code,
        "error_message": group.error_message,
        "owner": group.owner.username if group.owner_id else None,
        "shared": group.shared,
        "analyze_members": group.analyze_members,
        "created_at": iso(group.created_at),
        "started_at": iso(group.started_at),
        "finished_at": iso(group.finished_at),
        "members": [group_member_state(sae) for sae in group.members.order_by("group_index")],
    }


# --- a group request's parts (the API, the page and the command validate with them) ---------------


class TranscoderSerializer(StrictSerializer):
    hook_in = serializers.CharField(max_length=300)
    hook_out = serializers.CharField(max_length=300)
    skip = serializers.BooleanField(default=False)


class VariantSerializer(StrictSerializer):
    architecture = serializers.ChoiceField(choices=ARCHITECTURES, required=False)
    expansion_factor = serializers.IntegerField(min_value=1, max_value=1024, required=False)
    d_sae = serializers.IntegerField(min_value=1, max_value=2**24, required=False)
    k = serializers.IntegerField(min_value=1, max_value=2**16, required=False)
    l1_coefficient = serializers.FloatField(min_value=0, max_value=1e6, required=False)
    l0_coefficient = serializers.FloatField(min_value=0, max_value=1e6, required=False)
    lr = serializers.FloatField(min_value=1e-8, max_value=1.0, required=False)
    matryoshka_widths = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=2**24), max_length=16, required=False
    )
    dead_after_steps = serializers.IntegerField(min_value=1, max_value=10**9, required=False)


TRANSCODER_LINE = re.compile(r"^\s*(\S+)\s*(?:->|→)\s*(\S+)\s*(skip)?\s*$")


def parse_transcoders(text: str) -> list[dict[str, Any]]:
    """``in -> out`` (``skip`` after it for a skip transcoder), one a line: the page's and the
    command's text as the API's ``transcoders``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = TRANSCODER_LINE.match(line)
        if match is None:
            raise serializers.ValidationError(
                {"transcoders": [f"Line {number}: write it as 'input hook -> output hook [skip]'."]}
            )
        found.append({"hook_in": match[1], "hook_out": match[2], "skip": bool(match[3])})
    return found


def parse_variants(text: str) -> list[dict[str, Any]]:
    """One variant a line, as ``name=value`` pairs (``k=32 expansion_factor=8``): the page's and
    the command's text as the API's ``variants``, each checked by :class:`VariantSerializer`."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        variant: dict[str, Any] = {}
        for pair in line.replace(",", " ").split():
            name, _, value = pair.partition("=")
            if not value:
                raise serializers.ValidationError(
                    {"variants": [f"Line {number}: write each setting as name=value."]}
                )
            variant[name] = value.split("/") if name == "matryoshka_widths" else value
        checked = VariantSerializer(data=variant)
        if not checked.is_valid():
            raise serializers.ValidationError({"variants": [f"Line {number}: {checked.errors}"]})
        found.append(dict(checked.validated_data))
    return found


def group_variant(values: dict[str, Any]) -> Variant:
    """A validated variant (:class:`VariantSerializer`) as the service's :class:`Variant`."""
    return config_from_dict(Variant, frozen_widths(values))


def group_request_members(
    *,
    hooks: list[str],
    transcoders: list[dict[str, Any]],
    variants: list[dict[str, Any]],
    cross_layer_transcoder: bool = False,
    n_layers: int | None = None,
) -> tuple[GroupMember, ...]:
    """Validated hooks, transcoders and variants as the group's members: every site once per
    variant; ``cross_layer_transcoder``: one more site, a CLT over the model's ``n_layers``."""
    sites = [GroupMember(hook=hook) for hook in hooks]
    sites += [
        GroupMember(hook=each["hook_in"], hook_out=each["hook_out"], skip=bool(each.get("skip", False)))
        for each in transcoders
    ]
    if cross_layer_transcoder:
        sites.append(clt_member(n_layers or 0))
    return group_members(sites=sites, variants=[group_variant(variant) for variant in variants])


def group_request(
    values: dict[str, Any], *, n_layers: int | None = None
) -> tuple[GroupSettings, tuple[GroupMember, ...]]:
    """A validated group request (the API's body less ``model_id``, ``dataset_id``, ``name`` and
    ``shared``) as the service's settings and members (``n_layers``: the model's, for a CLT); a
    key the settings lack is an error."""
    values = dict(values)
    members = group_request_members(
        hooks=values.pop("hooks", []),
        transcoders=values.pop("transcoders", []),
        variants=values.pop("variants", []),
        cross_layer_transcoder=values.pop("cross_layer_transcoder", False),
        n_layers=n_layers,
    )
    return config_from_dict(GroupSettings, frozen_widths(values)), members


def frozen_widths(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``matryoshka_widths`` as a tuple (the settings are frozen, hence hashable)."""
    widths = values.get("matryoshka_widths")
    return values if widths is None else {**values, "matryoshka_widths": tuple(widths)}


# --- output serializers: what the schema says the rows' JSON above is -----------------------------


class SaeOutputSerializer(JobOutputSerializer):
    """:func:`sae_state` (``history`` only on an SAE's own detail)."""

    id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    source = serializers.CharField()
    model_id = serializers.CharField(allow_null=True)
    model_name = serializers.CharField(allow_blank=True)
    cache_id = serializers.CharField(allow_null=True)
    dataset_id = serializers.CharField(allow_null=True)
    group_id = serializers.CharField(allow_null=True)
    hook_name = serializers.CharField()
    hook_name_out = serializers.CharField(allow_null=True)
    feature_hook = serializers.CharField()
    architecture = serializers.CharField()
    d_in = serializers.IntegerField()
    d_out = serializers.IntegerField(allow_null=True)
    d_sae = serializers.IntegerField(help_text="Features (per layer, for a cross-layer transcoder)")
    n_layers = serializers.IntegerField(
        allow_null=True, help_text="A cross-layer transcoder's layers; null for a single-layer SAE"
    )
    k = serializers.IntegerField(allow_null=True)
    hyperparameters = serializers.DictField()
    scaling_factor = serializers.FloatField(allow_null=True)
    step = serializers.IntegerField()
    total_steps = serializers.IntegerField()
    tokens_seen = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    tokens_per_second = serializers.FloatField(allow_null=True)
    eta_seconds = serializers.FloatField(allow_null=True)
    metrics = serializers.DictField()
    evaluation = serializers.DictField()
    evaluation_status = serializers.CharField(allow_blank=True)
    warnings = serializers.ListField(child=serializers.CharField())
    memory_estimate_bytes = serializers.IntegerField()
    file_size_bytes = serializers.IntegerField()
    training_time_seconds = serializers.FloatField(allow_null=True)
    history = serializers.ListField(child=serializers.DictField(), required=False)


class EvaluationOutputSerializer(OutputSerializer):
    """:func:`evaluation_state`."""

    evaluation_id = serializers.CharField()
    sae_id = serializers.CharField()
    cache_id = serializers.CharField(allow_null=True)
    status = serializers.CharField()
    progress = serializers.FloatField()
    results = serializers.DictField()
    memory_estimate_bytes = serializers.IntegerField()
    host_worker = serializers.CharField(allow_blank=True)
    error_code = serializers.CharField(allow_blank=True)
    error_message = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


class GroupMemberOutputSerializer(OutputSerializer):
    """:func:`group_member_state`: the member's held-out metrics are null until it is evaluated."""

    id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    hook_name = serializers.CharField()
    hook_name_out = serializers.CharField(allow_null=True)
    architecture = serializers.CharField()
    d_sae = serializers.IntegerField()
    k = serializers.IntegerField(allow_null=True)
    lr = serializers.FloatField(allow_null=True)
    status = serializers.CharField()
    step = serializers.IntegerField()
    metrics = serializers.DictField()
    evaluation = serializers.DictField(child=serializers.FloatField(allow_null=True))


class SaeGroupOutputSerializer(JobOutputSerializer):
    """:func:`sae_group_state`."""

    id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    model_id = serializers.CharField(allow_null=True)
    dataset_id = serializers.CharField(allow_null=True)
    settings = serializers.DictField()
    step = serializers.IntegerField()
    total_steps = serializers.IntegerField()
    tokens_seen = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    tokens_per_second = serializers.FloatField(allow_null=True)
    eta_seconds = serializers.FloatField(allow_null=True)
    memory_estimate_bytes = serializers.IntegerField()
    analyze_members = serializers.BooleanField()
    members = GroupMemberOutputSerializer(many=True)


class SaeListOutputSerializer(OutputSerializer):
    """``GET /api/saes``: the newest 500 (without their curves) and how many there are."""

    saes = SaeOutputSerializer(many=True)
    total = serializers.IntegerField()


class SaeEvaluationStartedOutputSerializer(SaeOutputSerializer):
    """The SAE as an evaluation of it is queued, with that evaluation's id."""

    evaluation_id = serializers.CharField()


class TranscoderSetOutputSerializer(OutputSerializer):
    """The SAEs a transcoder set's import made (or found already imported)."""

    saes = SaeOutputSerializer(many=True)


class SaeGroupListOutputSerializer(OutputSerializer):
    """``GET /api/saes/groups``: the newest 200 and how many there are."""

    groups = SaeGroupOutputSerializer(many=True)
    total = serializers.IntegerField()
