"""An explanation job's cost is capped before anything is written (``features.explanations``): its
estimate against the per-job and per-user token limits (lower on an external endpoint), its
options within their ranges (``concurrency`` refused past ``EXPLAINER_MAX_CONCURRENCY``, never
lowered in silence), and the dry run giving the same verdict as the request. Real rows, the real
API; no worker runs (a job that is admitted only waits in its queue)."""

from __future__ import annotations

import pytest

from conftest import make_user
from features.explanations import explanation_cost_refusal, explanation_request
from features.models import ExplanationJob, Feature, FeatureAnalysis
from models_app.models import LanguageModel

pytestmark = pytest.mark.django_db

# The hostile review's job: selection "all", test_examples 100, non_activating 100,
# explain_max_tokens 1024 (92,394 requests).
HOSTILE_ESTIMATE = {
    "features": 1743,
    "requests": 92_394,
    "prompt_tokens": 9_500_000,
    "completion_tokens_at_most": 23_900_000,
}


@pytest.fixture
def analysis(tiny_model, sae_row, planted_cache, writer):
    """A completed analysis with 40 live features; the model is ready (the explainer on this /v1)."""
    row = FeatureAnalysis.objects.create(sae=sae_row, cache=planted_cache, status="completed", owner=writer)
    Feature.objects.bulk_create(
        Feature(analysis=row, index=index, density=0.01 * (index + 1), max_activation=1, mean_activation=0.5)
        for index in range(40)
    )
    # Ready, with the context of a model the prompts fit (the tiny model's own 128 tokens do not).
    long_context = {**tiny_model.config, "n_positions": 4096}
    LanguageModel.objects.filter(pk=tiny_model.pk).update(
        status=LanguageModel.Status.READY, config=long_context
    )
    return row


def start(api, analysis, **body):
    return api.post(
        f"/api/saes/{analysis.sae_id}/explanations",
        {"explainer_model": analysis.sae.model_id, **body},
        format="json",
    )


def test_the_default_limits_refuse_the_hostile_job_and_pass_the_demos_jobs(analysis, writer):
    refusal = explanation_cost_refusal(owner=writer, endpoint="local", estimate=HOSTILE_ESTIMATE)
    assert refusal is not None and (refusal.status, refusal.code) == (400, "EXPLANATION_TOO_LARGE")
    assert refusal.details["tokens"] == 33_400_000 and refusal.details["limit"] == 10_000_000
    assert "EXPLANATION_MAX_TOKENS_PER_JOB" in refusal.message and "fewer features" in refusal.message
    # The demo's jobs: the form's default (the 50 densest, default options), and every feature.
    for selection in ({"kind": "top", "count": 50}, {"kind": "all"}):
        verdict = explanation_request(
            owner=writer, analysis=analysis, explainer_model=analysis.sae.model_id, selection=selection,
            dry_run=True,
        )  # fmt: skip
        assert verdict["refusal"] is None, verdict
    # A job of 2M tokens is fine on this workbench's /v1, too costly on an administrator's paid key.
    middling = {**HOSTILE_ESTIMATE, "prompt_tokens": 1_500_000, "completion_tokens_at_most": 500_000}
    assert explanation_cost_refusal(owner=writer, endpoint="local", estimate=middling) is None
    external = explanation_cost_refusal(owner=writer, endpoint="paid", estimate=middling)
    assert external.code == "EXPLANATION_TOO_LARGE" and external.details["limit"] == 1_000_000
    assert "EXPLANATION_EXTERNAL_MAX_TOKENS_PER_JOB" in external.message


def test_a_job_over_the_per_job_limit_is_refused_and_the_dry_run_says_so(
    analysis, writer, client_for, settings
):
    settings.EXPLANATION_MAX_TOKENS_PER_JOB = 50_000
    api = client_for(writer)
    body = {"selection": {"kind": "all"}, "options": {"test_examples": 30, "non_activating": 30}}
    dry = start(api, analysis, **body, dry_run=True)
    assert dry.status_code == 200, dry.content
    estimate, refusal = dry.json()["estimate"], dry.json()["refusal"]
    assert estimate["prompt_tokens"] + estimate["completion_tokens_at_most"] > 50_000
    assert dry.json()["limits"]["per_job"] == 50_000
    refused = start(api, analysis, **body)
    assert refused.status_code == 400 == refusal["status"]
    error = refused.json()["error"]
    assert error["code"] == refusal["code"] == "EXPLANATION_TOO_LARGE"
    assert error["details"]["estimate"] == estimate and error["details"]["limit"] == 50_000
    assert error["message"] == refusal["message"]
    assert not ExplanationJob.objects.exists()
    # Made smaller, as the message says: accepted.
    assert start(api, analysis, selection={"kind": "top", "count": 2}).status_code == 202


