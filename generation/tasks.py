"""RQ entry point of a generation. It runs in the worker that hosts the model.

Requests wait on the worker's interactive queue, which a running job serves between its steps
(``mistudio.jobs``): a generation never waits for a long job to end. A request puts one token on
the queue; a token claims the next batch of the model's queued rows, shared round robin between
their owners (:func:`claim_batch`, least served first), and decodes them together, so concurrent
clients share the forward passes. A batch yields to whoever had less of the worker's time
(:class:`YieldPoll`); its unfinished rows go on in a later batch from where they stopped.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import close_old_connections
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from activations.models import ActivationCache
from activations.services import cache_store_completed, cache_store_failed, cache_store_open, key_hash
from engine.effects import steering_effect
from engine.errors import EngineError
from engine.generation import (
    GenerationResult,
    Progress,
    SamplingParams,
    check_context,
    context_length,
    generate,
    render_prompt,
)
from engine.placement import input_device
from engine.registry import LOADED_MODELS
from generation.interventions import loaded_sae, resolved_interventions
from generation.models import Generation
from generation.selectors import generation_state
from generation.streams import GenerationStream, cancel_requested
from mistudio.errors import ApplicationError
from mistudio.events import BACKGROUND_PUBLISHER, rows_audience
from mistudio.worker_clock import CLOCK
from mistudio.workers import (
    Lender,
    call_owners,
    current_worker,
    enqueue,
    interactive_queue,
    lender,
    read_heartbeats,
    worker_task,
)
from models_app.models import LanguageModel

logger = logging.getLogger(__name__)

# Browsers get tokens in chunks at most this often (a page needs no more than ~10 updates a second).
GROUP_TOKEN_INTERVAL_SECONDS = 0.1
# How often the decode loop asks Redis whether a client cancelled.
CANCEL_POLL_SECONDS = 0.05
# The HTTP status a waiting client answers with, for errors that are not the server's bug (500).
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
    "WORKER_LOST": 503,  # the server's trouble, and a retry may find another worker
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


def withdraw_queued(generation_id: str) -> None:
    """Cancel a queued row nobody waits for (or whose cancel was asked) and tell its readers."""
    if Generation.objects.filter(pk=generation_id, status=Generation.Status.QUEUED).update(
        status=Generation.Status.CANCELLED, finish_reason="cancelled", finished_at=timezone.now()
    ):
        finish_cancelled(Generation.objects.get(pk=generation_id))


def fail(generation: Generation, code: str, message: str) -> None:
    generation.save(update_fields=generation.mark_failed(code=code, message=message))
    GenerationStream(generation.id).emit_event(final_event(generation))
    BACKGROUND_PUBLISHER.send(
        "generation:failed",
        {**group_event_data(generation), "code": code, "message": message},
        groups=generation_groups(generation),
        audience=rows_audience(("generation", generation.id)),
    )


@dataclass(frozen=True)
class Waiting:
    """What the choice of a batch reads of a queued row."""

    pk: str
    owner_id: int | None
    created_at: Any
    captures: bool


def fair_batch(queued: list[Waiting], served: dict[int | None, float], *, size: int) -> list[Waiting]:
    """The rows of the next batch among ``queued`` (oldest first): round robin between owners, the
    owner who had the least of the worker's time lately first (``served``, ``mistudio.worker_clock``;
    ties: whose oldest row waited longest), each owner's rows oldest first. A row that captures
    activations runs alone, when its owner's turn comes first; in a shared batch it waits."""
    by_owner: dict[int | None, list[Waiting]] = {}
    for row in queued:
        by_owner.setdefault(row.owner_id, []).append(row)
    owners = sorted(by_owner, key=lambda owner: (served.get(owner, 0.0), by_owner[owner][0].created_at))
    if not owners:
        return []
    if by_owner[owners[0]][0].captures:
        return [by_owner[owners[0]][0]]
    waiting = {owner: [row for row in by_owner[owner] if not row.captures] for owner in owners}
    batch: list[Waiting] = []
    while len(batch) < size and any(waiting.values()):
        for owner in owners:
            if waiting[owner] and len(batch) < size:
                batch.append(waiting[owner].pop(0))
    return batch


def generations_reconcile() -> list[str]:
    """Settle the rows nobody will run (the worker hook ``reconcile``): running on a worker that
    is gone (``WORKER_LOST``), or queued for a model that is not loaded any more
    (``MODEL_NOT_LOADED``). Without it they would count against their owner's share for ever."""
    alive = [beat["name"] for beat in read_heartbeats()]
    lost = Q(status=Generation.Status.RUNNING) & ~Q(host_worker="") & ~Q(host_worker__in=alive)
    unloaded = Q(status=Generation.Status.QUEUED) & ~Q(model__status=LanguageModel.Status.READY)
    return settle(Generation.objects.filter(lost | unloaded))


