"""Requests of the OpenAI-compatible API: serializers, chat messages, the body as parsed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from rest_framework import serializers

from engine.generation.params import MAX_TOP_LOGPROBS
from generation.models import Generation
from generation.serializers import SamplingSerializer, string_or_list
from generation.services import (
    MAX_BATCH_PROMPTS,
    MAX_PROMPT_CHARACTERS,
    MAX_TOKENS_LIMIT,
    SamplingRequest,
    generation_model,
    generation_request,
)
from mistudio import roles
from mistudio.async_api import authenticated_user, json_body, validated
from mistudio.errors import ApplicationError
from mistudio.openai_errors import openai_error_response
from models_app.models import LanguageModel

# Completions' OpenAI default; chat's default is "whatever fits the context".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5
# Accepted and ignored: they change nothing about what a local model generates.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def invalid(field: str, message: str) -> serializers.ValidationError:
    return serializers.ValidationError({field: [message]})


def method_not_allowed(method: str) -> JsonResponse:
    return openai_error_response(ApplicationError("METHOD_NOT_ALLOWED", f"Use {method}.", status=405))


class StreamOptionsSerializer(serializers.Serializer):
    # Not strict: newer clients send options (e.g. include_obfuscation) that change nothing here.
    include_usage = serializers.BooleanField(default=False)


class OpenAIRequestSerializer(SamplingSerializer):
    """The fields chat and completions share, with OpenAI's defaults and OpenAI's unsupported ones."""

    model = serializers.CharField(max_length=500)
    stream = serializers.BooleanField(default=False)
    stream_options = StreamOptionsSerializer(required=False)
    n = serializers.IntegerField(required=False, min_value=1, max_value=128)
    presence_penalty = serializers.FloatField(required=False, min_value=-2.0, max_value=2.0)
    frequency_penalty = serializers.FloatField(required=False, min_value=-2.0, max_value=2.0)
    logit_bias = serializers.DictField(required=False)
    # vLLM's extension: each prompt token's logprob and this many alternatives, in vLLM's shape.
    prompt_logprobs = serializers.IntegerField(min_value=0, max_value=MAX_TOP_LOGPROBS, required=False)

    default_temperature = 1.0
    default_top_p = 1.0
    default_max_tokens = MAX_TOKENS_LIMIT

    def validate(self, attrs):
        attrs = super().validate(attrs)
        if attrs.get("n", 1) != 1:
            raise invalid("n", "Only n=1 is supported.")
        for name in ("presence_penalty", "frequency_penalty"):
            if attrs.get(name, 0) != 0:
                raise invalid(name, f"{name} is not supported; use repetition_penalty (an extension).")
        if attrs.get("logit_bias"):
            raise invalid("logit_bias", "logit_bias is not supported.")
        if attrs["stream"] and "prompt_logprobs" in attrs:
            raise invalid("prompt_logprobs", "prompt_logprobs are not streamed; send stream: false.")
        return attrs

    def sampling(self, data: dict[str, Any]) -> SamplingRequest:
        request = super().sampling(data)
        if "max_tokens" not in data:
            request.max_tokens = self.default_max_tokens
        request.prompt_logprobs = data.get("prompt_logprobs")
        return request


class ChatCompletionSerializer(OpenAIRequestSerializer):
    messages = serializers.JSONField()
    max_completion_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS_LIMIT, required=False)
    tools = serializers.JSONField(required=False)
    tool_choice = serializers.JSONField(required=False)
    response_format = serializers.JSONField(required=False)
    modalities = serializers.JSONField(required=False)

    def validate(self, attrs):
        attrs = super().validate(attrs)
        if "max_completion_tokens" in attrs:
            attrs["max_tokens"] = attrs.pop("max_completion_tokens")
        if attrs.get("top_logprobs", 0) > 0 and not attrs.get("logprobs"):
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true.")
        if attrs.get("tools"):
            raise invalid("tools", "Tool calling is not supported.")
        if attrs.get("tool_choice", "none") != "none":
            raise invalid("tool_choice", "Tool calling is not supported.")
        response_format = attrs.get("response_format", {"type": "text"})
        if not isinstance(response_format, dict) or response_format.get("type") != "text":
            raise invalid("response_format", 'Only {"type": "text"} is supported.')
        if attrs.get("modalities", ["text"]) != ["text"]:
            raise invalid("modalities", 'Only ["text"] is supported.')
        attrs["messages"] = chat_messages(attrs["messages"])
        return attrs


def chat_messages(value: Any) -> list[dict[str, str]]:
    """OpenAI messages as ``[{"role", "content"}]`` strings; a 400 names the first bad part."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", "A non-empty list of messages.")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(where, "A message object.")
        # A message copied back from a response carries null refusal/tool_calls/audio fields.
        message = {key: item for key, item in message.items() if item is not None}
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{where}.role", "One of system, developer, user, assistant.")
        if message.get("tool_calls"):
            raise invalid(f"{where}.tool_calls", "Tool calling is not supported.")
        unknown = set(message) - {"role", "content", "name", "tool_calls", "refusal", "annotations"}
        if unknown:
            raise invalid(f"{where}.{sorted(unknown)[0]}", "Unknown or unsupported field.")
        messages.append({"role": CHAT_ROLES[role], "content": message_content(message.get("content"), where)})
    return messages


