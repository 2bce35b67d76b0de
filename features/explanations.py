"""Explanation workflows: endpoints, feature selection, the estimate, requests, cancel, accept.

Every front door (API, pages, admin, ``manage.py explain_features``) calls these. An explanation
job is a job (``mistudio.jobs``); its task is ``features.explanation_tasks``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, fields
from typing import Any

from django.conf import settings
from django.db import transaction

from engine.autointerp.pipeline import OPTION_BOUNDS, InterpretationConfig
from engine.autointerp.prompts import PROMPT_VERSION
from engine.autointerp.scoring import prompt_templates, scorer_names
from engine.generation.params import config_context_length
from features.models import Explanation, ExplanationJob, Feature, FeatureAnalysis, FeatureLabel
from features.search import check_embedding_model
from features.services import feature_label_set
from generation.services import generation_model
from mistudio import jobs
from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError, rate_limited
from mistudio.transaction_locks import take_turns
from mistudio.workers import shared_queue
from models_app.models import LanguageModel

LOCAL = "local"
MAX_INDICES = 1 << 20
CHARACTERS_PER_TOKEN = 4  # an estimate's rule of thumb where no tokenizer is at hand
EXAMPLE_MARKS_TOKENS = 6  # "Example i: " and the marks around an example's activating tokens


# --- endpoints -----------------------------------------------------------------------------------


def explainer_endpoints() -> list[dict[str, Any]]:
    """The endpoints a job may use: this workbench's own ``/v1`` first, then the administrator's.
    Their keys are never part of this (only whether one is configured and set)."""
    endpoints = [{"name": LOCAL, "url": "/v1", "kind": "local", "has_key": True}]
    for name, spec in settings.EXPLAINER_ENDPOINTS.items():
        endpoints.append(
            {
                "name": name,
                "url": spec["url"],
                "kind": "external",
                "has_key": bool(spec["key_env"] and os.environ.get(spec["key_env"])),
                "context_tokens": spec["context_tokens"],
            }
        )
    return endpoints


def model_context_tokens(model: LanguageModel) -> int:
    """The model's context (from the config its row keeps), 2,048 when it names none."""
    return config_context_length(model.config or {}) or 2048


def check_endpoint(*, user, endpoint: str, model_ref: str) -> tuple[str, int]:
    """``(model name to send, context tokens)`` for ``model_ref`` at ``endpoint``: on ``local``, a
    model the user may generate with, loaded now (409 otherwise); elsewhere the name as given."""
    if endpoint == LOCAL:
        model = generation_model(user=user, model_ref=model_ref)
        if model.status != LanguageModel.Status.READY:
            raise ApplicationError(
                "MODEL_NOT_LOADED",
                f"The explainer model {model.name} is {model.status}: load it first "
                f"(POST /api/models/{model.id}/load).",
                status=409,
            )
        return model.id, model_context_tokens(model)
    spec = settings.EXPLAINER_ENDPOINTS.get(endpoint)
    if spec is None:
        known = ", ".join([LOCAL, *settings.EXPLAINER_ENDPOINTS])
        raise ApplicationError(
            "ENDPOINT_NOT_FOUND", f"No explainer endpoint {endpoint!r} (there are: {known}).", status=404
        )
    if not model_ref.strip():
        raise ApplicationError("INVALID_REQUEST", "Name the model the endpoint should use.", status=400)
    return model_ref.strip(), spec["context_tokens"]


def explainer_choices(*, models: list[LanguageModel], analysis: FeatureAnalysis) -> list[dict[str, Any]]:
    """The loaded models an explainer may be on this workbench, each with its context and whether
    the job's prompts (default options) fit it: what the form offers, the ones that fit first."""
    config = interpretation_config(analysis, {})
    needed = prompt_sizes(analysis, config)["explain"]
    choices = []
    for model in models:
        context = model_context_tokens(model)
        unfit, _ = explanation_fit(analysis=analysis, config=config, context=context, model_name=model.name)
        choices.append(
            {
                "id": model.id, "name": model.name, "context_tokens": context, "fits": unfit is None,
                "needed_tokens": needed,
            }
        )  # fmt: skip
    return sorted(choices, key=lambda choice: not choice["fits"])


