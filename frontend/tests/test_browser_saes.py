"""The SAE pages in a real browser against a live Daphne and a real worker: the cache page's
"Train an SAE" link opens the form with that cache chosen, the form shows the fields of the chosen
architecture, submitting opens the SAE's page, and the page follows the training without a reload
(the curves fill in, the status turns "completed", the held-out metrics and then CE loss recovered
appear as the evaluation ends). Then the same SAE's features: a feature analysis run from its page
(followed live to "completed"), the feature list sorted by density, a feature's dashboard
(examples, logit effects, similar features), its label, keyboard navigation, finding it again by
its label, and which features fire on a typed text (the evaluation left the model loaded in the
live worker); "Steer" from a feature's page opens the playground with the feature preset, where a
large coefficient makes the steered output differ from the baseline beside it. Saves the "saes",
"sae-detail", "features", "feature-detail", "feature-encode" and "playground-steering" screenshots."""

import re

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from features.models import FeatureAnalysis, FeatureLabel
from frontend.tests.browser import LIVE_TIMEOUT_MS, screenshot
from models_app.services import model_register
from saes.models import SparseAutoencoder
from saes.tests.conftest import HOOK, write_planted_cache

pytestmark = pytest.mark.slow


def test_train_from_the_form_and_watch_the_curves_fill_in(page, site, tiny_gpt2_folder):
    owner = get_user_model().objects.get(username="ada")
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gpt2", owner=owner)
    other_cache = write_planted_cache(model, owner, samples=8)
    cache = write_planted_cache(model, owner, samples=256)

    page.goto(site.url(f"/activations/{cache.id}/"))
    page.click("#train-sae-link")
    page.wait_for_url(re.compile(rf"/saes/\?cache={cache.id}"))
    expect(page.locator("#train-cache")).to_have_value(cache.id)
    expect(page.locator("#train-hook")).to_have_value(HOOK)
    # Only the chosen cache's hooks are listed (before, every cache's showed in the dropdown).
    expect(page.locator("#train-hook optgroup")).to_have_count(1)
    expect(page.locator("#train-hook optgroup")).to_have_attribute("data-cache", cache.id)
    page.select_option("#train-cache", other_cache.id)
    expect(page.locator("#train-hook optgroup")).to_have_attribute("data-cache", other_cache.id)
    page.select_option("#train-cache", cache.id)
    # The fields of the chosen architecture only: k for TopK, the L1 coefficient for standard.
    expect(page.locator("#train-k")).to_be_visible()
    expect(page.locator("#train-l1")).to_be_hidden()
    page.select_option("#train-architecture", "standard")
    expect(page.locator("#train-l1")).to_be_visible()
    expect(page.locator("#train-k")).to_be_hidden()
    page.select_option("#train-architecture", "topk")
    page.fill("#train-expansion", "4")
    page.fill("#train-k", "8")
    page.fill("#train-lr", "0.003")
    page.fill("#train-batch", "64")
    page.fill("#train-tokens", "4000")  # ~60 steps: enough to watch
    page.fill("#train-name", "browser topk")
    page.click("#train-submit")

    page.wait_for_url(re.compile(r"/saes/sae_\w+/$"))
    sae = SparseAutoencoder.objects.get(name="browser topk")
    assert (sae.architecture, sae.d_sae, sae.k, sae.owner) == ("topk", 4 * 64, 8, owner)
    # Count each swap of the training part, and the points its curves had: the page must follow
    # the training by fragments, never by a reload.
    page.evaluate(
        """() => {
        window.__marker = 1;
        window.__points = [];
        new MutationObserver(() => {
          const chart = document.querySelector('#curves svg');
          window.__points.push(chart ? Number(chart.dataset.points || 0) : -1);
        }).observe(document.getElementById('sae-live'), { childList: true });
      }"""
    )
    training = page.locator("#sae-training")
    expect(training).to_have_attribute("data-status", "completed", timeout=LIVE_TIMEOUT_MS)
    sae.refresh_from_db()
    assert sae.status == "completed", (sae.error_code, sae.error_message)
    expect(page.locator("#curves svg.line-chart")).to_have_count(4)
    expect(page.locator("#curves svg").first).to_have_attribute("data-points", str(len(sae.history)))
    seen = page.evaluate("window.__points")
    assert seen and seen[-1] == len(sae.history) > 10 and seen == sorted(seen)
    assert page.evaluate("window.__marker") == 1
    expect(page.locator("#metrics-table")).to_be_visible()
    # The model was not loaded: CE loss recovered follows from an evaluation job that loads it.
    ce = page.locator('[data-testid="ce-loss-recovered"]')
    expect(ce).to_have_text(re.compile(r"^-?\d+\.\d{4}$"), timeout=LIVE_TIMEOUT_MS)
    sae.refresh_from_db()
    assert ce.inner_text() == f"{sae.evaluation['ce_loss_recovered']:.4f}"
    expect(page.locator('[data-testid="file-size"]')).to_have_text(re.compile(r"KiB$"))  # its files now
    expect(page.locator("#export-sae")).to_be_visible()
    expect(page.locator("#cancel-sae")).to_be_hidden()
    assert page.evaluate("window.__marker") == 1

    analysis = run_the_feature_analysis(page, sae, cache)
    page.evaluate("document.getElementById('toasts').replaceChildren()")  # "queued", long since
    page.evaluate("window.scrollTo(0, 0)")  # from #features: the sticky top bar at the top
    screenshot(page, "sae-detail")
    browse_label_find_and_encode(page, sae, analysis)
    steer_from_the_feature_page(page, sae)

    page.click('nav[aria-label="Main"] >> text=SAEs')
    row = page.locator(f'tr[data-sae-id="{sae.id}"]')
    expect(row.locator(".badge")).to_have_text("completed")
    expect(row.locator('[data-metric="explained_variance"]')).to_have_text(
        f"{sae.evaluation['explained_variance']:.3f}"
    )
    expect(row.locator('[data-testid="features-link"]')).to_be_visible()
    screenshot(page, "saes")


