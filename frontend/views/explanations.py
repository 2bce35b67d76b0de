"""Pages: automatic interpretation of an SAE's features.

- ``/saes/<id>/explanations/new/``: choose the features (the N densest, a density range, a list or
  all), the endpoint and the explainer model (a loaded model of this workbench by default);
  "Estimate" shows the requests and prompt tokens the job will take before anything starts; "Start"
  queues it.
- ``/saes/<id>/explanations/<job>/``: its progress (live, ``?fragment=live``), the scores'
  distribution, and every feature's explanation with its scores; cancel.
- Accepting an explanation as a feature's label is a form on the feature's page, posted to
  ``/saes/<id>/features/<n>/explanations/<e>/accept/``.

The forms are validated with the API's own serializers and call the same services as
``/api/saes/<id>/explanations`` (one path per operation).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST
from rest_framework.exceptions import ValidationError

from engine.autointerp.pipeline import InterpretationConfig
from engine.autointerp.prompts import PROMPT_VERSION
from engine.autointerp.scoring import default_scorers, prompt_templates, scorer_names
from features import explanation_selectors, explanations, selectors
from features.explanation_apis import ExplanationJobListApi
from features.models import Explanation, ExplanationJob
from features.serializers import explanation_job_state, explanation_state
from frontend.access import reader_required, sae_or_404, writer_refusal
from frontend.charts import histogram_svg
from frontend.views.features import feature_url, validation_message
from frontend.views.job_pages import cancel_form
from mistudio.access import may_change
from mistudio.errors import ApplicationError
from mistudio.job_queue import queue_position
from models_app.models import LanguageModel
from models_app.selectors import model_list

SCORE_BINS = 10
RESULTS_SHOWN = 1000


def _form_body(post) -> dict[str, Any]:
    """The new-job form as the API's body (empty fields left out, so the defaults apply)."""
    kind = post.get("kind", "top")
    selection: dict[str, Any] = {"kind": kind}
    if kind == "top" and post.get("count", "").strip():
        selection["count"] = post["count"]
    if kind == "density":
        for name in ("min", "max"):
            if post.get(f"density_{name}", "").strip():
                selection[name] = post[f"density_{name}"]
    if kind == "list":
        selection["indices"] = [part for part in post.get("indices", "").replace(",", " ").split() if part]
    options: dict[str, Any] = {"scorers": post.getlist("scorers")}
    for name in ("concurrency", "explain_examples", "test_examples", "non_activating", "per_prompt"):
        if post.get(name, "").strip():
            options[name] = post[name]
    endpoint = post.get("endpoint", explanations.LOCAL)
    # On this workbench a loaded model is chosen from the list; elsewhere its name is typed.
    explainer = (
        post.get("explainer_model", "") if endpoint == explanations.LOCAL else post.get("external_model", "")
    )
    return {
        "endpoint": endpoint,
        "explainer_model": explainer,
        "scorer_model": post.get("scorer_model", ""),
        "selection": selection,
        "options": options,
        "shared": post.get("shared") == "on",
    }


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def explanation_new_page(request, sae_id: str):
    """The form; POST ``action=estimate`` shows the estimate, ``action=start`` queues the job."""
    if request.method == "POST" and (refused := writer_refusal(request)):
        return refused
    sae = sae_or_404(request.user, sae_id)
    context: dict[str, Any] = {
        "sae": sae,
        "endpoints": explanations.explainer_endpoints(),
        "models": list(model_list(user=request.user).filter(status=LanguageModel.Status.READY)),
        "prompt_version": PROMPT_VERSION,
        "templates": prompt_templates(),
        "scorers": scorer_names(),
        "values": {"kind": "top", "count": "50", "scorers": list(default_scorers()), "endpoint": "local"},
        "concurrency_max": explanations.option_bounds()["concurrency"][1],
        "concurrency_default": InterpretationConfig().concurrency,
    }
    context["values"].update(
        {name: request.GET[name] for name in ("kind", "count", "indices") if name in request.GET}
    )
    try:
        context["analysis"] = selectors.current_analysis(user=request.user, sae=sae)
    except ApplicationError as error:
        context["error"] = error
        return render(request, "frontend/explanation_new.html", context)
    context["explainers"] = explanations.explainer_choices(
        models=context["models"], analysis=context["analysis"]
    )
    if request.method != "POST":
        return render(request, "frontend/explanation_new.html", context)
    body = _form_body(request.POST)
    context["values"] = {**request.POST.dict(), "scorers": request.POST.getlist("scorers")}
    start = request.POST.get("action") == "start"
    try:
        data = ExplanationJobListApi.InputSerializer(data={**body, "dry_run": not start})
        data.is_valid(raise_exception=True)
        values = data.validated_data
        result = explanations.explanation_request(
            owner=request.user,
            analysis=context["analysis"],
            endpoint=values["endpoint"],
            explainer_model=values["explainer_model"],
            scorer_model=values.get("scorer_model") or None,
            selection=dict(values.get("selection") or {}),
            options=dict(values.get("options") or {}),
            shared=values["shared"],
            dry_run=not start,
        )
    except ValidationError as error:
        context["form_error"] = validation_message(error)
        return render(request, "frontend/explanation_new.html", context, status=400)
    except ApplicationError as error:
        context["form_error"] = error.message
        return render(request, "frontend/explanation_new.html", context, status=error.status)
    if start:
        messages.success(request, f"Explanation job {result.id} queued.")
        return redirect(reverse("frontend:explanation-job", args=[sae.id, result.id]))
    context["estimate"], context["refusal"] = result["estimate"], result["refusal"]
    context["warnings"] = result["warnings"]
    return render(request, "frontend/explanation_new.html", context)


