"""The playground in a real browser: text streams in, the result matches the stored row, capture
draws a heatmap of one neuron, Stop cancels, and an API error shows inline without losing the prompt."""

import re

import pytest
from playwright.sync_api import expect

from activations.models import ActivationCache
from frontend.tests.browser import LIVE_TIMEOUT_MS, screenshot
from generation.models import Generation, storable_text
from models_app.models import LanguageModel
from models_app.tests.live_stack import register_and_load, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PROMPT = "The river runs down to the sea, and"
HOOK = "blocks.1.mlp.hook_post"

# Records each distinct length the output text takes, from before the click to the end.
WATCH_OUTPUT = """() => {
  window.outputLengths = [];
  const node = document.getElementById("output-text");
  new MutationObserver(() => {
    const length = node.textContent.length;
    if (window.outputLengths[window.outputLengths.length - 1] !== length) window.outputLengths.push(length);
  }).observe(node, { childList: true, characterData: true, subtree: true });
}"""


def stat(page, name: str):
    return page.locator(f'[data-stat="{name}"]')


def test_text_streams_in_and_capture_draws_the_heatmap(page, site, tiny_gpt2_folder):
    register_and_load(tiny_gpt2_folder, name="play-gpt2")
    page.goto(site.url("/playground/"))
    expect(page.locator("#model option")).to_have_text(["play-gpt2"])

    page.fill("#prompt", PROMPT)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "80")
    page.check("#ignore_eos")  # the random tiny model may end at once otherwise: 80 tokens stream
    page.check("#capture")
    expect(page.locator("#hook")).to_be_enabled(timeout=LIVE_TIMEOUT_MS)
    page.select_option("#hook", HOOK)
    page.fill("#neuron", "3")
    page.evaluate(WATCH_OUTPUT)
    page.click("#generate-button")

    expect(page.locator("#run-state")).to_have_text("Done", timeout=LIVE_TIMEOUT_MS)
    lengths = page.evaluate("window.outputLengths")
    assert len({length for length in lengths if length > 0}) > 1, lengths  # it grew, not all at once

    request_id = page.locator("#request-link").text_content()
    row = Generation.objects.get(pk=request_id)
    assert row.status == "completed" and row.completion_tokens == 80
    assert storable_text(page.locator("#output-text").text_content()) == row.output_text
    assert page.locator("#output-prompt").text_content() == PROMPT
    expect(stat(page, "completion_tokens")).to_have_text("80")
    expect(stat(page, "prompt_tokens")).to_have_text(str(row.prompt_tokens))
    expect(stat(page, "finish_reason")).to_have_text("length")
    for name in ("ttft", "rate", "total"):
        expect(stat(page, name)).not_to_have_text("—")
    expect(page.locator("#generate-button")).to_be_enabled()
    expect(page.locator("#stop-button")).to_be_disabled()

    # Capture: one heat-coloured token per prompt and generated token, and the stored cache's link.
    tokens = page.locator("#heatmap .tokens .tok")
    expect(tokens).to_have_count(row.prompt_tokens + 80, timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#heatmap .tok.prompt")).to_have_count(row.prompt_tokens)
    # Coloured through data-alpha (app.js applies it: the Content-Security-Policy refuses style="").
    alphas = tokens.evaluate_all(
        "nodes => nodes.map(n => parseFloat(getComputedStyle(n).backgroundColor.split(',')[3] || '0'))"
    )
    assert max(alphas) > 0.3
    assert re.search(rf"{re.escape(HOOK)}\[3\] = ", tokens.first.get_attribute("title"))
    cache = ActivationCache.objects.get(pk=row.cache_id)
    assert cache.status == ActivationCache.Status.COMPLETED
    expect(page.locator("#cache-link")).to_have_attribute("href", f"/activations/{cache.id}/")

    # Another neuron redraws the heatmap from the same cache.
    before = page.locator("#heatmap .tokens").get_attribute("data-max")
    page.fill("#neuron", "4")
    expect(page.locator("#heat-caption")).to_contain_text("neuron 4")
    expect(page.locator("#heatmap .tokens")).not_to_have_attribute("data-max", before)
    expect(tokens).to_have_count(row.prompt_tokens + 80)
    page.locator("#neuron").blur()
    page.evaluate("window.scrollTo(0, 0)")  # the sticky top bar belongs at the top of the picture
    screenshot(page, "playground")


def test_stop_cancels_and_an_api_error_keeps_the_prompt(page, site, tiny_llama_folder):
    model_id = register_and_load(tiny_llama_folder, name="play-llama")
    page.goto(site.url("/playground/"))

    # Chat mode, a long generation, stopped from the keyboard-reachable Stop button.
    page.locator(".mode-toggle label", has_text="Chat").click()
    page.fill("#system-prompt", "You answer briefly.")
    page.fill("#user-message", "Tell me a long story.")
    page.fill("#max_tokens", "2000")
    page.check("#ignore_eos")
    page.locator("#user-message").press("Control+Enter")
    expect(page.locator("#run-state")).to_have_text("Generating", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#output-text")).not_to_have_text("", timeout=LIVE_TIMEOUT_MS)
    page.click("#stop-button")
    expect(page.locator("#run-state")).to_have_text("Stopped")
    request_id = page.locator("#request-link").text_content()
    cancelled = Generation.objects.filter(pk=request_id, status="cancelled")
    row = wait_until(cancelled.first, timeout=15, what="the generation to be cancelled")
    assert row.completion_tokens < 2000 and row.system_prompt == "You answer briefly."
    assert row.messages == [{"role": "user", "content": "Tell me a long story."}]

    # The model goes away behind the page's back: the API's 409 shows inline, the text stays.
    LanguageModel.objects.filter(pk=model_id).update(status=LanguageModel.Status.UNLOADED)
    page.click("#generate-button")
    expect(page.locator("#output-error")).to_contain_text("MODEL_NOT_LOADED")
    expect(page.locator("#run-state")).to_have_text("Failed")
    expect(page.locator("#user-message")).to_have_value("Tell me a long story.")
    expect(page.locator("#system-prompt")).to_have_value("You answer briefly.")
