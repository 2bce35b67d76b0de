"""Request serializers of generation: sampling, messages and capture, shared by /api/generate,
the OpenAI-compatible API, the playground and the generate/play commands."""

from __future__ import annotations

import math
from typing import Any

from rest_framework import serializers

from generation.intervention_schema import InterventionField, InterventionsField
from generation.services import (
    CAPTURE_DTYPES,
    MAX_BATCH_PROMPTS,
    MAX_PROMPT_CHARACTERS,
    MAX_STOP_SEQUENCES,
    MAX_SWEEP_COEFFICIENTS,
    MAX_TOKENS_LIMIT,
    SamplingRequest,
)
from mistudio.serializers import OutputSerializer, StrictSerializer

MAX_STOP_CHARACTERS = 200


class MessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=["system", "user", "assistant"])
    content = serializers.CharField(allow_blank=True, trim_whitespace=False, max_length=MAX_PROMPT_CHARACTERS)


class CaptureSerializer(StrictSerializer):
    """The ``mistudio`` extension: capture hook points during generation, and intervene
    (``interventions``: checked against the model by ``generation.interventions``)."""

    capture = serializers.ListField(child=serializers.CharField(max_length=300), max_length=64, default=list)
    store = serializers.BooleanField(default=True)
    dtype = serializers.ChoiceField(choices=CAPTURE_DTYPES, default="float32")
    interventions = InterventionsField(required=False)
    measure = serializers.JSONField(required=False)


def string_or_list(value: Any, *, field: str, max_items: int, max_length: int) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise serializers.ValidationError({field: ["A string or a list of strings."]})
    if len(items) > max_items:
        raise serializers.ValidationError({field: [f"At most {max_items} items."]})
    if any(len(item) > max_length for item in items):
        raise serializers.ValidationError({field: [f"Each at most {max_length} characters."]})
    return items


class SamplingSerializer(StrictSerializer):
    """Sampling fields shared by ``/api/generate`` and the OpenAI-compatible endpoints."""

    max_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS_LIMIT, required=False)
    temperature = serializers.FloatField(min_value=0, max_value=2, required=False)
    top_p = serializers.FloatField(min_value=0, max_value=1, required=False)
    top_k = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    repetition_penalty = serializers.FloatField(min_value=0, max_value=10, required=False)
    seed = serializers.IntegerField(min_value=0, max_value=2**63 - 1, required=False, allow_null=True)
    stop = serializers.JSONField(required=False, allow_null=True)
    logprobs = serializers.BooleanField(required=False)
    top_logprobs = serializers.IntegerField(min_value=0, max_value=20, required=False)
    ignore_eos = serializers.BooleanField(required=False)
    mistudio = CaptureSerializer(required=False)

    # /api/generate follows seed 000's defaults; the OpenAI endpoints override them with OpenAI's.
    default_temperature = 0.7
    default_top_p = 0.95

    def validate(self, attrs):
        attrs = super().validate(attrs)
        errors = {}
        for name in ("temperature", "top_p", "repetition_penalty"):
            if name in attrs and not math.isfinite(attrs[name]):
                errors[name] = ["Must be a finite number."]
        if attrs.get("top_p") == 0:
            errors["top_p"] = ["Must be greater than 0."]
        if attrs.get("repetition_penalty") == 0:
            errors["repetition_penalty"] = ["Must be greater than 0."]
        if errors:
            raise serializers.ValidationError(errors)
        if attrs.get("stop") is not None:
            attrs["stop"] = string_or_list(
                attrs["stop"], field="stop", max_items=MAX_STOP_SEQUENCES, max_length=MAX_STOP_CHARACTERS
            )
            if any(not stop for stop in attrs["stop"]):
                raise serializers.ValidationError({"stop": ["Stop sequences must not be empty."]})
        return attrs

    def sampling(self, data: dict[str, Any]) -> SamplingRequest:
        return SamplingRequest(
            max_tokens=data.get("max_tokens", SamplingRequest.max_tokens),
            max_tokens_explicit="max_tokens" in data,
            temperature=data.get("temperature", self.default_temperature),
            top_p=data.get("top_p", self.default_top_p),
            top_k=data.get("top_k", 0),
            repetition_penalty=data.get("repetition_penalty", 1.0),
            seed=data.get("seed"),
            stop=data.get("stop") or [],
            logprobs=bool(data.get("logprobs")) or data.get("top_logprobs", 0) > 0,
            top_logprobs=data.get("top_logprobs", 0),
            ignore_eos=data.get("ignore_eos", False),
        )