def run_the_feature_analysis(page, sae, cache) -> FeatureAnalysis:
    """From the SAE's page: the form defaults to the training cache; the analysis's row follows
    its events to "completed" without a reload."""
    expect(page.locator("#analysis-cache")).to_have_value(cache.id)
    page.click("#run-analysis")
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/#features$"))
    page.evaluate(
        """() => {
        window.__marker = 2;
        window.__statuses = [];
        new MutationObserver(() => {
          const row = document.querySelector('#analysis-list li');
          if (row) window.__statuses.push(row.dataset.status);
        }).observe(document.getElementById('sae-analyses'), { childList: true });
      }"""
    )
    row = page.locator("#analysis-list li").first
    expect(row).to_have_attribute("data-status", "completed", timeout=LIVE_TIMEOUT_MS)
    analysis = FeatureAnalysis.objects.get(sae=sae)
    assert analysis.status == "completed", (analysis.error_code, analysis.error_message)
    assert page.evaluate("window.__marker") == 2 and page.evaluate("window.__statuses")[-1] == "completed"
    expect(row.locator('[data-testid="analysis-dead"]')).to_have_text(str(analysis.summary["dead"]))
    return analysis


def browse_label_find_and_encode(page, sae, analysis) -> None:
    """Browse the features densest first, open one (examples, logit effects, similar features),
    label it, step to its neighbour and back by keyboard, find it again by its label, and see
    which features fire on a typed text."""
    page.click('[data-testid="browse-features"]')
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/features/\?analysis={analysis.id}$"))
    expect(page.locator("#feature-table tbody tr")).to_have_count(50)
    page.click("#sort-density")
    page.wait_for_url(re.compile(r"sort=-density"))
    densities = [float(value) for value in page.locator("#feature-table tbody tr").evaluate_all(
        "rows => rows.map((row) => row.dataset.density)"
    )]  # fmt: skip
    assert densities == sorted(densities, reverse=True) and densities[0] > 0
    screenshot(page, "features")

    first = page.locator("#feature-table tbody tr").first
    index = int(first.get_attribute("data-index"))
    first.locator("a.feature-link").click()
    page.wait_for_url(re.compile(rf"/features/{index}/\?analysis="))
    expect(page.locator("#top-examples .example-list li").first).to_be_visible()
    expect(page.locator("#top-examples .tok.center").first).to_be_visible()
    expect(page.locator("#promoted tr")).to_have_count(10)  # the model was loaded: logit effects
    expect(page.locator("#similar-features tbody tr")).to_have_count(10)
    page.fill("#label-text", "densest in the browser")
    page.fill("#label-notes", "found by the browser test")
    page.click("#save-label")
    expect(page.locator('[data-testid="feature-label"]')).to_have_text("densest in the browser")
    assert FeatureLabel.objects.get(sae=sae, index=index).notes == "found by the browser test"
    page.evaluate("document.getElementById('toasts').replaceChildren()")
    screenshot(page, "feature-detail")
    # ← / → and j / k: the keys follow the page's previous / next links.
    neighbour = index + 1 if index + 1 < sae.d_sae else index - 1
    page.keyboard.press("ArrowRight" if neighbour > index else "ArrowLeft")
    page.wait_for_url(re.compile(rf"/features/{neighbour}/"))
    page.keyboard.press("k" if neighbour > index else "j")
    page.wait_for_url(re.compile(rf"/features/{index}/"))

    page.click("nav.crumbs >> text=Features")
    page.fill("#filter-q", "densest in the")
    page.click("#apply-filters")
    expect(page.locator("#feature-table tbody tr")).to_have_count(1)
    expect(page.locator("#feature-table tbody tr")).to_have_attribute("data-index", str(index))

    page.fill("#list-encode-text", "The river runs down to the sea, and the sea runs on.")
    page.locator("#list-encode-form button[type=submit]").click()
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/encode/$"))
    expect(page.locator("#per-token tbody tr").first).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    assert page.locator("#per-token tbody tr").count() > 5
    expect(page.locator("#overall-features tbody tr").first).to_be_visible()
    screenshot(page, "feature-encode")
    page.locator("#overall-features a.feature-link").first.click()
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/features/\d+/$"))
    expect(page.locator("#top-examples")).to_be_visible()


