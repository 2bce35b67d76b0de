"""RQ entry point of a generation. It runs in the worker that hosts the model.

Requests wait on the worker's interactive queue, which a running job serves between its steps
(``mistudio.jobs``): a generation never waits for a long job to end. The first of them to run takes
every other queued request for the same model along (up to ``GENERATION_MAX_BATCH``, without
activation capture) and decodes them as one batch, so concurrent clients share the forward
passes. The jobs of the rows it took find them no longer queued and return at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.conf import settings
from django.db import close_old_connections
from django.urls import reverse
from django.utils import timezone

from activations.models import ActivationCache
from activations.services import cache_store_completed, cache_store_failed, cache_store_open, key_hash
from engine.effects import steering_effect
from engine.errors import EngineError
from engine.generation import SamplingParams, check_context, context_length, generate, render_prompt
from engine.placement import input_device
from engine.registry import LOADED_MODELS
from generation.interventions import loaded_sae, resolved_interventions
from generation.models import Generation
from generation.selectors import generation_state
from generation.streams import GenerationStream, cancel_requested
from mistudio.errors import ApplicationError
from mistudio.events import BACKGROUND_PUBLISHER, rows_audience
from mistudio.workers import current_worker, worker_task
from models_app.models import LanguageModel

logger = logging.getLogger(__name__)

# Browsers get tokens in chunks at most this often (a page needs no more than ~10 updates a second).
GROUP_TOKEN_INTERVAL_SECONDS = 0.1
# How often the decode loop asks Redis whether a client cancelled.
CANCEL_POLL_SECONDS = 0.05
# Errors that are the request's fault: the HTTP status the waiting client answers with.
CLIENT_ERROR_STATUS = {
    "CONTEXT_LENGTH_EXCEEDED": 400,
    "EMPTY_PROMPT": 400,
    "INVALID_PARAMETER": 400,
    "INVALID_TOKENS": 400,
    "INVALID_HOOK": 400,
    "UNKNOWN_HOOK": 400,
    "CAPTURE_NEEDS_ONE_PROMPT": 400,
    "INVALID_INTERVENTION": 400,
    "MODEL_NOT_LOADED": 409,
}


def generation_groups(generation: Generation) -> list[str]:
    return [f"generation.{generation.id}"]


def activations_of(generation: Generation) -> dict[str, Any] | None:
    cache = generation.cache
    if cache is None:
        return None
    return {
        "cache_id": cache.id,
        "hooks": cache.hooks,
        "shapes": cache.activation_shapes,
        "dtype": cache.dtype,
        "prompt_tokens": generation.prompt_tokens,
        "url": reverse("cache-detail", args=[cache.id]),
    }


# The fields of the row's state that a finished generation's result gives (the API's result body).
RESULT_FIELDS = (
    "request_id", "model_id", "output_text", "output_token_ids", "input_token_ids", "finish_reason",
    "usage", "timings", "effect", "sweep_coefficient",
)  # fmt: skip


def final_event(generation: Generation, **extra: Any) -> dict[str, Any]:
    """The last event of a generation's stream, built from its row (plus per-token extras)."""
    if generation.status == Generation.Status.FAILED:
        return {
            "type": "failed",
            "request_id": generation.id,
            "code": generation.error_code,
            "message": generation.error_message,
            "status": CLIENT_ERROR_STATUS.get(generation.error_code, 500),
        }
    state = generation_state(generation)
    return {
        "type": "done",
        "status": generation.status,
        **{name: state[name] for name in RESULT_FIELDS},
        "activations": activations_of(generation),
        **extra,
    }


def group_event_data(generation: Generation) -> dict[str, Any]:
    """What the ``generation.<id>`` group's events carry: the row's one state, as snapshots show it."""
    return generation_state(generation)


def finish_cancelled(generation: Generation) -> None:
    """Tell the readers of a generation cancelled before it ran."""
    GenerationStream(generation.id).emit_event(final_event(generation))
    BACKGROUND_PUBLISHER.send(
        "generation:cancelled",
        group_event_data(generation),
        groups=generation_groups(generation),
        audience=rows_audience(("generation", generation.id)),
    )


def fail(generation: Generation, code: str, message: str) -> None:
    generation.save(update_fields=generation.mark_failed(code=code, message=message))
    GenerationStream(generation.id).emit_event(final_event(generation))
    BACKGROUND_PUBLISHER.send(
        "generation:failed",
        {**group_event_data(generation), "code": code, "message": message},
        groups=generation_groups(generation),
        audience=rows_audience(("generation", generation.id)),
    )


