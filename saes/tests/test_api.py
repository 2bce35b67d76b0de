"""The SAE API: validation, access, cancel of a queued training, import (its job run by an in-process
burst worker), export, delete."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from django.conf import settings
from rq import Queue

from conftest import make_user
from engine.sae import SaeShape, SparseAutoencoder
from engine.sae.formats import load_saelens, save_saelens
from mistudio.redis_client import get_redis
from mistudio.workers import run_worker, shared_queue
from saes.models import SparseAutoencoder as SaeRow
from saes.tests.conftest import D_IN, HOOK

pytestmark = pytest.mark.django_db


def train(api, cache, **body):
    return api.post("/api/saes", {"cache_id": cache.id, "hook": HOOK, **body}, format="json")


def error_code(response) -> str:
    return response.json()["error"]["code"]


def test_train_request_is_queued_with_defaults_filled_in(
    planted_cache, writer, client_for, django_capture_on_commit_callbacks
):
    shared_queue().empty()  # tokens other tests left
    with django_capture_on_commit_callbacks(execute=True):
        response = train(client_for(writer), planted_cache, architecture="topk", batch_size=256)
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["id"].startswith("sae_") and body["status"] == "queued"
    # 8x expansion, less on a cache this small (100 training tokens a feature at least); k = d_in /
    # 24, at least 16 (32 was 40 % of a small model's features firing).
    training = int(planted_cache.num_tokens * 0.95)
    expansion = next(e for e in (8, 4, 2, 1) if e == 1 or training >= 100 * e * D_IN)
    assert (body["d_in"], body["d_sae"], body["k"]) == (D_IN, expansion * D_IN, 16)
    # One pass over the training part (the held-out 5 % excluded), or 512 steps when that is more.
    assert body["total_tokens"] == max(int(planted_cache.num_tokens * 0.95), 512 * 256)
    assert body["total_steps"] == -(-body["total_tokens"] // 256)
    assert body["hyperparameters"]["b_dec_init"] == "geometric_median"
    # Dead after a tenth of the run (a fixed 1,000 steps outlasted short runs: AuxK never engaged).
    assert body["hyperparameters"]["dead_after_steps"] == max(1, body["total_steps"] // 10)
    assert body["owner"] == writer.username and body["model_id"] == planted_cache.model_id
    # The row waits on the shared queue (the model is loaded nowhere), with a token there once the
    # request committed.
    assert SaeRow.objects.get(pk=body["id"]).queue_name == settings.SHARED_QUEUE
    assert [job.func_name for job in shared_queue().jobs] == ["mistudio.job_runner.run_next_job"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"hook": "blocks.1.hook_resid_post"}, 400, "INVALID_HOOK"),
        ({"architecture": "gated"}, 400, "VALIDATION_ERROR"),
        ({"architecture": "topk", "k": 4096}, 400, "INVALID_PARAMETER"),
        ({"architecture": "standard", "k": 8}, 400, "INVALID_PARAMETER"),
        ({"d_sae": 100, "expansion_factor": 4}, 400, "INVALID_PARAMETER"),
        ({"d_sae": 2**24}, 400, "SAE_TOO_LARGE"),
        ({"b_dec_init": "random"}, 400, "VALIDATION_ERROR"),
        ({"learning_rate": 0.1}, 400, "VALIDATION_ERROR"),  # unknown field: a typo never passes
        ({"cache_id": "act_nosuchcache"}, 404, "CACHE_NOT_FOUND"),
    ],
)
def test_bad_train_requests_get_a_clear_error_and_create_nothing(
    planted_cache, writer, client_for, body, status, code
):
    response = client_for(writer).post(
        "/api/saes", {"cache_id": planted_cache.id, "hook": HOOK, **body}, format="json"
    )
    assert response.status_code == status, response.content
    assert error_code(response) == code
    assert set(response.json()["error"]) >= {"code", "message", "details", "timestamp"}
    assert not SaeRow.objects.exists()


def test_a_cache_still_being_written_is_refused(planted_cache, writer, client_for):
    planted_cache.status = "writing"
    planted_cache.save()
    response = train(client_for(writer), planted_cache)
    assert response.status_code == 409 and error_code(response) == "CACHE_NOT_READY"


def test_access_readers_cannot_train_others_see_nothing_private(planted_cache, writer, reader, client_for):
    assert train(client_for(reader), planted_cache).status_code == 403
    sae_id = train(client_for(writer), planted_cache).json()["id"]
    other = make_user("otto-other", "model:write")
    assert client_for(other).get(f"/api/saes/{sae_id}").status_code == 404
    assert client_for(other).get("/api/saes").json()["total"] == 0
    assert train(client_for(other), planted_cache).status_code == 404  # not their cache either
    assert client_for(other).post(f"/api/saes/{sae_id}/cancel").status_code == 404
    shared = client_for(writer).patch(f"/api/saes/{sae_id}", {"shared": True}, format="json")
    assert shared.status_code == 200 and shared.json()["shared"] is True
    assert client_for(other).get(f"/api/saes/{sae_id}").status_code == 200
    refused = client_for(other).patch(f"/api/saes/{sae_id}", {"name": "mine"}, format="json")
    assert refused.status_code == 403 and error_code(refused) == "NOT_OWNER"


def test_cancel_a_queued_training_and_delete_it(
    planted_cache, writer, client_for, django_capture_on_commit_callbacks
):
    api = client_for(writer)
    sae_id = train(api, planted_cache).json()["id"]
    with django_capture_on_commit_callbacks(execute=True):
        response = api.post(f"/api/saes/{sae_id}/cancel")
    assert response.status_code == 202 and response.json()["status"] == "cancelled"
    assert f"sae-{sae_id}" not in Queue(shared_queue().name, connection=get_redis()).get_job_ids()
    assert api.post(f"/api/saes/{sae_id}/cancel").status_code == 409  # not running any more
    assert api.delete(f"/api/saes/{sae_id}").status_code == 204
    assert not SaeRow.objects.filter(pk=sae_id).exists()


def test_a_training_in_flight_cannot_be_deleted(planted_cache, writer, client_for):
    api = client_for(writer)
    sae_id = train(api, planted_cache).json()["id"]
    response = api.delete(f"/api/saes/{sae_id}")
    assert response.status_code == 409 and error_code(response) == "SAE_BUSY"


def import_and_run(api, body: dict, capture) -> dict:
    """POST an import (202: queued), let a burst worker run it, and return the SAE's state."""
    with capture(execute=True):
        response = api.post("/api/saes/import", body, format="json")
    assert response.status_code == 202, response.content
    assert response.json()["status"] == "queued"
    run_worker(name="import-worker", device="cpu", burst=True)
    return api.get(f"/api/saes/{response.json()['id']}").json()


