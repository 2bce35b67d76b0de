"""SAE training through the whole stack: API → queue → real worker → SAELens folder → metrics.

The metrics the job reports are checked against independent computations on the cache's
held-out rows, and the CE losses against transformers' own loss on the same token ids.
"""

import io
import math
import shutil
import tarfile
import threading
import time

import numpy as np
import pytest
import torch
from django.db import connection
from transformers import AutoModelForCausalLM

from activations.models import Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from activations.store import ActivationStore
from engine.sae.formats import load_saelens
from engine.testing.corpus import local_corpus
from mistudio.access import OPERATOR
from mistudio.workers import run_worker
from models_app.services import model_load_request
from models_app.tests.live_stack import wait_until
from saes.cache_data import cache_split, holdout_sequences
from saes.models import SparseAutoencoder as SaeRow
from saes.services import HOLDOUT_FRACTION

pytestmark = pytest.mark.django_db(transaction=True)
HOOK = "blocks.0.hook_resid_post"


def burst() -> None:
    run_worker(name="sae-worker", device="cpu", burst=True)


def test_extract_train_evaluate_export_like_a_researcher(
    tiny_gpt2_folder, tiny_model, writer, client_for, tmp_path
):
    api = client_for(writer)
    texts = [text for text in local_corpus(max_chars=60_000) if len(text) > 40][:300]
    dataset = dataset_create_from_texts(name="docs", texts=texts, owner=None, source=Dataset.Source.BUILTIN)
    extraction = api.post(
        f"/api/models/{tiny_model.id}/extract-activations",
        {"dataset_id": dataset.id, "hooks": [HOOK], "batch_size": 16, "max_length": 32},
        format="json",
    ).json()
    burst()  # loads the model into this worker, extracts
    cache = ExtractionJob.objects.get(pk=extraction["extraction_id"]).cache
    assert cache.status == "completed" and cache.num_tokens > 3000

    response = api.post(
        "/api/saes",
        {"cache_id": cache.id, "hook": HOOK, "architecture": "topk", "expansion_factor": 4, "k": 8,
         "batch_size": 128, "lr": 3e-3, "total_tokens": 3 * cache.num_tokens},
        format="json",
    )  # fmt: skip
    assert response.status_code == 202, response.content
    sae_id = response.json()["id"]
    burst()  # trains here, where the model is loaded: CE loss recovered at the end too
    sae = SaeRow.objects.get(pk=sae_id)
    assert sae.status == "completed", (sae.error_code, sae.error_message)
    # Whole batches: the last one may go past the tokens asked for.
    assert sae.step == sae.total_steps and 0 <= sae.tokens_seen - sae.total_tokens < 128
    assert (sae.d_in, sae.d_sae, sae.k) == (64, 256, 8)

    # The curves: ordered steps, the last one included; training improved the reconstruction.
    steps = [point["step"] for point in sae.history]
    assert steps == sorted(set(steps)) and steps[-1] == sae.total_steps and len(steps) <= 401
    assert sae.history[-1]["mse"] < sae.history[0]["mse"]
    assert all(point["l0"] <= 8 for point in sae.history)

    # Held-out metrics, recomputed independently from the cache and the SAELens folder.
    module, _ = load_saelens(sae.directory)
    store = ActivationStore.open(cache.directory)
    split = cache_split(store, HOLDOUT_FRACTION)
    held_out = torch.from_numpy(np.asarray(store.get(HOOK, split.holdout_start))).float()
    with torch.no_grad():
        features = module.encode(held_out)
        reconstruction = module.decode(features)
    residual = (held_out - reconstruction).pow(2).sum()
    variance = (held_out - held_out.mean(0)).pow(2).sum()
    evaluation = sae.evaluation
    assert evaluation["held_out_tokens"] == len(held_out) == cache.num_tokens - split.train_stop
    assert evaluation["explained_variance"] == pytest.approx(float(1 - residual / variance), abs=1e-4)
    assert evaluation["explained_variance"] > 0.5
    assert evaluation["l0"] == pytest.approx(float((features > 0).sum(-1).float().mean()), abs=1e-4)
    assert evaluation["dead_features"] == int(((features > 0).sum(0) == 0).sum())
    assert evaluation["mse"] == pytest.approx(
        float((held_out - reconstruction).pow(2).sum(-1).mean()), rel=1e-4
    )

    # CE loss recovered: the clean loss is transformers' own on the held-out token ids.
    sequences = holdout_sequences(store, split)
    reference = AutoModelForCausalLM.from_pretrained(tiny_gpt2_folder, use_safetensors=True).eval()
    losses, counts = [], []
    with torch.no_grad():
        for ids in sequences:
            losses.append(float(reference(torch.tensor([ids]), labels=torch.tensor([ids])).loss))
            counts.append(len(ids) - 1)
    clean = sum(loss * count for loss, count in zip(losses, counts, strict=True)) / sum(counts)
    assert evaluation["clean_loss"] == pytest.approx(clean, rel=1e-4)
    assert abs(evaluation["zero_ablation_loss"] - evaluation["clean_loss"]) > 1e-4
    recovered = (evaluation["zero_ablation_loss"] - evaluation["sae_loss"]) / (
        evaluation["zero_ablation_loss"] - evaluation["clean_loss"]
    )
    assert evaluation["ce_loss_recovered"] == pytest.approx(recovered, abs=1e-6)
    # A random tiny model predicts almost uniformly, so only the ordering of the losses is asserted
    # here; engine/tests/test_sae_evaluation.py checks the splice itself against plain torch hooks.
    assert evaluation["ce_tokens"] == sum(counts)

    # Export: the SAELens folder as a tar, loadable with the same encodings.
    export = api.get(f"/api/saes/{sae_id}/export")
    with tarfile.open(fileobj=io.BytesIO(b"".join(export.streaming_content))) as archive:
        assert sorted(archive.getnames()) == sorted(
            f"{sae_id}/{name}" for name in ("cfg.json", "sae_weights.safetensors", "sparsity.safetensors")
        )
        archive.extractall(tmp_path, filter="data")
    exported, described = load_saelens(tmp_path / sae_id)
    torch.testing.assert_close(exported.encode(held_out), features, rtol=0, atol=0)
    assert described["hook_name"] == HOOK and not (sae.directory / "checkpoint").exists()
    # GPT-2's tokenizer adds no BOS to the samples trained on: SAELens must not prepend one.
    assert described["cfg"]["metadata"]["prepend_bos"] is False

    # On demand: evaluate again (the same cache), in the worker that hosts the model.
    assert api.post(f"/api/saes/{sae_id}/evaluate", {}, format="json").status_code == 202
    burst()
    again = SaeRow.objects.get(pk=sae_id)
    assert again.evaluation_status == "" and again.evaluation["error"] is None
    assert again.evaluation["ce_loss_recovered"] == pytest.approx(evaluation["ce_loss_recovered"], abs=1e-6)


