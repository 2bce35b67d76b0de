"""The views under ``/v1``: models, completions and chat completions, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from asgiref.sync import sync_to_async
from django.db.models import Q
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from generation.apis import event_stream, failure, server_sent, until_final, wait_for_answer
from generation.models import Generation
from generation.openai_api.requests import (
    ChatCompletionSerializer,
    CompletionSerializer,
    method_not_allowed,
    start_generation,
)
from generation.openai_api.responses import ChunkWriter, chat_completion_body, completion_body
from mistudio import roles
from mistudio.async_api import authenticated_user
from mistudio.errors import ApplicationError
from mistudio.openai_errors import openai_error_body, openai_error_response
from models_app.models import LanguageModel
from models_app.selectors import model_list


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
        answer = await wait_for_answer(rows, stream=data["stream"])
        if answer.stream is None:
            (event,) = answer.finals
            if event["type"] == "failed":
                raise failure(event)
            return JsonResponse(chat_completion_body(event, model=model, created=created, logprobs=logprobs))
    except ApplicationError as error:
        return openai_error_response(error)
    return streamed_response(
        *answer.stream,
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
        answer = await wait_for_answer(rows, stream=data["stream"])
        if answer.stream is None:
            failed = next((event for event in answer.finals if event["type"] == "failed"), None)
            if failed is not None:
                raise failure(failed)
            return JsonResponse(
                completion_body(
                    answer.finals,
                    model=model,
                    created=created,
                    logprobs=logprobs,
                    echo=data["prompt"] if data["echo"] else None,
                )
            )
    except ApplicationError as error:
        return openai_error_response(error)
    return streamed_response(
        *answer.stream,
        data,
        chat=False,
        request_id=rows[0].id,
        model=model,
        created=created,
        logprobs=logprobs,
    )


@csrf_exempt  # any method gets the JSON 404, never the CSRF failure page
async def not_found(request: HttpRequest, unmatched: str = "") -> JsonResponse:
    """Any other ``/v1/…`` path: OpenAI's 404 body rather than the site's HTML page."""
    return openai_error_response(
        ApplicationError("NOT_FOUND", f"No such endpoint: {request.method} {request.path}.", status=404)
    )
