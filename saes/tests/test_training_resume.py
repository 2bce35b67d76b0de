"""A worker killed with SIGKILL mid-training resumes from its last checkpoint when restarted, and
ends with the very SAE an uninterrupted training gives."""

import json
import signal
import subprocess
import sys

import pytest
import torch
from django.conf import settings

from engine.sae.formats import load_saelens
from models_app.tests.live_stack import wait_until
from saes.models import SparseAutoencoder as SaeRow
from saes.services import sae_train_request
from saes.tests.conftest import HOOK, write_planted_cache

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.waits]


def start_worker(process_env):
    return subprocess.Popen(
        [sys.executable, "manage.py", "worker", "--name", "sae-resume-worker"],
        cwd=settings.BASE_DIR, env=process_env(SAE_CHECKPOINT_EVERY_STEPS="40"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def test_sigkill_mid_training_then_restart_resumes_from_the_checkpoint(tiny_model, writer, process_env):
    cache = write_planted_cache(tiny_model, writer, samples=256)
    config = {"cache": cache, "hook": HOOK, "architecture": "topk", "expansion_factor": 4, "k": 4,
              "batch_size": 64, "lr": 1e-3, "total_tokens": 10 * cache.num_tokens}  # fmt: skip
    sae = sae_train_request(owner=writer, **config)
    checkpoint = sae.checkpoint_directory / "checkpoint.json"

    worker = start_worker(process_env)
    try:

        def checkpoint_step() -> int:
            return json.loads(checkpoint.read_text())["step"] if checkpoint.exists() else 0

        wait_until(lambda: checkpoint_step() >= 80, interval=0.02, what="a checkpoint at step 80")
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    sae.refresh_from_db()
    assert sae.status == "running" and 0 < sae.step < sae.total_steps  # nobody finished it
    killed_at = sae.step

    uninterrupted = sae_train_request(owner=writer, **config)  # the same training, start to end
    worker = start_worker(process_env)
    try:
        both = SaeRow.objects.filter(pk__in=[sae.id, uninterrupted.id])
        wait_until(lambda: not both.filter(status__in=SaeRow.ACTIVE).exists(), timeout=300)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    sae.refresh_from_db()
    uninterrupted.refresh_from_db()
    assert sae.status == uninterrupted.status == "completed", (sae.error_code, sae.error_message)
    steps = [point["step"] for point in sae.history]
    assert steps == sorted(set(steps)) and steps[-1] == sae.total_steps  # no step counted twice
    assert steps == [point["step"] for point in uninterrupted.history]
    assert sae.step == sae.total_steps > killed_at
    assert not sae.checkpoint_directory.exists()

    resumed, _ = load_saelens(sae.directory)
    straight, _ = load_saelens(uninterrupted.directory)
    for name, tensor in straight.tensors().items():
        torch.testing.assert_close(resumed.tensors()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert sae.evaluation["explained_variance"] == pytest.approx(
        uninterrupted.evaluation["explained_variance"]
    )