def test_a_cache_deleted_under_a_queued_training_fails_it_cleanly(planted_cache, writer, client_for):
    api = client_for(writer)
    sae_id = api.post("/api/saes", {"cache_id": planted_cache.id, "hook": HOOK}, format="json").json()["id"]
    shutil.rmtree(planted_cache.directory)
    burst()
    sae = SaeRow.objects.get(pk=sae_id)
    assert (sae.status, sae.error_code) == ("failed", "CACHE_CORRUPT")
    assert not sae.directory.exists()


def test_the_four_architectures_train_on_a_planted_cache(planted_cache, writer, client_for):
    """Each architecture runs end to end in the worker and reconstructs the planted activations."""
    api = client_for(writer)
    ids = []
    for architecture, extra in [
        ("topk", {"k": 4}), ("batchtopk", {"k": 4}), ("jumprelu", {"l0_coefficient": 0.01}),
        ("standard", {"l1_coefficient": 0.5}),
    ]:  # fmt: skip
        body = {
            "cache_id": planted_cache.id, "hook": HOOK, "architecture": architecture, "expansion_factor": 4,
            "batch_size": 128, "lr": 3e-3, "total_tokens": 12 * planted_cache.num_tokens, **extra,
        }  # fmt: skip
        response = api.post("/api/saes", body, format="json")
        assert response.status_code == 202, response.content
        ids.append(response.json()["id"])
    burst()
    for sae in SaeRow.objects.filter(pk__in=ids):
        assert sae.status == "completed", (sae.architecture, sae.error_code, sae.error_message)
        assert sae.evaluation["explained_variance"] > 0.5, (sae.architecture, sae.evaluation)
        if sae.architecture in ("topk", "batchtopk"):  # k per row (on average, for batchtopk)
            assert sae.evaluation["l0"] == pytest.approx(4, abs=0 if sae.architecture == "topk" else 1)
        # The model was not loaded when training ended: an evaluation job followed and loaded it.
        assert sae.evaluation_status == "" and math.isfinite(sae.evaluation["ce_loss_recovered"])
        module, _ = load_saelens(sae.directory)
        expected = "jumprelu" if sae.architecture == "batchtopk" else sae.architecture
        assert module.shape.architecture == expected


