"""Time slices (``mistudio.job_runner``) with real rows, real Redis and a real RQ worker in burst
mode: a job that others wait behind yields at a checkpoint after its quantum and resumes to the
very result of an unsliced run; a job nobody waits behind runs on; a model load queued behind a
long job starts at once."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from rq.job import Job

from conftest import make_user
from engine.sae.formats import load_saelens
from mistudio import job_runner
from mistudio.access import OPERATOR
from mistudio.jobs import job_cancel
from mistudio.redis_client import get_redis
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.services import model_load_request, model_register
from models_app.tests.live_stack import wait_until
from saes import services
from saes.models import SparseAutoencoder
from saes.tests.conftest import HOOK, write_planted_cache

pytestmark = pytest.mark.django_db(transaction=True)  # the burst worker in this process closes connections

WORKER = "slices-worker"


@pytest.fixture
def model(tiny_gpt2_folder, writer):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch, settings):
    """A tiny quantum, and a running job that looks every 20 ms whether to yield, for work that
    has waited 50 ms (a live worker: 1 s each)."""
    settings.JOB_QUANTUM_SECONDS = 0.3
    monkeypatch.setattr(job_runner, "YIELD_POLL_SECONDS", 0.02)
    monkeypatch.setattr(job_runner, "IDLE_WORKER_GRACE_SECONDS", 0.05)


def long_training(owner, cache, **changes) -> SparseAutoencoder:
    """A training of a few hundred steps (a second or two here); the same config, the same seed."""
    config = {"architecture": "topk", "expansion_factor": 4, "k": 4, "batch_size": 64, "lr": 1e-3,
              "total_tokens": 10 * cache.num_tokens}  # fmt: skip
    return services.sae_train_request(owner=owner, cache=cache, hook=HOOK, **{**config, **changes})


def burst() -> None:
    run_worker(name=WORKER, device="cpu", burst=True)


def yields(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if " yields (" in record.getMessage()]


def weights(sae: SparseAutoencoder) -> dict[str, torch.Tensor]:
    return load_saelens(sae.directory)[0].tensors()


def test_a_job_yields_after_its_quantum_to_another_users_job_and_resumes_to_the_unsliced_result(
    model, writer, caplog, settings
):
    caplog.set_level(logging.INFO, logger="mistudio.job_runner")
    bob = make_user("bob-writer", "model:write")
    cache = write_planted_cache(model, writer, samples=256)
    sliced = long_training(writer, cache)
    bobs = services.sae_train_request(
        owner=bob,
        cache=write_planted_cache(model, bob, samples=32),
        hook=HOOK,
        batch_size=256,
        total_tokens=256,
    )
    burst()
    sliced.refresh_from_db()
    bobs.refresh_from_db()
    assert sliced.status == bobs.status == "completed", (sliced.error_message, bobs.error_message)
    # The walt's training started first (the oldest row), yet bob's ran and ended inside it.
    assert sliced.started_at < bobs.started_at < bobs.finished_at < sliced.finished_at
    assert any(f"{sliced.id} yields (time_slice)" in message for message in yields(caplog))

    settings.JOB_QUANTUM_SECONDS = 0  # the same training, start to end in one go
    straight = long_training(writer, cache)
    burst()
    straight.refresh_from_db()
    assert straight.status == "completed"
    assert [point["step"] for point in sliced.history] == [point["step"] for point in straight.history]
    for name, tensor in weights(straight).items():
        torch.testing.assert_close(weights(sliced)[name], tensor, rtol=0, atol=0, msg=name)
    assert sliced.evaluation["explained_variance"] == straight.evaluation["explained_variance"]
    assert not sliced.checkpoint_directory.exists()


def test_a_job_that_nobody_waits_behind_runs_past_its_quantum(model, writer, caplog):
    caplog.set_level(logging.INFO, logger="mistudio.job_runner")
    cache = write_planted_cache(model, writer, samples=256)
    alone = long_training(writer, cache)
    mine_too = long_training(writer, cache, lr=2e-3)  # the same owner's: it waits its turn
    burst()
    alone.refresh_from_db()
    mine_too.refresh_from_db()
    assert alone.status == mine_too.status == "completed"
    assert alone.finished_at < mine_too.started_at
    assert (alone.finished_at - alone.started_at).total_seconds() > 0.6  # well past the quantum
    assert yields(caplog) == []


def test_a_model_load_queued_behind_a_long_training_starts_at_once(model, writer, caplog, settings):
    """The load makes the training yield at its next step (a load has no quantum to wait)."""
    caplog.set_level(logging.INFO, logger="mistudio.job_runner")
    settings.JOB_QUANTUM_SECONDS = 0  # slices off: the load alone makes the training yield
    cache = write_planted_cache(model, writer, samples=256)
    training = long_training(writer, cache, total_tokens=1000 * cache.num_tokens)  # minutes, alone
    loaded = {}

    def load_while_it_trains() -> None:
        try:
            running = SparseAutoencoder.objects.filter(pk=training.pk, step__gt=0)
            wait_until(running.exists, timeout=60, what="the training's first steps")
            loaded["job"] = model_load_request(model_id=model.id, actor=OPERATOR).rq_job_id
            ready = LanguageModel.objects.filter(pk=model.pk, status="ready")
            wait_until(ready.exists, timeout=30, interval=0.02, what="the model's load")
        finally:
            job_cancel(SparseAutoencoder.objects.get(pk=training.pk), actor=writer)  # enough shown

    loader = threading.Thread(target=load_while_it_trains)
    loader.start()
    burst()
    loader.join(timeout=60)
    load = Job.fetch(loaded["job"], connection=get_redis())
    waited = (load.started_at - load.enqueued_at).total_seconds()
    assert waited < 5, f"the load waited {waited:.1f} s behind the training"
    model.refresh_from_db()
    training.refresh_from_db()
    assert model.status == "ready" and training.status == "cancelled"
    assert any(f"{training.id} yields (model_load)" in message for message in yields(caplog))


def test_a_job_that_made_room_for_a_load_keeps_its_owners_turn(model, writer):
    """Only a time slice counts as its owner's turn taken: a job that yielded to a model load was
    not served more, so the fair claim does not put its owner behind the others for it."""
    cache = write_planted_cache(model, writer, samples=64)
    training = long_training(writer, cache)
    redis_client, owner = get_redis(), f"user:{writer.pk}"
    redis_client.hdel(job_runner.served_key(), owner)
    job_runner.job_yield(training, reason="model_load", ran_seconds=0.1)
    assert redis_client.hget(job_runner.served_key(), owner) is None
    job_runner.job_yield(training, reason="time_slice", ran_seconds=0.1)
    assert redis_client.hget(job_runner.served_key(), owner) is not None
