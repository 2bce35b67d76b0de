"""Extraction through the whole stack: API → queue → real worker → cache on disk → read-back API.

Values are checked against transformers' own ``output_hidden_states`` (an independent reference).
"""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from django.core.management import call_command
from django.test import Client
from transformers import AutoModelForCausalLM, AutoTokenizer

from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from activations.store import ActivationStore
from activations.tests.test_store import xxh3_checksum
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.services import model_register

pytestmark = pytest.mark.django_db(transaction=True)
HOOKS = ["hook_embed", "blocks.0.hook_resid_post", "ln_final.hook_normalized"]
TEXTS = [
    "The function returns the value of the argument.",
    "Short one.",
    "A longer sample that goes on for a while, so that batches need padding to line up with the others.",
    "Numbers 1 2 3 and symbols: {} [] ().",
    "x",
    "Return a new list containing all items from the iterable in ascending order.",
]


def burst() -> None:
    run_worker(name="extraction-worker", device="cpu", burst=True)


@pytest.fixture
def setup(tiny_gpt2_folder, writer, client_for):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    dataset = dataset_create_from_texts(name="texts", texts=TEXTS, owner=None, source=Dataset.Source.BUILTIN)
    return model, dataset, client_for(writer)


def references(folder, texts, max_length):
    """Per sample, HF hidden states: [embedding output, after block 0, …, final norm output]."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True).eval()
    result = []
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        result.append((ids, [state[0].numpy() for state in hidden]))
    return result


def extract(api, model, dataset, **body):
    """POST an extraction; a ``None`` in ``body`` leaves that field out."""
    request = {"dataset_id": dataset.id, "hooks": HOOKS, "batch_size": 4, "max_length": 24, **body}
    request = {name: value for name, value in request.items() if value is not None}
    return api.post(f"/api/models/{model.id}/extract-activations", request, format="json")


def test_extract_through_the_api_matches_transformers_hidden_states(setup, tiny_gpt2_folder):
    model, dataset, api = setup
    response = extract(api, model, dataset)
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["status"] == "queued" and body["extraction_id"].startswith("ext_")
    assert body["estimated_time_seconds"] > 0 and body["cached"] is False

    burst()  # the model was not loaded: the worker loads it first, then extracts
    job = ExtractionJob.objects.get(pk=body["extraction_id"])
    assert job.status == "completed", (job.error_code, job.error_message)
    assert LanguageModel.objects.get(pk=model.id).status == "ready"
    cache = job.cache
    assert cache.status == "completed" and cache.file_size_bytes > 0

    store = ActivationStore.open(cache.directory)
    expected = references(tiny_gpt2_folder, TEXTS, 24)
    assert store.num_tokens == sum(len(ids) for ids, _ in expected)  # no pad rows stored
    for index, (ids, hidden) in enumerate(expected):
        token_ids, positions = store.sample_tokens(index)
        assert token_ids.tolist() == ids and positions.tolist() == list(range(len(ids)))
        np.testing.assert_allclose(store.sample("hook_embed", index), hidden[0], atol=1e-5)
        np.testing.assert_allclose(store.sample("blocks.0.hook_resid_post", index), hidden[1], atol=1e-5)
        np.testing.assert_allclose(store.sample("ln_final.hook_normalized", index), hidden[-1], atol=1e-5)

    status = api.get(f"/api/models/{model.id}/activations/{job.id}").json()
    assert status["status"] == "completed" and status["cache_id"] == cache.id
    assert api.get(f"/api/extractions/{job.id}").json()["progress"] == 100


def test_an_identical_request_reuses_the_cache_and_a_concurrent_one_joins_the_job(setup):
    model, dataset, api = setup
    first = extract(api, model, dataset).json()
    joined = extract(api, model, dataset)
    assert joined.status_code == 202 and joined.json()["extraction_id"] == first["extraction_id"]
    burst()
    cache = ActivationCache.objects.get()
    before = cache.last_accessed_at
    again = extract(api, model, dataset, batch_size=2)  # batch size does not change the activations
    assert again.status_code == 200
    assert again.json()["cached"] is True and again.json()["cache_id"] == cache.id
    assert again.json()["message"] == "Using cached activations"
    cache.refresh_from_db()
    assert cache.last_accessed_at > before and ActivationCache.objects.count() == 1
    different = extract(api, model, dataset, dtype="bfloat16")
    assert different.status_code == 202


def test_no_hook_named_reads_the_middle_blocks_residual_stream_and_none_at_all_is_a_400(setup):
    model, dataset, api = setup
    response = extract(api, model, dataset, hooks=None)
    assert response.status_code == 202, response.content
    assert ExtractionJob.objects.get().hooks == ["blocks.1.hook_resid_post"]  # 2 blocks: the second
    empty = extract(api, model, dataset, hooks=[])
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "INVALID_HOOK"


def test_the_stored_dtype_defaults_to_the_models_and_the_size_is_estimated(setup):
    """A bf16 model's activations are cached as bf16 unless the request asks otherwise, and the
    answer says at most how large the cache gets (samples x max_length tokens)."""
    model, dataset, api = setup
    LanguageModel.objects.filter(pk=model.pk).update(quantization="bf16")
    own = extract(api, model, dataset)
    assert own.status_code == 202 and own.json()["dtype"] == "bfloat16"
    widths = 3 * model.hidden_size  # hook_embed, blocks.0.hook_resid_post, ln_final.hook_normalized
    assert own.json()["estimated_size_bytes"] == len(TEXTS) * 24 * (widths * 2 + 48)
    chosen = extract(api, model, dataset, dtype="float32")
    assert chosen.status_code == 202 and chosen.json()["dtype"] == "float32"
    assert chosen.json()["estimated_size_bytes"] == len(TEXTS) * 24 * (widths * 4 + 48)
    assert ExtractionJob.objects.get(pk=own.json()["extraction_id"]).cache.dtype == "bfloat16"


def test_max_length_defaults_to_and_never_exceeds_the_models_context(setup):
    """On a model whose context is under 512 tokens, an omitted max_length is the context (512
    failed every long sample with SEQUENCE_TOO_LONG), and a longer one truncates at the context."""
    model, dataset, api = setup
    context = model.context_length
    assert context < 512
    omitted = extract(api, model, dataset, max_length=None)
    assert omitted.status_code == 202 and omitted.json()["max_length"] == context
    longer = extract(api, model, dataset, max_length=100_000, batch_size=2)
    assert longer.json()["extraction_id"] == omitted.json()["extraction_id"]  # the same request


def test_invalid_hooks_are_named(setup):
    model, dataset, api = setup
    response = extract(api, model, dataset, hooks=["blocks.99.hook_resid_post", "module:__import__('os')"])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "INVALID_HOOK"
    assert set(error["details"]["invalid"]) == {"blocks.99.hook_resid_post", "module:__import__('os')"}
    points = api.get(f"/api/models/{model.id}/hook-points").json()["hook_points"]
    names = {point["name"] for point in points}
    assert {"hook_embed", "blocks.1.mlp.hook_post", "ln_final.hook_normalized"} <= names
    mlp = next(point for point in points if point["name"] == "blocks.0.mlp.hook_post")
    assert mlp["shape"][1] == model.config["n_inner"] or mlp["shape"][1] == 4 * model.hidden_size


def test_cancel_a_queued_extraction(setup):
    model, dataset, api = setup
    job_id = extract(api, model, dataset).json()["extraction_id"]
    response = api.post(f"/api/extractions/{job_id}/cancel", {}, format="json")
    assert response.status_code == 202
    job = ExtractionJob.objects.get(pk=job_id)
    assert job.status == "cancelled" and ActivationCache.objects.count() == 0
    burst()  # nothing left to run
    assert ExtractionJob.objects.get(pk=job_id).status == "cancelled"


def test_read_back_slice_stats_top_k_download_and_delete(setup):
    model, dataset, api = setup
    job_id = extract(api, model, dataset, layer_indices=[0], hooks=None).json()["extraction_id"]
    burst()
    cache = ExtractionJob.objects.get(pk=job_id).cache
    hook = "blocks.0.hook_resid_post"
    store = ActivationStore.open(cache.directory)
    full = store.get(hook)

    listing = api.get("/api/activation-caches", {"model": model.id}).json()
    assert [entry["id"] for entry in listing["caches"]] == [cache.id]
    detail = api.get(f"/api/activation-caches/{cache.id}").json()
    assert detail["activation_shapes"][hook] == list(full.shape) and detail["manifest"]["hooks"]

    response = api.get(f"/api/activation-caches/{cache.id}/slice", {"hook": hook, "start": 3, "stop": 9})
    sliced = json.loads(b"".join(response.streaming_content))
    np.testing.assert_array_equal(np.array(sliced["values"], dtype=np.float32), full[3:9])
    raw = api.get(
        f"/api/activation-caches/{cache.id}/slice", {"hook": hook, "start": 0, "stop": 5, "output": "npy"}
    )
    np.testing.assert_array_equal(
        np.load(io.BytesIO(b"".join(raw.streaming_content)), allow_pickle=False), full[:5]
    )

    stats = api.get(f"/api/activation-caches/{cache.id}/stats", {"hook": hook}).json()["stats"][hook]
    np.testing.assert_allclose(stats["mean"], full.mean(axis=0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats["max"], full.max(axis=0), rtol=1e-6)

    top = api.get(f"/api/activation-caches/{cache.id}/top-k", {"hook": hook, "neuron": 3, "k": 5}).json()[
        "top_k"
    ]
    assert [round(entry["value"], 5) for entry in top] == [
        round(float(v), 5) for v in np.sort(full[:, 3])[::-1][:5]
    ]
    assert all("token" in entry and "context_tokens" in entry for entry in top)

    archive = api.get(f"/api/activation-caches/{cache.id}/download")
    with tarfile.open(fileobj=io.BytesIO(b"".join(archive.streaming_content))) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile(f"{cache.id}/manifest.json").read())
        for shard in manifest["shards"]:
            for relative, digest in shard["files"].items():
                assert xxh3_checksum(tar.extractfile(f"{cache.id}/{relative}").read()) == digest
    assert f"{cache.id}/manifest.json" in names

    bad = api.get(f"/api/activation-caches/{cache.id}/slice", {"hook": "blocks.5.hook_resid_post"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "INVALID_HOOK"
    assert api.delete(f"/api/activation-caches/{cache.id}").status_code == 204
    assert not cache.directory.exists()


def test_cli_extract_list_and_export(setup, tmp_path):
    model, dataset, _ = setup
    out = io.StringIO()
    call_command(
        "extract_activations", model.id, dataset.name, "--layers", "0", "1", "--no-wait",
        stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    assert "queued" in out.getvalue()
    burst()
    cache = ActivationCache.objects.get()
    out = io.StringIO()
    call_command("extract_activations", model.id, dataset.id, "--layers", "0", "1", stdout=out)
    assert f"Using cached activations: {cache.id}" in out.getvalue()
    out = io.StringIO()
    call_command("list_caches", stdout=out)
    assert cache.id in out.getvalue() and "completed" in out.getvalue()
    target = tmp_path / "export.tar"
    call_command("export_cache", cache.id, str(target), stdout=io.StringIO())
    with tarfile.open(target) as tar:
        assert f"{cache.id}/manifest.json" in tar.getnames()


async def test_extraction_events_reach_a_websocket_subscriber(setup):
    from asgiref.sync import sync_to_async

    from mistudio.tests.websocket import events_socket

    model, dataset, api = setup
    token = await sync_to_async(lambda: api._credentials["HTTP_AUTHORIZATION"])()
    job_id = (await sync_to_async(extract)(api, model, dataset)).json()["extraction_id"]
    communicator = events_socket((b"authorization", token.encode()))
    assert (await communicator.connect())[0]
    await communicator.send_json_to({"action": "subscribe", "groups": [f"extraction.{job_id}"]})
    snapshot = await communicator.receive_json_from(timeout=5)
    assert snapshot["type"] == "snapshot" and snapshot["data"]["status"] == "queued"
    await sync_to_async(burst, thread_sensitive=False)()
    events = []
    while not events or events[-1]["event"] not in {"extraction:completed", "extraction:failed"}:
        message = await communicator.receive_json_from(timeout=30)
        if message["type"] == "event":
            events.append(message)
    assert events[-1]["event"] == "extraction:completed"
    assert events[-1]["data"]["cache_id"] and events[-1]["data"]["file_size_bytes"] > 0
    progress = [event["data"] for event in events if event["event"] == "extraction:progress"]
    assert progress and progress[-1]["samples_processed"] == progress[-1]["total_samples"] == len(TEXTS)
    assert progress[-1]["tokens_per_second"] > 0
    await communicator.disconnect()


def test_cancel_a_running_extraction_stops_it_and_removes_its_files(setup, settings):
    import threading
    import time

    model, _, api = setup
    settings.ACTIVATION_SHARD_MAX_TOKENS = 64
    many = dataset_create_from_texts(
        name="many", texts=[f"sample {index} " + "words " * 40 for index in range(800)], owner=None,
        source=Dataset.Source.BUILTIN,
    )  # fmt: skip
    job_id = extract(api, model, many, batch_size=1, max_length=48).json()["extraction_id"]
    worker = threading.Thread(target=burst)
    worker.start()
    deadline = time.monotonic() + 60
    job = ExtractionJob.objects.get(pk=job_id)
    while job.samples_processed == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
        job.refresh_from_db()
    cache_id, directory = job.cache_id, job.cache.directory
    assert job.status == "running" and directory.exists()
    assert api.post(f"/api/extractions/{job_id}/cancel", {}, format="json").status_code == 202
    worker.join(timeout=60)
    job.refresh_from_db()
    assert job.status == "cancelled" and job.samples_processed < 800
    assert not ActivationCache.objects.filter(pk=cache_id).exists() and not directory.exists()


def test_deleting_a_model_removes_its_caches_files_and_all(setup):
    model, dataset, api = setup
    job_id = extract(api, model, dataset).json()["extraction_id"]
    busy = api.delete(f"/api/models/{model.id}")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "MODEL_BUSY"
    burst()
    directory = ExtractionJob.objects.get(pk=job_id).cache.directory
    assert directory.exists()
    assert api.delete(f"/api/models/{model.id}").status_code == 204
    assert not directory.exists() and ActivationCache.objects.count() == 0


def served_bytes(user, cache_id: str, *, pages: list[str] = ()) -> dict[str, bytes]:
    """Everything ``user`` is served about a cache: its API JSON, every file it can download one by
    one and as a tar, and the pages that show it."""
    from django.test import Client
    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {user.auth_token.key}")
    browser = Client()
    browser.force_login(user)

    def body(response) -> bytes:
        assert response.status_code == 200, response.status_code
        return b"".join(response.streaming_content) if response.streaming else response.content

    served = {
        "detail": body(api.get(f"/api/activation-caches/{cache_id}")),
        "list": body(api.get("/api/activation-caches")),
        "extractions": body(api.get("/api/extractions")),
        "tar": body(api.get(f"/api/activation-caches/{cache_id}/download")),
        "page": body(browser.get(f"/activations/{cache_id}/")),
        "list page": body(browser.get("/activations/")),
    }
    cache = ActivationCache.objects.get(pk=cache_id)
    for path in sorted(cache.directory.rglob("*")):
        if path.is_file():
            relative = str(path.relative_to(cache.directory))
            download = api.get(f"/api/activation-caches/{cache_id}/download", {"file": relative})
            served[relative] = body(download)
    for page in pages:
        served[page] = body(browser.get(page))
    return served


def test_no_served_byte_names_a_local_root(setup, writer, settings):
    model, dataset, api = setup
    job_id = extract(api, model, dataset).json()["extraction_id"]
    burst()
    cache = ExtractionJob.objects.get(pk=job_id).cache
    assert cache.status == "completed"
    # Stored path-free: the row, and the manifest on disk (which a researcher may copy anywhere).
    assert cache.key["model"]["identifier"] == "tiny-gpt2"
    manifest_path = cache.directory / "manifest.json"
    assert json.loads(manifest_path.read_text())["key"]["model"]["identifier"] == "tiny-gpt2"
    # Still found by the same request (and by the one before this change: the hash is unchanged).
    assert extract(api, model, dataset).json()["cached"] is True

    roots = [str(root).encode() for root in [*settings.LOCAL_MODEL_ROOTS, *settings.LOCAL_DATA_ROOTS]]
    pages = [f"/models/{model.id}/", f"/datasets/{dataset.id}/"]
    for name, content in served_bytes(writer, cache.id, pages=pages).items():
        assert not any(root in content for root in roots), name

    # A cache written before keys went path-free holds the absolute path: it is never served.
    manifest = json.loads(manifest_path.read_text())
    manifest["key"]["model"]["identifier"] = str(settings.LOCAL_MODEL_ROOTS[0] / "tiny-gpt2")
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    served = served_bytes(writer, cache.id)
    for name, content in served.items():
        assert not any(root in content for root in roots), name
    assert json.loads(served["manifest.json"])["key"]["model"]["identifier"] == "tiny-gpt2"
    assert json.loads(served["detail"])["manifest"]["key"]["model"]["identifier"] == "tiny-gpt2"


def test_a_reused_cache_names_each_users_own_dataset(tiny_gpt2_folder, writer, client_for):
    from conftest import make_user

    alice, bob = writer, make_user("bob-writer", "model:write")
    model = model_register(
        source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=alice, shared=True
    )
    content = "".join(f"{text}\n" for text in TEXTS).encode()

    def private_upload(user, name):
        handle = io.BytesIO(content)
        handle.name = "notes.txt"
        response = client_for(user).post("/api/datasets", {"file": handle, "name": name}, format="multipart")
        assert response.status_code == 201 and response.json()["shared"] is False
        return Dataset.objects.get(pk=response.json()["id"])

    alices = private_upload(alice, "alice-confidential-corpus")
    first = extract(client_for(alice), model, alices).json()
    burst()
    cache = ExtractionJob.objects.get(pk=first["extraction_id"]).cache
    assert cache.status == "completed" and cache.dataset == alices

    bobs = private_upload(bob, "bob-notes")
    assert bobs.content_hash == alices.content_hash
    reused = extract(client_for(bob), model, bobs)
    assert reused.status_code == 200, reused.content
    assert reused.json()["cached"] is True and reused.json()["cache_id"] == cache.id
    assert reused.json()["dataset_id"] == bobs.id

    def assert_shown(user, dataset, hidden):
        served = served_bytes(user, cache.id, pages=[f"/models/{model.id}/"])
        for name, content in served.items():
            assert not any(secret.encode() in content for secret in hidden), (user.username, name)
        detail = json.loads(served["detail"])
        provenance = detail["manifest"]["provenance"]
        assert detail["dataset_id"] == provenance["dataset_id"] == (dataset.id if dataset else None)
        assert provenance["dataset_name"] == (dataset.name if dataset else None)
        assert json.loads(served["manifest.json"])["provenance"] == provenance
        with tarfile.open(fileobj=io.BytesIO(served["tar"])) as tar:
            assert json.loads(tar.extractfile(f"{cache.id}/manifest.json").read())["provenance"] == provenance

    assert_shown(bob, bobs, hidden=[alices.id, alices.name])
    assert_shown(alice, alices, hidden=[bobs.id, bobs.name])
    bob_api = client_for(bob)
    by_dataset = bob_api.get("/api/activation-caches", {"dataset": bobs.id}).json()["caches"]
    assert [entry["id"] for entry in by_dataset] == [cache.id]
    assert bob_api.get("/api/activation-caches", {"dataset": alices.id}).json()["caches"] == []
    page = Client()
    page.force_login(bob)
    assert cache.id.encode() in page.get(f"/datasets/{bobs.id}/").content

    # Bob deletes his dataset: his view names no dataset, and never falls back to Alice's.
    assert bob_api.delete(f"/api/datasets/{bobs.id}").status_code == 204
    assert_shown(bob, None, hidden=[alices.id, alices.name])
    assert_shown(alice, alices, hidden=[bobs.id, bobs.name])
    # Alice deletes hers: she still sees the name her extraction recorded; Bob still sees nothing.
    assert client_for(alice).delete(f"/api/datasets/{alices.id}").status_code == 204
    served = json.loads(served_bytes(alice, cache.id)["detail"])
    assert served["dataset_id"] is None
    assert served["manifest"]["provenance"]["dataset_name"] == "alice-confidential-corpus"
    assert_shown(bob, None, hidden=[alices.id, alices.name])


def test_a_full_disk_fails_the_job_from_the_writer_thread(setup, monkeypatch, settings):
    """Shards are written on the job's background writer thread: a full disk there still ends the
    job ``failed`` with DISK_FULL and removes the partial cache, as when writing inline."""
    import errno

    from activations.store import format as cache_format

    settings.ACTIVATION_SHARD_MAX_TOKENS = 8  # small shards: the disk fills during the loop
    model, dataset, api = setup

    def full(handle, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_format, "_write_bytes", full)
    response = extract(api, model, dataset)
    burst()
    job = ExtractionJob.objects.get(pk=response.json()["extraction_id"])
    assert job.status == "failed" and job.error_code == "DISK_FULL", (job.error_code, job.error_message)
    assert job.cache is None or not job.cache.directory.exists() or not any(job.cache.directory.iterdir())