def test_cancel_a_running_training_stops_it_and_removes_its_files(planted_cache, writer, client_for):
    api = client_for(writer)
    tokens = 100 * planted_cache.num_tokens
    body = {"cache_id": planted_cache.id, "hook": HOOK, "batch_size": 64, "total_tokens": tokens}
    sae_id = api.post("/api/saes", body, format="json").json()["id"]
    answers = []

    def cancel_once_running() -> None:
        try:
            wait_until(lambda: SaeRow.objects.filter(pk=sae_id, status="running", step__gt=0).exists())
            answers.append(api.post(f"/api/saes/{sae_id}/cancel").status_code)
        finally:
            connection.close()

    canceller = threading.Thread(target=cancel_once_running)
    canceller.start()
    burst()  # the worker stops the training after the step it is in
    canceller.join()
    sae = SaeRow.objects.get(pk=sae_id)
    assert answers == [202]
    assert sae.status == "cancelled" and 0 < sae.step < sae.total_steps
    assert not sae.directory.exists()


def test_generation_and_worker_calls_are_answered_while_a_training_runs_on_the_models_worker(
    tiny_model, planted_cache, writer, client_for
):
    """The starvation the second review found: one user's long training on a model's worker made
    every other request for that model wait for it. Now the training serves them between its steps."""
    api = client_for(writer)
    model_load_request(model_id=tiny_model.id, actor=OPERATOR)
    burst()  # the model is loaded here: its jobs go to this worker's own queue
    body = {
        "cache_id": planted_cache.id,
        "hook": HOOK,
        "batch_size": 64,
        "total_tokens": 1000 * planted_cache.num_tokens,
    }
    sae_id = api.post("/api/saes", body, format="json").json()["id"]
    seen: dict = {}

    def use_the_model_meanwhile() -> None:
        try:
            wait_until(lambda: SaeRow.objects.filter(pk=sae_id, status="running", step__gt=0).exists())
            started = time.monotonic()
            seen["generate"] = api.post(
                "/api/generate",
                {
                    "model_id": tiny_model.id,
                    "prompt": "The function returns",
                    "max_tokens": 4,
                    "temperature": 0,
                },
                format="json",
            )
            seen["generate_seconds"] = time.monotonic() - started
            started = time.monotonic()
            seen["lens"] = api.post(
                f"/api/models/{tiny_model.id}/logit-lens", {"prompt": "Hello there"}, format="json"
            )
            seen["lens_seconds"] = time.monotonic() - started
            seen["step"] = SaeRow.objects.get(pk=sae_id).step
            wait_until(lambda: SaeRow.objects.get(pk=sae_id).step > seen["step"])  # it kept training
            seen["cancel"] = api.post(f"/api/saes/{sae_id}/cancel").status_code
        finally:
            connection.close()

    user = threading.Thread(target=use_the_model_meanwhile)
    user.start()
    burst()  # runs the training, and the requests between its steps
    user.join()
    assert seen["generate"].status_code == 200, seen["generate"].content
    assert seen["generate"].json()["finish_reason"] in ("length", "stop")
    assert seen["lens"].status_code == 200, seen["lens"].content
    assert seen["generate_seconds"] < 10 and seen["lens_seconds"] < 10
    sae = SaeRow.objects.get(pk=sae_id)
    assert seen["cancel"] == 202 and sae.status == "cancelled" and sae.step > seen["step"] > 0