def claim_batch(first: Generation) -> list[Generation]:
    """``first`` plus the other queued requests for its model that can share its batch.

    A request that captures activations runs alone (its hooks see one sequence).
    """
    claimed = Generation.objects.filter(pk=first.pk, status=Generation.Status.QUEUED).update(
        status=Generation.Status.RUNNING
    )
    if not claimed:
        return []
    batch = [first]
    if first.capture_hooks:
        return batch
    candidates = (
        Generation.objects.select_related("model")
        .filter(model_id=first.model_id, status=Generation.Status.QUEUED)
        .exclude(pk=first.pk)
        .order_by("created_at")
    )
    for candidate in candidates[: 4 * settings.GENERATION_MAX_BATCH]:
        if len(batch) >= settings.GENERATION_MAX_BATCH:
            break
        if candidate.capture_hooks:
            continue
        if Generation.objects.filter(pk=candidate.pk, status=Generation.Status.QUEUED).update(
            status=Generation.Status.RUNNING
        ):
            batch.append(candidate)
    return batch


def sampling_params(generation: Generation, *, prompt_tokens: int, context: int | None):
    """The engine's parameters for a row; a default max_tokens shrinks to fit the context."""

    parameters = generation.parameters
    max_tokens = parameters["max_tokens"]
    if context is not None and not generation.max_tokens_explicit:
        max_tokens = max(1, min(max_tokens, context - prompt_tokens))
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=parameters["temperature"],
        top_p=parameters["top_p"],
        top_k=parameters["top_k"],
        repetition_penalty=parameters["repetition_penalty"],
        seed=parameters["seed"],
        stop=tuple(parameters["stop"]),
        logprobs=parameters["logprobs"],
        top_logprobs=parameters["top_logprobs"],
        ignore_eos=parameters.get("ignore_eos", False),
    )


def token_payload(event) -> dict[str, Any]:
    payload: dict[str, Any] = {"index": event.index, "token_id": event.token_id, "text": event.text}
    if event.logprob is not None:
        payload["logprob"] = event.logprob
    if event.top_logprobs is not None:
        payload["top_logprobs"] = [[top.token_id, top.token, top.logprob] for top in event.top_logprobs]
    return payload


class TokenRelay:
    """Streams each row's tokens to its Redis stream, and in chunks to its browser group.

    A decode step's tokens (one per row, in row order) go to Redis in one round trip: they are
    held until the next step begins (a row's index not above the last one's) or :meth:`flush`.
    """

    def __init__(self, rows: list[Generation], streams: list[GenerationStream]):
        self.rows, self.streams = rows, streams
        self.pending_text = [""] * len(rows)
        self.sent_tokens = [0] * len(rows)
        self.last_group_send = [0.0] * len(rows)
        self.held: list[tuple[int, dict[str, Any]]] = []

    def __call__(self, event) -> None:
        if self.held and event.row <= self.held[-1][0]:
            self.flush()
        self.held.append((event.row, token_payload(event)))
        self.pending_text[event.row] += event.text
        now = time.monotonic()
        if now - self.last_group_send[event.row] >= GROUP_TOKEN_INTERVAL_SECONDS:
            self.flush_group(event.row, tokens=event.index + 1, now=now)

    def flush(self) -> None:
        """Send the tokens held back."""
        if not self.held:
            return
        pipeline = self.streams[0].redis.pipeline(transaction=False)
        for row, payload in self.held:
            self.streams[row].add_to(pipeline, "token", **payload)
        pipeline.execute()
        self.held = []

    def flush_group(self, row: int, *, tokens: int, now: float | None = None) -> None:
        if not self.pending_text[row] and tokens == self.sent_tokens[row]:
            return
        generation = self.rows[row]
        BACKGROUND_PUBLISHER.send(
            "generation:tokens",
            {"request_id": generation.id, "text": self.pending_text[row], "completion_tokens": tokens},
            groups=generation_groups(generation),
            audience=rows_audience(("generation", generation.id)),
        )
        self.pending_text[row], self.sent_tokens[row] = "", tokens
        self.last_group_send[row] = now if now is not None else time.monotonic()


class CancelPoll:
    """``cancelled_rows`` for the engine: asks Redis at most every ``CANCEL_POLL_SECONDS``."""

    def __init__(self, rows: list[Generation]):
        self.ids = [row.id for row in rows]
        self.cancelled: set[int] = set()
        self.last_poll = 0.0

    def __call__(self) -> set[int]:
        now = time.monotonic()
        if now - self.last_poll >= CANCEL_POLL_SECONDS:
            self.last_poll = now
            requested = cancel_requested(self.ids)
            self.cancelled = {
                index for index, generation_id in enumerate(self.ids) if generation_id in requested
            }
        return self.cancelled


