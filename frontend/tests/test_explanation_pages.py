"""The explanation pages as the server renders them, over a real analysis (a real worker in burst
mode) and explanation rows as a job writes them (the job itself runs end to end in
features/tests/test_explanation_job.py): the new-job form and its errors, a job's page (progress,
the scores' histogram, every explanation), the feature page's explanations with "accept as label",
and the feature list's explanation column, score sort and filter. Another user's private job
shows nowhere."""

import re

import pytest

from conftest import make_user
from features.models import Explanation, ExplanationJob, FeatureLabel
from features.tests.conftest import completed_sae_row
from frontend.tests.test_feature_pages import a_live_feature, analysed, indices, signed_in
from models_app.models import LanguageModel
from models_app.services import model_register
from saes.tests.conftest import write_planted_cache

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sae(tiny_gpt2_folder, writer):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gpt2", owner=writer)
    return completed_sae_row(model, write_planted_cache(model, writer, samples=64), writer, shared=True)


def explained(analysis, owner, scores: dict[int, float | None], *, shared: bool = False) -> ExplanationJob:
    job = ExplanationJob.objects.create(
        analysis=analysis, explainer_model="m_x", scorer_model="m_x", indices=list(scores), owner=owner,
        shared=shared, status="completed", progress=100, features_done=len(scores),
        estimate={"requests": 9 * len(scores), "prompt_tokens": 1000},
    )  # fmt: skip
    for index, score in scores.items():
        Explanation.objects.create(
            job=job, analysis=analysis, index=index, text=f"feature {index} fires on planted rows",
            explainer_model="m_x", scorer_model="m_x", prompt_version="mistudio-autointerp/1",
            prompt=[{"role": "user", "content": f"Example 0: a <<b>> c ({index})"}],
            detection=score, fuzzing=score, score=score,
        )  # fmt: skip
    return job


def test_the_pages_show_explanations_scores_and_accept_one_as_label(sae, writer):
    analysis = analysed(sae, writer)
    first = a_live_feature(analysis).index
    second, third = (f.index for f in analysis.features.filter(density__gt=0).exclude(index=first)[:2])
    job = explained(analysis, writer, {first: 0.9, second: 0.55, third: None})
    explained(analysis, make_user("other-writer", "model:write"), {first: 0.99})  # private: shown nowhere
    browser = signed_in(writer)

    page = browser.get(f"/saes/{sae.id}/explanations/{job.id}/").content.decode()
    assert f"feature {first} fires on planted rows" in page and 'id="score-histogram"' in page
    assert browser.get(f"/saes/{sae.id}/explanations/{job.id}/?fragment=live").status_code == 200

    detail = browser.get(f"/saes/{sae.id}/features/{first}/").content.decode()
    assert f"feature {first} fires on planted rows" in detail and "score 0.900" in detail
    assert "0.990" not in detail
    assert "Example 0: a &lt;&lt;b&gt;&gt; c" in detail  # the prompt, shown
    explanation = Explanation.objects.get(job=job, index=first)
    accepted = browser.post(
        f"/saes/{sae.id}/features/{first}/explanations/{explanation.pk}/accept/",
        {"text": "planted rows (edited)"},
    )
    assert accepted.status_code == 302
    assert FeatureLabel.objects.get(sae=sae, index=first, owner=writer).label == "planted rows (edited)"

    listing = browser.get(
        f"/saes/{sae.id}/features/", {"sort": "-score", "explained": "yes"}
    ).content.decode()
    assert indices(listing) == [first, second]  # scored only, best first
    assert re.search(r'data-testid="row-score">0\.90<', listing)
    assert indices(browser.get(f"/saes/{sae.id}/features/", {"score_min": "0.6"}).content.decode()) == [first]

    # A job where some features failed says so in amber, on its page and in the feature list's
    # list of jobs (before, a plain green "completed").
    ExplanationJob.objects.filter(pk=job.pk).update(status="completed", features_failed=1)
    for path in (f"/saes/{sae.id}/explanations/{job.id}/", f"/saes/{sae.id}/features/"):
        shown = browser.get(path).content.decode()
        assert 'class="badge status-warning" data-testid="explanation-status"' in shown, path
        assert "completed with failures" in shown


def test_the_new_job_form_estimates_and_says_what_is_wrong(sae, writer, reader):
    analysed(sae, writer)
    browser = signed_in(writer)
    # The tiny model's 128 tokens take no explanation prompt: offered, but disabled, saying why.
    page = browser.get(f"/saes/{sae.id}/explanations/new/").content.decode()
    assert re.search(rf'<option value="{sae.model_id}" disabled>[^<]*128-token context — too short', page)
    assert "No loaded model takes the prompts" in page and "MISTUDIO_EXPLAINER_ENDPOINTS" in page
    short = {"kind": "top", "count": "5", "explainer_model": sae.model_id, "action": "estimate"}
    refused = browser.post(f"/saes/{sae.id}/explanations/new/", short).content.decode()
    assert 'data-testid="estimate-refusal"' in refused and "takes 128" in refused
    model = LanguageModel.objects.get(pk=sae.model_id)
    model.config = {**model.config, "n_positions": 4096}  # a context the prompts fit
    model.save(update_fields=["config"])
    page = browser.get(f"/saes/{sae.id}/explanations/new/?kind=list&indices=4").content.decode()
    assert 'id="explain-form"' in page and 'value="4"' in page
    # The analysis loaded the tiny model (for its logit effects): it can explain.
    form = {"kind": "top", "count": "5", "explainer_model": sae.model_id, "scorers": ["detection"]}
    estimate = browser.post(f"/saes/{sae.id}/explanations/new/", {**form, "action": "estimate"})
    assert estimate.status_code == 200 and not ExplanationJob.objects.exists()
    assert 'data-testid="estimate-requests">25<' in estimate.content.decode()  # 5 x (1 + 20 / 5)
    unknown = browser.post(
        f"/saes/{sae.id}/explanations/new/", {**form, "explainer_model": "nope", "action": "start"}
    )
    assert unknown.status_code == 404 and "No model" in unknown.content.decode()
    started = browser.post(f"/saes/{sae.id}/explanations/new/", {**form, "action": "start"})
    job = ExplanationJob.objects.get()
    assert started.status_code == 302 and started["Location"].endswith(f"/explanations/{job.id}/")
    assert job.config["scorers"] == ["detection"] and len(job.indices) == 5
    # A reader may look, not start.
    assert signed_in(reader).post(f"/saes/{sae.id}/explanations/new/", {"action": "start"}).status_code == 403
