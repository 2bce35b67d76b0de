"""Datasets and workers pages in a real browser against a live Daphne and a real worker.

(a) Upload by a real drop on the drop zone, an API refusal shown inline with nothing lost, the sample
preview with "Load more", and deletion through the confirmation dialog (on the list and the detail page).
(b) The workers page finds the live worker on its 5 s refresh, with its device, memory bar, queues and,
once loaded, its model.
"""

import pytest
from playwright.sync_api import expect

from activations.models import Dataset
from frontend.tests.browser import LIVE_TIMEOUT_MS, screenshot

pytestmark = pytest.mark.slow

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Residual streams carry information between transformer blocks.",
    "Sparse autoencoders decompose activations into interpretable features.",
    "Attention heads move information between token positions.",
    "A neuron that fires on French text may also fire on Spanish.",
]
DROPPED_LINES = [f"{SENTENCES[index % len(SENTENCES)]} (sample {index})" for index in range(27)]


def test_upload_by_drop_preview_and_delete(page, site):
    page.goto(site.url("/datasets/"))
    expect(page.locator("#dataset-empty")).to_contain_text("No datasets yet")
    form = page.locator("#upload-form")

    # A JSONL file without the default field: the API's reason shows inline, the file and the name stay.
    page.set_input_files(
        "#dataset-file",
        files=[
            {
                "name": "bodies.jsonl",
                "mimeType": "application/json",
                "buffer": b'{"body": "alpha"}\n{"body": "beta"}\n',
            }
        ],
    )
    page.fill("#dataset-name", "bodies")
    page.click("#upload-button")
    expect(form.locator(".form-error")).to_contain_text("has no field 'text'; it has 'body'")
    expect(form.locator('[data-error-for="field"]')).to_have_text("The file has: body")
    expect(page.locator("#dropzone")).to_contain_text("bodies.jsonl")
    expect(page.locator("#dataset-name")).to_have_value("bodies")
    page.fill("#dataset-field", "body")
    page.click("#upload-button")
    bodies_row = page.locator("#dataset-table tbody tr", has_text="bodies")
    expect(bodies_row.get_by_test_id("sample-count")).to_have_text("2")
    expect(form.locator(".form-error")).to_have_count(0)

    # An empty file is refused by the API, its message under the drop zone.
    page.set_input_files(
        "#dataset-file", files=[{"name": "empty.txt", "mimeType": "text/plain", "buffer": b""}]
    )
    page.click("#upload-button")
    expect(form.locator('[data-error-for="file"]')).to_contain_text("empty")
    page.click("#upload-clear")

    # A real drop: dragenter lights the zone up, the drop chooses the file, Upload sends it.
    transfer = page.evaluate_handle(
        """([name, text]) => {
            const transfer = new DataTransfer();
            transfer.items.add(new File([text], name, { type: "text/plain" }));
            return transfer;
        }""",
        ["corpus.txt", "\n".join(DROPPED_LINES) + "\n"],
    )
    page.dispatch_event(".dropzone", "dragenter", {"dataTransfer": transfer})
    expect(page.locator(".dropzone")).to_have_class("dropzone over")
    page.dispatch_event(".dropzone", "drop", {"dataTransfer": transfer})
    expect(page.locator(".dropzone")).to_contain_text("corpus.txt")
    expect(page.locator("#dataset-name")).to_have_attribute("placeholder", "corpus.txt")
    page.fill("#dataset-name", "dropped corpus")
    page.click("#upload-button")
    row = page.locator("#dataset-table tbody tr", has_text="dropped corpus")
    expect(row.get_by_test_id("sample-count")).to_have_text(str(len(DROPPED_LINES)))
    expect(page.locator("#dataset-count")).to_have_text("2 datasets")
    stored = Dataset.objects.get(name="dropped corpus")
    assert stored.sample_count == len(DROPPED_LINES) and stored.original_name == "corpus.txt"
    assert stored.format == "text_lines" and row.get_attribute("data-dataset-id") == stored.id
    # The screenshot shows the list at rest: no toasts, no "just added" highlight.
    page.evaluate(
        "document.querySelectorAll('.toast').forEach((n) => n.remove());"
        " document.querySelectorAll('tr.fresh').forEach((n) => n.classList.remove('fresh'))"
    )
    page.mouse.move(0, 0)
    screenshot(page, "datasets")

    # The preview: the first page of samples, then the rest as a fragment of the same page.
    row.get_by_role("link", name="dropped corpus").click()
    page.wait_for_url(site.url(f"/datasets/{stored.id}/"))
    samples = page.locator("#samples > li")
    expect(samples).to_have_count(20)
    expect(samples.first).to_contain_text(DROPPED_LINES[0])
    expect(samples.first.locator(".sample-index")).to_have_text("#0")
    screenshot(page, "dataset-detail")
    page.click("#load-more")
    expect(samples).to_have_count(len(DROPPED_LINES))
    expect(samples.last).to_contain_text(DROPPED_LINES[-1])
    expect(page.locator("#samples-shown")).to_have_text(
        f"Showing 1\u2013{len(DROPPED_LINES)} of {len(DROPPED_LINES)}"
    )
    expect(page.locator("#load-more")).to_have_count(0)

    # Delete from the detail page: Escape cancels, the dialog's button confirms, back on the list it is gone.
    page.click("#delete-dataset")
    expect(page.locator("dialog.confirm")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator("dialog.confirm")).to_have_count(0)
    page.click("#delete-dataset")
    page.locator('dialog.confirm button[value="ok"]').click()
    page.wait_for_url(site.url("/datasets/"))
    expect(page.locator("#toasts")).to_contain_text("Deleted “dropped corpus”")
    expect(page.locator("#dataset-table tbody tr")).to_have_count(1)
    assert not Dataset.objects.filter(pk=stored.id).exists()

    # Delete the last one from the list: its row goes without a reload and the empty state returns.
    page.locator("#dataset-table tbody tr", has_text="bodies").get_by_role(
        "button", name="Delete bodies"
    ).click()
    page.locator('dialog.confirm button[value="ok"]').click()
    expect(page.locator("#dataset-table tbody tr")).to_have_count(0)
    expect(page.locator("#dataset-empty")).to_be_visible()
    assert Dataset.objects.count() == 0