def generations_on_worker_start(identity) -> None:
    """A starting worker runs none of its rows yet (the worker hook ``start``): rows still
    ``running`` under its name were its previous process's, which died mid-batch. Its heartbeat
    under the same name would hide them from :func:`generations_reconcile`."""
    settled = settle(Generation.objects.filter(status=Generation.Status.RUNNING, host_worker=identity.name))
    if settled:
        logger.info("worker %s start: %d generation rows of its last run failed", identity.name, len(settled))


def settle(rows) -> list[str]:
    """Fail ``rows`` (running: ``WORKER_LOST``; queued: ``MODEL_NOT_LOADED``) and end their
    streams; the ids of those it changed."""
    settled = []
    for row in rows.select_related("model"):
        code, message = (
            ("WORKER_LOST", "The worker stopped.")
            if row.status == Generation.Status.RUNNING
            else ("MODEL_NOT_LOADED", "The model is not loaded any more; load it and try again.")
        )
        if Generation.objects.filter(pk=row.pk, status=row.status).update(
            status=Generation.Status.FAILED,
            error_code=code,
            error_message=message,
            finished_at=timezone.now(),
        ):
            row.refresh_from_db()
            GenerationStream(row.id).emit_event(final_event(row))
            settled.append(row.id)
    return settled


def claim_batch(model_id: str, *, worker_name: str, lender: Lender | None = None) -> list[Generation]:
    """Claim (``running`` on ``worker_name``, from here on: a crash leaves no row unowned) the next
    batch of the model's queued rows (:func:`fair_batch`). A row
    another worker or a cancel took first is left out. Between a job's steps (``lender``), only the
    rows of owners who had no more of the worker's time than the job's owner: the job's time goes
    to whoever's turn it is, not to everyone who has rows waiting."""
    # Every queued row is read (admission bounds them), lightly: a newcomer is never out of sight.
    queued = [
        Waiting(pk=pk, owner_id=owner_id, created_at=created_at, captures=bool(hooks))
        for pk, owner_id, created_at, hooks in Generation.objects.filter(
            model_id=model_id, status=Generation.Status.QUEUED
        )
        .order_by("created_at")
        .values_list("pk", "owner_id", "created_at", "capture_hooks")
    ]
    orphans = cancel_requested(row.pk for row in queued)
    for pk in orphans:
        withdraw_queued(pk)
    queued = [row for row in queued if row.pk not in orphans]
    served = CLOCK.snapshot({row.owner_id for row in queued} | ({lender.owner} if lender else set()))
    if lender is not None:
        queued = [row for row in queued if served[row.owner_id] <= served[lender.owner]]
    chosen = fair_batch(queued, served, size=settings.GENERATION_MAX_BATCH)
    claimed: list[str] = []
    try:
        for row in chosen:
            if Generation.objects.filter(pk=row.pk, status=Generation.Status.QUEUED).update(
                status=Generation.Status.RUNNING, host_worker=worker_name
            ):
                claimed.append(row.pk)
        rows = Generation.objects.select_related("model").in_bulk(claimed)
    except BaseException:  # claimed rows that no batch will run go back to the queue
        Generation.objects.filter(pk__in=claimed, status=Generation.Status.RUNNING).update(
            status=Generation.Status.QUEUED, host_worker=""
        )
        raise
    return [rows[pk] for pk in claimed]


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
        prompt_logprobs=parameters.get("prompt_logprobs"),
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
        scale, mean = measure.get("scale"), effect.get("activation_mean")
        if scale and mean is not None:  # the mean in units of the feature's max activation
            effect["activation_mean_of_max"] = round(mean / scale, 6)
        row.effect = {"sae": measure["sae"], "feature": measure["feature"], "feature_max": scale, **effect}


def generation_enqueue(*, host: str, generation_id: str) -> None:
    """Ask ``host`` to run a batch of the queued rows of ``generation_id``'s model (on commit). Any
    token runs the fairest batch of that model's rows (:func:`claim_batch`), so a request puts one
    token on the queue, whatever its number of rows."""
    # The worker's interactive queue: served between the steps of a job it runs.
    enqueue(
        interactive_queue(host),
        "generation.tasks.run_generation",
        generation_id,
        job_id=f"generate-{uuid.uuid4().hex}",
        result_ttl=0,
    )


