"""SAEBench runs through the API: a burst worker judges two SAEs by the core metrics and sparse
probing, storing what the engine computes on the same model, tokens and split; the comparison
sorts them, the export is SAEBench's JSON; a resumed run skips what it finished; others see only
what they may; bad requests get a clear 4xx and queue nothing."""

import io
import json

import pytest

from activations.services.datasets import dataset_create_from_texts, dataset_labelled_samples
from conftest import make_user
from engine.registry import LOADED_MODELS
from engine.sae.formats import save_saelens
from engine.saebench.core import context_batches, core_metrics
from engine.saebench.results import CoreConfig
from engine.saebench.sparse_probing import sparse_probing, split_by_class
from engine.testing.corpus import local_corpus
from engine.testing.tiny_saes import random_sae
from evaluations.models import BenchResult, BenchRun
from evaluations.tasks import ignored_tokens, tail_texts
from mistudio.identifiers import new_model_id
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.tests.burst_worker import load_on_burst_worker
from saes.models import SparseAutoencoder
from saes.services import folder_size

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "bench-worker"
HOOK = "blocks.1.hook_resid_post"
CORE = {"context_size": 32, "batch_size_prompts": 4, "n_eval_reconstruction_batches": 2,
        "n_eval_sparsity_variance_batches": 2}  # fmt: skip
PROBING = {"context_length": 32, "k_values": [1, 2], "max_per_class": 20, "seed": 7}


@pytest.fixture
def loaded_model(tiny_gpt2_folder, writer):
    return load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)


def sae_row(model, owner, *, architecture="topk", seed=3, shared=False, name=None) -> SparseAutoencoder:
    """A completed SAE row at ``HOOK`` with random weights, as a training leaves it."""
    module = random_sae(64, architecture, k=8 if architecture == "topk" else None, expansion=4, seed=seed)
    sae = SparseAutoencoder(
        name=name or f"{architecture} {seed}", model=model, model_name=model.display_identifier,
        hook_name=HOOK, architecture=architecture, d_in=64, d_sae=256, d_out=64, status="completed",
        progress=100, owner=owner, shared=shared,
    )  # fmt: skip
    save_saelens(module, sae.directory, hook_name=HOOK, model_name=sae.model_name)
    sae.file_size_bytes = folder_size(sae.directory)
    sae.save()
    return sae


def labelled_upload(api, name="topics"):
    """Local paragraphs labelled by the first of three words they use, uploaded as a CSV."""
    rows = ["text,word"]
    for text in local_corpus():
        lowered = f" {text.lower()} "
        found = sorted(
            (lowered.find(f" {word} "), word) for word in ("the", "a", "is") if f" {word} " in lowered
        )
        if found:
            rows.append(json.dumps(text[:300]).replace('\\"', '""') + f",{found[0][1]}")
    handle = io.BytesIO("\n".join(rows).encode())
    handle.name = "topics.csv"
    response = api.post(
        "/api/datasets", {"file": handle, "name": name, "label_field": "word"}, format="multipart"
    )
    assert response.status_code == 201, response.content
    return response.json()


