"""Activation patching and the logit lens in a real browser, on the tiny GPT-2 loaded by a real
worker: the heatmap is drawn (and reads out by keyboard), an API error shows in the form, the lens
fills its table. And the playground steered by a saved steering vector, and one computed there."""

import pytest
import torch
from playwright.sync_api import expect
from safetensors.torch import save
from transformers import AutoTokenizer

from frontend.tests.browser import LIVE_TIMEOUT_MS, screenshot
from models_app.models import LanguageModel
from models_app.tests.live_stack import register_and_load
from steering.models import SteeringVector
from steering.services import vector_import

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# The corrupted prompt swaps the clean one's last token: same length, and the answers are one token.
CLEAN = "The river runs down to the"
CORRUPTED = "The river runs down to and"


def test_patching_draws_the_heatmap_and_the_lens_fills_its_table(page, site, tiny_gpt2_folder):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_folder)
    tokens = len(tokenizer.encode(CLEAN))
    assert tokens == len(tokenizer.encode(CORRUPTED))
    assert len(tokenizer.encode(" the")) == len(tokenizer.encode(" and")) == 1
    model_id = register_and_load(tiny_gpt2_folder, name="probe-gpt2")

    page.goto(site.url(f"/models/{model_id}/"))
    page.click("#patching-link")
    page.fill("#patch-clean", CLEAN)
    page.fill("#patch-corrupted", CORRUPTED + " sea")  # one token too many: the API's 400 shows
    page.fill("#patch-answer", " the")
    page.fill("#patch-wrong", " and")
    # The tokenizer preview says it before the run: the lengths differ; each answer is one token.
    longer = tokenizer.encode(CORRUPTED + " sea")
    preview = page.locator("#patch-corrupted-tokens")
    expect(preview.locator(".token-note")).to_have_text(
        f"{len(longer)} tokens · the other has {tokens}: patching needs the same number"
    )
    expect(preview.locator(".tok")).to_have_count(len(longer))
    expect(preview.locator(".tok").last).to_have_text(tokenizer.decode(longer[-1:]))
    expect(page.locator("#patch-answer-tokens .token-note")).to_have_text("one token")
    page.fill("#patch-wrong", " and so")
    expect(page.locator("#patch-wrong-tokens .token-note")).to_have_text("2 tokens: the metric reads one")
    page.fill("#patch-wrong", " and")
    page.click("#patch-submit")
    expect(page.locator("#patch-error")).to_contain_text("PROMPT_LENGTHS_DIFFER", timeout=LIVE_TIMEOUT_MS)

    page.fill("#patch-corrupted", CORRUPTED)
    expect(page.locator("#patch-clean-tokens .token-note")).to_have_text(f"{tokens} tokens · same length")
    page.click("#patch-submit")
    expect(page.locator("#patching-result")).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#patch-error")).to_have_count(0)
    rows = page.locator("#patch-heatmap tbody tr")
    expect(rows).to_have_count(2)  # each block's hook_resid_pre
    expect(rows.first.locator(".heat-cell")).to_have_count(tokens + 1)  # every position, then "All"
    expect(page.locator("#patch-heatmap thead th")).to_have_count(tokens + 2)
    # Only the last token differs: patching it into block 0's input gives back the whole clean run.
    last = rows.first.locator(".heat-cell").nth(tokens - 1)
    expect(last).to_have_text("1.000")
    expect(rows.first.locator(".all-cell")).to_have_text("1.000")
    expect(rows.first.locator(".heat-cell").first).to_have_text("0.000")  # identical position: no effect
    expect(page.locator("#clean-metric")).not_to_have_text("—")

    rows.first.locator(".heat-cell").first.focus()
    expect(page.locator("#cell-readout")).to_contain_text("blocks.0.hook_resid_pre, position 0")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowRight")
    expect(page.locator("#cell-readout")).to_contain_text("blocks.1.hook_resid_pre, position 1")
    page.evaluate("window.scrollTo(0, 0)")
    screenshot(page, "patching")

    page.goto(site.url(f"/models/{model_id}/"))
    page.click("#logit-lens-link")
    page.fill("#lens-prompt", CLEAN)
    page.fill("#lens-top", "3")
    page.click("#lens-submit")
    expect(page.locator("#lens-result")).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#lens-table tbody tr")).to_have_count(2)  # one row per layer
    expect(page.locator("#lens-table tbody tr").first.locator(".lens-cell")).to_have_count(tokens)
    cell = page.locator("#lens-table .lens-cell").first
    expect(cell.locator(".lens-others")).to_be_hidden()
    cell.focus()
    expect(cell.locator(".lens-others li")).to_have_count(3)
    expect(cell.locator(".lens-others")).to_be_visible()
    screenshot(page, "logit-lens")


def test_the_playground_steers_with_a_saved_vector_preset_by_its_id(page, site, tiny_gpt2_folder):
    model = LanguageModel.objects.get(pk=register_and_load(tiny_gpt2_folder, name="vector-gpt2"))
    direction = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0))
    vector = vector_import(
        owner=None,
        model=model,
        hook_name="blocks.1.hook_resid_pre",
        data=save({"vector": direction}),
        name="random",
    )

    page.goto(site.url(f"/playground/?model={model.id}&vector={vector.id}&coefficient=50"))
    expect(page.locator("#steer")).to_be_checked()
    expect(page.locator("#steer-vector")).to_have_value(vector.id)
    expect(page.locator("#steer-vector-meta")).to_contain_text("blocks.1.hook_resid_pre · width 64")
    expect(page.locator("#steer-feature-fields")).to_be_hidden()
    page.fill("#prompt", "The river runs down to the sea, and the")
    page.fill("#max_tokens", "10")
    page.check("#ignore_eos")
    page.click("#generate-button")
    expect(page.locator("#steered-stats")).to_contain_text("tokens", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#generate-button")).to_be_enabled(timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#steer-error")).to_be_hidden()
    expect(page.locator("#steer-caption")).to_contain_text(f"vector {vector.id}, +50 ")
    baseline, steered = page.inner_text("#output-text"), page.inner_text("#steered-text")
    assert baseline and steered and baseline != steered
    screenshot(page, "playground-vector")

    # A new vector from the page: difference of means, computed by the worker, then chosen.
    page.click("#new-vector summary")
    page.fill("#vector-hook", "blocks.1.hook_resid_post")
    page.fill("#vector-positive", "The sea is calm\nThe river runs")
    page.fill("#vector-negative", "A list of items\n")
    page.fill("#vector-name", "sea minus list")
    page.click("#vector-create")
    page.wait_for_url(lambda url: "vector=sv_" in url and vector.id not in url, timeout=LIVE_TIMEOUT_MS)
    vector = SteeringVector.objects.get(name="sea minus list")
    assert (vector.status, vector.hook_name, vector.positive) == (
        "completed", "blocks.1.hook_resid_post", ["The sea is calm", "The river runs"],
    )  # fmt: skip
    expect(page.locator("#steer-vector")).to_have_value(vector.id)
    expect(page.locator("#steer-vector-meta")).to_contain_text("blocks.1.hook_resid_post · width 64")
