"""The OpenAI-compatible API under ``/v1``: models, completions and chat completions.

Any OpenAI client (the ``openai`` package, LangChain, curl) can talk to a loaded miStudio model:
point its base URL at ``https://<host>/v1`` and use a miStudio API token as the API key. The
views call the same services as ``POST /api/generate`` (one path per operation); they only
translate OpenAI's request fields in and OpenAI's response shapes out.

What differs from OpenAI, on purpose:

* ``model`` is a miStudio model id (``m_…``) or a unique model name; responses name the model
  by its id (the ``id`` that ``GET /v1/models`` lists). A model must be loaded first: otherwise
  409 ``MODEL_NOT_LOADED`` (generation never loads a model on its own).
* Fields we cannot honour are a 400 naming the field, never silently dropped: ``n`` > 1,
  non-zero ``presence_penalty``/``frequency_penalty``, a non-empty ``logit_bias``, ``tools``,
  ``tool_choice`` other than "none", ``response_format`` other than text, completions' ``echo``,
  ``best_of`` > 1 and ``suffix``, and token-id prompts. Fields without effect here (``user``,
  ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``) are accepted and ignored; a
  field OpenAI does not define is a 400, as it is on OpenAI. ``null`` means "not given".
* Defaults: ``temperature`` 1 and ``top_p`` 1 (OpenAI's); ``max_tokens`` up to the model's
  context (at most 2,048) for chat, 16 for completions (OpenAI's). Greedy decoding is
  ``temperature: 0``.
* Extensions: ``top_k``, ``repetition_penalty`` and ``ignore_eos`` (vLLM's name) in the request;
  ``mistudio`` (``{"capture": [hook names], "store": true, "dtype": "float32"}``) captures the
  activations of prompt + completion, returned in a top-level ``activations`` object. Every
  response (a stream: its finish chunk) carries ``mistudio: {"request_id", "timings"}``;
  ``GET /api/generations/{request_id}`` reads the stored row.
* Chat prompts go through the tokenizer's chat template; a tokenizer without one gets a plain
  ``User: …\\nAssistant:`` rendering (see ``engine.generation.render_prompt``).
  Completions use the raw prompt.
* Logprobs are the raw model's (before temperature and penalties), one entry per generated
  token, the end-of-sequence token included. A token's text is its own decoding where the
  engine reports it (it is among the ``top_logprobs``), otherwise the text it released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from asgiref.sync import sync_to_async
from django.db.models import Q
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers

from generation.apis import (
    SamplingSerializer,
    event_stream,
    failure,
    open_stream,
    result_event,
    server_sent,
    string_or_list,
    until_final,
)
from generation.models import Generation
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
from mistudio.openai_errors import openai_error_body, openai_error_response
from mistudio.throttling import GenerationThrottle, throttle_check
from models_app.models import LanguageModel
from models_app.selectors import model_list

# Completions' OpenAI default; chat's default is "whatever fits the context".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5
# Accepted and ignored: they change nothing about what a local model generates.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


# --- errors -------------------------------------------------------------------------------------


def invalid(field: str, message: str) -> serializers.ValidationError:
    return serializers.ValidationError({field: [message]})


def method_not_allowed(method: str) -> JsonResponse:
    return openai_error_response(ApplicationError("METHOD_NOT_ALLOWED", f"Use {method}.", status=405))


# --- requests -----------------------------------------------------------------------------------


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
        return attrs

    def sampling(self, data: dict[str, Any]) -> SamplingRequest:
        request = super().sampling(data)
        if "max_tokens" not in data:
            request.max_tokens = self.default_max_tokens
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
        if attrs["echo"]:
            raise invalid("echo", "echo is not supported.")
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
    await throttle_check(request=request, user=user, throttle_class=GenerationThrottle)
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
        **inputs(data),
    )
    return data, model, rows


# --- responses ----------------------------------------------------------------------------------


def finish_reason(event: dict[str, Any]) -> str:
    # "cancelled" only reaches a client whose generation an operator stopped; OpenAI has no such value.
    return "length" if event.get("finish_reason") == "length" else "stop"


def token_text(payload: dict[str, Any]) -> str:
    """A token's own text: its decoding among the alternatives, else the text it released."""
    for token_id, text, _logprob in payload.get("top_logprobs") or []:
        if token_id == payload["token_id"]:
            return text
    return payload.get("text", "")


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": (text := token_text(payload)),
                "logprob": payload.get("logprob"),
                "bytes": utf8(text),
                "top_logprobs": [
                    {"token": top_text, "logprob": logprob, "bytes": utf8(top_text)}
                    for _token_id, top_text, logprob in payload.get("top_logprobs") or []
                ],
            }
            for payload in payloads
        ],
        "refusal": None,
    }