# --- which features ------------------------------------------------------------------------------


def explanation_indices(analysis: FeatureAnalysis, selection: dict[str, Any]) -> list[int]:
    """The live features ``selection`` names: ``{"kind": "all"}``, ``{"kind": "top", "count": N}``
    (the N densest), ``{"kind": "density", "min": a, "max": b}`` or ``{"kind": "list", "indices": [...]}``.
    Dead features (no examples to explain) are left out."""
    live = Feature.objects.filter(analysis=analysis).exclude(density=0)
    kind = selection.get("kind", "top")
    if kind == "all":
        indices = list(live.order_by("index").values_list("index", flat=True))
    elif kind == "top":
        count = selection.get("count", 50)
        indices = list(live.order_by("-density", "index").values_list("index", flat=True)[:count])
    elif kind == "density":
        low, high = selection.get("min", 0.0), selection.get("max", 1.0)
        if low > high:
            raise ApplicationError(
                "INVALID_SELECTION", "The density range's min is above its max.", status=400
            )
        indices = list(
            live.filter(density__gte=low, density__lte=high).order_by("index").values_list("index", flat=True)
        )
    elif kind == "list":
        wanted = list(dict.fromkeys(selection.get("indices") or []))
        d_sae = analysis.sae.d_sae
        outside = [index for index in wanted if not 0 <= index < d_sae]
        if outside:
            raise ApplicationError(
                "FEATURE_NOT_FOUND", f"The SAE has features 0 to {d_sae - 1}, not {outside[:5]}.", status=400
            )
        alive = set(live.filter(index__in=wanted).values_list("index", flat=True))
        indices = [index for index in wanted if index in alive]
    else:
        raise ApplicationError("INVALID_SELECTION", f"Unknown selection kind {kind!r}.", status=400)
    if not indices:
        raise ApplicationError(
            "NO_FEATURES", "The selection holds no live feature of this analysis.", status=400
        )
    return indices


# --- the estimate and the request ----------------------------------------------------------------


def option_bounds() -> dict[str, tuple[float, float | None]]:
    """Each numeric option's range (``OPTION_BOUNDS``), ``concurrency`` up to
    ``EXPLAINER_MAX_CONCURRENCY``: what the API, the form and the command accept."""
    return {**OPTION_BOUNDS, "concurrency": (1, settings.EXPLAINER_MAX_CONCURRENCY)}


def check_options(options: dict[str, Any]) -> None:
    """400 ``VALIDATION_ERROR`` (one message per field, as the serializers give) for an option
    outside its range: a value is refused, never silently lowered."""
    errors = {}
    for name, (low, high) in option_bounds().items():
        value = options.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            errors[name] = ["A number is required."]
        elif value < low or (high is not None and value > high):
            errors[name] = [f"Must be between {low} and {high}." if high is not None else f"At least {low}."]
    if errors:
        raise ApplicationError(
            "VALIDATION_ERROR",
            "Options out of range: " + "; ".join(f"{name}: {text[0]}" for name, text in errors.items()),
            details={"fields": {"options": errors}},
        )


def interpretation_config(analysis: FeatureAnalysis, options: dict[str, Any]) -> InterpretationConfig:
    """The job's settings: the defaults and the request's ``options`` (each within its range),
    the examples bounded by what the analysis holds (its top examples and interval examples)."""
    names = {field.name for field in fields(InterpretationConfig)}
    unknown = set(options) - names
    if unknown:
        raise ApplicationError(
            "INVALID_REQUEST", f"Unknown options: {', '.join(sorted(unknown))}.", status=400
        )
    check_options(options)
    values = {**asdict(InterpretationConfig()), **options}
    if "concurrency" not in options:  # the default, within what this deployment allows
        values["concurrency"] = min(values["concurrency"], settings.EXPLAINER_MAX_CONCURRENCY)
    values["scorers"] = tuple(values["scorers"])
    if not set(values["scorers"]) <= set(scorer_names()):
        raise ApplicationError("INVALID_REQUEST", f"Scorers are {', '.join(scorer_names())}.", status=400)
    if "embedding" in values["scorers"]:
        check_embedding_model()
    top_k = analysis.config.get("top_k", 20)
    interval_examples = analysis.config.get("intervals", 5) * analysis.config.get("per_interval", 4)
    values["explain_examples"] = max(1, min(values["explain_examples"], top_k))
    values["test_examples"] = max(
        1, min(values["test_examples"], interval_examples + top_k - values["explain_examples"])
    )
    return InterpretationConfig(**values)


