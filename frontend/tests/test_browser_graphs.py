"""Circuits in one browser tab, against a live Daphne and a real worker holding the model: attribute
a prompt through one transcoder per layer (the form), watch the job end and the graph appear
without a reload, pin a path (a feature and a logit it reaches), group the pinned feature into a
named supernode (drawn as a box) and accept a suggested one, show the pinned subgraph, prune live
(the pinned nodes stay, the graph's thresholds change only when asked), intervene on the feature
(the worker answers with the new top logits), export the graph's JSON, save the reading as a
shared subgraph that another user reopens from its link; then a cross-layer transcoder's graph of
a logit difference, from the same form. Saves the "graph" screenshot."""

import json
import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from circuits.models import AttributionGraph
from circuits.tests.conftest import transcoder_rows
from frontend.tests.browser import LIVE_TIMEOUT_MS, USERNAME, browser_user, page_of, screenshot
from models_app.models import LanguageModel
from models_app.tests.live_stack import register_and_load, wait_until

pytestmark = pytest.mark.slow


def test_attribute_pin_a_path_group_a_supernode_intervene_and_export(page, site, tiny_gpt2_folder):
    user = get_user_model().objects.get(username=USERNAME)
    model = LanguageModel.objects.get(pk=register_and_load(tiny_gpt2_folder, name="browser-circuits"))
    transcoders = transcoder_rows(model, tiny_gpt2_folder, user)

    # The form: the model, its transcoders (layer 0 first), a prompt.
    page.goto(site.url("/graphs/"))
    page.select_option("#graph-model", model.id)
    page.select_option("#graph-group", "")
    page.fill("#graph-transcoders", " ".join(sae.id for sae in transcoders))
    page.fill("#graph-prompt", "The cat sat on the mat because it was warm")
    page.fill("#graph-name", "cats")
    page.click("#graph-start")
    page.wait_for_url(re.compile(r"/graphs/ag_\w+/$"))
    page.evaluate("window.__marker = 1")  # gone if anything reloads the page
    expect(page.locator('[data-testid="graph-status"]')).to_have_text("completed", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#graph-explorer")).to_have_attribute("data-loaded", "1", timeout=LIVE_TIMEOUT_MS)
    assert page.evaluate("window.__marker") == 1
    graph = AttributionGraph.objects.get()
    assert graph.owner == user and graph.status == "completed"
    nodes = page.locator("#graph-svg .node")
    assert nodes.count() > 5

    # Pin a path: a feature, then a logit it reaches.
    graph_json = page.evaluate(f"fetch('/api/graphs/{graph.id}/nodes').then(r => r.json())")
    kinds = {node["node_id"]: node["feature_type"] for node in graph_json["nodes"]}
    logit, feature = next(
        (link["target"], link["source"])
        for link in graph_json["links"]
        if kinds[link["target"]] == "logit" and kinds[link["source"]] == "cross layer transcoder"
    )
    page.locator(f'#graph-svg [data-node-id="{feature}"]').click()
    expect(page.locator("#node-card")).to_be_visible()
    expect(page.locator("#node-title")).to_contain_text("feature")
    page.click("#pin-node")
    expect(page.locator(f'#pinned-list li[data-node-id="{feature}"]')).to_have_count(1)
    page.locator(f'#graph-svg [data-node-id="{logit}"]').click()
    page.click("#pin-node")
    expect(page.locator("#pinned-list li")).to_have_count(2)

    # Group the pinned feature into a supernode, then show the pinned subgraph.
    page.fill("#supernode-name", "cat detector")
    page.click("#group-supernode")
    expect(page.locator('#supernode-list li[data-supernode="cat detector"]')).to_have_count(1)
    graph.refresh_from_db()
    assert graph.pinned == [feature, logit]
    assert graph.supernodes == [["cat detector", feature]]
    expect(page.locator('#graph-svg rect.supernode[data-supernode="cat detector"]')).to_have_count(1)
    page.check("#subgraph-toggle")
    expect(nodes).to_have_count(2)
    page.uncheck("#subgraph-toggle")

    # A suggested supernode (features with one role: the same strongest target), grouped in one click.
    suggestion = page.locator("#supernode-suggestions li").first
    expect(suggestion).to_be_visible()
    suggested = suggestion.get_attribute("data-suggestion")
    suggestion.locator("button").click()
    expect(page.locator("#supernode-list li")).to_have_count(2)
    wait_until(lambda: (graph.refresh_from_db(), len(graph.supernodes))[1] == 2, timeout=20, what="saved")
    assert graph.supernodes[1][0] == suggested and len(graph.supernodes[1]) >= 3

    # Prune live: a lower node threshold keeps fewer nodes, the pinned ones whatever it is; the
    # graph's own threshold changes only when asked.
    shown = nodes.count()
    page.locator("#node-threshold").fill("0.3")
    expect(page.locator("#node-threshold-value")).to_have_text("0.3")
    wait_until(lambda: nodes.count() < shown, timeout=20, what="fewer nodes")
    expect(page.locator(f'#graph-svg [data-node-id="{feature}"]')).to_have_count(1)
    expect(page.locator(f'#pinned-list li[data-node-id="{feature}"]')).to_contain_text("Layer")
    page.wait_for_timeout(1500)
    graph.refresh_from_db()
    assert graph.node_threshold == 0.8
    page.click("#save-thresholds")
    wait_until(lambda: (graph.refresh_from_db(), graph.node_threshold)[1] == 0.3, timeout=20, what="saved")

    # Intervene: ablate the feature; the worker answers with the new top logits.
    page.locator("#node-threshold").fill("0.8")
    wait_until(lambda: nodes.count() >= shown, timeout=20, what="the nodes back")
    page.locator(f'#graph-svg [data-node-id="{feature}"]').click()
    page.click("#intervene-ablate")
    expect(page.locator("#intervention-section")).to_have_attribute("data-done", "1", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#intervention-result tbody tr")).to_have_count(10)
    screenshot(page, "graph")

    # Export: the graph JSON that Neuronpedia's viewer loads, with the pins and the supernode.
    with page.expect_download() as download:
        page.click("#export-graph")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["metadata"]["slug"] == graph.id
    assert exported["qParams"]["pinnedIds"] == [feature, logit]
    assert exported["qParams"]["supernodes"][0] == ["cat detector", feature]
    assert {node["node_id"] for node in exported["nodes"]} >= {feature, logit}

    # The reading saved as a shared subgraph; another user reopens it from its link.
    page.evaluate(f"mi.api('PATCH', 'graphs/{graph.id}', {{shared: true}})")
    page.fill("#subgraph-name", "cat path")
    page.fill("#subgraph-notes", "the feature and the logit it reaches")
    page.check("#subgraph-shared")
    page.click("#save-subgraph")
    page.wait_for_url(re.compile(r"\?subgraph=sg_\w+$"))
    expect(page.locator("#graph-explorer")).to_have_attribute("data-subgraph", re.compile(r"^sg_"))
    browser_user("second-reader", "model:read")
    other = page_of(page, site, "second-reader")
    other.goto(page.url)
    expect(other.locator("#subgraph-reading")).to_contain_text("cat path")
    expect(other.locator(f'#pinned-list li[data-node-id="{feature}"]')).to_contain_text("Layer")
    other.context.close()

    # A cross-layer transcoder, imported, chosen on the form, explaining a logit difference.
    clt_graph_of_a_logit_difference(page, site, model, user, tiny_gpt2_folder)


def clt_graph_of_a_logit_difference(page, site, model, user, tiny_gpt2_folder):
    from types import SimpleNamespace

    from django.conf import settings
    from transformers import AutoConfig

    from engine.sae.clt import save_clt
    from engine.testing.tiny_saes import random_clt
    from saes.models import SparseAutoencoder
    from saes.services import transcoder_set_import

    clt = random_clt(
        SimpleNamespace(config=AutoConfig.from_pretrained(tiny_gpt2_folder)), activation="jumprelu"
    )
    folder = save_clt(clt, settings.LOCAL_MODEL_ROOTS[0] / "clts" / "browser-clt")
    [row], _ = transcoder_set_import(owner=user, local_path=str(folder), model=model, name="browser CLT")
    wait_until(
        lambda: SparseAutoencoder.objects.get(pk=row.pk).status == "completed", timeout=60, what="the CLT"
    )
    page.goto(site.url("/graphs/"))
    page.select_option("#graph-model", model.id)
    page.select_option("#graph-group", f"sae:{row.id}")
    page.fill("#graph-prompt", "The cat sat on the mat")
    page.check("#graph-target-difference-choice")
    page.fill("#graph-target-first", " mat")
    page.fill("#graph-target-second", " the")
    page.click("#graph-start")
    page.wait_for_url(re.compile(r"/graphs/ag_\w+/$"))
    expect(page.locator("#graph-explorer")).to_have_attribute("data-loaded", "1", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#logit-list li")).to_have_text(['Output " mat" minus " the"'])
    graph = AttributionGraph.objects.get(pk=page.url.rstrip("/").split("/")[-1])
    assert graph.transcoders == [row.id] and graph.summary["target"]["kind"] == "difference"
