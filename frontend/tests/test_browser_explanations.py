"""Automatic interpretation in one browser tab, against a live Daphne and a real worker that serves
the explainer (a tiny Llama, loaded) through this workbench's own /v1: from the feature list, explain
the top features (the form offers 50; 12 here, to spare CI's two cores), estimate first, then start;
watch the job's page fill in without a reload, open a feature's dashboard and see its explanation
with its scores, accept it (edited) as the label, then find that feature again by meaning. Saves
the "explanations", "feature-explanations" and "features-search" screenshots."""

import re

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from engine.autointerp.pipeline import InterpretationConfig
from features.models import Explanation, ExplanationJob
from features.services import analysis_request
from features.tests.conftest import completed_sae_row
from frontend.tests.browser import LIVE_TIMEOUT_MS, USERNAME, screenshot
from models_app.services import model_register
from models_app.tests.live_stack import register_and_load, wait_until
from saes.tests.conftest import write_planted_cache

pytestmark = pytest.mark.slow
COUNT = 12


def test_explain_the_top_features_see_scores_accept_a_label_and_search_by_meaning(
    page, site, tiny_gpt2_folder, tiny_llama_folder
):
    user = get_user_model().objects.get(username=USERNAME)
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="browser-gpt2", owner=user)
    sae = completed_sae_row(model, write_planted_cache(model, user, samples=64), user)
    analysis = analysis_request(owner=user, sae=sae)
    wait_until(lambda: analysis.refresh_from_db() or analysis.status == "completed", what="the analysis")
    explainer = register_and_load(tiny_llama_folder, name="browser-explainer")

    # From the feature list: explain the densest features (the form offers 50), estimate first.
    page.goto(site.url(f"/saes/{sae.id}/features/"))
    page.click("#explain-features")
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/explanations/new/$"))
    expect(page.locator("#explain-count")).to_have_value("50")
    page.fill("#explain-count", str(COUNT))
    page.select_option("#explain-model", explainer)  # the loaded models its prompts fit
    page.fill("#explain-per-prompt", "10")  # fewer, longer scoring prompts: a quicker test
    page.click("#explain-estimate-button")
    requests = COUNT * InterpretationConfig(per_prompt=10).requests_per_feature()
    expect(page.locator('[data-testid="estimate-requests"]')).to_have_text(str(requests))
    assert not ExplanationJob.objects.exists()
    page.click("#explain-start")
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/explanations/xj_\w+/$"))
    page.evaluate("window.__marker = 1")  # gone if anything reloads the page
    # "completed", or "completed with failures" where the tiny explainer's answer held none.
    expect(page.locator('[data-testid="explanation-status"]')).to_have_text(
        re.compile(r"^completed"), timeout=3 * LIVE_TIMEOUT_MS
    )
    assert page.evaluate("window.__marker") == 1
    job = ExplanationJob.objects.get()
    assert job.status == "completed" and job.features_done == COUNT and job.owner == user
    expect(page.locator("#explanation-table tbody tr")).to_have_count(COUNT)
    screenshot(page, "explanations")

    # A feature's dashboard shows its explanation, its scores and how many answers were usable.
    explained = Explanation.objects.filter(job=job, error_code="").order_by("index").first()
    assert explained is not None, list(job.explanations.values_list("error_code", flat=True))
    page.locator(f'#explanation-table tr[data-index="{explained.index}"] a').click()
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/features/{explained.index}/$"))
    card = page.locator(f'[data-explanation-id="{explained.pk}"]')
    expect(card.locator('[data-testid="explanation-text"]')).to_have_text(explained.text)
    expect(card.locator('[data-testid="explanation-score"]')).to_contain_text("score")
    expect(card.locator('[data-testid="scorer-detection"]')).to_be_visible()
    screenshot(page, "feature-explanations")

    # Accept it, edited, as the label.
    card.locator("input[name=text]").fill("closing brackets at the end of a call")
    card.get_by_role("button", name="Accept as label").click()
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/features/{explained.index}/$"))
    expect(page.locator('[data-testid="feature-label"]')).to_have_text(
        "closing brackets at the end of a call"
    )

    # Find it again by meaning.
    page.goto(site.url(f"/saes/{sae.id}/features/"))
    page.fill("#meaning-q", "parenthesis that ends a function call")
    page.click("#meaning-form button[type=submit]")
    first = page.locator("#meaning-table tbody tr").first
    expect(first).to_have_attribute("data-index", str(explained.index))
    expect(first.locator('[data-testid="meaning-text"]')).to_have_text(
        "closing brackets at the end of a call"
    )
    screenshot(page, "features-search")