def prompt_sizes(analysis: FeatureAnalysis, config: InterpretationConfig) -> dict[str, int]:
    """Tokens each kind of request needs at most, prompt and answer (``explain``; ``score``: the
    largest scorer's), estimated as the job's prompts are built: its template (at
    ``CHARACTERS_PER_TOKEN``) plus its examples' windows, plus the tokens it may answer with."""
    window = analysis.config.get("context_before", 8) + 1 + analysis.config.get("context_after", 3)
    templates = prompt_templates()

    def prompt(template: str, examples: int) -> int:
        return len(templates[template]) // CHARACTERS_PER_TOKEN + examples * (window + EXAMPLE_MARKS_TOKENS)

    explain = prompt("explain", config.explain_examples)
    score = max((prompt(kind, config.per_prompt) for kind in config.scorers), default=0)
    return {
        "explain_prompt": explain,
        "explain": explain + config.explain_max_tokens,
        "score_prompt": score,
        "score": score + config.score_max_tokens,
        "example": window + EXAMPLE_MARKS_TOKENS,
    }


def explanation_estimate(
    *, analysis: FeatureAnalysis, features: int, config: InterpretationConfig, context: int
) -> dict[str, int]:
    """Requests and prompt tokens of the job, before it runs (:func:`prompt_sizes`, each prompt at
    most the model's context)."""
    sizes = prompt_sizes(analysis, config)
    scoring_requests = config.requests_per_feature() - 1
    return {
        "features": features,
        "requests": features * config.requests_per_feature(),
        "prompt_tokens": features
        * (min(context, sizes["explain_prompt"]) + scoring_requests * min(context, sizes["score_prompt"])),
        "completion_tokens_at_most": features
        * (config.explain_max_tokens + scoring_requests * config.score_max_tokens),
    }


def explanation_fit(
    *, analysis: FeatureAnalysis, config: InterpretationConfig, context: int, model_name: str
) -> tuple[ApplicationError | None, list[str]]:
    """Whether the job's requests fit the explainer's context, before anything starts: a refusal
    (400 ``EXPLAINER_CONTEXT_TOO_SMALL``) when no explanation prompt fits, so that no feature could
    be explained; warnings when the scoring prompts do not (explanations without scores)."""
    sizes = prompt_sizes(analysis, config)
    warnings: list[str] = []
    elsewhere = (
        "Choose a model with a longer context (an external one is configured with "
        "MISTUDIO_EXPLAINER_ENDPOINTS)"
    )
    if sizes["explain"] > context:
        room = context - (sizes["explain"] - config.explain_examples * sizes["example"])
        fewer = room // sizes["example"]
        return ApplicationError(
            "EXPLAINER_CONTEXT_TOO_SMALL",
            f"The explainer's prompt needs about {sizes['explain']:,} tokens ({config.explain_examples} "
            f"examples and {config.explain_max_tokens} to answer); {model_name} takes {context:,}. "
            + (
                f"{elsewhere}, or lower explain_examples to {fewer} or fewer."
                if fewer >= 1
                else f"{elsewhere}: even its instructions alone do not fit."
            ),
            details={"needed_tokens": sizes["explain"], "context_tokens": context},
        ), warnings
    if sizes["score"] > context:
        warnings.append(
            f"A scoring prompt needs about {sizes['score']:,} tokens, more than {model_name}'s "
            f"{context:,}: explanations will not be scored. Lower per_prompt, or choose a model with "
            "a longer context."
        )
    return None, warnings


def explanation_tokens(estimate: dict[str, int]) -> int:
    """What a job may cost, in tokens: its prompt tokens plus the most completion tokens."""
    return int(estimate.get("prompt_tokens", 0)) + int(estimate.get("completion_tokens_at_most", 0))


