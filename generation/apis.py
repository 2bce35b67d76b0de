"""``POST /api/generate`` (async: it waits on the worker, or streams), cancel, and the read-back API.

The helpers that wait on a generation's events (:func:`wait_for_answer`, :func:`until_final`) serve
the OpenAI-compatible endpoints too; every way a request ends without its answer withdraws its rows.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from generation.models import Generation
from generation.selectors import generation_get, generation_list, generation_state
from generation.serializers import (
    GenerateInputSerializer,
    GenerationListOutputSerializer,
    GenerationOutputSerializer,
    SweepInputSerializer,
)
from generation.services import (
    generation_cancel,
    generation_check,
    generation_model,
    generation_request,
    generation_stop,
    generations_withdraw,
    result_body,
    sweep_header,
    sweep_request,
)
from generation.streams import FINAL_EVENTS, read_events
from mistudio import roles
from mistudio.async_api import authenticated_user, json_body, validated
from mistudio.errors import ApplicationError, error_body, error_response
from mistudio.job_apis import JobApi
from mistudio.permissions import CanRead
from mistudio.request_lifetime import release_database


def cancelled_meanwhile() -> bool:
    """Whether this task was cancelled although no ``CancelledError`` reached it.

    redis-py sends each command under ``asyncio.wait_for``, which on Python 3.11 drops a
    cancellation that lands just as the command completes (CPython gh-86296, fixed in 3.12), so a
    read loop would go on serving a client that left. The task's cancel count still tells.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def generation_events(generation_id: str) -> AsyncIterator[dict[str, Any]]:
    """:func:`read_events` of one generation, ended by a cancellation even when redis-py hid it."""

    async def check():
        return await sync_to_async(released_after(generation_check))(generation_id)

    events = read_events(generation_id, check=check)
    try:
        async for event in events:
            if cancelled_meanwhile():
                raise asyncio.CancelledError
            yield event
    finally:
        await events.aclose()


@asynccontextmanager
async def withdrawn_on_exit(rows: list[Generation]) -> AsyncIterator[set[str]]:
    """The ids of the request's rows that have no answer yet: however the request ends before
    they do (an error, its time limit, its client gone: ``CancelledError``), they are withdrawn
    (``generations_withdraw``). A row leaves the set when its final event is read, or when a
    streamed answer takes it over (:func:`until_final` withdraws it on its own exits)."""
    unanswered = {row.id for row in rows}
    try:
        yield unanswered
    finally:
        if unanswered:
            await asyncio.shield(sync_to_async(generations_withdraw)(sorted(unanswered)))


async def final_event_of(generation_id: str) -> dict[str, Any]:
    """The generation's ``done`` or ``failed`` event."""
    async with aclosing(generation_events(generation_id)) as events:
        async for event in events:
            if event["type"] in FINAL_EVENTS:
                return event
    raise ApplicationError("GENERATION_FAILED", "The generation ended without a result.", status=500)


async def final_events(rows: list[Generation], unanswered: set[str]) -> list[dict[str, Any]]:
    """Every row's final event, in order, within ``GENERATION_REQUEST_TIMEOUT_SECONDS`` (504
    ``GENERATION_TIMEOUT`` past it). Use inside :func:`withdrawn_on_exit`: rows left unanswered by
    an error or the time limit are withdrawn there."""

    async def answered(row: Generation) -> dict[str, Any]:
        event = await final_event_of(row.id)
        unanswered.discard(row.id)
        return event

    waits = [asyncio.ensure_future(answered(row)) for row in rows]
    try:
        async with asyncio.timeout(settings.GENERATION_REQUEST_TIMEOUT_SECONDS):
            return list(await asyncio.gather(*waits))
    except TimeoutError:
        raise ApplicationError(
            "GENERATION_TIMEOUT",
            f"No result in {settings.GENERATION_REQUEST_TIMEOUT_SECONDS:g} s; the generation was stopped.",
            status=504,
        ) from None
    finally:
        for wait in waits:  # a failed sibling ends the others' waits too
            wait.cancel()


@dataclass
class Answer:
    """How a request's rows answered: their final events, or (streamed) the opened stream."""

    finals: list[dict[str, Any]] = field(default_factory=list)
    stream: tuple[AsyncIterator[dict[str, Any]], dict[str, Any]] | None = None