def test_two_saes_are_judged_compared_and_exported_as_the_engine_judges_them(
    loaded_model, writer, client_for, tmp_path
):
    api = client_for(writer)
    saes = [
        sae_row(loaded_model, writer, seed=3),
        sae_row(loaded_model, writer, architecture="jumprelu", seed=4),
    ]
    text = dataset_create_from_texts(name="corpus", texts=local_corpus(), owner=writer, source="upload")
    labelled = labelled_upload(api)
    response = api.post(
        "/api/saebench",
        {"sae_ids": [sae.id for sae in saes], "methods": ["core", "sparse_probing"], "dataset_id": text.id,
         "probing_dataset_id": labelled["id"], "core": CORE, "sparse_probing": PROBING, "name": "two"},
        format="json",
    )  # fmt: skip
    assert response.status_code == 202, response.content
    run_id = response.json()["id"]
    assert response.json()["status"] == "queued" and response.json()["memory_estimate_bytes"] > 0
    run_worker(name=WORKER, device="cpu", burst=True)
    run = BenchRun.objects.get(pk=run_id)
    assert run.status == "completed", (run.error_code, run.error_message)
    assert run.results.count() == 4 and run.summary["done"] == 4

    # What the job stored is what the engine computes on the same model, tokens and split.
    loaded = LOADED_MODELS.get(loaded_model.id)
    config = CoreConfig(**CORE)
    batches = context_batches(
        tail_texts(text, loaded.tokenizer, 10_000), context_size=32, batch_size=4, batches=2,
        bos_token_id=loaded.tokenizer.bos_token_id,
    )  # fmt: skip
    split = split_by_class(
        dataset_labelled_samples(run.probing_dataset), train_fraction=0.8, max_per_class=20, seed=7
    )
    for sae in saes:
        from saes.tasks import sae_module

        module = sae_module(sae)
        expected = core_metrics(
            loaded.model, module, batches, hook_name=HOOK, ignore_tokens=ignored_tokens(loaded.tokenizer),
            config=config,
        )  # fmt: skip
        stored = run.results.get(sae=sae, method="core")
        assert stored.metrics.keys() == expected.metrics.keys()
        for category, values in expected.metrics.items():
            assert stored.metrics[category] == pytest.approx(values, rel=1e-9), category
        assert stored.method_version == "sae-bench 0.6.0 core"
        assert stored.feature_file.is_file()
        (probed,) = sparse_probing(  # the SAE alone: the run probed both together
            loaded.model,
            loaded.tokenizer,
            [module],
            split,
            hook_name=HOOK,
            k_values=[1, 2],
            context_length=32,
            seed=7,
        )
        probing = run.results.get(sae=sae, method="sparse_probing").metrics
        assert probing == {source: pytest.approx(values) for source, values in probed["metrics"].items()}
    # The two SAEs differ, so the comparison has something to sort.
    l0 = {sae.id: run.results.get(sae=sae, method="core").metrics["sparsity"]["l0"] for sae in saes}
    assert l0[saes[0].id] != pytest.approx(l0[saes[1].id])

    table = api.get(f"/api/saebench/compare?run_id={run_id}&sort=core.l0&descending=true").json()
    values = [row["values"]["core.l0"] for row in table["rows"]]
    assert values == sorted(l0.values(), reverse=True)
    assert {row["sae_id"] for row in table["rows"]} == {sae.id for sae in saes}
    assert table["rows"][0]["values"]["sparse_probing.sae_top_1_test_accuracy"] is not None
    assert any(column["key"] == "core.ce_loss_score" for column in table["columns"])
    ids = ",".join(sae.id for sae in saes)
    assert api.get(f"/api/saebench/compare?sae_ids={ids}").json()["rows"][0]["sae_id"] == saes[0].id

    exported = api.get(f"/api/saebench/{run_id}/export?sae_id={saes[0].id}&method=core")
    assert exported.status_code == 200
    assert "eval_results.json" in exported["Content-Disposition"]
    document = json.loads(exported.content)
    assert document["eval_type_id"] == "core" and document["sae_lens_id"] == saes[0].id
    assert len(document["eval_result_details"]) == 256
    assert document["eval_result_metrics"]["sparsity"]["l0"] == pytest.approx(l0[saes[0].id])
    assert HOOK in json.dumps(document["sae_cfg_dict"])  # its SAELens cfg.json
    probing = json.loads(
        api.get(f"/api/saebench/{run_id}/export?sae_id={saes[0].id}&method=sparse_probing").content
    )
    assert (
        probing["eval_type_id"] == "sparse_probing"
        and probing["eval_result_details"][0]["dataset_name"] == "topics"
    )
    results = api.get(f"/api/saebench/{run_id}/results").json()["results"]
    assert len(results) == 4

    # Someone else sees neither the private run nor its results; shared, the run but not the SAEs.
    other = client_for(make_user("otto-other", "model:write"))
    assert other.get(f"/api/saebench/{run_id}").status_code == 404
    assert other.get(f"/api/saebench/compare?sae_ids={ids}").status_code == 404
    assert api.patch(f"/api/saebench/{run_id}", {"shared": True}, format="json").status_code == 200
    shown = other.get(f"/api/saebench/{run_id}").json()
    assert shown["sae_ids"] == [None, None] and shown["probing_dataset_id"] is None
    assert other.get(f"/api/saebench/{run_id}/results").json()["results"] == []
    assert other.get(f"/api/saebench/{run_id}/export?sae_id={saes[0].id}").status_code == 404

    # Deleted with its results and its folder.
    folder = run.directory
    assert api.delete(f"/api/saebench/{run_id}").status_code == 204
    assert not BenchResult.objects.exists() and not folder.exists()