def top_logprob_map(payload: dict[str, Any]) -> dict[str, float]:
    """``{token: logprob}``, most likely first; of two ids that decode alike the likelier keeps the key."""
    alternatives: dict[str, float] = {}
    for _token_id, text, logprob in payload.get("top_logprobs") or []:
        alternatives.setdefault(text, logprob)
    return alternatives


def completion_logprobs(payloads: list[dict[str, Any]], *, offset: int) -> dict[str, Any]:
    """The completions API's parallel lists; ``offset`` is where the first token's text begins."""
    offsets = []
    for payload in payloads:
        offsets.append(offset)
        offset += len(payload.get("text", ""))
    return {
        "tokens": [token_text(payload) for payload in payloads],
        "token_logprobs": [payload.get("logprob") for payload in payloads],
        "top_logprobs": [top_logprob_map(payload) for payload in payloads],
        "text_offset": offsets,
    }


def extensions(event: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {"mistudio": {"request_id": event["request_id"], "timings": event.get("timings")}}
    if event.get("activations"):
        extra["activations"] = event["activations"]
    return extra


def chat_completion_body(event: dict[str, Any], *, model: LanguageModel, created: int, logprobs: bool):
    return {
        "id": f"chatcmpl-{event['request_id']}",
        "object": "chat.completion",
        "created": created,
        "model": model.id,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": event["output_text"], "refusal": None},
                "logprobs": chat_logprobs(event.get("logprobs") or []) if logprobs else None,
                "finish_reason": finish_reason(event),
            }
        ],
        "usage": event["usage"],
        **extensions(event),
    }


