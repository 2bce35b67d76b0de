"""Generation workflows: validate a request, write its rows, queue it on the model's host worker.

One path for every front door: ``POST /api/generate``, the OpenAI-compatible ``/v1`` endpoints,
``manage.py generate`` / ``play`` and the playground page all call :func:`generation_request`,
then read the generation's event stream (``generation.streams``).

Documented behaviour for a model that is not loaded: 409 ``MODEL_NOT_LOADED`` (load it first:
``POST /api/models/{id}/load``). Generation never loads a model on its own, because a load can
evict another model and take minutes, which a chat client waiting on a socket should not cause.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from activations.model_structure import skeleton
from activations.services import hook_names_for
from engine.generation.params import config_context_length
from engine.hooks import MODULE_PREFIX, list_hook_points
from generation.admission import admission_turn, generation_admit, row_work
from generation.interventions import (
    MAX_MAGNITUDE,
    interventions_memory,
    interventions_request,
    measure_request,
    swept_amount,
)
from generation.models import Generation
from generation.selectors import generation_get
from generation.streams import GenerationStream, grant_leases, request_cancel
from generation.tasks import final_event, generation_enqueue, withdraw_queued
from mistudio import roles
from mistudio.access import OPERATOR
from mistudio.budgets import memory_budget_check
from mistudio.errors import ApplicationError
from mistudio.workers import read_heartbeats
from models_app.models import LanguageModel
from models_app.selectors import model_list, models_named
from models_app.services import model_host

MAX_TOKENS_LIMIT = 2048
DEFAULT_MAX_TOKENS = 128
MAX_PROMPT_CHARACTERS = 12_000
MAX_BATCH_PROMPTS = 16
MAX_STOP_SEQUENCES = 4
CAPTURE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class SamplingRequest:
    """Sampling parameters as validated by an API serializer (names as in ``/api/generate``)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    # Each prompt token's logprob and this many alternatives (None: not asked for): completions'
    # echo with logprobs, and vLLM's prompt_logprobs on both /v1 endpoints.
    prompt_logprobs: int | None = None
    # Keep going past the end-of-sequence token (vLLM's ignore_eos): benchmarks, long probes.
    ignore_eos: bool = False
    # False when max_tokens is the default: then it shrinks to fit the model's context.
    max_tokens_explicit: bool = False


def check_may_generate(user) -> None:
    """403 ``PERMISSION_DENIED`` without the model:write role: checked before the body is read, so a
    reader learns nothing from validation messages."""
    if not user.has_perm(roles.WRITE):
        raise ApplicationError("PERMISSION_DENIED", "Generating needs the model:write role.", status=403)


def generation_model(*, user, model_ref: str) -> LanguageModel:
    """The model an API request names, by id (``m_…``) or by name, if the user may generate with it.

    403 ``PERMISSION_DENIED`` without the model:write role; 404 ``MODEL_NOT_FOUND`` for a model
    the user cannot see.
    """

    check_may_generate(user)
    matches = models_named(model_list(user=user), model_ref)
    if len(matches) > 1:
        raise ApplicationError(
            "AMBIGUOUS_MODEL", f"Several models are named {model_ref!r}; use the model id.", status=400
        )
    if not matches:
        raise ApplicationError("MODEL_NOT_FOUND", f"No model {model_ref!r}.", status=404)
    return matches[0]


def check_prompt_text(text: str, *, field_name: str) -> None:
    if not text.strip():
        raise ApplicationError(
            "EMPTY_PROMPT", "The prompt is empty.", details={"fields": {field_name: ["Empty."]}}, status=400
        )
    if "\x00" in text:
        raise ApplicationError(
            "INVALID_PROMPT",
            "The prompt contains a NUL character.",
            details={"fields": {field_name: ["NUL characters are not allowed."]}},
            status=400,
        )
    if len(text) > MAX_PROMPT_CHARACTERS:
        raise ApplicationError(
            "PROMPT_TOO_LONG",
            f"The prompt has {len(text)} characters; the limit is {MAX_PROMPT_CHARACTERS}.",
            details={"fields": {field_name: [f"At most {MAX_PROMPT_CHARACTERS} characters."]}},
            status=400,
        )


