"""A researcher's first session, in one browser tab against a live Daphne and a real worker:
sign in → add a tiny local model → load it (the badge turns "ready" without a reload) → extract
activations (progress reaches 100 % and the cache appears) → open the activation browser (the
top-tokens list shows) → the playground streams text → and then the research path on every
default: extract the middle block (the picked hook, the default length), train an SAE (nothing
typed), analyse it, open its densest feature, steer with it and sweep its strength, patch, export,
train a group of SAEs straight from the model and compare them; then from the model to meaning with
no cache (a transcoder per layer analysed when it ends, a graph whose nodes carry labels, a node's
dashboard, explaining refused up front, search by meaning) → sign out.

The other browser modules test each page in depth; this one proves the pages connect."""

import json
import re
from pathlib import Path

import pytest
from playwright.sync_api import expect

from activations.models import ActivationCache
from activations.services import dataset_create_from_texts
from activations.store import ActivationStore
from engine.sae import default_expansion
from features.models import FeatureAnalysis
from frontend.tests.browser import LIVE_TIMEOUT_MS, screenshot
from frontend.views.activations import TOP_K
from generation.models import Generation
from models_app.models import LanguageModel
from models_app.tests.live_stack import wait_until
from saes.models import SaeGroup, SparseAutoencoder
from saes.services import training_tokens

pytestmark = pytest.mark.slow

TEXTS = [
    "Induction heads copy the token that followed an earlier occurrence.",
    "The residual stream is a sum of every layer's output.",
    "Superposition packs more features than there are dimensions.",
    "Logit lens reads the residual stream through the unembedding.",
    "Probing classifiers find linear structure in activations.",
    "def mean(xs):\n    return sum(xs) / len(xs)",
]


def test_sign_in_add_load_extract_browse_and_generate(page, site, tiny_gpt2_folder):
    dataset = dataset_create_from_texts(name="interp notes", texts=TEXTS, owner=None, source="upload")
    page.goto(site.url("/"))
    page.evaluate("window.__marker = 1")  # gone if anything reloads the page

    # Add the model through the dialog, then load it from its card.
    page.click("#add-model-open")
    dialog = page.locator("#add-model-dialog")
    dialog.get_by_label("Local folder").check()
    page.fill("#add-identifier", str(tiny_gpt2_folder))
    page.fill("#add-name", "journey-gpt2")
    page.click("#add-model-submit")
    expect(dialog).to_be_hidden()
    model = LanguageModel.objects.get(name="journey-gpt2")
    card = page.locator(f'.model-card[data-model-id="{model.id}"]')
    card.get_by_role("button", name="Load").click()
    expect(card.locator('[data-field="status"]')).to_have_text("ready", timeout=LIVE_TIMEOUT_MS)
    assert page.evaluate("window.__marker") == 1
    model.refresh_from_db()
    assert model.status == LanguageModel.Status.READY and model.host_worker == site.worker_name

    # Extract every layer's residual stream from the model's page.
    card.locator('[data-field="link"]').click()
    page.wait_for_url(site.url(f"/models/{model.id}/"))
    form = page.locator("#extract-form")
    form.get_by_label("Dataset").select_option(dataset.id)
    page.fill("#extract-max-length", "32")
    form.get_by_role("button", name="resid_post every layer").click()
    page.click("#extract-submit")
    panel = page.locator("#job-panel")
    expect(panel.locator("#job-percent")).to_have_text("100 %", timeout=LIVE_TIMEOUT_MS)
    expect(panel.locator("#job-status")).to_have_text("completed")
    cache = ActivationCache.objects.get(model_id=model.id)
    assert cache.status == ActivationCache.Status.COMPLETED and cache.num_samples == len(TEXTS)
    expect(page.locator(f'#cache-table tr[data-cache-id="{cache.id}"]')).to_be_visible()

    # The activation browser: the default neuron's top tokens, as the stored cache ranks them.
    panel.get_by_role("link", name="Open in activation browser").click()
    page.wait_for_url(re.compile(rf"/activations/{cache.id}/"))
    items = page.locator("#top-list > li")
    expect(items).to_have_count(TOP_K)
    neuron = int(page.locator("#neuron-head").get_attribute("data-neuron"))
    hook = page.locator('.hook-tabs a[aria-selected="true"]').get_attribute("data-hook")
    store = ActivationStore.open(cache.directory)
    expected = [row["value"] for row in store.top_k(hook, neuron, TOP_K, context=8)]
    shown = page.locator("#top-list .value").evaluate_all(
        "nodes => nodes.map(node => Number(node.dataset.value))"
    )
    assert shown == pytest.approx(expected, rel=1e-6)

    # The playground, reached from the top bar, streams a reply from the loaded model.
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Playground").click()
    page.wait_for_url(site.url("/playground/"))
    page.fill("#prompt", "The residual stream")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "80")
    page.check("#ignore_eos")
    # The token counter moves with each streamed token (the text itself is drawn once a frame, so
    # on a starved CPU a short reply can land in one frame).
    page.evaluate("""() => {
      window.tokenCounts = [];
      const node = document.getElementById("live-count");
      new MutationObserver(() => window.tokenCounts.push(node.textContent))
        .observe(node, { childList: true, characterData: true, subtree: true });
    }""")  # fmt: skip
    page.click("#generate-button")
    expect(page.locator("#run-state")).to_have_text("Done", timeout=LIVE_TIMEOUT_MS)
    assert len(set(page.evaluate("window.tokenCounts"))) > 1
    expect(page.locator("#output-text")).not_to_be_empty()
    row = Generation.objects.get(pk=page.locator("#request-link").text_content())
    assert row.model_id == model.id and row.completion_tokens == 80 and row.status == "completed"

    research_path_on_defaults(page, site, model, dataset)

    # Signing out ends the session: the pages ask to sign in again.
    page.get_by_role("button", name="Sign out").click()
    page.goto(site.url("/playground/"))
    expect(page).to_have_url(re.compile(r"/login/"))