def completion_body(events: list[dict[str, Any]], *, model: LanguageModel, created: int, logprobs: bool):
    first = events[0]
    body = {
        "id": f"cmpl-{first['request_id']}",
        "object": "text_completion",
        "created": created,
        "model": model.id,
        "choices": [
            {
                "text": event["output_text"],
                "index": index,
                "logprobs": completion_logprobs(event.get("logprobs") or [], offset=0) if logprobs else None,
                "finish_reason": finish_reason(event),
            }
            for index, event in enumerate(events)
        ],
        "usage": {
            key: sum(event["usage"][key] for event in events)
            for key in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
        **extensions(first),
    }
    if len(events) > 1:
        body["mistudio"]["batch"] = [
            {"index": index, "request_id": event["request_id"], "timings": event.get("timings")}
            for index, event in enumerate(events)
        ]
    return body


# --- streaming ----------------------------------------------------------------------------------


class ChunkWriter:
    """Builds one stream's chunks in OpenAI's ``chat.completion.chunk`` / ``text_completion`` shape."""

    def __init__(self, *, chat: bool, request_id: str, model: LanguageModel, created: int, usage: bool):
        self.chat, self.usage = chat, usage
        self.header = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model.id,
        }
        self.offset = 0  # characters of completion text sent so far (completions' text_offset)

    def chunk(self, choice: dict[str, Any], **extra: Any) -> str:
        body = {**self.header, "choices": [{"index": 0, **choice}]}
        if self.usage:
            body["usage"] = None  # as OpenAI: every chunk but the last carries usage: null
        return server_sent({**body, **extra})

    def opening(self) -> list[str]:
        if not self.chat:
            return []
        return [
            self.chunk(
                {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
        ]

    def logprobs(self, payloads: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if payloads is None:
            return None
        return chat_logprobs(payloads) if self.chat else completion_logprobs(payloads, offset=self.offset)

    def text(self, text: str, payloads: list[dict[str, Any]] | None, *, finish: str | None = None, **extra):
        logprobs = self.logprobs(payloads)
        self.offset += len(text)
        if self.chat:
            # A token's chunk always has content ("" when it released none); the finish chunk has none.
            delta = {"content": text} if text or finish is None else {}
            return self.chunk({"delta": delta, "logprobs": logprobs, "finish_reason": finish}, **extra)
        return self.chunk({"text": text, "logprobs": logprobs, "finish_reason": finish}, **extra)

    def closing(self, event: dict[str, Any], payloads: list[dict[str, Any]] | None) -> list[str]:
        chunks = [self.text("", payloads or None, finish=finish_reason(event), **extensions(event))]
        if self.usage:
            chunks.append(server_sent({**self.header, "choices": [], "usage": event["usage"]}))
        return chunks


# --- waiting on a generation --------------------------------------------------------------------


async def stream_chunks(
    events: AsyncIterator[dict[str, Any]], opening: dict[str, Any], writer: ChunkWriter, *, logprobs: bool
) -> AsyncIterator[str]:
    """Server-sent chunks of one generation. A client that disconnects stops it (:func:`until_final`)."""
    streamed = ""
    async with aclosing(until_final(events, opening)) as relayed:
        async for event in relayed:
            if event is opening:
                for chunk in writer.opening():
                    yield chunk
            if event["type"] == "token":
                # One chunk per token, also when it releases no text yet (content ""): the client
                # sees the first token and the decode rate as they happen, each with its logprob.
                streamed += event["text"]
                yield writer.text(event["text"], [event] if logprobs else None)
            elif event["type"] == "done":
                # Tokens the stream lost (it expired and the row's result came back) still arrive.
                rest = (
                    event["output_text"][len(streamed) :] if event["output_text"].startswith(streamed) else ""
                )
                if rest:
                    yield writer.text(rest, None)
                for chunk in writer.closing(event, None):
                    yield chunk
                yield server_sent("[DONE]")
            elif event["type"] == "failed":
                yield server_sent({"error": openai_error_body(failure(event))})
                yield server_sent("[DONE]")


def streamed_response(
    events: AsyncIterator[dict[str, Any]],
    opening: dict[str, Any],
    data: dict[str, Any],
    *,
    chat: bool,
    request_id: str,
    model: LanguageModel,
    created: int,
    logprobs: bool,
) -> StreamingHttpResponse:
    """The server-sent-events response of a started generation (chat or completion chunks)."""
    writer = ChunkWriter(
        chat=chat,
        request_id=request_id,
        model=model,
        created=created,
        usage=bool((data.get("stream_options") or {}).get("include_usage")),
    )
    return event_stream(stream_chunks(events, opening, writer, logprobs=logprobs))


# --- views --------------------------------------------------------------------------------------


def model_object(model: LanguageModel) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": int(model.created_at.timestamp()),
        "owned_by": "mistudio",
        "name": model.name,
        "status": model.status,
        "quantization": model.quantization,
    }


def visible_models(user, model_ref: str | None = None) -> list[dict[str, Any]]:

    models = model_list(user=user).order_by("created_at")
    if model_ref is not None:
        models = models.filter(Q(pk=model_ref) | Q(name=model_ref))
    return [model_object(model) for model in models]


@csrf_exempt  # token auth only: no cookie, so nothing to forge
async def list_models(request: HttpRequest) -> JsonResponse:
    """``GET /v1/models``: the models the user can see, any status (only ``ready`` ones generate)."""
    if request.method != "GET":
        return method_not_allowed("GET")
    try:
        user = await authenticated_user(request, permission=roles.READ, session=False)
    except ApplicationError as error:
        return openai_error_response(error)
    return JsonResponse({"object": "list", "data": await sync_to_async(visible_models)(user)})


@csrf_exempt
async def retrieve_model(request: HttpRequest, model_ref: str) -> JsonResponse:
    """``GET /v1/models/{model}``: one model, by id or unique name."""
    if request.method != "GET":
        return method_not_allowed("GET")
    try:
        user = await authenticated_user(request, permission=roles.READ, session=False)
        found = await sync_to_async(visible_models)(user, model_ref)
        if len(found) != 1:
            raise ApplicationError(
                "MODEL_NOT_FOUND" if not found else "AMBIGUOUS_MODEL",
                f"No model {model_ref!r}." if not found else f"Several models are named {model_ref!r}.",
                status=404 if not found else 400,
            )
    except ApplicationError as error:
        return openai_error_response(error)
    return JsonResponse(found[0])


@csrf_exempt
async def chat_completions(request: HttpRequest) -> JsonResponse | StreamingHttpResponse:
    """``POST /v1/chat/completions``: a reply to ``messages``, whole or streamed as server-sent events.

    A stream begins only once the generation has started, so an error before the first token
    (validation, a model not loaded, a prompt too long for the context) is a plain HTTP error.
    """
    if request.method != "POST":
        return method_not_allowed("POST")
    created = int(time.time())
    try:
        data, model, rows = await start_generation(
            request,
            ChatCompletionSerializer,
            lambda data: {"messages": data["messages"], "interface": Generation.Interface.OPENAI_CHAT},
        )
        logprobs = bool(data.get("logprobs"))
        if data["stream"]:
            events, opening = await open_stream(rows[0].id)
        else:
            event = await result_event(rows[0].id)
            if event["type"] == "failed":
                raise failure(event)
            return JsonResponse(chat_completion_body(event, model=model, created=created, logprobs=logprobs))
    except ApplicationError as error:
        return openai_error_response(error)
    return streamed_response(
        events,
        opening,
        data,
        chat=True,
        request_id=rows[0].id,
        model=model,
        created=created,
        logprobs=logprobs,
    )


@csrf_exempt
async def completions(request: HttpRequest) -> JsonResponse | StreamingHttpResponse:
    """``POST /v1/completions``: continue a raw prompt; a list of prompts is a batch (not streamed).

    The batch's choices come back in prompt order, each with its ``index``.
    """
    if request.method != "POST":
        return method_not_allowed("POST")
    created = int(time.time())
    try:
        data, model, rows = await start_generation(
            request,
            CompletionSerializer,
            lambda data: {
                "prompts": data["prompt"],
                "chat_template": False,  # a completion continues the raw text
                "interface": Generation.Interface.OPENAI_COMPLETION,
            },
        )
        logprobs = "logprobs" in data
        if data["stream"]:
            events, opening = await open_stream(rows[0].id)
        else:
            results = await asyncio.gather(*(result_event(row.id) for row in rows))
            failed = next((event for event in results if event["type"] == "failed"), None)
            if failed is not None:
                raise failure(failed)
            return JsonResponse(
                completion_body(list(results), model=model, created=created, logprobs=logprobs)
            )
    except ApplicationError as error:
        return openai_error_response(error)
    return streamed_response(
        events,
        opening,
        data,
        chat=False,
        request_id=rows[0].id,
        model=model,
        created=created,
        logprobs=logprobs,
    )


async def not_found(request: HttpRequest, unmatched: str = "") -> JsonResponse:
    """Any other ``/v1/…`` path: OpenAI's 404 body rather than the site's HTML page."""
    return openai_error_response(
        ApplicationError("NOT_FOUND", f"No such endpoint: {request.method} {request.path}.", status=404)
    )