def random_sae(architecture: str, *, d_in: int = D_IN, d_sae: int = 128, k: int | None = None, seed: int = 0):
    torch.manual_seed(seed)
    sae = SparseAutoencoder(SaeShape(architecture, d_in, d_sae, k))
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            getattr(sae, name).normal_(0, 0.2)
        sae.threshold.uniform_(0.01, 0.2)
    return sae


@pytest.mark.django_db(transaction=True)  # the worker closes its connections as a job starts
def test_import_a_saelens_folder_then_export_it_as_a_tar(
    tiny_model, writer, client_for, django_capture_on_commit_callbacks, tmp_path
):
    folder = settings.LOCAL_MODEL_ROOTS[0] / "saes" / "jumprelu-l0"
    original = random_sae("jumprelu")
    save_saelens(original, folder, hook_name=HOOK, model_name="tiny-gpt2")
    api = client_for(writer)
    body = import_and_run(
        api, {"local_path": str(folder), "model_id": tiny_model.id}, django_capture_on_commit_callbacks
    )
    assert (body["source"], body["architecture"], body["status"]) == ("saelens", "jumprelu", "completed")
    assert (body["hook_name"], body["d_in"], body["d_sae"], body["model_id"]) == (
        HOOK,
        D_IN,
        128,
        tiny_model.id,
    )

    export = api.get(f"/api/saes/{body['id']}/export")
    assert export.status_code == 200 and export["Content-Type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(b"".join(export.streaming_content))) as archive:
        names = sorted(archive.getnames())
        archive.extractall(tmp_path, filter="data")
    assert names == [f"{body['id']}/cfg.json", f"{body['id']}/sae_weights.safetensors"]
    exported, described = load_saelens(tmp_path / body["id"])
    x = torch.randn(200, D_IN)
    torch.testing.assert_close(exported.encode(x), original.encode(x), rtol=0, atol=1e-6)
    assert described["hook_name"] == HOOK
    cfg = json.loads((tmp_path / body["id"] / "cfg.json").read_text())
    assert cfg["metadata"]["hook_name"] == HOOK and cfg["architecture"] == "jumprelu"

    with django_capture_on_commit_callbacks(execute=True):
        assert api.delete(f"/api/saes/{body['id']}").status_code == 204
    assert not (settings.SAE_DIR / body["id"]).exists()  # the files follow the row


@pytest.mark.django_db(transaction=True)
def test_import_gemma_scope_params(tiny_model, writer, client_for, django_capture_on_commit_callbacks):
    folder = settings.LOCAL_MODEL_ROOTS[0] / "saes" / "gemma-scope-like"
    folder.mkdir(parents=True, exist_ok=True)
    original = random_sae("jumprelu", seed=3)
    arrays = {name: tensor.numpy() for name, tensor in original.tensors().items()}
    np.savez(folder / "params.npz", **arrays)
    body = import_and_run(
        client_for(writer),
        {"local_path": str(folder), "hook": HOOK, "model_id": tiny_model.id},
        django_capture_on_commit_callbacks,
    )
    sae = SaeRow.objects.get(pk=body["id"])
    assert (sae.source, sae.status) == ("gemma_scope", "completed")
    imported, _ = load_saelens(sae.directory)
    x = torch.randn(100, D_IN)
    reference = original.tensors()  # Gemma Scope: b_dec is not subtracted from the input
    pre = x @ reference["W_enc"] + reference["b_enc"]
    expected = pre.relu() * (pre > reference["threshold"])
    torch.testing.assert_close(imported.encode(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("where", "code"),
    [("/etc", "INVALID_LOCAL_PATH"), ("relative/path", "INVALID_LOCAL_PATH"), ("empty", "INVALID_SAE")],
)
def test_imports_outside_the_roots_or_of_non_sae_folders_are_refused(writer, client_for, where, code):
    if where == "empty":
        folder = settings.LOCAL_MODEL_ROOTS[0] / "saes" / "empty"
        folder.mkdir(parents=True, exist_ok=True)
        where = str(folder)
    response = client_for(writer).post("/api/saes/import", {"local_path": where, "hook": HOOK}, format="json")
    assert response.status_code == 400 and error_code(response) == code
    assert not SaeRow.objects.exists()


def test_import_checks_the_width_against_the_models_hook(tiny_model, writer, client_for):
    folder = settings.LOCAL_MODEL_ROOTS[0] / "saes" / "wide"
    save_saelens(random_sae("standard", d_in=96), folder, hook_name=HOOK, model_name="x")
    response = client_for(writer).post(
        "/api/saes/import", {"local_path": str(folder), "model_id": tiny_model.id}, format="json"
    )
    assert response.status_code == 400 and error_code(response) == "HOOK_WIDTH_MISMATCH"
    assert not SaeRow.objects.exists()


def test_defaults_are_sized_to_the_model_and_the_run():
    """k follows d_in (32 for GPT-2 small's 768, at least 16), and a feature is
    dead after a tenth of the run, at most 1,000 steps (a 977-step demo run: 97)."""
    from saes.services import training_hyperparameters

    def config(d_in, total_tokens, **options):
        return training_hyperparameters(
            architecture="topk", d_in=d_in, d_sae=None, expansion_factor=None, k=None,
            l1_coefficient=None, l0_coefficient=None, lr=3e-4, batch_size=4096,
            total_tokens=total_tokens, b_dec_init="zeros", **options,
        )  # fmt: skip

    assert [config(d_in, 4096)["k"] for d_in in (64, 128, 768, 2048, 4096)] == [16, 16, 32, 85, 128]
    assert config(128, 977 * 4096)["dead_after_steps"] == 97
    assert config(768, 100_000 * 4096)["dead_after_steps"] == 1000
    assert config(128, 4096)["dead_after_steps"] == 1
    assert config(128, 977 * 4096, dead_after_steps=50)["dead_after_steps"] == 50


def test_dead_after_steps_is_taken_from_the_request(planted_cache, writer, client_for):
    api = client_for(writer)
    response = train(api, planted_cache, architecture="topk", batch_size=256, dead_after_steps=7)
    assert response.status_code == 202, response.content
    assert response.json()["hyperparameters"]["dead_after_steps"] == 7
    refused = train(api, planted_cache, architecture="topk", dead_after_steps=0)
    assert refused.status_code == 400 and error_code(refused) == "VALIDATION_ERROR"


def test_an_sae_warns_of_a_weak_sparsity_penalty_and_of_dead_features():
    """The review's JumpReLU on the demo model: L0 448 of d_in 128 and 604 of 1,024 features dead
    held out, with no warning. The row (API, events, page) now says both."""
    weak = SaeRow(
        architecture="jumprelu", d_in=128, d_sae=1024, hyperparameters={"l0_coefficient": 1.0},
        evaluation={"l0": 448.0, "dead_features": 604},
    )  # fmt: skip
    dense, dead = weak.warnings
    assert "L0 is 448, over a quarter of d_in (128)" in dense and "l0_coefficient (now 1.0)" in dense
    assert dead.startswith("604 of 1,024 features (59 %) never fired")
    healthy = SaeRow(architecture="topk", d_in=128, d_sae=1024, evaluation={"l0": 5.0, "dead_features": 3})
    assert healthy.warnings == []


@pytest.mark.django_db(transaction=True)  # each request in its own thread and transaction
def test_identical_evaluation_requests_at_the_same_moment_queue_one_job(
    tiny_model, planted_cache, writer, client_for
):
    from features.tests.conftest import completed_sae_row
    from mistudio.tests.at_once import at_once
    from saes.models import SaeEvaluation

    sae = completed_sae_row(tiny_model, planted_cache, writer)
    answers = at_once(lambda: client_for(writer).post(f"/api/saes/{sae.id}/evaluate", {}, format="json"))
    assert sorted(answer.status_code for answer in answers) == [202, 409, 409, 409], [
        a.content for a in answers
    ]
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 409} == {"EVALUATION_IN_PROGRESS"}
    assert SaeEvaluation.objects.filter(sae=sae).count() == 1
