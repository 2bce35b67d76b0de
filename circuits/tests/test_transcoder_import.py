"""Transcoders in circuit-tracer's layout: imported through the API as one transcoder row per layer
(a worker reads each file; the weights are the files' exactly), then used for a graph; refused with
a clear 4xx when the folder lies outside the roots, does not fit the model or is cross-layer; and
exported again in circuit-tracer's layout with the SAE."""

import io
import json
import tarfile
from types import SimpleNamespace

import pytest
import torch
from django.conf import settings
from safetensors.torch import load
from transformers import AutoConfig

from engine.sae.formats import save_circuit_tracer_set
from engine.testing.tiny_saes import random_transcoders
from mistudio.workers import run_worker
from models_app.tests.burst_worker import load_on_burst_worker
from saes.models import SparseAutoencoder
from saes.tasks import sae_module

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "import-worker"


def test_a_circuit_tracer_set_imports_as_one_transcoder_per_layer_and_attributes(
    tiny_gpt2_folder, writer, client_for
):
    model = load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)
    api = client_for(writer)
    config = AutoConfig.from_pretrained(tiny_gpt2_folder)
    modules = random_transcoders(SimpleNamespace(config=config), "jumprelu", skip=True, seed=9)
    folder = settings.LOCAL_MODEL_ROOTS[0] / "transcoder-sets" / "tiny-set"
    save_circuit_tracer_set(modules, folder, model_name="tiny", scan="tiny-set")

    body = {"local_path": str(folder), "model_id": model.id, "name": "imported"}
    response = api.post("/api/saes/import-transcoders", body, format="json")
    assert response.status_code == 202, response.content
    rows = response.json()["saes"]
    assert [row["hook_name"] for row in rows] == [
        "blocks.0.ln2.hook_normalized",
        "blocks.1.ln2.hook_normalized",
    ]
    assert [row["hook_name_out"] for row in rows] == ["blocks.0.hook_mlp_out", "blocks.1.hook_mlp_out"]
    run_worker(name=WORKER, device="cpu", burst=True)
    saes = [SparseAutoencoder.objects.get(pk=row["id"]) for row in rows]
    assert all(sae.status == "completed" and sae.source == "circuit_tracer" for sae in saes), [
        (sae.status, sae.error_code, sae.error_message) for sae in saes
    ]
    for sae, module in zip(saes, modules, strict=True):
        loaded = sae_module(sae)
        assert loaded.shape.is_transcoder and loaded.shape.skip
        for name, tensor in module.tensors().items():
            assert torch.equal(loaded.tensors()[name], tensor), name
    # The same files again: the rows already made.
    again = api.post("/api/saes/import-transcoders", body, format="json")
    assert again.status_code == 200 and [row["id"] for row in again.json()["saes"]] == [
        sae.id for sae in saes
    ]

    # They attribute a prompt.
    graph = api.post("/api/graphs", {"model_id": model.id, "prompt": "The cat sat", "transcoder_ids":
                                     [sae.id for sae in saes], "batch_size": 8}, format="json")  # fmt: skip
    assert graph.status_code == 202, graph.content
    run_worker(name=WORKER, device="cpu", burst=True)
    assert api.get(f"/api/graphs/{graph.json()['id']}").json()["status"] == "completed"

    # The export carries the circuit-tracer file beside the SAELens folder.
    export = api.get(f"/api/saes/{saes[1].id}/export")
    with tarfile.open(fileobj=io.BytesIO(b"".join(export.streaming_content))) as archive:
        exported = load(archive.extractfile(f"{saes[1].id}/circuit_tracer/layer_1.safetensors").read())
    assert torch.equal(exported["W_enc"], modules[1].W_enc.T)


def test_bad_transcoder_sets_are_refused_and_write_nothing(tiny_gpt2_folder, writer, client_for, tmp_path):
    model = load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)
    api = client_for(writer)
    config = AutoConfig.from_pretrained(tiny_gpt2_folder)
    modules = random_transcoders(SimpleNamespace(config=config), "jumprelu", seed=10)
    inside = settings.LOCAL_MODEL_ROOTS[0] / "transcoder-sets"
    one_layer = save_circuit_tracer_set(modules[:1], inside / "one-layer", model_name="tiny", scan="x")
    cross_layer = save_circuit_tracer_set(modules, inside / "clt", model_name="tiny", scan="x")
    (cross_layer / "config.yaml").write_text("model_kind: cross_layer_transcoder\n")
    outside = save_circuit_tracer_set(modules, tmp_path / "outside", model_name="tiny", scan="x")
    for folder, status, code in (
        (one_layer, 400, "INVALID_TRANSCODERS"),
        (cross_layer, 400, "UNSUPPORTED_SAE"),
        (outside, 400, "INVALID_LOCAL_PATH"),  # outside LOCAL_MODEL_ROOTS
    ):
        response = api.post("/api/saes/import-transcoders", {"local_path": str(folder), "model_id": model.id},
                            format="json")  # fmt: skip
        assert response.status_code == status, (folder, response.content)
        assert response.json()["error"]["code"] == code, folder
    assert not SparseAutoencoder.objects.exists()


