"""The activation browser in a real browser, over a cache the live worker extracted (tiny GPT-2):
the list, the histogram and norm chart, picking a neuron (typed, refused when out of range, quick
pick) → its top tokens with highlighted context, stepping through samples (buttons, arrow keys,
a top token's "sample n") → the heatmap follows. Saves the "activations" and "activation-browser"
screenshots."""

import re

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from activations.models import Dataset, ExtractionJob
from activations.services import dataset_create_from_texts, extraction_request
from activations.store import ActivationStore
from frontend.hook_stats import HISTOGRAM_BINS
from frontend.tests.browser import LIVE_TIMEOUT_MS, screenshot
from frontend.views.activations import TOP_K
from models_app.services import model_register
from models_app.tests.live_stack import wait_until

pytestmark = pytest.mark.slow

HOOKS = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post", "ln_final.hook_normalized"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Residual streams carry information between transformer blocks.",
    "Sparse autoencoders decompose activations into interpretable features.",
    "Attention heads move information between token positions.",
    "A neuron that fires on French text may also fire on Spanish.",
    "def add(a, b):\n    return a + b",
]


def extract_with_the_live_worker(folder):
    owner = get_user_model().objects.get(username="ada")
    model = model_register(source="local", identifier=str(folder), name="tiny-gpt2", owner=owner)
    dataset = dataset_create_from_texts(
        name="six sentences", texts=TEXTS, owner=owner, source=Dataset.Source.UPLOAD
    )
    job = extraction_request(
        model_id=model.id, dataset_id=dataset.id, owner=owner, hooks=HOOKS, batch_size=4, max_length=32
    )

    def finished():
        job.refresh_from_db()
        assert job.status not in ("failed", "cancelled"), (job.error_code, job.error_message)
        return job.status == ExtractionJob.Status.COMPLETED

    wait_until(finished, timeout=LIVE_TIMEOUT_MS / 1000, what="the extraction")
    return job.cache, ActivationStore.open(job.cache.directory)


def test_browse_a_cache_pick_a_neuron_and_step_through_samples(page, site, tiny_gpt2_folder):
    cache, store = extract_with_the_live_worker(tiny_gpt2_folder)

    page.goto(site.url("/activations/"))
    row = page.locator(f'tr[data-cache-id="{cache.id}"]')
    expect(row).to_contain_text("tiny-gpt2")
    expect(row).to_contain_text("six sentences")
    expect(row.locator(".badge")).to_have_text("completed")
    screenshot(page, "activations")

    row.locator("a.cache-link").click()
    page.wait_for_url(re.compile(rf"/activations/{cache.id}/$"))
    histogram = page.locator("#histogram .chart-linear svg")
    expect(histogram).to_be_visible()
    expect(histogram.locator("rect.bar-fill")).to_have_count(HISTOGRAM_BINS)
    expect(page.locator("#norm-chart circle.dot")).to_have_count(len(HOOKS))
    page.check("#log-scale")  # the log chart replaces the linear one
    expect(page.locator("#histogram .chart-log svg")).to_be_visible()
    expect(histogram).to_be_hidden()
    page.uncheck("#log-scale")

    # A click on the norm chart's point opens that hook.
    page.locator('#norm-chart a[aria-label="blocks.1.mlp.hook_post"]').click()
    page.wait_for_url(re.compile(r"hook=blocks\.1\.mlp\.hook_post"))
    hook = "blocks.1.mlp.hook_post"
    expect(page.locator('.hook-tabs a[aria-selected="true"]')).to_have_attribute("data-hook", hook)
    width = store.shape(hook)[1]

    # Out of range: said under the input, the typed value kept, nothing fetched.
    page.fill("#neuron-input", str(width))
    page.press("#neuron-input", "Enter")
    expect(page.locator('[data-error-for="neuron"]')).to_have_text(f"Choose a neuron from 0 to {width - 1}.")
    expect(page.locator("#neuron-input")).to_have_value(str(width))

    neuron = 17
    page.fill("#neuron-input", str(neuron))
    page.press("#neuron-input", "Enter")
    expect(page.locator("#neuron-head")).to_have_attribute("data-neuron", str(neuron))
    expect(page.locator('[data-error-for="neuron"]')).to_have_count(0)
    items = page.locator("#top-list > li")
    expect(items).to_have_count(TOP_K)
    expected = store.top_k(hook, neuron, TOP_K, context=8)
    values = [float(value) for value in page.locator("#top-list .value").evaluate_all(
        "nodes => nodes.map(node => node.dataset.value)"
    )]  # fmt: skip
    assert values == [row["value"] for row in expected]
    first = items.first
    expect(first.locator(".tok.center")).to_have_count(1)
    expect(first.locator(".tok")).to_have_count(len(expected[0]["context_token_ids"]))
    # The top token: the positive colour, as strong as its share of the neuron's largest |value|.
    colour = first.locator(".tok.center").evaluate("node => getComputedStyle(node).backgroundColor")
    stats = store.stats(hook)
    scale = max(abs(float(stats["max"][neuron])), abs(float(stats["min"][neuron])))
    assert colour.startswith("rgba(214, 69, 65, ")
    assert float(colour.rsplit(",", 1)[1].rstrip(")")) == pytest.approx(
        min(0.85, expected[0]["value"] / scale * 0.85), abs=0.01
    )
    assert f"neuron={neuron}" in page.url

    # The sample heatmap follows the neuron; next / arrow keys / a top token's sample step through it.
    heatmap = page.locator("#sample-tokens")
    expect(heatmap).to_have_attribute("data-neuron", str(neuron))
    expect(heatmap.locator(".tok")).to_have_count(len(store.sample_tokens(0)[0]))
    page.click("#sample-next")
    expect(heatmap).to_have_attribute("data-sample", "1")
    expect(heatmap.locator(".tok")).to_have_count(len(store.sample_tokens(1)[0]))
    page.evaluate("document.activeElement.blur()")  # arrows step samples unless typing in an input
    page.keyboard.press("ArrowRight")
    expect(heatmap).to_have_attribute("data-sample", "2")
    expect(page.locator("#sample-input")).to_have_value("2")
    page.keyboard.press("ArrowLeft")
    expect(heatmap).to_have_attribute("data-sample", "1")
    wanted = expected[0]["sample_index"]
    first.locator(".show-sample").click()
    expect(heatmap).to_have_attribute("data-sample", str(wanted))
    values = heatmap.locator(".tok").evaluate_all("nodes => nodes.map(node => Number(node.dataset.value))")
    assert values == pytest.approx(store.sample(hook, wanted)[:, neuron].tolist(), rel=1e-6)
    heatmap.locator(".tok").nth(2).hover()
    expect(page.locator("#token-readout")).to_contain_text("position 2")

    # A quick pick (the neuron with the highest max) switches both panels.
    pick = page.locator("#quick-picks .pick").first
    picked = pick.get_attribute("data-neuron")
    pick.click()
    expect(page.locator("#neuron-head")).to_have_attribute("data-neuron", picked)
    expect(heatmap).to_have_attribute("data-neuron", picked)
    expect(pick).to_have_attribute("aria-pressed", "true")
    expect(page.locator("#neuron-input")).to_have_value(picked)

    # The address names the view: a reload shows the same neuron and sample.
    page.reload()
    expect(page.locator("#neuron-head")).to_have_attribute("data-neuron", picked)
    expect(page.locator("#sample-tokens")).to_have_attribute("data-sample", str(wanted))
    page.evaluate("window.scrollTo(0, 0)")
    screenshot(page, "activation-browser")