def released_after(function):
    """``function`` that gives its thread's database connections back when it returns
    (``release_database``): the request goes on waiting."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        finally:
            release_database()

    return call


async def wait_for_answer(rows: list[Generation], *, stream: bool) -> Answer:
    """Every row's final event, or with ``stream`` the first row's opened stream
    (:func:`open_stream`); on every other way out the rows are withdrawn (:func:`withdrawn_on_exit`).
    The request's database connection goes back to the pool for the wait."""
    await sync_to_async(release_database)()
    async with withdrawn_on_exit(rows) as unanswered:
        if stream:
            opened = await open_stream(rows[0].id)
            unanswered.clear()  # the stream withdraws it on its own exits (until_final)
            return Answer(stream=opened)
        return Answer(finals=await final_events(rows, unanswered))


def failure(event: dict[str, Any]) -> ApplicationError:
    return ApplicationError(event["code"], event["message"], status=event.get("status", 500))


# --- streaming (shared with the OpenAI-compatible endpoints) -------------------------------------


def server_sent(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <compact JSON or text>`` and the blank line that ends it."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def event_stream(chunks: AsyncIterator[str]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(chunks, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx would otherwise hold tokens back
    return response


async def open_stream(generation_id: str) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any]]:
    """The generation's events and the first that decides between a stream and an HTTP error.

    That is ``started`` (or a final event): a request that fails before its first token (its
    prompt does not fit the context, the model was unloaded) gets a plain HTTP error. Use inside
    :func:`withdrawn_on_exit`, which withdraws the row when this does not return.
    """
    events = generation_events(generation_id)

    async def decisive() -> dict[str, Any]:
        async for event in events:
            if event["type"] == "started" or event["type"] in FINAL_EVENTS:
                return event
        raise ApplicationError("GENERATION_FAILED", "The generation ended without a result.", status=500)

    try:
        async with asyncio.timeout(settings.GENERATION_REQUEST_TIMEOUT_SECONDS):
            event = await decisive()
    except BaseException as error:
        await events.aclose()
        if isinstance(error, TimeoutError):
            raise ApplicationError(
                "GENERATION_TIMEOUT", "The generation did not start in time; it was stopped.", status=504
            ) from None
        raise
    if event["type"] == "failed":
        await events.aclose()
        raise failure(event)
    return events, event


async def until_final(events: AsyncIterator[dict[str, Any]], opening: dict[str, Any]):
    """The events of an opened stream (:func:`open_stream`), ``opening`` first, up to the final one.

    A consumer that stops before the final event stops the generation: Django cancels a
    streaming response whose client disconnected (``CancelledError`` here) or closes it
    (``GeneratorExit``). Consume it under ``contextlib.aclosing`` so a close reaches this too.
    """
    finished = opening["type"] in FINAL_EVENTS
    try:
        yield opening
        if finished:
            return
        async for event in events:
            # Set before the yield: a client that leaves after the final event stops nothing.
            finished = event["type"] in FINAL_EVENTS
            yield event
            if finished:
                return
    finally:
        if not finished:
            await asyncio.shield(sync_to_async(generation_stop)(opening["request_id"]))
        await events.aclose()


async def generate_stream(events: AsyncIterator[dict[str, Any]], opening: dict[str, Any]):
    """``POST /api/generate`` with ``stream``: ``started``, one ``token`` per token, ``done`` or ``error``."""
    async with aclosing(until_final(events, opening)) as relayed:
        async for event in relayed:
            kind = event["type"]
            if kind == "started" or (kind == "done" and event is opening):
                # A generation cancelled while still queued ends without a started event of its own.
                yield server_sent(
                    {
                        "type": "started",
                        "request_id": event["request_id"],
                        "input_token_ids": event.get("input_token_ids", []),
                    }
                )
            if kind == "token":
                yield server_sent(event)
            elif kind == "done":
                yield server_sent({"type": "done", **result_body(event)})
            elif kind == "failed":
                yield server_sent({"type": "error", **error_body(event["code"], event["message"])})