def test_the_workers_page_shows_the_live_worker(page, site, tiny_gpt2_folder):
    from models_app.tests.live_stack import register_and_load

    page.goto(site.url("/workers/"))
    card = page.locator(f'.worker-card[data-worker="{site.worker_name}"]')
    # The worker process may still be starting: the page's 5 s refresh brings its card in.
    expect(card).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    expect(card.get_by_test_id("device")).to_have_text("cpu")
    expect(card.get_by_test_id("memory-text")).to_contain_text(" %")
    width = card.locator(".bar.memory > span").first.evaluate("node => node.getBoundingClientRect().width")
    assert width > 0
    expect(page.locator(f'tr[data-queue$=".worker.{site.worker_name}"]')).to_be_visible()
    expect(page.locator('tr[data-queue$=".shared"]').get_by_test_id("queued")).to_have_text("0")
    expect(page.get_by_test_id("redis-status").locator(".badge")).to_have_text("reachable")

    # A model loaded meanwhile appears on the card at the next refresh, without a reload.
    model_id = register_and_load(tiny_gpt2_folder, name="browser-gpt2")
    link = card.get_by_role("link", name="browser-gpt2")
    expect(link).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    assert link.get_attribute("href") == f"/models/{model_id}/"
    page.mouse.move(0, 0)
    screenshot(page, "workers")


def test_the_api_documentation_renders_under_the_content_security_policy(page, site):
    """Swagger UI from the vendored sidecar, its initializer from ``?script`` (no inline code)."""
    response = page.goto(site.url("/docs/api/"))
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "style-src 'self'" in policy and "unsafe-inline" not in policy
    expect(page.locator(".opblock").first).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    expect(page.locator(".opblock-summary-path", has_text="/api/models").first).to_be_visible()