class GenerateInputSerializer(SamplingSerializer):
    model_id = serializers.CharField(max_length=500)
    prompt = serializers.JSONField(required=False)
    messages = MessageSerializer(many=True, required=False, allow_empty=False)
    system_prompt = serializers.CharField(
        required=False, allow_blank=True, trim_whitespace=False, max_length=MAX_PROMPT_CHARACTERS
    )
    chat_template = serializers.BooleanField(required=False, allow_null=True, default=None)
    stream = serializers.BooleanField(default=False)

    def validate(self, attrs):
        attrs = super().validate(attrs)
        if ("prompt" in attrs) == ("messages" in attrs):
            raise serializers.ValidationError({"prompt": ["Give either prompt or messages."]})
        if "prompt" in attrs:
            attrs["prompt"] = string_or_list(
                attrs["prompt"], field="prompt", max_items=MAX_BATCH_PROMPTS, max_length=MAX_PROMPT_CHARACTERS
            )
            if not attrs["prompt"]:
                raise serializers.ValidationError({"prompt": ["Give at least one prompt."]})
            if attrs["stream"] and len(attrs["prompt"]) > 1:
                raise serializers.ValidationError(
                    {"prompt": ["A stream takes one prompt (or messages); send a batch without stream."]}
                )
        return attrs


class SweepInputSerializer(SamplingSerializer):
    """``POST /api/generate/sweep``: one prompt, one intervention, several strengths."""

    model_id = serializers.CharField(max_length=500)
    prompt = serializers.CharField(trim_whitespace=False, max_length=MAX_PROMPT_CHARACTERS)
    intervention = InterventionField()
    coefficients = serializers.ListField(
        child=serializers.FloatField(), required=False, allow_empty=False, max_length=MAX_SWEEP_COEFFICIENTS
    )
    measure = serializers.JSONField(required=False)
    mistudio = None  # no capture or interventions beside the swept one


class UsageOutputSerializer(OutputSerializer):
    """Token counts in OpenAI's shape (``Generation.usage``)."""

    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class TimingsOutputSerializer(OutputSerializer):
    """``Generation.timings``: null until the generation has them."""

    prefill_ms = serializers.FloatField(allow_null=True)
    decode_tokens_per_second = serializers.FloatField(allow_null=True)
    total_ms = serializers.FloatField(allow_null=True)


class GenerationRowOutputSerializer(OutputSerializer):
    """What :func:`generation.selectors.generation_state` shows of a generation, whole or listed."""

    request_id = serializers.CharField()
    model_id = serializers.CharField()
    status = serializers.CharField()
    interface = serializers.CharField()
    parameters = serializers.DictField()
    capture_hooks = serializers.ListField(child=serializers.CharField())
    effect = serializers.DictField(allow_null=True)
    sweep_coefficient = serializers.FloatField(allow_null=True)
    finish_reason = serializers.CharField(allow_blank=True)
    usage = UsageOutputSerializer()
    timings = TimingsOutputSerializer()
    cache_id = serializers.CharField(allow_null=True)
    error_code = serializers.CharField(allow_blank=True)
    error_message = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField(allow_null=True)
    completed_at = serializers.DateTimeField(allow_null=True)


class GenerationOutputSerializer(GenerationRowOutputSerializer):
    """A generation whole (``GET /api/generations/{id}``, events, snapshots)."""

    prompt = serializers.CharField(allow_blank=True)
    messages = serializers.ListField(child=serializers.DictField())
    output_text = serializers.CharField(allow_blank=True)
    output_token_ids = serializers.ListField(child=serializers.IntegerField())
    input_token_ids = serializers.ListField(child=serializers.IntegerField())


class GenerationSummaryOutputSerializer(GenerationRowOutputSerializer):
    """A generation as the list shows it: the start of its prompt and output."""

    prompt_preview = serializers.CharField(allow_blank=True)
    output_preview = serializers.CharField(allow_blank=True)


class GenerationListOutputSerializer(OutputSerializer):
    """``GET /api/generations``: the caller's newest 200, as the list shows them."""

    results = GenerationSummaryOutputSerializer(many=True)


class GenerateResultOutputSerializer(OutputSerializer):
    """A finished generation as ``POST /api/generate`` answers it (``generation.tasks.final_event``
    less its type and status; logprobs and the like beside these when asked for)."""

    request_id = serializers.CharField()
    model_id = serializers.CharField()
    output_text = serializers.CharField(allow_blank=True)
    output_token_ids = serializers.ListField(child=serializers.IntegerField())
    input_token_ids = serializers.ListField(child=serializers.IntegerField())
    finish_reason = serializers.CharField(allow_blank=True)
    usage = UsageOutputSerializer()
    timings = TimingsOutputSerializer()
    effect = serializers.DictField(allow_null=True)
    sweep_coefficient = serializers.FloatField(allow_null=True)
    activations = serializers.DictField(allow_null=True, help_text="The captured cache, when capturing")


class GenerateBatchOutputSerializer(OutputSerializer):
    """A batch's answer: each prompt's result in order (a failed prompt's: its ``request_id`` and
    an ``error`` object instead)."""

    results = serializers.ListField(child=serializers.DictField())