@csrf_exempt  # CSRF is checked by DRF's SessionAuthentication for session users; tokens need none
async def generate(request: HttpRequest) -> JsonResponse | StreamingHttpResponse:
    """``POST /api/generate``: generate for one prompt, a list of prompts (a batch), or messages.

    Waits for the result. A single prompt answers with the result object; a list of prompts
    with ``{"results": [...]}`` in order, where a prompt that failed has an ``error`` object.
    With ``"stream": true`` (one prompt or messages) the answer is server-sent events from the
    moment the generation starts (see :func:`generate_stream`); an error before that is a plain
    HTTP error, as without ``stream``.
    """
    if request.method != "POST":
        return error_response(ApplicationError("METHOD_NOT_ALLOWED", "Use POST.", status=405))
    try:
        user = await authenticated_user(request, permission=roles.WRITE)
        data = validated(GenerateInputSerializer, json_body(request))
        capture = data.get("mistudio") or {}
        model = await sync_to_async(generation_model)(user=user, model_ref=data["model_id"])
        rows = await sync_to_async(generation_request)(
            model_id=model.id,
            owner=user,
            prompts=data.get("prompt"),
            messages=[dict(message) for message in data["messages"]] if "messages" in data else None,
            system_prompt=data.get("system_prompt", ""),
            chat_template=data.get("chat_template"),
            sampling=GenerateInputSerializer().sampling(data),
            capture=capture.get("capture") or [],
            capture_dtype=capture.get("dtype", "float32"),
            store_activations=capture.get("store", True),
            interventions=capture.get("interventions"),
            measure=capture.get("measure"),
            interface=Generation.Interface.API,
        )
        answer = await wait_for_answer(rows, stream=data["stream"])
        if answer.stream is not None:
            return event_stream(generate_stream(*answer.stream))
        events = answer.finals
        batch = isinstance(request_prompt := data.get("prompt"), list) and len(request_prompt) > 1
        if not batch:
            if events[0]["type"] == "failed":
                raise failure(events[0])
            return JsonResponse(result_body(events[0]))
    except ApplicationError as error:
        return error_response(error)
    results = [
        result_body(event)
        if event["type"] == "done"
        else {"request_id": event.get("request_id"), **error_body(event["code"], event["message"])}
        for event in events
    ]
    return JsonResponse({"results": results})


def sweep_table(rows: list[Generation], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer of a sweep: :func:`sweep_header`, and one entry per strength (the baseline first)
    with the text and its measured effect."""
    header = sweep_header(rows)
    entries = []
    for row, event in zip(rows, events, strict=True):
        entry: dict[str, Any] = {
            "coefficient": row.sweep_coefficient,
            "raw_coefficient": row.sweep_coefficient * header["unit_scale"],
            "request_id": row.id,
        }
        if event["type"] == "done":
            body = result_body(event)
            entry.update(
                output_text=body["output_text"],
                finish_reason=body["finish_reason"],
                completion_tokens=body["usage"]["completion_tokens"],
                effect=body["effect"],
            )
        else:
            entry.update(error_body(event["code"], event["message"]))
        entries.append(entry)
    return {**header, "rows": entries}


@csrf_exempt
async def sweep(request: HttpRequest) -> JsonResponse:
    """``POST /api/generate/sweep``: the prompt generated without the intervention and at each
    coefficient, with one seed, as one batch; waits for all and answers :func:`sweep_table`."""
    if request.method != "POST":
        return error_response(ApplicationError("METHOD_NOT_ALLOWED", "Use POST.", status=405))
    try:
        user = await authenticated_user(request, permission=roles.WRITE)
        data = validated(SweepInputSerializer, json_body(request))
        model = await sync_to_async(generation_model)(user=user, model_ref=data["model_id"])
        rows = await sync_to_async(sweep_request)(
            model_id=model.id,
            owner=user,
            intervention=data["intervention"],
            coefficients=data.get("coefficients"),
            measure=data.get("measure"),
            prompts=[data["prompt"]],
            sampling=SweepInputSerializer().sampling(data),
            interface=Generation.Interface.API,
        )
        events = (await wait_for_answer(rows, stream=False)).finals
    except ApplicationError as error:
        return error_response(error)
    return JsonResponse(await sync_to_async(sweep_table)(rows, events))


class GenerationListApi(APIView):
    """``GET /api/generations``: your generations, newest first (all of them for model:admin), each
    with the start of its prompt and output (``GET /api/generations/{id}`` has them whole)."""

    permission_classes = [CanRead]

    @extend_schema(responses={200: GenerationListOutputSerializer}, operation_id="api_generations_list")
    def get(self, request):
        rows = generation_list(user=request.user)[:200]
        return Response({"results": [generation_state(row, whole=False) for row in rows]})


def _generation_cancel(*, generation: Generation, actor) -> Generation:
    return generation_cancel(user=actor, generation_id=generation.id)


# A generation is not a job row (its worker batches rows itself), but its edge is a job's.
GENERATION_API = JobApi(
    route="generations/<str:generation_id>",
    cancel_route="generate/<str:generation_id>/cancel",
    name="generation",
    component="Generation",
    row="generation",
    find=generation_get,
    body=lambda generation, request: generation_state(generation),
    response=GenerationOutputSerializer,
    cancel=_generation_cancel,
    permission=CanRead,
    doc="``GET /api/generations/{id}``: one generation's request and result.",
    cancel_doc="``POST /api/generate/{request_id}/cancel``: stop a queued or running generation.",
)