def test_a_users_running_total_is_capped_per_kind_of_endpoint(analysis, writer, client_for, settings):
    """The owner's queued and running jobs on this /v1 count against the per-user limit (429 with
    Retry-After until one ends); another user's, and the owner's ended ones, do not."""
    api = client_for(writer)
    first = start(api, analysis, selection={"kind": "top", "count": 10})
    assert first.status_code == 202, first.content
    job = ExplanationJob.objects.get(pk=first.json()["id"])
    cost = job.estimate["prompt_tokens"] + job.estimate["completion_tokens_at_most"]
    settings.EXPLANATION_MAX_TOKENS_PER_USER = cost + cost // 2  # room for half a job more
    again = start(api, analysis, selection={"kind": "top", "count": 10}, dry_run=True)
    assert again.json()["refusal"]["status"] == 429
    refused = start(api, analysis, selection={"kind": "top", "count": 10})
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    error = refused.json()["error"]
    assert error["code"] == "RATE_LIMITED" and error["details"]["scope"] == "explanation_tokens"
    assert error["details"]["active_tokens"] == cost and error["details"]["active_jobs"] == [job.id]
    assert ExplanationJob.objects.count() == 1
    # Another user's total is their own.
    other = make_user("olga-other", "model:write")
    analysis.sae.shared = True
    analysis.sae.save(update_fields=["shared"])
    FeatureAnalysis.objects.filter(pk=analysis.pk).update(shared=True)
    LanguageModel.objects.filter(pk=analysis.sae.model_id).update(shared=True)
    assert start(client_for(other), analysis, selection={"kind": "top", "count": 10}).status_code == 202
    # Once the first job has ended, the owner may start another.
    ExplanationJob.objects.filter(pk=job.pk).update(status="completed")
    assert start(api, analysis, selection={"kind": "top", "count": 10}).status_code == 202


def test_concurrency_past_the_deployments_maximum_is_refused_not_lowered(
    analysis, writer, client_for, settings
):
    settings.EXPLAINER_MAX_CONCURRENCY = 8
    api = client_for(writer)
    for concurrency, status in ((256, 400), (9, 400), (8, 202)):
        response = start(
            api, analysis, selection={"kind": "top", "count": 2}, options={"concurrency": concurrency}
        )
        assert response.status_code == status, response.content
        if status == 400:
            error = response.json()["error"]
            assert error["code"] == "VALIDATION_ERROR"
            assert error["details"]["fields"]["options"]["concurrency"] == ["Must be between 1 and 8."]
    job = ExplanationJob.objects.get()
    assert job.config["concurrency"] == 8
    # The command line goes through the same check.
    from mistudio.errors import ApplicationError

    with pytest.raises(ApplicationError, match="concurrency"):
        explanation_request(
            owner=writer, analysis=analysis, explainer_model=analysis.sae.model_id,
            selection={"kind": "top", "count": 2}, options={"concurrency": 9, "test_examples": 0},
        )  # fmt: skip


def test_an_explainer_whose_context_the_prompts_do_not_fit_is_refused_before_anything_starts(
    analysis, writer, client_for
):
    """Before: the demo model (128 tokens) was accepted, 9 of 20 features then failed
    PROMPT_TOO_LONG and the rest NO_EXPLANATION, and the job said "Completed"."""
    LanguageModel.objects.filter(pk=analysis.sae.model_id).update(config={"n_positions": 128})
    api = client_for(writer)
    dry = start(api, analysis, dry_run=True).json()
    assert dry["refusal"]["code"] == "EXPLAINER_CONTEXT_TOO_SMALL"
    assert "128" in dry["refusal"]["message"] and "MISTUDIO_EXPLAINER_ENDPOINTS" in dry["refusal"]["message"]
    refused = start(api, analysis)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "EXPLAINER_CONTEXT_TOO_SMALL"
    assert not ExplanationJob.objects.exists()

    # The command says it too, before anything starts, even for an estimate (before: "0 of 3").
    from django.core.management import CommandError, call_command

    for extra in ([], ["--estimate"]):
        with pytest.raises(CommandError, match="EXPLAINER_CONTEXT_TOO_SMALL: The explainer's prompt needs"):
            call_command(
                "explain_features", analysis.sae_id, "--model", analysis.sae.model_id, "--owner",
                writer.username, "--top", "3", *extra,
            )  # fmt: skip
    assert not ExplanationJob.objects.exists()

    # Where the explanation prompt fits and a scoring prompt does not: a warning, before it starts.
    LanguageModel.objects.filter(pk=analysis.sae.model_id).update(config={"n_positions": 600})
    options = {"explain_examples": 1, "explain_max_tokens": 8, "per_prompt": 20, "score_max_tokens": 256}
    narrow = start(api, analysis, dry_run=True, options=options).json()
    assert narrow["refusal"] is None
    assert narrow["warnings"] and "will not be scored" in narrow["warnings"][0]