def store_capture(generation: Generation, result) -> Any:
    """Write the captured activations as an ActivationCache (source = generation); return the row."""
    import torch

    prompt_tokens = len(generation.input_token_ids)
    token_ids = [*generation.input_token_ids, *result.token_ids]
    key = {
        "source": "generation",
        "generation_id": generation.id,
        "hooks": sorted(generation.capture_hooks),
        "dtype": generation.capture_dtype,
    }
    cache = ActivationCache.objects.create(
        key_hash=key_hash(key),
        key=key,
        model=generation.model,
        source=ActivationCache.Source.GENERATION,
        hooks=generation.capture_hooks,
        max_length=len(token_ids),
        dtype=generation.capture_dtype,
        sample_count=1,
        owner=generation.owner,
    )
    try:
        with cache_store_open(
            cache,
            provenance={
                "cache_id": cache.id,
                "generation_id": generation.id,
                "model_id": generation.model_id,
                "model": generation.model.display_identifier,
                "quantization": generation.model.quantization,
                "prompt_tokens": prompt_tokens,
                "generated_tokens": len(result.token_ids),
            },
            hooks={name: int(result.activations[name].shape[1]) for name in generation.capture_hooks},
            extra_token_columns=("generated",),
        ) as writer:
            count = len(token_ids)
            writer.add_batch(
                0,
                token_ids=torch.tensor(token_ids, dtype=torch.long),
                sample_index=torch.zeros(count, dtype=torch.long),
                positions=torch.arange(count),
                activations={name: result.activations[name] for name in generation.capture_hooks},
                extra_columns={"generated": (torch.arange(count) >= prompt_tokens).long()},
            )
            manifest = writer.finalize(num_samples=1)
    except Exception as error:
        cache_store_failed(
            cache,
            code=getattr(error, "code", "CAPTURE_STORE_FAILED"),
            message=f"Storing the captured activations failed: {type(error).__name__}.",
            remove_files=True,
        )
        raise
    cache_store_completed(cache, manifest=manifest, size_bytes=writer.size_bytes)
    return cache


def measure_effects(model, rows: list[Generation], results, interventions, *, device) -> None:
    """Each measured row's ``effect`` (``engine.effects``): its feature on its output, read by the
    unsteered model, the first token's KL and distinct-2. A measurement that fails says why in
    the effect and fails nothing else. Saved with the row's result."""
    modules: dict[str, Any] = {}
    for row, result, steering in zip(rows, results, interventions, strict=True):
        if not row.measure:
            continue
        measure = row.measure
        try:
            if measure["sae"] not in modules:
                modules[measure["sae"]] = loaded_sae(measure["sae"], device)
            effect = steering_effect(
                model,
                row.input_token_ids,
                result.token_ids,
                sae=modules[measure["sae"]],
                hook=measure["hook"],
                feature=measure["feature"],
                interventions=steering,
            ).as_dict()
        except Exception as error:  # the generation stands without its measurement
            logger.exception("measuring the effect of %s failed", row.id)
            effect = {"error": f"{type(error).__name__}: {getattr(error, 'message', error)}"}
        row.effect = {"sae": measure["sae"], "feature": measure["feature"], **effect}


@worker_task(timeout=3600)
def run_generation(generation_id: str) -> None:
    """Generate for this request and every queued one that can share its batch.

    Idempotent: a request that is no longer queued (taken into another batch, cancelled) is
    skipped. Every row ends ``completed``, ``cancelled`` or ``failed``, and its stream ends with
    a ``done`` or ``failed`` event, whatever happens.
    """
    close_old_connections()
    first = Generation.objects.select_related("model").filter(pk=generation_id).first()
    if first is None or first.status != Generation.Status.QUEUED:
        return
    rows = claim_batch(first)
    try:
        run_batch(rows)
    except Exception as error:
        logger.exception("generation %s failed", generation_id)
        for row in rows:
            # Rows that vanished meanwhile (deleted with their model) need nothing.
            if Generation.objects.filter(pk=row.pk, status__in=Generation.ACTIVE).exists():
                fail(row, "GENERATION_FAILED", f"Generation failed: {type(error).__name__}.")