def test_a_resumed_run_keeps_what_it_finished_and_judges_the_rest(loaded_model, writer, client_for):
    api = client_for(writer)
    saes = [sae_row(loaded_model, writer, seed=5), sae_row(loaded_model, writer, seed=6)]
    text = dataset_create_from_texts(name="corpus", texts=local_corpus(), owner=writer, source="upload")
    response = api.post(
        "/api/saebench",
        {"sae_ids": [sae.id for sae in saes], "dataset_id": text.id, "core": CORE},
        format="json",
    )
    run = BenchRun.objects.get(pk=response.json()["id"])
    assert run.methods == ["core"]  # the default: every method that is not opt-in
    # As a worker killed after the first pair leaves it: that pair's result is stored.
    finished = BenchResult.objects.create(
        run=run,
        sae=saes[0],
        method="core",
        method_version="sae-bench 0.6.0 core",
        metrics={"sparsity": {"l0": -5}},
    )
    run_worker(name=WORKER, device="cpu", burst=True)
    run.refresh_from_db()
    assert run.status == "completed"
    assert BenchResult.objects.get(pk=finished.pk).metrics == {"sparsity": {"l0": -5}}  # not redone
    assert run.results.get(sae=saes[1]).metrics["sparsity"]["l0"] > 0


def test_bad_requests_get_a_clear_4xx_and_queue_nothing(loaded_model, writer, client_for):
    api = client_for(writer)
    sae = sae_row(loaded_model, writer)
    text = dataset_create_from_texts(name="corpus", texts=local_corpus(), owner=writer, source="upload")
    other_model = LanguageModel.objects.get(pk=loaded_model.pk)  # a second registration, as a copy
    other_model.id, other_model.name, other_model.revision = new_model_id(), "tiny again", "other"
    other_model.save(force_insert=True)
    elsewhere = sae_row(other_model, writer, seed=9)
    stranger = make_user("stan-stranger", "model:write")
    private = sae_row(loaded_model, stranger, seed=8)
    training = sae_row(loaded_model, writer, seed=10)
    SparseAutoencoder.objects.filter(pk=training.pk).update(status="training")

    def refused(body, code, status=400):
        response = api.post("/api/saebench", body, format="json")
        assert response.status_code == status, response.content
        assert response.json()["error"]["code"] == code

    refused({"sae_ids": [sae.id], "methods": ["nonsense"]}, "VALIDATION_ERROR")
    refused({"dataset_id": text.id}, "SAES_REQUIRED")
    refused({"sae_ids": [sae.id, elsewhere.id], "dataset_id": text.id}, "MIXED_MODELS")
    refused({"sae_ids": [private.id], "dataset_id": text.id}, "SAE_NOT_FOUND", 404)
    refused({"sae_ids": [training.id], "dataset_id": text.id}, "SAE_NOT_READY", 409)
    refused(
        {"sae_ids": [sae.id], "methods": ["sparse_probing"], "probing_dataset_id": text.id},
        "DATASET_NOT_LABELLED",
    )
    refused({"sae_ids": [sae.id], "methods": ["sparse_probing"]}, "DATASET_REQUIRED")
    refused({"sae_ids": [sae.id], "core": {"context_size": 2}}, "VALIDATION_ERROR")
    refused(
        {"sae_ids": [sae.id], "methods": ["absorption"], "absorption": {"max_words": 5}}, "VALIDATION_ERROR"
    )
    transcoder = sae_row(loaded_model, writer, seed=11)
    SparseAutoencoder.objects.filter(pk=transcoder.pk).update(hook_name_out="blocks.1.hook_mlp_out")
    refused({"sae_ids": [transcoder.id], "methods": ["absorption"]}, "NOT_AN_SAE", 409)
    assert not BenchRun.objects.exists()
    assert api.get("/api/saebench/sb_nothing").status_code == 404


