"""mistudio-client against a live miStudio (Daphne and a real worker over tiny models): the version
handshake, typed errors, models, a dataset from a list of strings, an extraction waited on and read
as lazy arrays (a slice fetches those rows: equal to the server's JSON slice), generation with
capture and interventions (equal to the raw /api/generate answer), and an SAE trained, waited on and
exported; the package installs with pip."""

import shutil
import subprocess
import sys
from pathlib import Path

import mistudio_client
import numpy as np
import pytest
from mistudio_client import Add, BadRequest, Client, NotFound, Unauthorized, VersionMismatch

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


def test_train_an_sae_wait_and_export(live_stack, client, tmp_path):
    model = live_stack.models["gpt2"]
    dataset = client.datasets.upload(TEXTS * 4, name="client sae texts")
    cache = client.extractions.start(model, dataset, hooks=[HOOK], batch_size=16).wait(progress=False).cache()
    job = client.saes.train(
        cache, HOOK, architecture="topk", expansion_factor=2, k=8, batch_size=256, total_tokens=4096
    )
    job.wait(progress=False)
    sae = client.saes.get(job.id)
    assert sae["status"] == "completed" and sae["d_sae"] == 128
    values, answer = client.features.encode(job.id, "The cat sat on the mat", top=4)
    assert values.shape == (len(answer["tokens"]), 128) and (values > 0).sum(1).max() <= 4
    labelled = client.features.label(job.id, 3, "cats and mats")
    assert labelled["label"]["label"] == "cats and mats"
    folder = client.saes.export(job.id, tmp_path / "sae")
    assert (folder / "cfg.json").is_file() and (folder / "sae_weights.safetensors").is_file()


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