def explanation_limits(endpoint: str) -> dict[str, Any]:
    """The token limits of a job on ``endpoint`` (0: none): an external endpoint's are its own,
    lower ones (an administrator's paid key)."""
    if endpoint == LOCAL:
        return {
            "per_job": settings.EXPLANATION_MAX_TOKENS_PER_JOB,
            "per_user": settings.EXPLANATION_MAX_TOKENS_PER_USER,
            "settings": ["EXPLANATION_MAX_TOKENS_PER_JOB", "EXPLANATION_MAX_TOKENS_PER_USER"],
        }
    return {
        "per_job": settings.EXPLANATION_EXTERNAL_MAX_TOKENS_PER_JOB,
        "per_user": settings.EXPLANATION_EXTERNAL_MAX_TOKENS_PER_USER,
        "settings": ["EXPLANATION_EXTERNAL_MAX_TOKENS_PER_JOB", "EXPLANATION_EXTERNAL_MAX_TOKENS_PER_USER"],
    }


REDUCE_HINT = (
    "Explain fewer features (selection), or lower test_examples, non_activating, per-request "
    "max tokens (explain_max_tokens, score_max_tokens) or use one scorer."
)


def explanation_cost_refusal(*, owner, endpoint: str, estimate: dict[str, int]) -> ApplicationError | None:
    """Why a job of ``estimate`` may not start now, or None: over the per-job limit (400
    ``EXPLANATION_TOO_LARGE``), or with the owner's queued and running jobs on endpoints of the
    same kind over the per-user limit (429 ``RATE_LIMITED``, until one of them ends). The dry run
    shows the same answer the request would get."""
    limits = explanation_limits(endpoint)
    tokens = explanation_tokens(estimate)
    where = "this workbench's /v1" if endpoint == LOCAL else f"the external endpoint {endpoint!r}"
    cost = (
        f"{tokens:,} tokens ({estimate['prompt_tokens']:,} prompt + at most "
        f"{estimate['completion_tokens_at_most']:,} completion, {estimate['requests']:,} requests)"
    )
    per_job, per_user = limits["per_job"], limits["per_user"]
    if per_job and tokens > per_job:
        return ApplicationError(
            "EXPLANATION_TOO_LARGE",
            f"This job would cost up to {cost}, more than the {per_job:,} one job may on {where} "
            f"({limits['settings'][0]}). {REDUCE_HINT}",
            details={"scope": "job", "estimate": estimate, "tokens": tokens, "limit": per_job},
        )
    user = owner if getattr(owner, "is_authenticated", False) else None
    if not per_user or user is None:
        return None
    if tokens > per_user:
        return ApplicationError(
            "EXPLANATION_TOO_LARGE",
            f"This job would cost up to {cost}, more than the {per_user:,} a user's jobs may on {where} "
            f"together ({limits['settings'][1]}). {REDUCE_HINT}",
            details={"scope": "user", "estimate": estimate, "tokens": tokens, "limit": per_user},
        )
    active = ExplanationJob.objects.filter(owner=user, status__in=ExplanationJob.ACTIVE)
    active = active.filter(endpoint=LOCAL) if endpoint == LOCAL else active.exclude(endpoint=LOCAL)
    rows = list(active)
    spent = sum(explanation_tokens(row.estimate or {}) for row in rows)
    if spent + tokens > per_user:
        return rate_limited(
            f"Your queued and running explanation jobs may cost up to {spent:,} tokens; this one's "
            f"{cost} would take them past the {per_user:,} allowed per user on {where} "
            f"({limits['settings'][1]}). Send it again when one of them ends, or make it smaller. "
            + REDUCE_HINT,
            retry_after_seconds=jobs.slot_retry_after(rows),
            details={
                "scope": "explanation_tokens", "estimate": estimate, "tokens": tokens, "limit": per_user,
                "active_tokens": spent, "active_jobs": [row.pk for row in rows],
            },
        )  # fmt: skip
    return None


def refusal_body(error: ApplicationError) -> dict[str, Any]:
    """A refusal as the dry run shows it: the status and error the request itself would get."""
    return {"status": error.status, "code": error.code, "message": error.message, "details": error.details}