def research_path_on_defaults(page, site, model, dataset) -> None:
    """Extract → train → analyse → steer and sweep → patch → export, keeping every default."""
    page.goto(site.url(f"/models/{model.id}/"))
    form = page.locator("#extract-form")
    form.get_by_label("Dataset").select_option(dataset.id)
    expect(page.locator("#hook-summary")).to_have_text("1 hook point selected")  # the middle block
    page.click("#extract-submit")
    panel = page.locator("#job-panel")
    expect(panel.locator("#job-status")).to_have_text("completed", timeout=LIVE_TIMEOUT_MS)
    cache = ActivationCache.objects.filter(model_id=model.id, hooks=["blocks.1.hook_resid_post"]).get()

    page.goto(site.url(f"/activations/{cache.id}/"))
    page.click("#train-sae-link")
    page.wait_for_url(re.compile(rf"/saes/\?cache={cache.id}"))
    page.click("#train-submit")  # nothing typed: the defaults sized to the model
    page.wait_for_url(re.compile(r"/saes/sae_\w+/$"))
    sae = SparseAutoencoder.objects.get(cache=cache)
    expect(page.locator("#sae-training")).to_have_attribute(
        "data-status", "completed", timeout=LIVE_TIMEOUT_MS
    )
    sae.refresh_from_db()
    # A six-text cache: the dictionary shrinks to give each feature enough training tokens.
    expansion = default_expansion(model.hidden_size, training_tokens(cache))
    assert (sae.architecture, sae.k, sae.d_sae) == ("topk", 16, expansion * model.hidden_size)
    assert sae.evaluation["explained_variance"] > 0.5, sae.evaluation

    page.click("#run-analysis")
    expect(page.locator("#analysis-list li").first).to_have_attribute(
        "data-status", "completed", timeout=LIVE_TIMEOUT_MS
    )
    page.goto(site.url(f"/saes/{sae.id}/features/?sort=-density"))
    page.locator("#feature-table tbody tr a").first.click()
    page.wait_for_url(re.compile(rf"/saes/{sae.id}/features/\d+/$"))
    index = int(page.locator("#feature-page").get_attribute("data-index"))

    # Steer with it on the page's defaults (4 x its max activation), then sweep the defaults.
    page.click("#steer-feature")
    page.fill("#prompt", "The residual stream")
    page.click("#generate-button")
    expect(page.locator("#steered-effect")).to_contain_text(
        f"feature {index} on the text", timeout=LIVE_TIMEOUT_MS
    )
    expect(page.locator("#sweep-button")).to_be_enabled(timeout=LIVE_TIMEOUT_MS)  # both runs ended
    page.click("#sweep-button")
    expect(page.locator("#sweep-state")).to_have_text("Done", timeout=LIVE_TIMEOUT_MS)
    rows = page.locator("#sweep-table tbody tr")
    expect(rows).to_have_count(6)  # the baseline and 0.5, 1, 2, 4, 8
    expect(page.locator("#sweep-caption")).to_contain_text("\u00d7 max activation")
    assert Generation.objects.filter(sweep_coefficient__isnull=False).count() == 6

    # Patching, its tokenizer preview saying the prompts match, then the SAE exported.
    page.goto(site.url(f"/models/{model.id}/patching/"))
    page.fill("#patch-clean", "The river runs down to the")
    page.fill("#patch-corrupted", "The river runs down to and")
    page.fill("#patch-answer", " the")
    page.fill("#patch-wrong", " and")
    expect(page.locator("#patch-clean-tokens .token-note")).to_contain_text("same length")
    page.click("#patch-submit")
    expect(page.locator("#patching-result")).to_be_visible(timeout=LIVE_TIMEOUT_MS)

    page.goto(site.url(f"/saes/{sae.id}/"))
    with page.expect_download() as download:
        page.click("#export-sae")
    assert download.value.suggested_filename == f"{sae.id}.tar"

    # A group straight from the model: two hooks x two variants from one forward pass, compared.
    page.goto(site.url("/saes/"))
    page.click("#new-group-link")
    page.wait_for_url(site.url("/saes/groups/new/"))
    page.select_option("#group-model", model.id)
    expect(page.locator("#group-suggestion")).to_contain_text("k 16")  # d_in 64: k at its floor
    page.select_option("#group-dataset", dataset.id)
    page.fill("#group-hooks", "blocks.0.hook_resid_post blocks.1.hook_resid_post")
    page.fill("#group-variants", "k=8\nk=16")
    page.fill("#group-expansion", "2")
    page.fill("#group-batch", "512")
    page.fill("#group-tokens", "10240")
    page.click("#group-submit")
    page.wait_for_url(re.compile(r"/saes/groups/grp_\w+/$"))
    expect(page.locator('[data-testid="group-status"]')).to_have_text("completed", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#group-members tbody tr")).to_have_count(4)
    expect(page.locator('[data-chart="explained_variance"] circle.dot')).to_have_count(4)
    expect(page.locator('[data-chart="ce_loss_recovered"] circle.dot')).to_have_count(4)
    judged_side_by_side(page, site, dataset)

    model_to_meaning(page, site, model, dataset)


def judged_side_by_side(page, site, dataset) -> None:
    """The group's members judged by SAEBench's core metrics from its page, then sorted by a column
    (best first), each member's result downloaded as SAEBench's JSON."""
    page.click("#group-saebench")
    page.wait_for_url(re.compile(r"/saes/compare/\?group=grp_\w+$"))
    expect(page.locator("#compare-table tbody tr")).to_have_count(4)  # not judged yet
    page.select_option("#bench-dataset", dataset.id)
    page.fill("#bench-batch", "2")  # the journey's text is six sentences: 2 batches of 2 x 16 tokens
    page.fill("#bench-context", "16")
    page.fill("#bench-batches", "2")
    page.click("#bench-start")
    page.wait_for_url(re.compile(r"/saes/compare/\?run=sb_\w+$"))
    expect(page.locator('[data-testid="run-status"]')).to_have_text("completed", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator('#compare-table td[data-metric="core.l0"]').first).not_to_have_text("—")
    expect(page.locator('[data-chart="core.ce_loss_score"] circle.dot')).to_have_count(4)
    page.click('th[data-column="core.explained_variance"] a')
    expect(page.locator("#compare-table")).to_have_attribute("data-sort", "core.explained_variance")
    shown = [
        float(text) for text in page.locator('td[data-metric="core.explained_variance"]').all_inner_texts()
    ]
    assert shown == sorted(shown, reverse=True)
    with page.expect_download() as download:
        page.locator('[data-export="core"]').first.click()
    document = json.loads(Path(download.value.path()).read_text())
    assert document["eval_type_id"] == "core" and len(document["eval_result_details"]) > 0
    screenshot(page, "saebench-compare")


def model_to_meaning(page, site, model, dataset) -> None:
    """From the model to meaning with no cache: a group of one transcoder per layer (one click),
    analysed when it ends (the default) → an attribution graph whose feature nodes carry those
    analyses' labels → a node's dashboard → explaining says before anything starts why the tiny
    model cannot → search by meaning finds the automatic labels."""
    caches_before = ActivationCache.objects.count()
    page.goto(site.url("/saes/groups/new/"))
    page.select_option("#group-model", model.id)
    expect(page.locator("#group-suggestion")).to_contain_text("min on cpu")  # the time, before it starts
    page.select_option("#group-dataset", dataset.id)
    page.fill("#group-hooks", "")
    page.click("#group-transcoder-per-layer")
    expect(page.locator("#group-transcoders")).to_have_value(
        "\n".join(f"blocks.{layer}.ln2.hook_normalized -> blocks.{layer}.hook_mlp_out" for layer in range(2))
    )
    expect(page.locator("#group-analyze")).to_be_checked()
    page.fill("#group-tokens", "10240")  # the CPU default is ten minutes: a test has seconds
    page.click("#group-submit")
    page.wait_for_url(re.compile(r"/saes/groups/grp_\w+/$"))
    expect(page.locator('[data-testid="group-status"]')).to_have_text("completed", timeout=LIVE_TIMEOUT_MS)
    group = SaeGroup.objects.get(pk=page.url.rstrip("/").rsplit("/", 1)[-1])
    members = list(group.members.order_by("group_index"))

    def analysed() -> bool:
        analyses = FeatureAnalysis.objects.filter(sae__in=members)
        return analyses.count() == len(members) and all(row.status == "completed" for row in analyses)

    wait_until(analysed, timeout=LIVE_TIMEOUT_MS / 1000, what="the members' analyses")
    assert all(row.source == "model" for row in FeatureAnalysis.objects.filter(sae__in=members))
    assert ActivationCache.objects.count() == caches_before  # nothing written to disk for them

    # An attribution graph over the group's transcoders: its feature nodes carry labels.
    page.goto(site.url("/graphs/"))
    page.select_option("#graph-model", model.id)
    page.select_option("#graph-group", group.id)
    page.fill("#graph-prompt", "The residual stream is a sum")
    page.click("#graph-start")
    page.wait_for_url(re.compile(r"/graphs/ag_\w+/$"))
    expect(page.locator('[data-testid="graph-status"]')).to_have_text("completed", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#graph-explorer")).to_have_attribute("data-loaded", "1", timeout=LIVE_TIMEOUT_MS)
    graph_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    # Three steps of training leave weak features: every node kept (the slider at its end).
    body = page.evaluate(f"fetch('/api/graphs/{graph_id}/nodes?node_threshold=1').then(r => r.json())")
    labelled = [n for n in body["nodes"] if n["feature_type"] == "cross layer transcoder" and n["clerp"]]
    assert labelled and all(node["clerp"].startswith("auto: ") for node in labelled)
    page.locator("#node-threshold").fill("1")
    node = page.locator(f'#graph-svg [data-node-id="{labelled[0]["node_id"]}"]')
    expect(node).to_have_count(1, timeout=LIVE_TIMEOUT_MS)
    node.click()
    expect(page.locator("#node-label")).to_contain_text("auto: ")
    page.click("#node-dashboard")  # its dashboard, from the analysis made through the model
    page.wait_for_url(re.compile(r"/saes/sae_\w+/features/\d+/$"))
    expect(page.locator("#feature-error")).to_have_count(0)
    expect(page.locator("#feature-page")).to_be_visible()
    sae_id = page.url.split("/saes/")[1].split("/")[0]

    # Explaining: the tiny model's 128 tokens take no explanation prompt, said before anything starts.
    page.goto(site.url(f"/saes/{sae_id}/explanations/new/"))
    expect(page.locator("#explain-model-hint")).to_contain_text("No loaded model takes the prompts")
    expect(page.locator("#explain-model-hint")).to_contain_text("MISTUDIO_EXPLAINER_ENDPOINTS")
    expect(page.locator("#explain-model option").first).to_be_disabled()

    # Search by meaning finds the features by their automatic labels (indexed by a worker).
    def found() -> bool:
        page.goto(site.url(f"/saes/{sae_id}/features/?meaning=the"))
        return page.locator('[data-testid="auto-label-mark"]').count() > 0

    wait_until(
        found, timeout=2 * LIVE_TIMEOUT_MS / 1000, interval=2, what="automatic labels found by meaning"
    )
