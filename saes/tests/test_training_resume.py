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


def test_sigkill_mid_group_training_from_the_model_resumes_to_the_uninterrupted_result(
    tiny_model, writer, process_env
):
    """Training from the model: the checkpoint holds the SAEs, the optimiser, the dataset position
    and the shuffle buffer with its generator, so the resumed group ends where one never killed does."""
    from activations.models import Dataset
    from activations.services import dataset_create_from_texts
    from engine.testing.corpus import local_corpus
    from saes.groups import GroupMember, GroupSettings, sae_group_train_request
    from saes.models import SaeGroup

    texts = [text for text in local_corpus(max_chars=40_000) if len(text) > 40][:120]
    dataset = dataset_create_from_texts(name="docs", texts=texts, owner=writer, source=Dataset.Source.UPLOAD)
    config = {
        "model": tiny_model, "dataset": dataset,
        "members": (GroupMember(HOOK), GroupMember("blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out")),
        "settings": GroupSettings(
            expansion_factor=2, k=4, batch_size=64, lr=1e-3, total_tokens=64 * 400, max_length=32
        ),
    }  # fmt: skip
    group = sae_group_train_request(owner=writer, **config)
    checkpoints = group.checkpoint_directory

    def checkpoint_step() -> int:
        complete = [path for path in checkpoints.glob("step-*") if (path / "source.json").exists()]
        return max((int(path.name.removeprefix("step-")) for path in complete), default=0)

    worker = start_worker(process_env)
    try:
        wait_until(
            lambda: checkpoint_step() >= 80, interval=0.02, timeout=300, what="a checkpoint at step 80"
        )
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    group.refresh_from_db()
    assert group.status == "running" and group.step < group.total_steps  # nobody finished it

    uninterrupted = sae_group_train_request(owner=writer, **config)
    worker = start_worker(process_env)
    try:
        both = SaeGroup.objects.filter(pk__in=[group.id, uninterrupted.id])
        wait_until(lambda: not both.filter(status__in=SaeGroup.ACTIVE).exists(), timeout=300)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    group.refresh_from_db()
    uninterrupted.refresh_from_db()
    assert group.status == uninterrupted.status == "completed", (group.error_code, group.error_message)
    assert not checkpoints.exists()
    pairs = zip(
        group.members.order_by("group_index"), uninterrupted.members.order_by("group_index"), strict=True
    )
    for resumed_row, straight_row in pairs:
        steps = [point["step"] for point in resumed_row.history]
        assert steps == sorted(set(steps)) == [point["step"] for point in straight_row.history]
        resumed, _ = load_saelens(resumed_row.directory)
        straight, _ = load_saelens(straight_row.directory)
        for name, tensor in straight.tensors().items():
            torch.testing.assert_close(resumed.tensors()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
