"""The models pages in a real browser against a live Daphne and a real worker: add a model and load it
live, the polling fallback when the WebSocket drops, and an extraction from the detail page (then its
cache reused)."""

import pytest
from playwright.sync_api import expect

from activations.models import ActivationCache, ExtractionJob
from activations.services import dataset_create_from_texts
from frontend.tests.browser import LIVE_TIMEOUT_MS, screenshot
from mistudio.access import OPERATOR
from models_app.models import LanguageModel
from models_app.services import model_load_request, model_register
from models_app.tests.live_stack import register_and_load

pytestmark = pytest.mark.slow

PANGRAMS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs.",
    "How vexingly quick daft zebras jump!",
    "Sphinx of black quartz, judge my vow.",
    "The five boxing wizards jump quickly.",
    "Jackdaws love my big sphinx of quartz.",
    "Bright vixens jump; dozy fowl quack.",
    "Quick zephyrs blow, vexing daft Jim.",
    "Waltz, bad nymph, for quick jigs vex.",
    "Glib jocks quiz nymph to vex dwarf.",
]


def test_add_a_local_model_then_load_unload_and_delete_it_without_a_reload(
    page, site, tiny_gpt2_folder, tiny_llama_folder
):
    model_register(source="local", identifier=str(tiny_llama_folder), name="tiny-llama", owner=None)
    page.goto(site.url("/"))
    page.evaluate("window.__marker = 1")  # gone if anything reloads the page
    page.click("#add-model-open")
    dialog = page.locator("#add-model-dialog")
    expect(dialog).to_be_visible()

    # A path outside LOCAL_MODEL_ROOTS: the API's message under the input, the dialog and the text kept.
    dialog.get_by_label("Local folder").check()
    expect(dialog.get_by_label("Folder path")).to_be_visible()
    page.fill("#add-identifier", "/etc")
    page.click("#add-model-submit")
    expect(dialog.locator('[data-error-for="model_identifier"]')).to_have_text(
        "The local path is outside the configured roots (LOCAL_MODEL_ROOTS)."
    )
    expect(page.locator("#add-identifier")).to_have_value("/etc")
    expect(dialog).to_be_visible()
    screenshot(page, "add-model")

    page.fill("#add-identifier", str(tiny_gpt2_folder))
    page.fill("#add-name", "tiny-gpt2")
    expect(page.locator("#add-auto-load")).not_to_be_checked()
    page.click("#add-model-submit")
    expect(dialog).to_be_hidden()
    model = LanguageModel.objects.get(name="tiny-gpt2")
    card = page.locator(f'.model-card[data-model-id="{model.id}"]')
    badge = card.locator('[data-field="status"]')
    expect(badge).to_have_text("not loaded")  # registered, never loaded ("pending" in the API)
    expect(card.locator('[data-field="num_layers"]')).to_have_text("2")
    expect(page.locator("#model-count")).to_have_text("2 models")

    card.get_by_role("button", name="Load").click()
    expect(badge).to_have_text("ready", timeout=LIVE_TIMEOUT_MS)
    expect(card.locator('[data-field="memory"]')).not_to_contain_text("≈")  # measured by the worker now
    expect(card.get_by_role("button", name="Unload")).to_be_visible()
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "live")
    assert page.evaluate("window.__marker") == 1
    screenshot(page, "models")

    # The filters act at once: "ready" leaves the loaded card only.
    page.select_option("#model-status-filter", "ready")
    expect(page.locator(".model-card:visible")).to_have_count(1)
    expect(page.locator("#model-count")).to_have_text("1 of 2 models")
    page.select_option("#model-status-filter", "")

    card.get_by_role("button", name="Unload").click()
    expect(badge).to_have_text("unloaded", timeout=LIVE_TIMEOUT_MS)
    card.get_by_role("button", name="Delete").click()
    page.locator("dialog.confirm").get_by_role("button", name="Delete model").click()
    expect(card).to_have_count(0)
    assert not LanguageModel.objects.filter(pk=model.id).exists()
    assert page.evaluate("window.__marker") == 1


def close_at_once(socket):
    """A WebSocket route handler that closes the page's socket as soon as it opens.

    Playwright's sync API (1.63) calls WebSocket route handlers inside its own event loop, where the
    sync ``socket.close()`` waits on that very loop and deadlocks (seen: the test hangs). The
    handler may return an awaitable, which Playwright awaits: so return the async close instead.
    """
    return socket._impl_obj.close()


