"""The SAE pages in a real browser against a live Daphne and a real worker: the cache page's
"Train an SAE" link opens the form with that cache chosen, the form shows the fields of the chosen
architecture, submitting opens the SAE's page, and the page follows the training without a reload
(the curves fill in, the status turns "completed", the held-out metrics and then CE loss recovered
appear as the evaluation ends). Saves the "saes" and "sae-detail" screenshots."""

import re

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from frontend.tests.browser import LIVE_TIMEOUT_MS, screenshot
from models_app.services import model_register
from saes.models import SparseAutoencoder
from saes.tests.conftest import HOOK, write_planted_cache

pytestmark = pytest.mark.slow


def test_train_from_the_form_and_watch_the_curves_fill_in(page, site, tiny_gpt2_folder):
    owner = get_user_model().objects.get(username="ada")
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gpt2", owner=owner)
    cache = write_planted_cache(model, owner, samples=256)

    page.goto(site.url(f"/activations/{cache.id}/"))
    page.click("#train-sae-link")
    page.wait_for_url(re.compile(rf"/saes/\?cache={cache.id}"))
    expect(page.locator("#train-cache")).to_have_value(cache.id)
    expect(page.locator("#train-hook")).to_have_value(HOOK)
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
    page.fill("#train-batch", "64")  # one pass (the default) in ~60 steps: enough to watch
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
    page.evaluate("document.getElementById('toasts').replaceChildren()")  # "queued", long since
    screenshot(page, "sae-detail")

    page.click('nav[aria-label="Main"] >> text=SAEs')
    row = page.locator(f'tr[data-sae-id="{sae.id}"]')
    expect(row.locator(".badge")).to_have_text("completed")
    expect(row.locator('[data-metric="explained_variance"]')).to_have_text(
        f"{sae.evaluation['explained_variance']:.3f}"
    )
    screenshot(page, "saes")