def message_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"{where}.content[{index}]", 'Only {"type": "text", "text": "..."} parts.')
            parts.append(part["text"])
        text = "\n".join(parts)
    else:
        raise invalid(f"{where}.content", "A string or a list of text parts.")
    if len(text) > MAX_PROMPT_CHARACTERS:
        raise invalid(f"{where}.content", f"At most {MAX_PROMPT_CHARACTERS} characters.")
    return text


class CompletionSerializer(OpenAIRequestSerializer):
    prompt = serializers.JSONField()
    # The completions API's logprobs: how many alternatives per token (0 = the chosen token only).
    logprobs = serializers.IntegerField(min_value=0, max_value=MAX_COMPLETION_LOGPROBS, required=False)
    top_logprobs = None  # a chat field
    echo = serializers.BooleanField(default=False)
    best_of = serializers.IntegerField(required=False, min_value=1, max_value=20)
    suffix = serializers.CharField(required=False, allow_blank=True, max_length=MAX_PROMPT_CHARACTERS)

    default_max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS

    def validate(self, attrs):
        attrs = super().validate(attrs)
        if attrs["echo"] and attrs["stream"]:
            raise invalid("echo", "echo is not streamed; send stream: false.")
        if attrs["echo"] and "prompt_logprobs" in attrs:
            raise invalid("prompt_logprobs", "Use echo with logprobs, or prompt_logprobs, not both.")
        if attrs.get("best_of", 1) != 1:
            raise invalid("best_of", "Only best_of=1 is supported.")
        if attrs.get("suffix"):
            raise invalid("suffix", "suffix is not supported.")
        prompt = attrs["prompt"]
        if isinstance(prompt, list) and any(isinstance(item, (int, list)) for item in prompt):
            raise invalid("prompt", "Token-id prompts are not supported; send text.")
        attrs["prompt"] = string_or_list(
            prompt, field="prompt", max_items=MAX_BATCH_PROMPTS, max_length=MAX_PROMPT_CHARACTERS
        )
        if not attrs["prompt"]:
            raise invalid("prompt", "Give at least one prompt.")
        if attrs["stream"] and len(attrs["prompt"]) > 1:
            raise invalid("prompt", "Streaming takes one prompt.")
        return attrs

    def sampling(self, data: dict[str, Any]) -> SamplingRequest:
        request = super().sampling(data)
        request.logprobs = "logprobs" in data
        request.top_logprobs = data.get("logprobs", 0)
        if data["echo"]:  # the prompt comes back too: its tokens' logprobs when logprobs are asked for
            request.prompt_logprobs = data.get("logprobs")
        return request


def request_data(request: HttpRequest, serializer_class: type[OpenAIRequestSerializer]) -> dict[str, Any]:
    # OpenAI treats null as "not given"; clients send it (stop=None, a message's refusal=None).
    body = {
        key: value
        for key, value in json_body(request).items()
        if value is not None and key not in IGNORED_FIELDS
    }
    return validated(serializer_class, body)


async def start_generation(
    request: HttpRequest,
    serializer_class: type[OpenAIRequestSerializer],
    inputs: Callable[[dict[str, Any]], dict[str, Any]],
) -> tuple[dict[str, Any], LanguageModel, list[Generation]]:
    """Authenticate, validate and queue: (validated data, model, generation rows).

    ``inputs`` maps the validated data to the endpoint's own arguments of ``generation_request``.
    """
    user = await authenticated_user(request, permission=roles.WRITE, session=False)
    data = request_data(request, serializer_class)
    model = await sync_to_async(generation_model)(user=user, model_ref=data["model"])
    capture = data.get("mistudio") or {}
    rows = await sync_to_async(generation_request)(
        model_id=model.id,
        owner=user,
        sampling=serializer_class().sampling(data),
        capture=capture.get("capture") or [],
        capture_dtype=capture.get("dtype", "float32"),
        store_activations=capture.get("store", True),
        interventions=capture.get("interventions"),
        **inputs(data),
    )
    return data, model, rows