def steer_from_the_feature_page(page, sae) -> None:
    """From a feature's page to the playground's Steering panel: the feature is preset; an index
    past the SAE's width is the API's 400, shown in the panel; a large coefficient gives a steered
    output that differs from the baseline generated with the same seed."""
    index = int(page.locator("#feature-page").get_attribute("data-index"))
    page.click("#steer-feature")
    page.wait_for_url(re.compile(rf"/playground/\?model={sae.model_id}&sae={sae.id}&feature={index}$"))
    expect(page.locator("#steer")).to_be_checked()
    expect(page.locator("#model")).to_have_value(sae.model_id)
    expect(page.locator("#steer-sae")).to_have_value(sae.id)
    expect(page.locator("#steer-index")).to_have_value(str(index))
    expect(page.locator("#steered-pane")).to_be_visible()
    page.fill("#prompt", "The river runs down to the sea, and the")
    page.fill("#max_tokens", "12")

    page.fill("#steer-index", str(sae.d_sae))
    page.keyboard.press("Control+Enter")
    expect(page.locator("#steer-error")).to_contain_text("Intervention 0:", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#steer-error")).to_contain_text("INVALID_INTERVENTION")
    expect(page.locator("#generate-button")).to_be_enabled(timeout=LIVE_TIMEOUT_MS)  # the baseline ran

    page.fill("#steer-index", str(index))
    page.fill("#steer-amount", "50")
    page.click("#generate-button")
    expect(page.locator("#steered-stats")).to_contain_text("tokens", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#generate-button")).to_be_enabled(timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#steer-error")).to_be_hidden()
    seed = page.input_value("#seed")
    assert seed.isdigit()  # chosen by the page, shown, and the same for both requests
    expect(page.locator("#steer-caption")).to_contain_text(f"Seed {seed} for both")
    baseline, steered = page.inner_text("#output-text"), page.inner_text("#steered-text")
    assert baseline and steered and baseline != steered
    # 50 x the feature's max activation (the analysis gives it), and what it did to the text.
    expect(page.locator("#steer-caption")).to_contain_text("\u00d7 max activation")
    expect(page.locator("#steered-effect")).to_contain_text(f"feature {index} on the text")
    expect(page.locator("#steered-effect")).to_contain_text("(baseline ")
    expect(page.locator("#steered-effect")).to_contain_text("KL at the first token")
    screenshot(page, "playground-steering")

    # The sweep: a baseline and one row per coefficient, one seed, each with its measured effect.
    page.fill("#sweep-coefficients", "1, 8, 50")
    expect(page.locator("#sweep-button")).to_be_enabled(timeout=LIVE_TIMEOUT_MS)
    page.click("#sweep-button")
    expect(page.locator("#sweep-state")).to_have_text("Done", timeout=LIVE_TIMEOUT_MS)
    rows = page.locator("#sweep-table tbody tr")
    expect(rows).to_have_count(4)
    expect(rows.nth(0)).to_have_attribute("data-coefficient", "0")
    expect(rows.nth(3)).to_have_attribute("data-coefficient", "50")
    expect(page.locator("#sweep-caption")).to_contain_text(f"feature {index} of {sae.id}")
    expect(page.locator("#sweep-caption")).to_contain_text("\u00d7 max activation")
    values = [rows.nth(i).locator("td.effect").get_attribute("data-value") for i in range(4)]
    assert all(value != "" for value in values), values  # every output measured
    assert rows.nth(3).locator("td.text").inner_text() != rows.nth(0).locator("td.text").inner_text()
    screenshot(page, "playground-sweep")

    # Ablation from the page: the feature set to 0 (its amount field goes away).
    page.check('input[name="steer_kind"][value="ablate"]')
    expect(page.locator("#steer-amount")).to_be_hidden()
    page.click("#generate-button")
    expect(page.locator("#steer-caption")).to_contain_text(f"feature {index} of {sae.id}, ablated")
    expect(page.locator("#steered-stats")).to_contain_text("tokens", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#generate-button")).to_be_enabled(timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#steer-error")).to_be_hidden()