def job_context(request, sae, job: ExplanationJob) -> dict[str, Any]:
    rows = list(job.explanations.defer("prompt").order_by("index")[:RESULTS_SHOWN])
    scores = [row.score for row in rows if row.score is not None]
    state = explanation_job_state(job, viewer=request.user)
    shown = [explanation_state(row) for row in rows]
    # The scorers the job ran (their columns), or the default ones before any result.
    columns = [
        column
        for column in Explanation.SCORE_COLUMNS.values()
        if any(row.get(column) is not None for row in shown)
    ] or [Explanation.SCORE_COLUMNS[name] for name in default_scorers()]
    return {
        "score_columns": columns,
        "sae": sae,
        "job": job,
        "state": state,
        "active": job.status in ExplanationJob.ACTIVE,
        "can_change": may_change(job, request.user),
        "rows": [
            {
                **row,
                "url": feature_url(sae.id, row["index"]),
                "cells": [row.get(column) for column in columns],
            }
            for row in shown
        ],
        "more": job.explanations.count() - len(rows),
        "score_histogram": score_histogram(scores),
        "queue": queue_position(job, viewer=request.user),
    }


def score_histogram(scores: list[float]):
    """The scores' distribution over [0, 1] in ``SCORE_BINS`` bins (None without scores)."""
    if not scores:
        return None
    counts, edges = np.histogram(scores, bins=SCORE_BINS, range=(0.0, 1.0))
    return histogram_svg(
        counts.tolist(),
        edges.round(3).tolist(),
        label="Scores of the job's explanations (mean balanced accuracy)",
        x_label="score (0.5: chance)",
    )


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def explanation_job_page(request, sae_id: str, job_id: str):
    """A job's progress and results; POST cancels it (``explanation_cancel``); ``?fragment=live``
    is the part that changes while it runs."""
    if request.method == "POST" and (refused := writer_refusal(request)):
        return refused
    sae = sae_or_404(request.user, sae_id)
    try:
        job = explanation_selectors.explanation_job_get(user=request.user, sae=sae, job_id=job_id)
    except ApplicationError as error:
        return render(request, "frontend/partials/cache_error.html", {"message": error.message}, status=404)
    if request.method == "POST":
        return cancel_form(
            request,
            cancel=lambda: explanations.explanation_cancel(job=job, actor=request.user),
            cancelling="Cancelling: requests in flight finish, nothing new is sent.",
            back=request.path,
        )
    context = job_context(request, sae, job)
    if request.GET.get("fragment") == "live":
        return render(request, "frontend/partials/explanation_job_live.html", context)
    return render(request, "frontend/explanation_job.html", context)


@reader_required
@require_POST
def explanation_accept_page(request, sae_id: str, index: int, explanation_id: int):
    """Make an explanation (``text``: as edited) the user's label of the feature, as
    ``POST /api/saes/<id>/features/<n>/explanations/<e>/accept`` does; back to the feature."""
    if refused := writer_refusal(request):
        return refused
    sae = sae_or_404(request.user, sae_id)
    if "text" not in request.POST:
        return render(
            request,
            "frontend/partials/cache_error.html",
            {"message": "The form sends the label's text."},
            status=400,
        )
    try:
        explanation = explanation_selectors.explanation_get(
            user=request.user, sae=sae, index=index, explanation_id=explanation_id
        )
        explanations.explanation_accept(
            explanation=explanation, actor=request.user, text=request.POST["text"]
        )
        messages.success(request, "Explanation accepted as your label.")
    except ApplicationError as error:
        messages.error(request, error.message)
    return redirect(feature_url(sae.id, index, request.POST.get("analysis") or None))
