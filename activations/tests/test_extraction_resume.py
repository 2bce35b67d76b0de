"""A worker killed with SIGKILL mid-extraction resumes from its last complete shard when restarted."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from django.conf import settings

from activations.models import Dataset, ExtractionJob
from activations.services import dataset_create_from_texts, extraction_request
from activations.store import ActivationStore, verify
from models_app.services import model_register

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.waits]


def start_worker(process_env):
    return subprocess.Popen(
        [sys.executable, "manage.py", "worker", "--name", "resume-worker"],
        cwd=settings.BASE_DIR, env=process_env(ACTIVATION_SHARD_MAX_TOKENS="64"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def wait(condition, timeout=120.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(interval)
    raise AssertionError("timed out")


def test_sigkill_mid_extraction_then_restart_resumes_without_duplicates(tiny_gpt2_folder, process_env):
    texts = [f"Sample number {index}: " + "the quick brown fox jumps over the lazy dog " * (1 + index % 5)
             for index in range(600)]  # fmt: skip
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None)
    dataset = dataset_create_from_texts(name="many", texts=texts, owner=None, source=Dataset.Source.BUILTIN)
    job = extraction_request(
        model_id=model.id, dataset_id=dataset.id, owner=None, layers=[0, 1], batch_size=2, max_length=48
    )
    manifest_path = job.cache.directory / "manifest.json"

    worker = start_worker(process_env)
    try:

        def shards_written():
            if not manifest_path.exists():
                return 0
            return len(json.loads(manifest_path.read_text())["shards"]) >= 3

        wait(shards_written)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    job.refresh_from_db()
    assert job.status == "running"  # the row still says so: nobody finished it
    shards_before = len(json.loads(manifest_path.read_text())["shards"])
    assert shards_before >= 3

    worker = start_worker(process_env)
    try:
        wait(lambda: ExtractionJob.objects.filter(pk=job.id, status__in=["completed", "failed"]).exists())
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    job.refresh_from_db()
    assert job.status == "completed", (job.error_code, job.error_message)
    assert verify(job.cache.directory) == []
    store = ActivationStore.open(job.cache.directory)
    manifest = store.manifest
    assert manifest["shards"][0]["first_batch"] == 0  # the shards from before the kill were kept
    tokens = store.tokens()
    pairs = set(zip(tokens["sample_index"].tolist(), tokens["position"].tolist(), strict=True))
    assert len(pairs) == store.num_tokens  # no (sample, position) stored twice
    assert sorted(set(tokens["sample_index"].tolist())) == list(range(len(texts)))

    from transformers import AutoTokenizer

    from engine.extraction import tokenize_samples

    lengths = [
        len(ids) for ids in tokenize_samples(AutoTokenizer.from_pretrained(tiny_gpt2_folder), texts, 48)
    ]
    assert store.num_tokens == sum(lengths)
    assert np.isfinite(store.get("blocks.1.hook_resid_post")).all()