@worker_task(timeout=3600)
def run_generation(generation_id: str) -> None:
    """Run the next batch of the queued rows of ``generation_id``'s model (:func:`claim_batch`).

    Idempotent: when nothing of that model waits any more (its rows were taken into another
    batch, or cancelled) it returns at once. Every row ends ``completed``, ``cancelled`` or
    ``failed`` (or goes back to ``queued`` when its batch yields, with a token for the next one),
    and its stream ends with a ``done`` or ``failed`` event, whatever happens.
    """
    close_old_connections()
    model_id = Generation.objects.filter(pk=generation_id).values_list("model_id", flat=True).first()
    if model_id is None:
        return
    started = time.monotonic()
    lending = lender()
    rows: list[Generation] = []
    poll = None
    try:
        rows = claim_batch(model_id, worker_name=current_worker().name, lender=lending)
        poll = YieldPoll(rows, lender=lending, started=started)
        run_batch(rows, poll)
    except Exception as error:
        logger.exception("generation batch of %s failed", generation_id)
        fail_running(rows, "GENERATION_FAILED", f"Generation failed: {type(error).__name__}.")
    except BaseException:  # a signal, or the time limit of the job this batch ran between steps of
        fail_running(rows, "WORKER_LOST", "The worker stopped while generating.")
        raise
    finally:
        if poll is not None:
            poll.charge()  # all of the worker's time the batch took, from its claim to its rows' saves
        pass_token_on(model_id)


def pass_token_on(model_id: str) -> None:
    """A token runs one batch: while rows of the model still wait (more than a batch holds, rows
    that yielded, rows a lent turn could not take, rows of a batch that failed to start), one more
    token goes out, so the queue never holds more tokens than requests, and never none while a row
    waits."""
    try:
        next_row = Generation.objects.filter(model_id=model_id, status=Generation.Status.QUEUED).first()
        if next_row is not None:
            generation_enqueue(host=current_worker().name, generation_id=next_row.id)
    except Exception:  # never in place of what the batch raised; the reconcile settles the rest
        logger.exception("generation token of %s not passed on", model_id)


def fail_running(rows: list[Generation], code: str, message: str) -> None:
    """Fail those of ``rows`` still ``running`` (rows that vanished meanwhile, deleted with their
    model, need nothing)."""
    for row in rows:
        if Generation.objects.filter(pk=row.pk, status=Generation.Status.RUNNING).exists():
            fail(row, code, message)


@dataclass
class Planned:
    """A claimed row, ready to decode: its prompt's ids, sampling, interventions, and where it
    stands when it goes on after a yield."""

    row: Generation
    prompt: list[int]
    sampling: SamplingParams
    steering: list
    progress: Progress | None


def plan_row(row: Generation, loaded, *, identity, context: int | None, device) -> Planned | None:
    """Tokenize and check one claimed row (``running`` from here); a row that cannot run fails
    alone (None), not its batch."""
    try:
        if row.progress:
            input_ids = row.input_token_ids  # going on after a yield: tokenized the first time
        else:
            input_ids = render_prompt(
                loaded.tokenizer,
                prompt=row.prompt if not row.messages else None,
                messages=row.messages or None,
                system_prompt=row.system_prompt or None,
                chat_template=row.chat_template,
            )
        sampling = sampling_params(row, prompt_tokens=len(input_ids), context=context)
        check_context(loaded.model, [input_ids], [sampling])
        steering = resolved_interventions(row.interventions, device=device)
    except (ApplicationError, EngineError) as error:
        fail(row, error.code, error.message)
        return None
    going_on = Progress.from_json(row.progress["engine"]) if row.progress else None
    row.save(update_fields=row.mark_running(host_worker=identity.name, input_token_ids=input_ids))
    return Planned(row=row, prompt=input_ids, sampling=sampling, steering=steering, progress=going_on)


def announce_started(row: Generation, stream: GenerationStream, *, host_worker: str) -> None:
    stream.emit("started", request_id=row.id, input_token_ids=row.input_token_ids, host_worker=host_worker)
    BACKGROUND_PUBLISHER.send(
        "generation:started",
        {**group_event_data(row), "prompt_tokens": row.prompt_tokens},
        groups=generation_groups(row),
        audience=rows_audience(("generation", row.id)),
    )