def test_the_models_page_polls_when_the_websocket_is_down(page, site, tiny_gpt2_folder):
    page.route_web_socket("**/ws/events/", close_at_once)
    page.goto(site.url("/"))
    indicator = page.locator("#live-indicator")
    expect(indicator).to_have_text("Polling")
    page.evaluate("window.__marker = 1")

    # Registered and loaded behind the page's back: only the REST polling can bring it in.
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="polled-gpt2", owner=None)
    model_load_request(model_id=model.id, actor=OPERATOR)
    badge = page.locator(f'.model-card[data-model-id="{model.id}"] [data-field="status"]')
    expect(badge).to_have_text("ready", timeout=LIVE_TIMEOUT_MS)
    expect(indicator).to_have_text("Polling")
    assert page.evaluate("window.__marker") == 1


def test_extract_from_the_detail_page_then_reuse_the_cache(page, site, tiny_gpt2_folder):
    dataset = dataset_create_from_texts(name="pangrams", texts=PANGRAMS, owner=None, source="upload")
    model_id = register_and_load(tiny_gpt2_folder, name="tiny-gpt2")
    page.goto(site.url(f"/models/{model_id}/"))
    expect(page.get_by_test_id("model-status")).to_have_text("ready")
    form = page.locator("#extract-form")
    expect(form).to_be_visible()
    form.get_by_label("Dataset").select_option(dataset.id)
    page.fill("#extract-samples", "8")
    page.fill("#extract-batch", "3")
    page.fill("#extract-max-length", "24")
    form.get_by_label("Storage dtype").select_option("float16")

    # The middle block's residual stream comes picked (the API's default too); with nothing
    # picked, the API's message shows under the hook picker, the numbers kept.
    default = page.locator('input[name="hooks"][value="blocks.1.hook_resid_post"]')
    expect(default).to_be_checked()
    expect(page.locator("#hook-summary")).to_have_text("1 hook point selected")
    default.uncheck()
    page.click("#extract-submit")
    expect(form.locator('[data-error-for="hooks"]')).to_have_text(
        "At least one hook point (or layer) is required."
    )
    expect(page.locator("#extract-samples")).to_have_value("8")

    form.get_by_role("button", name="resid_post every layer").click()
    expect(page.locator("#hook-summary")).to_have_text("2 hook points selected")
    # The size at most: 8 samples x 24 tokens, each with two float16 rows and its token columns.
    per_token = 2 * LanguageModel.objects.get(pk=model_id).hidden_size * 2 + 48
    expect(page.locator("#extract-size")).to_contain_text(f"(192 tokens \u00d7 {per_token} bytes)")
    page.click("#extract-submit")
    panel = page.locator("#job-panel")
    expect(panel.locator("#job-percent")).to_have_text("100 %", timeout=LIVE_TIMEOUT_MS)
    expect(panel.locator("#job-progress")).to_have_attribute("aria-valuenow", "100")
    expect(panel.locator("#job-samples")).to_have_text("8 / 8 samples")
    expect(panel.locator("#job-status")).to_have_text("completed")
    cache = ActivationCache.objects.get(model_id=model_id)
    assert cache.status == "completed" and cache.num_samples == 8 and cache.dtype == "float16"
    assert sorted(cache.hooks) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    open_cache = panel.get_by_role("link", name="Open in activation browser")
    expect(open_cache).to_have_attribute("href", f"/activations/{cache.id}/")
    expect(page.locator(f'#cache-table tr[data-cache-id="{cache.id}"]')).to_be_visible()
    expect(panel.locator("#job-rate")).not_to_have_text("—")
    page.evaluate("window.scrollTo(0, 0)")
    screenshot(page, "model-detail")

    # The identical request again: answered from the cache, nothing recomputed.
    page.click("#extract-submit")
    expect(panel.locator("#job-notice")).to_contain_text("Using cached activations")
    expect(open_cache).to_have_attribute("href", f"/activations/{cache.id}/")
    assert ActivationCache.objects.filter(model_id=model_id).count() == 1
    cached_flags = ExtractionJob.objects.order_by("created_at").values_list("cached", flat=True)
    assert list(cached_flags) == [False, True]