def generation_request(
    *,
    model_id: str,
    owner,
    prompts: list[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: str = "",
    chat_template: bool | None = None,
    sampling: SamplingRequest,
    capture: list[str] | None = None,
    capture_dtype: str = "float32",
    store_activations: bool = True,
    interventions: list[dict[str, Any]] | None = None,
    measure: dict[str, Any] | None = None,
    sweep: list[tuple[float, list[dict[str, Any]]]] | None = None,
    interface: str = Generation.Interface.API,
) -> list[Generation]:
    """Create one queued generation per prompt (or one for ``messages``) and queue them on the host.

    Rows of one request share a ``batch_id`` and are created in one transaction before any job is
    queued, so the worker runs them as one batch. Raises 409 ``MODEL_NOT_LOADED`` when the model
    is not ready, 400 for bad prompts, hook names or interventions (``generation.interventions``,
    which every row of the request gets). Permissions are the caller's to check
    (:func:`generation_model` finds a model the way an API user may see it).

    ``measure`` names an SAE feature whose activation on the output the worker measures
    (``engine.effects``); by default, the first feature the interventions add or clamp. ``sweep``
    (from :func:`sweep_request`) makes one row of the one prompt per (coefficient, validated
    interventions) instead.
    """

    model = LanguageModel.objects.get(pk=model_id)
    _check_prompts(prompts, messages, system_prompt)
    user = owner if owner is not None else OPERATOR
    # The model's structure only when a hook must be checked (building it the first time is slow).
    widths = hook_widths(model, interventions) if interventions or measure is not None else {}
    steering = interventions_request(interventions, widths=widths, user=user) if interventions else []
    measured = measure_request(measure, steering, widths=widths, user=user)
    planned = _planned_rows(prompts, sweep, steering)
    host = model_host(model)
    if (estimate := interventions_memory(steering, user=user)) is not None:
        memory_budget_check(estimate, what="this mean ablation", worker_name=host)
    hooks = _capture_hooks(model, capture, capture_dtype, prompts)

    parameters = asdict(sampling)
    explicit = parameters.pop("max_tokens_explicit")
    shared = {
        "model": model,
        "owner": owner,
        "interface": interface,
        "batch_id": uuid.uuid4().hex[:12],
        "messages": messages or [],
        "system_prompt": system_prompt,
        "chat_template": chat_template,
        "parameters": parameters,
        "max_tokens_explicit": explicit,
        "capture_hooks": hooks,
        "capture_dtype": capture_dtype,
        "store_activations": store_activations,
        "measure": measured,
    }
    text = "\n".join(message["content"] for message in messages) + system_prompt if messages else None
    context = config_context_length(model.config or {})
    work = [
        row_work(
            row.prompt if text is None else text, sampling.max_tokens, explicit=explicit, context=context
        )
        for row in planned
    ]
    return _queue_rows(owner=owner, host=host, planned=planned, work=work, shared=shared)


@dataclass(frozen=True)
class _PlannedRow:
    """One generation of a request: its prompt, and its sweep coefficient and interventions."""

    prompt: str
    coefficient: float | None
    interventions: list[dict[str, Any]]


def _check_prompts(
    prompts: list[str] | None, messages: list[dict[str, str]] | None, system_prompt: str
) -> None:
    """A request has either prompts (1 to MAX_BATCH_PROMPTS) or messages, each within the size limit."""
    if (prompts is None) == (messages is None):
        raise ApplicationError("INVALID_REQUEST", "Give either a prompt or messages.", status=400)
    if prompts is not None:
        if not prompts or len(prompts) > MAX_BATCH_PROMPTS:
            raise ApplicationError("INVALID_REQUEST", f"Give 1 to {MAX_BATCH_PROMPTS} prompts.", status=400)
        for index, prompt in enumerate(prompts):
            check_prompt_text(prompt, field_name="prompt" if len(prompts) == 1 else f"prompt[{index}]")
        return
    if not messages:
        raise ApplicationError("EMPTY_PROMPT", "messages is empty.", status=400)
    check_prompt_text(
        "\n".join(message["content"] for message in messages) + system_prompt, field_name="messages"
    )


def _planned_rows(
    prompts: list[str] | None,
    sweep: list[tuple[float, list[dict[str, Any]]]] | None,
    steering: list[dict[str, Any]],
) -> list[_PlannedRow]:
    """One row per prompt with the request's interventions, or one row of the one prompt per
    coefficient of a sweep (a request of messages has the empty prompt)."""
    if sweep is None:
        return [_PlannedRow(prompt, None, steering) for prompt in (prompts if prompts is not None else [""])]
    return [_PlannedRow(prompts[0] if prompts else "", coefficient, specs) for coefficient, specs in sweep]


def _capture_hooks(
    model: LanguageModel, capture: list[str] | None, dtype: str, prompts: list[str] | None
) -> list[str]:
    """The hook points to capture (checked against the model), for one prompt, in a known dtype."""
    hooks = hook_names_for(model, hooks=capture, layers=None) if capture else []
    if hooks and prompts is not None and len(prompts) > 1:
        raise ApplicationError(
            "CAPTURE_NEEDS_ONE_PROMPT", "Activation capture works on one prompt per request.", status=400
        )
    if dtype not in CAPTURE_DTYPES:
        raise ApplicationError(
            "INVALID_DTYPE", f"dtype must be one of {', '.join(CAPTURE_DTYPES)}.", status=400
        )
    return hooks


def _queue_rows(
    *, owner, host: str, planned: list[_PlannedRow], work: list[int], shared: dict[str, Any]
) -> list[Generation]:
    """The request's rows, admitted and created in one transaction, then queued as one batch."""
    with admission_turn(owner), transaction.atomic():
        generation_admit(owner=owner, host=host, tokens=sum(work))
        rows = [
            Generation.objects.create(
                **shared,
                prompt=row.prompt,
                interventions=row.interventions,
                sweep_coefficient=row.coefficient,
                work_tokens=row_work_tokens,
            )
            for row, row_work_tokens in zip(planned, work, strict=True)
        ]
        grant_leases(*(row.id for row in rows))
        generation_enqueue(host=host, generation_id=rows[0].id)
    return rows


MAX_SWEEP_COEFFICIENTS = 8
# In units of the feature's max activation (an SAE feature with an analysis), else raw.
DEFAULT_SWEEP_COEFFICIENTS = (0.5, 1, 2, 4, 8)


def sweep_request(
    *,
    model_id: str,
    owner,
    intervention: dict[str, Any],
    coefficients: list[float] | None,
    measure: dict[str, Any] | None = None,
    interface: str = Generation.Interface.API,
    **request: Any,
) -> list[Generation]:
    """A strength sweep: the same prompt (or messages) generated once without ``intervention`` and
    once per coefficient with it (an add's ``coefficient``, a clamp's ``value``), all with one seed
    (chosen here when the sampling has none), as one batch. Every row measures the effect on the
    intervention's SAE feature (or on ``measure``). The rows come back baseline first."""
    model = LanguageModel.objects.get(pk=model_id)
    coefficients = list(DEFAULT_SWEEP_COEFFICIENTS if coefficients is None else coefficients)
    if (
        not 1 <= len(coefficients) <= MAX_SWEEP_COEFFICIENTS
        or not all(
            isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= MAX_MAGNITUDE
            for value in coefficients
        )
        or len(set(coefficients)) != len(coefficients)
    ):
        raise ApplicationError(
            "INVALID_SWEEP",
            f"coefficients must be 1 to {MAX_SWEEP_COEFFICIENTS} distinct numbers.",
            details={"fields": {"coefficients": ["Distinct numbers."]}},
            status=400,
        )
    amount = swept_amount(intervention)
    if amount is None:
        raise ApplicationError(
            "INVALID_SWEEP", "A sweep varies one add or clamp_feature intervention.", status=400
        )
    (template,) = interventions_request(
        [{**intervention, amount: 1.0}],
        widths=hook_widths(model, [intervention]),
        user=owner if owner is not None else OPERATOR,
    )
    if measure is None and "feature" in template:
        measure = {"sae": template["sae"], "feature": template["feature"]}
    sampling: SamplingRequest = request.pop("sampling")
    if sampling.seed is None:
        sampling.seed = secrets.randbelow(2**31)
    return generation_request(
        model_id=model.id,
        owner=owner,
        sampling=sampling,
        measure=measure,
        sweep=[(0.0, []), *((float(value), [{**template, amount: float(value)}]) for value in coefficients)],
        interface=interface,
        **request,
    )


def sweep_header(rows: list[Generation]) -> dict[str, Any]:
    """What every row of a sweep shares (rows from :func:`sweep_request`, baseline first): its
    model, seed, swept intervention (without its amount), unit and scale (a row's raw coefficient is
    its ``sweep_coefficient`` times ``unit_scale``) and measured feature."""
    steered = next((row.interventions[0] for row in rows if row.interventions), {})
    return {
        "model_id": rows[0].model_id,
        "seed": rows[0].parameters["seed"],
        "intervention": {
            key: value for key, value in steered.items() if key not in ("coefficient", "value", "vector")
        },
        "unit": steered.get("unit", "raw"),
        "unit_scale": steered.get("unit_scale", 1.0),
        "measure": rows[0].measure or None,
    }


def hook_widths(model: LanguageModel, interventions: Any) -> dict[str, int | None]:
    """The width of each hook point of ``model``, and None for the ``module:`` paths the
    interventions name (valid ones: 400 ``INVALID_HOOK`` otherwise)."""
    structure = skeleton(model)
    widths: dict[str, int | None] = {point.name: point.width for point in list_hook_points(structure)}
    items = interventions if isinstance(interventions, list) else []
    modules = [
        item["hook"]
        for item in items
        if isinstance(item, dict)
        and isinstance(item.get("hook"), str)
        and item["hook"].startswith(MODULE_PREFIX)
    ]
    if modules:
        widths.update(dict.fromkeys(hook_names_for(model, hooks=modules, layers=None)))
    return widths


def generation_cancel(*, user, generation_id: str) -> Generation:
    """Stop a generation: a queued one never runs, a running one stops after its current token."""

    generation = generation_get(user=user, generation_id=generation_id)
    if not user.has_perm(roles.WRITE):
        raise ApplicationError("PERMISSION_DENIED", "Cancelling needs the model:write role.", status=403)
    generation_stop(generation.id)
    generation.refresh_from_db()
    return generation


def generation_stop(generation_id: str) -> None:
    """Cancel without a permission check (the client that asked for it went away)."""
    generations_withdraw([generation_id])


def generations_withdraw(generation_ids: list[str]) -> None:
    """Withdraw the rows of a request that ended without them (its client went away, it failed or
    timed out): a queued row never runs, a running one stops after its current token. Rows that
    already ended are left as they are."""
    if not generation_ids:
        return
    request_cancel(*generation_ids)
    for generation_id in generation_ids:
        # One conditional UPDATE: a worker claiming the row at the same moment gets it or nothing.
        withdraw_queued(generation_id)


# How long after a row became final its worker's final event may still be on its way (a large
# capture is turned into lists first): a silent reader is not answered from the row until then.
FINAL_EVENT_GRACE_SECONDS = 30


def generation_check(generation_id: str) -> dict[str, Any] | None:
    """For a reader that has heard nothing for a while: a final event if the generation cannot finish.

    A row already final gives its result: a failed one at once; a completed or cancelled one once
    it has been final for ``FINAL_EVENT_GRACE_SECONDS`` (its stream expired): until then the worker
    is still writing its final event, which carries what the row does not (captured values,
    logprobs). A running row whose host worker has no heartbeat any more is failed with
    ``WORKER_LOST``.
    """

    generation = Generation.objects.filter(pk=generation_id).first()
    if generation is None:
        return {
            "type": "failed",
            "code": "GENERATION_NOT_FOUND",
            "message": "The generation is gone.",
            "status": 404,
        }
    if generation.status not in Generation.ACTIVE:
        grace = timedelta(seconds=FINAL_EVENT_GRACE_SECONDS)
        recent = generation.finished_at is not None and timezone.now() - generation.finished_at < grace
        if recent and generation.status != Generation.Status.FAILED:
            return None
        return final_event(generation)
    alive = {beat["name"] for beat in read_heartbeats()}
    host = generation.host_worker or generation.model.host_worker
    if host and host not in alive:
        failed = Generation.objects.filter(pk=generation_id, status__in=Generation.ACTIVE).update(
            status=Generation.Status.FAILED,
            error_code="WORKER_LOST",
            error_message="The worker stopped.",
            finished_at=timezone.now(),
        )
        if failed:
            generation.refresh_from_db()
            event = final_event(generation)
            GenerationStream(generation_id).emit_event(event)
            return event
    return None


def result_body(event: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in event.items() if key not in ("type", "status")}