class YieldPoll:
    """``should_yield`` for the engine, asked between decode steps (at most every
    ``YIELD_POLL_SECONDS``); it also charges the batch's owners for the worker's time as it runs
    (``mistudio.worker_clock``). The batch yields:

    * to an owner waiting for this worker (a queued row for a model it hosts, or a worker call) who
      had less of its time lately than every owner in the batch — a chat waits about a poll, not
      the batch;
    * once it has decoded ``GENERATION_SLICE_SECONDS`` (counted from its first poll, after the
      prefill: a prompt whose prefill takes longer than a slice still makes progress), to anyone
      else waiting;
    * when it runs between a job's steps (``lender``: the job's owner), as soon as one of its owners
      has had more of the worker's time than the job's owner (it was claimed among owners who had
      no more: :func:`claim_batch`), and after its slice unless every row is the job owner's (the
      job would only wait for them; someone waiting who had less still goes first, as above).

    Every yield re-runs the rows' prefill in their next batch, so no batch yields before it has
    decoded as long as its prefill took (and a poll): whoever makes it yield, at most half of the
    worker's time goes to prefills made again. One owner alone, with nothing else waiting, runs to
    the end.
    """

    def __init__(self, rows: list[Generation], *, lender: Lender | None, started: float | None = None):
        self.owners = [row.owner_id for row in rows]
        self.lender = lender
        self.claimed = self.charged = time.monotonic() if started is None else started
        self.decoding_since: float | None = None  # the first poll: the prefill is done
        self.last_poll = 0.0
        self.answer = False

    def charge(self) -> None:
        now = time.monotonic()
        CLOCK.charge(now - self.charged, self.owners)
        self.charged = now

    def __call__(self) -> bool:
        now = time.monotonic()
        if self.decoding_since is None:
            self.decoding_since = now
        if self.answer or now - self.last_poll < YIELD_POLL_SECONDS:
            return self.answer
        self.last_poll = now
        self.charge()
        slice_seconds = settings.GENERATION_SLICE_SECONDS
        decoded = now - self.decoding_since
        if not slice_seconds or decoded < max(YIELD_POLL_SECONDS, self.decoding_since - self.claimed):
            return False
        sliced = decoded >= slice_seconds
        owners = set(self.owners)
        waiting = waiting_owners(exclude=owners)
        lending = {self.lender.owner} if self.lender is not None else set()
        served = CLOCK.snapshot(owners | waiting | lending)
        if waiting and min(served[owner] for owner in waiting) < min(served[owner] for owner in owners):
            self.answer = True
        elif self.lender is not None:
            overdrawn = served[self.lender.owner] < max(served[owner] for owner in owners)
            self.answer = overdrawn or (sliced and owners != lending)
        else:
            self.answer = sliced and bool(waiting)
        return self.answer


YIELD_POLL_SECONDS = 0.05


def waiting_owners(*, exclude: set[int | None] = frozenset()) -> set[int | None]:
    """The owners of the interactive work waiting for this worker, but ``exclude``: of queued rows
    for the models it hosts, and of worker calls on its queue."""
    hosted = LOADED_MODELS.model_ids()
    queued = Generation.objects.filter(model_id__in=hosted, status=Generation.Status.QUEUED)
    owners = set(queued.values_list("owner_id", flat=True).distinct())
    return (owners | call_owners(current_worker())) - exclude


def run_batch(rows: list[Generation], poll: YieldPoll) -> None:
    """Decode ``rows`` (claimed, all for one model) as one batch, then finish each of them, or put
    it back in the queue with its progress when the batch yielded before it ended."""

    if not rows:
        return
    identity = current_worker()
    loaded = LOADED_MODELS.get(rows[0].model_id)
    if loaded is None:
        for row in rows:
            fail(row, "MODEL_NOT_LOADED", "The model is not loaded any more; load it and try again.")
        return
    context, device = context_length(loaded.model), input_device(loaded.model)
    planned = [plan_row(row, loaded, identity=identity, context=context, device=device) for row in rows]
    planned = [plan for plan in planned if plan is not None]
    if not planned:
        return
    batch = DecodeBatch.open(planned, host_worker=identity.name)
    results = batch.decode(loaded, poll)
    if results is not None:
        batch.settle(loaded, results, device=device)