def explanation_request(
    *,
    owner,
    analysis: FeatureAnalysis,
    endpoint: str = LOCAL,
    explainer_model: str,
    scorer_model: str | None = None,
    selection: dict[str, Any],
    options: dict[str, Any] | None = None,
    shared: bool = False,
    dry_run: bool = False,
) -> ExplanationJob | dict[str, Any]:
    """Queue an explanation job for the features ``selection`` names (``dry_run``: only its
    estimate). The analysis must be completed; on ``local`` the explainer (and scorer) must be
    models the owner may generate with, loaded."""
    if analysis.status != FeatureAnalysis.Status.COMPLETED:
        raise ApplicationError("ANALYSIS_NOT_READY", f"The analysis is {analysis.status}.", status=409)
    user = owner or OPERATOR
    if endpoint == LOCAL and not getattr(owner, "is_authenticated", False):
        raise ApplicationError(
            "OWNER_REQUIRED", "A job on this workbench's /v1 runs as a user: name its owner.", status=400
        )
    explainer, context = check_endpoint(user=user, endpoint=endpoint, model_ref=explainer_model)
    scorer = (
        explainer
        if not scorer_model
        else check_endpoint(user=user, endpoint=endpoint, model_ref=scorer_model)[0]
    )
    config = interpretation_config(analysis, options or {})
    indices = explanation_indices(analysis, selection)
    estimate = explanation_estimate(analysis=analysis, features=len(indices), config=config, context=context)
    unfit, warnings = explanation_fit(
        analysis=analysis, config=config, context=context, model_name=explainer_model.strip()
    )
    if dry_run:
        refusal = unfit or explanation_cost_refusal(owner=owner, endpoint=endpoint, estimate=estimate)
        return {
            "estimate": estimate,
            "limits": explanation_limits(endpoint),
            "refusal": None if refusal is None else refusal_body(refusal),
            "warnings": warnings,
            "indices": indices[:1000],
            "config": asdict(config),
            "prompt_version": PROMPT_VERSION,
        }
    if unfit is not None:
        raise unfit
    with transaction.atomic():
        user = owner if getattr(owner, "is_authenticated", False) else None
        if user is not None:  # the user's running total is checked and added to in turn
            take_turns("explanation-tokens", user.pk)
        refusal = explanation_cost_refusal(owner=owner, endpoint=endpoint, estimate=estimate)
        if refusal is not None:
            raise refusal
        jobs.job_admit(owner=owner, tokens=explanation_tokens(estimate))
        job = ExplanationJob.objects.create(
            analysis=analysis,
            endpoint=endpoint,
            explainer_model=explainer,
            scorer_model=scorer,
            selection=selection,
            indices=indices,
            config={**asdict(config), "context_tokens": context},
            estimate={**estimate, **({"warnings": warnings} if warnings else {})},
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=shared,
        )
        jobs.job_submit(job, queue=shared_queue())
    return job


def explanation_cancel(*, job: ExplanationJob, actor) -> ExplanationJob:
    """A queued job is cancelled at once; a running one sends nothing new (requests in flight end)."""
    return jobs.job_cancel(job, actor=actor)


def explanation_job_update(*, job: ExplanationJob, actor, shared: bool) -> ExplanationJob:
    jobs.job_update(job, actor=actor, changes={"shared": shared})
    return job


def explanation_accept(*, explanation: Explanation, actor, text: str | None = None) -> FeatureLabel:
    """Make the explanation (or ``text``, an edited version of it) the actor's label of its feature."""
    chosen = (text if text is not None else explanation.text).strip()
    if not chosen:
        raise ApplicationError("EMPTY_LABEL", "An empty explanation cannot be a label.", status=400)
    return feature_label_set(
        sae=explanation.analysis.sae, index=explanation.index, actor=actor, label=chosen[:200]
    )


def explanation_summary(values: list[float | None]) -> dict[str, Any]:
    """Count, mean and deciles of scores (Nones left out): the job page's distribution."""
    present = sorted(value for value in values if value is not None and not math.isnan(value))
    if not present:
        return {"count": 0}
    deciles = [present[min(len(present) - 1, round(q * (len(present) - 1) / 10))] for q in range(11)]
    return {"count": len(present), "mean": sum(present) / len(present), "deciles": deciles}
