"""Memory budget in a real worker: LRU eviction, pinning, count cap, INSUFFICIENT_MEMORY, keep-alive."""

import threading
import time

import pytest
import torch
from django.conf import settings as django_settings

from engine.registry import LOADED_MODELS
from engine.testing.tiny_models import build_tiny_model
from mistudio.access import OPERATOR
from mistudio.workers import WorkerIdentity, heartbeat_key, run_worker, shared_queue, write_heartbeat
from models_app.models import LanguageModel
from models_app.services import model_load_request, model_register, unload_idle_models

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "memory-worker"


@pytest.fixture
def three_models():
    models = []
    for index, name in enumerate(["alpha", "beta", "gamma"]):
        folder = django_settings.LOCAL_MODEL_ROOTS[0] / f"tiny-{name}"
        if not (folder / "config.json").exists():
            build_tiny_model("gpt2", folder, size="tiny", seed=index)
        models.append(model_register(source="local", identifier=str(folder), name=name, owner=None))
    yield models
    for model in models:
        LOADED_MODELS.remove(model.id)


def load(model: LanguageModel) -> LanguageModel:
    model_load_request(model_id=model.id, actor=OPERATOR)
    run_worker(name=WORKER, device="cpu", burst=True)
    model.refresh_from_db()
    return model


def budget_for(count: float, model: LanguageModel, settings) -> None:
    """A budget of ``count`` times one model's estimate (the tiny models are all the same size)."""
    settings.MODEL_MEMORY_LIMIT_GB = count * model.memory_estimates["none"] / 2**30


def test_least_recently_used_unpinned_model_is_evicted(three_models, settings):
    alpha, beta, gamma = three_models
    budget_for(2.5, alpha, settings)
    assert load(alpha).status == "ready" and load(beta).status == "ready"
    time.sleep(0.01)
    LOADED_MODELS.get(alpha.id)  # alpha used after beta: beta is now the least recently used
    assert load(gamma).status == "ready"
    alpha.refresh_from_db()
    beta.refresh_from_db()
    assert alpha.status == "ready"
    assert beta.status == "unloaded" and beta.unload_reason == "evicted"
    assert LOADED_MODELS.get(beta.id) is None


def test_pinned_models_are_never_evicted_and_then_memory_runs_out(three_models, settings):
    alpha, beta, gamma = three_models
    budget_for(2.5, alpha, settings)
    for model in (alpha, beta):
        model.pinned = True
        model.save(update_fields=["pinned"])
        assert load(model).status == "ready"
    gamma = load(gamma)
    assert gamma.status == "failed" and gamma.error_code == "INSUFFICIENT_MEMORY"
    assert gamma.error_details["required_gb"] > gamma.error_details["available_gb"] >= 0
    assert LanguageModel.objects.filter(status="ready").count() == 2


def test_the_model_count_cap_evicts_too(three_models, settings):
    alpha, beta, _ = three_models
    settings.MAX_LOADED_MODELS = 1
    assert load(alpha).status == "ready"
    assert load(beta).status == "ready"
    alpha.refresh_from_db()
    assert alpha.status == "unloaded" and alpha.unload_reason == "evicted"


def test_the_web_refuses_at_once_when_no_live_worker_could_fit_it(three_models, settings, writer, client_for):
    alpha = three_models[0]
    budget_for(0.5, alpha, settings)
    write_heartbeat(
        WorkerIdentity(name=WORKER, device="cpu"), started_at=time.time()
    )  # the real heartbeat code
    try:
        response = client_for(writer).post(f"/api/models/{alpha.id}/load", {}, format="json")
    finally:
        from mistudio.redis_client import get_redis

        get_redis().delete(heartbeat_key(WORKER))
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "INSUFFICIENT_MEMORY"
    assert error["details"]["required_gb"] > error["details"]["available_gb"]
    alpha.refresh_from_db()
    assert alpha.status == "pending"  # nothing queued, nothing changed