@dataclass(frozen=True)
class DecodeBatch:
    """The planned rows decoded together, their streams and the relay of their tokens."""

    planned: list[Planned]
    ready: list[Generation]
    streams: list[GenerationStream]
    relay: TokenRelay
    # Activations are captured for a batch of one row only.
    capture: list[str]

    @classmethod
    def open(cls, planned: list[Planned], *, host_worker: str) -> DecodeBatch:
        """The batch, its rows announced as started (those going on after a yield already were)."""
        ready = [plan.row for plan in planned]
        streams = [GenerationStream(row.id) for row in ready]
        for plan, stream in zip(planned, streams, strict=True):
            if plan.progress is None:
                announce_started(plan.row, stream, host_worker=host_worker)
        capture = ready[0].capture_hooks if len(ready) == 1 else []
        return cls(planned, ready, streams, TokenRelay(ready, streams), capture)

    def decode(self, loaded, poll: YieldPoll) -> list[GenerationResult] | None:
        """Every row's result; None when the batch failed (its rows are failed then)."""
        try:
            results = generate(
                loaded.model,
                loaded.tokenizer,
                [plan.prompt for plan in self.planned],
                [plan.sampling for plan in self.planned],
                capture=self.capture,
                capture_dtype=self.ready[0].capture_dtype,
                on_token=self.relay,
                cancelled_rows=CancelPoll(self.ready),
                interventions=[plan.steering for plan in self.planned],
                progress=[plan.progress for plan in self.planned],
                should_yield=None if self.capture else poll,
            )
        except (ApplicationError, EngineError) as error:
            self.relay.flush()
            for row in self.ready:
                fail(row, error.code, error.message)
            return None
        self.relay.flush()
        return results

    def settle(self, loaded, results: list[GenerationResult], *, device) -> None:
        """Put the yielded rows back in the queue, then measure and finish the others."""
        pairs = list(zip(self.planned, results, strict=True))
        for plan, result in pairs:
            if result.progress is not None:
                keep_progress(plan.row, result)
        finished = [index for index, (_, result) in enumerate(pairs) if result.progress is None]
        measure_effects(
            loaded.model,
            [self.ready[index] for index in finished],
            [results[index] for index in finished],
            [self.planned[index].steering for index in finished],
            device=device,
        )
        LanguageModel.objects.filter(pk=self.ready[0].model_id).update(last_used_at=timezone.now())
        for index in finished:
            finish_row(
                self.ready[index],
                results[index],
                relay=self.relay,
                index=index,
                stream=self.streams[index],
                capture=self.capture,
            )


def keep_progress(row: Generation, result) -> None:
    """Back to ``queued`` with where the row stands and its timings so far."""
    earlier = row.progress or {}
    progress = {
        "engine": result.progress.as_json(),
        "prefill_ms": earlier.get("prefill_ms", round(result.prefill_seconds * 1000, 3)),
        "decode_seconds": earlier.get("decode_seconds", 0.0) + result.decode_seconds,
        "segments": earlier.get("segments", 1) + 1,
    }
    row.save(
        update_fields=row.mark_yielded(
            progress=progress, output_token_ids=result.token_ids, output_text=result.text
        )
    )


def finish_row(
    row: Generation, result, *, relay: TokenRelay, index: int, stream: GenerationStream, capture: list[str]
) -> None:
    """Save a finished row's result and end its stream and group."""
    earlier = row.progress or {}
    generated = len(result.token_ids)
    decode_seconds = earlier.get("decode_seconds", 0.0) + result.decode_seconds
    row.save(
        update_fields=[
            *row.mark_finished(
                output_token_ids=result.token_ids,
                output_text=result.text,
                finish_reason=result.finish_reason,
                prefill_ms=earlier.get("prefill_ms", round(result.prefill_seconds * 1000, 3)),
                decode_tokens_per_second=(
                    round((generated - 1) / decode_seconds) if generated > 1 and decode_seconds > 0 else None
                ),
                total_ms=round((timezone.now() - row.started_at).total_seconds() * 1000, 3),
            ),
            "effect",  # measure_effects' result
        ]
    )

    extra: dict[str, Any] = {"output_text": result.text}
    if result.logprobs is not None:
        extra["logprobs"] = [token_payload(event) for event in result.logprobs]
    if result.prompt_logprobs is not None:
        extra["prompt_logprobs"] = [token_payload(event) for event in result.prompt_logprobs]
    if capture and result.activations is not None:
        if row.store_activations:
            try:
                row.cache = store_capture(row, result)
                row.save(update_fields=["cache"])
            except Exception as error:
                logger.exception("storing the activations of %s failed", row.id)
                code = getattr(error, "code", "CAPTURE_FAILED")
                fail(row, code, f"The activations could not be stored: {getattr(error, 'message', error)}")
                return
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
    stream.emit_event(final_event(row, **extra))
    BACKGROUND_PUBLISHER.send(
        f"generation:{'cancelled' if row.status == Generation.Status.CANCELLED else 'completed'}",
        group_event_data(row),
        groups=generation_groups(row),
        audience=rows_audience(("generation", row.id)),
    )