def test_a_cross_layer_transcoder_imports_as_one_row_and_attributes_and_intervenes(
    tiny_gpt2_folder, writer, client_for
):
    from engine.sae.clt import save_clt
    from engine.testing.tiny_saes import random_clt

    model = load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)
    api = client_for(writer)
    config = AutoConfig.from_pretrained(tiny_gpt2_folder)
    clt = random_clt(SimpleNamespace(config=config), activation="jumprelu", seed=11)
    folder = save_clt(clt, settings.LOCAL_MODEL_ROOTS[0] / "clts" / "tiny-clt")

    body = {"local_path": str(folder), "model_id": model.id, "name": "a CLT"}
    response = api.post("/api/saes/import-transcoders", body, format="json")
    assert response.status_code == 202, response.content
    [row] = response.json()["saes"]
    assert (row["n_layers"], row["d_sae"], row["hook_name"], row["hook_name_out"], row["source"]) == (
        2, clt.shape.d_sae, "blocks.0.ln2.hook_normalized", "blocks.1.hook_mlp_out", "clt",
    )  # fmt: skip
    run_worker(name=WORKER, device="cpu", burst=True)
    sae = SparseAutoencoder.objects.get(pk=row["id"])
    assert sae.status == "completed", (sae.error_code, sae.error_message)
    for name, tensor in clt.state_dict().items():
        assert torch.equal(sae_module(sae).state_dict()[name], tensor), name
    again = api.post("/api/saes/import-transcoders", body, format="json")
    assert again.status_code == 200 and again.json()["saes"][0]["id"] == sae.id

    # A graph through it: feature nodes of both layers (interventions: engine/tests/test_attribution.py).
    graph = api.post("/api/graphs", {"model_id": model.id, "prompt": "The cat sat on the mat",
                                     "transcoder_ids": [sae.id], "batch_size": 8}, format="json")  # fmt: skip
    assert graph.status_code == 202, graph.content
    run_worker(name=WORKER, device="cpu", burst=True)
    state = api.get(f"/api/graphs/{graph.json()['id']}").json()
    assert state["status"] == "completed", state
    assert state["summary"]["completeness_error"] <= 1e-4 and state["summary"]["feature_nodes"] > 0
    view = json.loads(api.get(f"/api/graphs/{graph.json()['id']}/nodes").content)
    layers = {node["layer"] for node in view["nodes"] if node["feature_type"] == "cross layer transcoder"}
    assert layers == {"0", "1"}

    # The export is circuit-tracer's layout.
    export = api.get(f"/api/saes/{sae.id}/export")
    with tarfile.open(fileobj=io.BytesIO(b"".join(export.streaming_content))) as archive:
        exported = load(archive.extractfile(f"{sae.id}/clt/W_dec_0.safetensors").read())
    assert torch.equal(exported["W_dec_0"], clt.W_dec[0].detach())

    # Its pages: one SAE over every layer, offered as the transcoders of a new graph.
    from django.test import Client

    browser = Client()
    browser.force_login(writer)
    page = browser.get(f"/saes/{sae.id}/").content.decode()
    assert 'data-testid="cross-layer"' in page
    assert f"2 layers \N{MULTIPLICATION SIGN} {clt.shape.d_sae}" in page
    form = browser.get("/graphs/").content.decode()
    assert f'<option value="sae:{sae.id}"' in form and "cross-layer, 2 layers" in form
    queued = browser.post(
        "/graphs/", {"model_id": model.id, "prompt": "The dog", "sae_group_id": f"sae:{sae.id}"}
    )
    assert queued.status_code == 302, queued.content.decode()[:2000]

    # What works on single-layer SAEs only says so; a CLT replaces every MLP alone.
    analysis = api.post(f"/api/saes/{sae.id}/analyses", {}, format="json")
    assert analysis.status_code == 400 and analysis.json()["error"]["code"] == "UNSUPPORTED_SAE"
    mixed = api.post("/api/graphs", {"model_id": model.id, "prompt": "The cat", "transcoder_ids":
                                     [sae.id, sae.id], "batch_size": 8}, format="json")  # fmt: skip
    assert mixed.status_code == 400 and mixed.json()["error"]["code"] == "INVALID_TRANSCODERS"


def test_a_damaged_or_misfit_cross_layer_transcoder_is_refused_and_writes_nothing(
    tiny_gpt2_folder, writer, client_for
):
    from engine.sae.clt import CltShape, CrossLayerTranscoder, save_clt

    model = load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)
    api = client_for(writer)
    width = AutoConfig.from_pretrained(tiny_gpt2_folder).hidden_size
    inside = settings.LOCAL_MODEL_ROOTS[0] / "clts"
    three_layers = save_clt(CrossLayerTranscoder(CltShape(3, width, 16)), inside / "three")
    damaged = save_clt(CrossLayerTranscoder(CltShape(2, width, 16)), inside / "damaged")
    (damaged / "W_dec_1.safetensors").unlink()
    for folder, code in ((three_layers, "INVALID_TRANSCODERS"), (damaged, "INVALID_SAE")):
        response = api.post("/api/saes/import-transcoders", {"local_path": str(folder), "model_id": model.id},
                            format="json")  # fmt: skip
        assert response.status_code == 400, (folder, response.content)
        assert response.json()["error"]["code"] == code, (folder, response.content)
    assert not SparseAutoencoder.objects.exists()
