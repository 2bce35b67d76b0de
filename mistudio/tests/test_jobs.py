"""The one job model (``mistudio.jobs``) with real rows, real Redis and real RQ workers: users take
turns, every job is bounded in time and tokens, the worker checks its memory before a job starts,
and a job whose worker is gone is cancelled at once."""

from __future__ import annotations

import pytest
from django.conf import settings

from conftest import make_user
from mistudio import job_runner
from mistudio.workers import run_worker, shared_queue, worker_queue
from models_app.services import model_register
from saes import services
from saes.models import SparseAutoencoder
from saes.tests.conftest import HOOK, write_planted_cache

pytestmark = pytest.mark.django_db(transaction=True)  # the burst worker in this process closes connections


@pytest.fixture
def model(tiny_gpt2_folder, writer):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)


def training(owner, cache, **changes) -> SparseAutoencoder:
    """A short training (one step), followed by its evaluation (which loads the model)."""
    sae = services.sae_train_request(
        owner=owner, cache=cache, hook=HOOK, batch_size=256, total_tokens=256, **changes
    )
    return sae


def burst() -> None:
    run_worker(name="jobs-worker", device="cpu", burst=True)


def test_two_users_batch_jobs_alternate_rather_than_first_come_first_served(model, writer):
    bob = make_user("bob-writer", "model:write")
    caches = {
        writer.pk: write_planted_cache(model, writer, samples=32),
        bob.pk: write_planted_cache(model, bob, samples=32),
    }
    queued = [training(writer, caches[writer.pk]) for _ in range(3)] + [
        training(bob, caches[bob.pk]) for _ in range(3)
    ]
    assert [sae.owner for sae in queued] == [writer] * 3 + [bob] * 3  # the writer queued all theirs first
    burst()
    trained = list(SparseAutoencoder.objects.order_by("started_at"))
    assert [sae.status for sae in trained] == ["completed"] * 6
    assert [sae.owner.username for sae in trained] == ["walt-writer", "bob-writer"] * 3


def test_fairest_is_the_oldest_job_of_the_owner_served_longest_ago():
    from datetime import datetime, timedelta

    t0 = datetime(2026, 11, 26)
    waiting = [
        job_runner._Waiting(
            created_at=t0 + timedelta(seconds=index), pk=f"r{index}", owner_id=owner, model=SparseAutoencoder
        )
        for index, owner in enumerate([1, 1, 2, None, 2])
    ]
    assert job_runner.fairest(waiting, {}).pk == "r0"  # nobody served yet: the oldest job
    assert (
        job_runner.fairest(waiting, {"user:1": 10.0}).pk == "r2"
    )  # user 2 and the system never served: oldest of theirs
    assert job_runner.fairest(waiting, {"user:1": 10.0, "user:2": 5.0}).pk == "r3"
    assert job_runner.fairest(waiting, {"user:1": 1.0, "user:2": 5.0, "system": 9.0}).pk == "r0"


def test_a_job_past_its_time_limit_fails_with_job_timeout_and_leaves_nothing(model, writer, settings):
    settings.JOB_MAX_SECONDS = 1
    cache = write_planted_cache(model, writer, samples=64)
    sae = services.sae_train_request(owner=writer, cache=cache, hook=HOOK, batch_size=64, total_tokens=10**8)
    burst()
    sae.refresh_from_db()
    assert (sae.status, sae.error_code) == ("failed", "JOB_TIMEOUT"), sae.error_message
    assert "limit of 1 s" in sae.error_message and 0 < sae.step < sae.total_steps
    assert not sae.directory.exists()