def run_batch(rows: list[Generation]) -> None:
    """Decode ``rows`` (claimed, all for one model) as one batch and finish each of them."""

    if not rows:
        return
    identity = current_worker()
    first = rows[0]
    loaded = LOADED_MODELS.get(first.model_id)
    if loaded is None:
        for row in rows:
            fail(row, "MODEL_NOT_LOADED", "The model is not loaded any more; load it and try again.")
        return
    started = time.monotonic()
    context = context_length(loaded.model)
    device = input_device(loaded.model)
    ready: list[Generation] = []
    prompts: list[list[int]] = []
    params = []
    interventions = []
    for row in rows:
        try:
            input_ids = render_prompt(
                loaded.tokenizer,
                prompt=row.prompt if not row.messages else None,
                messages=row.messages or None,
                system_prompt=row.system_prompt or None,
                chat_template=row.chat_template,
            )
            row.input_token_ids = input_ids
            sampling = sampling_params(row, prompt_tokens=len(input_ids), context=context)
            # Checked per row here, so that one prompt too long fails alone rather than its batch.
            check_context(loaded.model, [input_ids], [sampling])
            steering = resolved_interventions(row.interventions, device=device)
        except (ApplicationError, EngineError) as error:
            fail(row, error.code, error.message)
            continue
        row.save(update_fields=row.mark_running(host_worker=identity.name, input_token_ids=input_ids))
        ready.append(row)
        prompts.append(input_ids)
        params.append(sampling)
        interventions.append(steering)
    if not ready:
        return
    streams = [GenerationStream(row.id) for row in ready]
    for row, stream in zip(ready, streams, strict=True):
        stream.emit(
            "started", request_id=row.id, input_token_ids=row.input_token_ids, host_worker=identity.name
        )
        BACKGROUND_PUBLISHER.send(
            "generation:started",
            {**group_event_data(row), "prompt_tokens": row.prompt_tokens},
            groups=generation_groups(row),
            audience=rows_audience(("generation", row.id)),
        )
    relay = TokenRelay(ready, streams)
    capture = ready[0].capture_hooks if len(ready) == 1 else []
    try:
        results = generate(
            loaded.model,
            loaded.tokenizer,
            prompts,
            params,
            capture=capture,
            capture_dtype=ready[0].capture_dtype,
            on_token=relay,
            cancelled_rows=CancelPoll(ready),
            interventions=interventions,
        )
    except (ApplicationError, EngineError) as error:
        relay.flush()
        for row in ready:
            fail(row, error.code, error.message)
        return
    relay.flush()
    total_ms = (time.monotonic() - started) * 1000
    measure_effects(loaded.model, ready, results, interventions, device=device)
    LanguageModel.objects.filter(pk=first.model_id).update(last_used_at=timezone.now())
    for index, (row, result) in enumerate(zip(ready, results, strict=True)):
        generated = len(result.token_ids)
        row.save(
            update_fields=[
                *row.mark_finished(
                    output_token_ids=result.token_ids,
                    output_text=result.text,
                    finish_reason=result.finish_reason,
                    prefill_ms=round(result.prefill_seconds * 1000, 3),
                    decode_tokens_per_second=(
                        round((generated - 1) / result.decode_seconds, 2)
                        if generated > 1 and result.decode_seconds > 0
                        else None
                    ),
                    total_ms=round(total_ms, 3),
                ),
                "effect",  # measure_effects' result
            ]
        )
        extra: dict[str, Any] = {"output_text": result.text}
        if result.logprobs is not None:
            extra["logprobs"] = [token_payload(event) for event in result.logprobs]
        if capture and result.activations is not None:
            if row.store_activations:
                try:
                    row.cache = store_capture(row, result)
                    row.save(update_fields=["cache"])
                except Exception as error:
                    logger.exception("storing the activations of %s failed", row.id)
                    code = getattr(error, "code", "CAPTURE_FAILED")
                    fail(
                        row, code, f"The activations could not be stored: {getattr(error, 'message', error)}"
                    )
                    continue
            else:
                extra["activations"] = {
                    "cache_id": None,
                    "hooks": capture,
                    "shapes": {name: list(result.activations[name].shape) for name in capture},
                    "dtype": row.capture_dtype,
                    "prompt_tokens": row.prompt_tokens,
                    "url": None,
                    "values": {name: result.activations[name].float().tolist() for name in capture},
                }
        relay.flush_group(index, tokens=generated)
        streams[index].emit_event(final_event(row, **extra))
        BACKGROUND_PUBLISHER.send(
            f"generation:{'cancelled' if row.status == Generation.Status.CANCELLED else 'completed'}",
            group_event_data(row),
            groups=generation_groups(row),
            audience=rows_audience(("generation", row.id)),
        )