def test_a_text_too_short_for_the_batches_fails_the_run_saying_what_to_change(
    loaded_model, writer, client_for
):
    api = client_for(writer)
    sae = sae_row(loaded_model, writer)
    texts = ["one two three", "four five six"]
    short = dataset_create_from_texts(name="six words", texts=texts, owner=writer, source="upload")
    response = api.post(
        "/api/saebench", {"sae_ids": [sae.id], "dataset_id": short.id, "core": CORE}, format="json"
    )
    run_worker(name=WORKER, device="cpu", burst=True)
    run = BenchRun.objects.get(pk=response.json()["id"])
    assert run.status == "failed" and run.error_code == "NOT_ENOUGH_TOKENS"
    assert "six words" in run.error_message and not run.results.exists()


def test_absorption_is_estimated_first_then_judged_as_the_engine_judges_it(loaded_model, writer, client_for):
    from engine.saebench.absorption import AbsorptionConfig, absorption, alpha_words
    from saes.tasks import sae_module

    api = client_for(writer)
    saes = [
        sae_row(loaded_model, writer, seed=3),
        sae_row(loaded_model, writer, architecture="jumprelu", seed=4),
    ]
    # A random model knows no first letters: every letter with a true positive is counted.
    settings = {"max_k": 3, "min_probe_f1": 0.0, "min_letters": 1}
    body = {"sae_ids": [sae.id for sae in saes], "methods": ["absorption"], "absorption": settings}

    estimate = api.post("/api/saebench", {**body, "estimate_only": True}, format="json")
    assert estimate.status_code == 200, estimate.content
    plan = estimate.json()["config"]["absorption"]["plan"]
    tokenizer = LOADED_MODELS.get(loaded_model.id).tokenizer
    assert plan["words"] == len(alpha_words(tokenizer)) and plan["seconds"] > 0
    assert estimate.json()["tokens"] == plan["tokens"] > plan["prompts"] > plan["words"]
    assert not BenchRun.objects.exists()  # nothing queued

    response = api.post("/api/saebench", body, format="json")
    assert response.status_code == 202, response.content
    run_worker(name=WORKER, device="cpu", burst=True)
    run = BenchRun.objects.get(pk=response.json()["id"])
    assert run.status == "completed", (run.error_code, run.error_message)
    loaded = LOADED_MODELS.get(loaded_model.id)
    (alone,) = absorption(  # the second SAE alone: the run judged both together
        loaded.model,
        loaded.tokenizer,
        [sae_module(saes[1])],
        hook_name=HOOK,
        config=AbsorptionConfig(**settings),
    )
    stored = run.results.get(sae=saes[1], method="absorption")
    assert stored.metrics == alone["metrics"] and stored.details["letters"] == alone["letters"]
    assert stored.method_version == "sae-bench 0.6.0 absorption_first_letter"
    fraction = alone["metrics"]["mean"]["mean_absorption_fraction_score"]
    assert fraction is not None and 0 <= fraction <= 1

    table = api.get(f"/api/saebench/compare?run_id={run.id}").json()
    shown = {
        row["sae_id"]: row["values"]["absorption.mean_absorption_fraction_score"] for row in table["rows"]
    }
    assert shown[saes[1].id] == pytest.approx(fraction)
    document = json.loads(
        api.get(f"/api/saebench/{run.id}/export?sae_id={saes[1].id}&method=absorption").content
    )
    assert document["eval_type_id"] == "absorption_first_letter"
    assert document["eval_result_metrics"]["mean"]["mean_absorption_fraction_score"] == pytest.approx(
        fraction
    )
    counted = [row["first_letter"] for row in alone["letters"] if row["counted"]]
    assert [row["first_letter"] for row in document["eval_result_details"]] == counted