def test_a_job_over_the_token_budget_is_refused_before_it_is_written(model, writer, client_for, settings):
    settings.JOB_MAX_TOKENS = 1000
    cache = write_planted_cache(model, writer, samples=32)
    response = client_for(writer).post(
        "/api/saes", {"cache_id": cache.id, "hook": HOOK, "total_tokens": 1001}, format="json"
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "JOB_TOO_LARGE"
    assert response.json()["error"]["details"] == {"tokens": 1001, "limit": 1000}
    assert not SparseAutoencoder.objects.exists()


def test_the_worker_checks_its_free_memory_before_a_job_starts(model, writer):
    cache = write_planted_cache(model, writer, samples=32)
    sae = training(writer, cache)
    # Memory taken elsewhere since the request was admitted: more than this machine has.
    SparseAutoencoder.objects.filter(pk=sae.pk).update(memory_estimate_bytes=2**60)
    burst()
    sae.refresh_from_db()
    assert (sae.status, sae.error_code, sae.step) == ("failed", "INSUFFICIENT_MEMORY", 0)
    assert "its worker has" in sae.error_message


def test_cancelling_a_running_job_whose_worker_is_gone_ends_it_at_once(model, writer, client_for):
    cache = write_planted_cache(model, writer, samples=32)
    sae = training(writer, cache)
    SparseAutoencoder.objects.filter(pk=sae.pk).update(status="running", host_worker="a-worker-that-died")
    response = client_for(writer).post(f"/api/saes/{sae.id}/cancel")
    assert response.status_code == 202 and response.json()["status"] == "cancelled"


def test_a_starting_worker_takes_back_its_running_rows_and_re_tokens_waiting_ones(model, writer):
    cache = write_planted_cache(model, writer, samples=32)
    interrupted, waiting = training(writer, cache), training(writer, cache)
    SparseAutoencoder.objects.filter(pk=interrupted.pk).update(status="running", host_worker="jobs-worker")
    for queue in (worker_queue("jobs-worker"), shared_queue()):
        queue.empty()  # a Redis that restarted empty lost the tokens
    burst()  # its start hook re-queues the interrupted row on its own queue, re-tokens the waiting one
    for sae in (interrupted, waiting):
        sae.refresh_from_db()
        assert sae.status == "completed", (sae.error_code, sae.error_message)
    assert interrupted.queue_name == worker_queue("jobs-worker").name
    assert waiting.queue_name == settings.SHARED_QUEUE


def test_a_training_is_completed_even_when_no_evaluation_can_follow_it(model, writer):
    """The follow-up evaluation (CE loss recovered, where the model is) is the owner's request: one
    refused (here: the owner cannot read the cache any more) leaves the finished training alone."""
    bob = make_user("bob-writer", "model:write")
    bobs_cache = write_planted_cache(model, bob, samples=32)
    sae = training(writer, bobs_cache)  # queued while the writer could use it (a reuse, since gone)
    burst()
    sae.refresh_from_db()
    assert sae.status == "completed", (sae.error_code, sae.error_message)
    assert sae.directory.exists() and not sae.evaluations.exists()


# --- every kind's admission counts its tokens ------------------------------------------------------


def job_rows() -> dict[str, int]:
    from mistudio.jobs import job_kinds

    return {kind.model.kind: kind.model.objects.count() for kind in job_kinds()}


@pytest.fixture
def inputs_of_every_kind(model, writer, tiny_gpt2_folder):
    """What each kind's request names: a dataset and a cache, a completed SAE with a completed
    analysis, a set of transcoders; the model is marked ready (an explainer on this /v1)."""
    from activations.services import dataset_create_from_texts
    from circuits.tests.conftest import transcoder_rows
    from features.models import Feature, FeatureAnalysis
    from features.tests.conftest import completed_sae_row
    from models_app.models import LanguageModel

    cache = write_planted_cache(model, writer, samples=32)
    sae = completed_sae_row(model, cache, writer)
    analysis = FeatureAnalysis.objects.create(sae=sae, cache=cache, status="completed", owner=writer)
    Feature.objects.bulk_create(
        Feature(analysis=analysis, index=index, density=0.1, max_activation=1, mean_activation=0.5)
        for index in range(8)
    )
    # Ready, with a context the explanation prompts fit (the tiny model's own 128 tokens do not).
    LanguageModel.objects.filter(pk=model.pk).update(
        status=LanguageModel.Status.READY, config={**model.config, "n_positions": 4096}
    )
    return {
        "model": model.id,
        "dataset": dataset_create_from_texts(name="texts", texts=["one two", "three"], owner=writer,
                                             source="upload").id,
        "cache": cache.id,
        "sae": sae.id,
        "transcoders": [row.id for row in transcoder_rows(model, tiny_gpt2_folder, writer)],
    }  # fmt: skip


KIND_REQUESTS = {
    "extraction": lambda ids: (
        f"/api/models/{ids['model']}/extract-activations",
        {"dataset_id": ids["dataset"], "hooks": [HOOK]},
    ),
    "sae from a cache": lambda ids: ("/api/saes", {"cache_id": ids["cache"], "hook": HOOK}),
    "sae group from the model": lambda ids: (
        "/api/saes/groups",
        {"model_id": ids["model"], "dataset_id": ids["dataset"], "hooks": [HOOK]},
    ),
    "analysis": lambda ids: (f"/api/saes/{ids['sae']}/analyses", {}),
    "evaluation": lambda ids: (f"/api/saes/{ids['sae']}/evaluate", {}),
    "explanation": lambda ids: (
        f"/api/saes/{ids['sae']}/explanations",
        {"explainer_model": ids["model"], "selection": {"kind": "top", "count": 2}},
    ),
    "steering vector": lambda ids: (
        "/api/steering-vectors",
        {"model_id": ids["model"], "hook_name": HOOK, "positive": ["good"], "negative": ["bad"]},
    ),
    "attribution graph": lambda ids: (
        "/api/graphs",
        {"model_id": ids["model"], "transcoder_ids": ids["transcoders"], "prompt": "The cat"},
    ),
}


@pytest.mark.parametrize("kind", KIND_REQUESTS)
def test_every_kind_of_job_over_the_token_budget_is_refused_before_a_row_is_written(
    kind, inputs_of_every_kind, writer, client_for, settings
):
    """Each kind's request counts the tokens its job will process (an import processes none): one
    over ``JOB_MAX_TOKENS`` is 400 ``JOB_TOO_LARGE`` with its count, and no job row is written."""
    settings.JOB_MAX_TOKENS = 1
    path, body = KIND_REQUESTS[kind](inputs_of_every_kind)
    before = job_rows()
    response = client_for(writer).post(path, body, format="json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "JOB_TOO_LARGE" and error["details"]["limit"] == 1
    assert error["details"]["tokens"] > 1
    assert job_rows() == before