def test_a_worker_that_splits_models_takes_one_too_big_for_its_memory(
    three_models, settings, writer, client_for
):
    """A --device auto worker offloads what does not fit: the web does not refuse the load, and
    the memory report says it fits there."""
    alpha = three_models[0]
    budget_for(0.5, alpha, settings)
    half = alpha.memory_estimates["none"] // 2
    split = WorkerIdentity(name=WORKER, device="auto", max_memory=(("cpu", half),))
    write_heartbeat(split, started_at=time.time())
    api = client_for(writer)
    try:
        report = api.get(f"/api/models/{alpha.id}/memory-estimate").json()
        response = api.post(f"/api/models/{alpha.id}/load", {}, format="json")
    finally:
        from mistudio.redis_client import get_redis

        get_redis().delete(heartbeat_key(WORKER))
        shared_queue().empty()  # the load is not run here
    (worker,) = report["workers"]
    assert worker["splits_models"] is True and worker["capacity_bytes"] < alpha.memory_estimates["none"]
    assert worker["fits"]["none"] is True
    assert response.status_code == 202, response.content
    assert response.json()["status"] == "loading"


def test_an_idle_model_past_its_keep_alive_is_unloaded(three_models):
    alpha = three_models[0]
    alpha.keep_alive_seconds = 1
    alpha.save(update_fields=["keep_alive_seconds"])
    assert load(alpha).status == "ready"
    time.sleep(1.2)  # unused for longer than its keep-alive
    unload_idle_models(WorkerIdentity(name=WORKER, device="cpu"))  # the heartbeat's hook
    run_worker(name=WORKER, device="cpu", burst=True)
    alpha.refresh_from_db()
    assert alpha.status == "unloaded" and alpha.unload_reason == "idle"
    assert LOADED_MODELS.get(alpha.id) is None


def test_a_load_never_evicts_the_model_of_a_job_that_yielded_to_it(three_models, settings, monkeypatch):
    """An extraction on alpha yields its worker to beta's load (a person waits on a load); with room
    for one model, beta's load may not evict alpha (the extraction resumes on it): it fails
    ``INSUFFICIENT_MEMORY``, and the extraction ends with the activations of an unsliced run."""
    from activations.models import Dataset, ExtractionJob
    from activations.services import dataset_create_from_texts, extraction_request
    from activations.store import ActivationStore, verify
    from engine.extraction import extract, plan_batches, tokenize_samples
    from mistudio import job_runner
    from models_app.tests.live_stack import wait_until

    monkeypatch.setattr(job_runner, "YIELD_POLL_SECONDS", 0.02)
    monkeypatch.setattr(job_runner, "IDLE_WORKER_GRACE_SECONDS", 0.05)
    alpha, beta, _ = three_models
    settings.MAX_LOADED_MODELS = 1
    assert load(alpha).status == "ready"
    texts = [f"Sample {index}: " + "the quick brown fox jumps over the lazy dog " * (1 + index % 5)
             for index in range(1500)]  # fmt: skip
    dataset = dataset_create_from_texts(name="many", texts=texts, owner=None, source=Dataset.Source.BUILTIN)
    job = extraction_request(
        model_id=alpha.id, dataset_id=dataset.id, owner=None, layers=[0, 1], batch_size=2, max_length=32
    )

    def load_beta_while_it_runs() -> None:
        running = ExtractionJob.objects.filter(pk=job.pk, status="running", samples_processed__gt=0)
        wait_until(running.exists, timeout=60, interval=0.01, what="the extraction's first batches")
        model_load_request(model_id=beta.id, actor=OPERATOR)

    loader = threading.Thread(target=load_beta_while_it_runs)
    loader.start()
    run_worker(name=WORKER, device="cpu", burst=True)
    loader.join(timeout=60)
    for row in (alpha, beta, job):
        row.refresh_from_db()
    assert (beta.status, beta.error_code) == ("failed", "INSUFFICIENT_MEMORY")
    assert alpha.status == "ready" and LOADED_MODELS.get(alpha.id) is not None
    assert job.status == "completed", (job.error_code, job.error_message)

    assert verify(job.cache.directory) == []
    store = ActivationStore.open(job.cache.directory)
    loaded = LOADED_MODELS.get(alpha.id)
    tokenized = tokenize_samples(loaded.tokenizer, texts, 32)
    batches = extract(loaded.model, tokenized, plan_batches([len(ids) for ids in tokenized], 2),
                      hooks=store.hooks, dtype=store.manifest["dtype"])  # fmt: skip
    expected = {hook: [] for hook in store.hooks}
    for batch in batches:
        for hook in store.hooks:
            expected[hook].append(batch.activations[hook])
    for hook, parts in expected.items():
        assert torch.equal(store.get(hook, as_torch=True), torch.cat(parts).cpu()), hook
