"""mistudio-client against a live miStudio (Daphne and a real worker over tiny models): the version
handshake, typed errors, models, a dataset from a list of strings, an extraction waited on and read
as lazy arrays (a slice fetches those rows: equal to the server's JSON slice), generation with
capture and interventions (equal to the raw /api/generate answer), and an SAE trained, waited on and
exported; the package installs with pip."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mistudio_client
import numpy as np
import pytest
from mistudio_client import Add, BadRequest, Client, Job, NotFound, Unauthorized, VersionMismatch
from mistudio_client.safetensors import read_safetensors

pytestmark = pytest.mark.slow
HOOK = "blocks.1.hook_resid_post"
TEXTS = [f"Sample number {index}: the cat sat on the mat and looked at the door." for index in range(24)]


@pytest.fixture
def client(live_stack):
    with Client(live_stack.base_url, live_stack.token) as opened:
        yield opened


def test_the_handshake_and_typed_errors(live_stack, client, monkeypatch):
    assert client.server["api_version"] == mistudio_client.API_VERSION
    with pytest.raises(Unauthorized) as refused:
        Client(live_stack.base_url, "not-a-token")
    assert refused.value.status == 401
    monkeypatch.setattr("mistudio_client.client.API_VERSION", 99)
    with pytest.raises(VersionMismatch, match="API version 1"):
        Client(live_stack.base_url, live_stack.token)
    with pytest.raises(NotFound) as missing:
        client.datasets.get("ds_nonexistent")
    assert missing.value.code == "DATASET_NOT_FOUND"


def test_extract_wait_and_slice_lazily(live_stack, client):
    model = client.models.get("live-gpt2")
    assert model["status"] == "ready" and model["id"] == live_stack.models["gpt2"]
    dataset = client.datasets.upload(TEXTS, name="client texts")
    assert dataset["sample_count"] == len(TEXTS)
    with pytest.raises(BadRequest) as bad:
        client.extractions.start(model, dataset, hooks=["blocks.99.hook_resid_post"])
    assert bad.value.code == "INVALID_HOOK" and bad.value.details["invalid"] == ["blocks.99.hook_resid_post"]
    job = client.extractions.start(model, dataset, hooks=[HOOK], batch_size=8)
    cache = job.wait(progress=False).cache()
    assert client.job(job.id).refresh()["status"] == "completed"  # reattached by id
    array = cache[HOOK]
    tokens, width = array.shape
    assert width == 64 and tokens > 200
    rows = array[100:140]
    assert rows.shape == (40, 64) and rows.dtype == np.float32
    expected = client.request(
        "GET",
        f"activation-caches/{cache.id}/slice",
        params={"hook": HOOK, "start": 100, "stop": 140, "output": "json"},
    )
    values = expected["values"] if isinstance(expected, dict) else expected
    assert np.allclose(rows, np.asarray(values, dtype=np.float32))
    whole = np.asarray(array)
    assert whole.shape == (tokens, 64) and np.array_equal(whole[100:140], rows)
    assert np.array_equal(array[-1], whole[-1]) and np.array_equal(array[5:20:5], whole[5:20:5])
    assert np.array_equal(np.concatenate(list(array.chunks(rows=97))), whole)


def test_generate_with_capture_and_an_intervention(live_stack, client):
    model = live_stack.models["gpt2"]
    plain = client.generate(model, "The cat sat on", max_tokens=6, capture=[HOOK])
    raw = client.request(
        "POST",
        "generate",
        json={"model_id": model, "prompt": "The cat sat on", "max_tokens": 6, "temperature": 0},
    )
    assert plain.text == raw["output_text"] and plain.output_token_ids == raw["output_token_ids"]
    captured = plain.activations[HOOK]
    assert captured.shape[1] == 64
    assert captured.shape[0] >= len(plain.input_token_ids)
    steered = client.generate(
        model,
        "The cat sat on",
        max_tokens=6,
        interventions=[Add(HOOK, np.random.default_rng(0).standard_normal(64), coefficient=20.0)],
    )
    assert steered.output_token_ids != plain.output_token_ids
    streamed = client.stream(model, "The cat sat on", max_tokens=6, capture=[HOOK])
    tokens = list(streamed)
    assert [token["token_id"] for token in tokens] == plain.output_token_ids
    assert "".join(token["text"] for token in tokens) == plain.text == streamed.result.text
    assert np.allclose(streamed.result.activations[HOOK], captured)
    with pytest.raises(BadRequest):
        list(client.stream(model, "The cat", max_tokens=-1))


def test_train_an_sae_wait_and_export(live_stack, client, tmp_path, monkeypatch):
    model = live_stack.models["gpt2"]
    dataset = client.datasets.upload(TEXTS * 4, name="client sae texts")
    cache = client.extractions.start(model, dataset, hooks=[HOOK], batch_size=16).wait(progress=False).cache()
    job = client.saes.train(
        cache, HOOK, architecture="topk", expansion_factor=2, k=8, batch_size=256, total_tokens=4096
    )
    # Followed through its WebSocket events: the row is read over REST once, at the end (polling
    # every 0.5 s would read it on each turn).
    reads = []
    monkeypatch.setattr("mistudio_client.jobs.Job.refresh", counted(reads, Job.refresh))
    job.wait(progress=False)
    assert len(reads) == 1
    monkeypatch.undo()
    sae = client.saes.get(job.id)
    assert sae["status"] == "completed" and sae["d_sae"] == 128
    values, answer = client.features.encode(job.id, "The cat sat on the mat", top=4)
    assert values.shape == (len(answer["tokens"]), 128) and (values > 0).sum(1).max() <= 4
    labelled = client.features.label(job.id, 3, "cats and mats")
    assert labelled["label"]["label"] == "cats and mats"
    folder = client.saes.export(job.id, tmp_path / "sae")
    assert (folder / "cfg.json").is_file() and (folder / "sae_weights.safetensors").is_file()
    # The exported folder sent back (as from a laptop) imports to the same weights.
    uploaded = client.saes.upload(folder, model=model, name="round trip").wait(progress=False)
    assert uploaded.id != job.id and client.saes.get(uploaded.id)["name"] == "round trip"
    sent = read_safetensors((folder / "sae_weights.safetensors").read_bytes())
    back = client.saes.export(uploaded.id, tmp_path / "back") / "sae_weights.safetensors"
    received = read_safetensors(back.read_bytes())
    assert sent.keys() == received.keys() and all(np.array_equal(sent[name], received[name]) for name in sent)
    evaluation = client.saes.evaluate(job.id)
    assert 0 < evaluation["l0"] <= 8 and client.saes.get(job.id)["evaluation_status"] == ""

    analysis = client.features.analyze(job.id).wait(progress=False)
    assert client.job(analysis.id, sae=job.id).refresh()["status"] == "completed"
    assert [row["id"] for row in client.features.analyses(job.id)] == [analysis.id]
    page = client.features.list(job.id, sort="-density", page_size=5)
    assert page["analysis_id"] == analysis.id and len(page["features"]) == 5
    densities = [feature["density"] for feature in page["features"]]
    assert densities == sorted(densities, reverse=True)
    dense = page["features"][0]["index"]
    assert client.features.get(job.id, dense)["top_examples"]
    # The same SAE analysed over its dataset read straight through the model: no cache written.
    through = client.features.analyze(job.id, dataset=dataset, sample_count=4, max_length=16)
    state = client.features.analysis(job.id, through.wait(progress=False).id)
    assert state["source"] == "model" and state["cache_id"] is None and state["dataset_id"] == dataset["id"]
    assert state["reading"]["sample_count"] == 4 and state["status"] == "completed"
    exported = json.loads(client.features.export(job.id, tmp_path / "features.json").read_text())
    assert len(exported["features"]) == 128

    # The llama explains two features (a 4,096-token context: its prompts fit), scored.
    explainer = live_stack.models["llama"]
    selection = {"kind": "list", "indices": [dense, page["features"][1]["index"]]}
    options = {"concurrency": 4, "explain_max_tokens": 24, "score_max_tokens": 16, "test_examples": 6}
    plan = client.features.explain(job.id, explainer, selection=selection, options=options, dry_run=True)
    assert sorted(plan["indices"]) == sorted(selection["indices"]) and plan["estimate"]["prompt_tokens"] > 0
    explaining = client.features.explain(job.id, explainer, selection=selection, options=options)
    explaining.wait(progress=False)
    results = client.features.explanations(job.id, explaining.id)
    assert results["total"] == 2 and {row["index"] for row in results["explanations"]} == set(
        selection["indices"]
    )
    good = next(row for row in results["explanations"] if not row["error_code"])
    accepted = client.features.accept_explanation(job.id, good["index"], good["id"])
    assert accepted["label"]["label"] == good["text"][:200]
    assert [row["id"] for row in client.features.explanation_jobs(job.id)] == [explaining.id]

    # The cache's statistics and top activations; the rows as the user changes them.
    stats = client.caches.stats(cache, HOOK)
    assert len(stats["stats"][HOOK]["mean"]) == 64
    top = client.caches.top_k(cache, HOOK, 5, k=3)
    assert len(top["top_k"]) == 3
    assert top["top_k"][0]["value"] == pytest.approx(float(np.asarray(cache[HOOK])[:, 5].max()), rel=1e-5)
    assert client.datasets.samples(dataset, limit=3)["samples"][0] == TEXTS[0]
    assert client.datasets.update(dataset, name="renamed")["name"] == "renamed"
    assert client.saes.update(job.id, name="client sae")["name"] == "client sae"
    client.saes.delete(job.id)
    with pytest.raises(NotFound):
        client.saes.get(job.id)


def counted(calls: list, method):
    def wrapper(self, *args, **kwargs):
        calls.append(self.id)
        return method(self, *args, **kwargs)

    return wrapper


def test_the_package_installs_with_pip(tmp_path):
    """``pip install ./client`` (no network: its build backend is setuptools, present here)."""
    # A copy: setuptools builds in the source folder (build/, *.egg-info).
    client_folder = tmp_path / "client"
    shutil.copytree(
        Path(mistudio_client.__file__).resolve().parents[1],
        client_folder,
        ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(tmp_path / "site"),
            str(client_folder),
        ],
        check=True,
        capture_output=True,
    )
    assert (tmp_path / "site" / "mistudio_client" / "client.py").is_file()


def test_probes_steering_vectors_and_the_model_side(live_stack, client):
    model = live_stack.models["gpt2"]
    points = {point["name"]: point for point in client.models.hook_points(model)}
    assert points[HOOK]["shape"][-1] == 64
    tokens = client.models.tokenize(model, ["The cat sat", " cat"], special_tokens=False)
    assert "".join(token["text"] for token in tokens[0]) == "The cat sat"
    assert any(worker["name"] == live_stack.worker_name for worker in client.models.workers())
    assert client.explainers()["prompt_version"] and client.explainers()["endpoints"][0]["name"] == "local"
    lens = client.models.logit_lens(model, "The cat sat on the", top=3)
    assert len(lens["layers"]) == 2 and len(lens["top"][-1][-1]) == 3
    # The last layer's lens is the model's own prediction.
    greedy = client.generate(model, "The cat sat on the", max_tokens=1)
    assert lens["top"][-1][-1][0]["token_id"] == greedy.output_token_ids[0]
    pieces = [
        token["text"]
        for token in client.models.tokenize(model, ["The cat sat on the mat"], special_tokens=False)[0]
    ]
    grid = client.models.patching(
        model, "The cat sat on the mat", "The dog sat on the mat", pieces[-1], pieces[1]
    )
    assert grid["grid"].shape == (2, len(grid["tokens"]))
    job = client.steering_vectors.create(model, HOOK, ["I love this", "What joy"], ["I hate this", "How sad"])
    job.wait(progress=False)
    vector = client.steering_vectors.values(job.id)
    assert vector.shape == (64,) and client.steering_vectors.get(job.id)["norm"] == pytest.approx(
        float(np.linalg.norm(vector)), rel=1e-5
    )
    steered = client.generate(
        model,
        "The cat sat on",
        max_tokens=6,
        interventions=[{"type": "add", "steering_vector": job.id, "coefficient": 30.0}],
    )
    assert steered.output_token_ids != client.generate(model, "The cat sat on", max_tokens=6).output_token_ids
    # A vector of your own, uploaded, reads back as it was sent.
    mine = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    uploaded = client.steering_vectors.upload(model, HOOK, mine, name="mine")
    assert np.array_equal(client.steering_vectors.values(uploaded["id"]), mine)
    assert client.steering_vectors.update(uploaded["id"], name="renamed")["name"] == "renamed"
    client.steering_vectors.delete(uploaded["id"])
    assert uploaded["id"] not in [row["id"] for row in client.steering_vectors.list()]
