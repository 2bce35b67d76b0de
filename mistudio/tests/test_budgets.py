"""Memory budgets before allocation (``mistudio.budgets``): a job or worker request whose estimated
peak is over its worker's budget is refused with a 400 that states the estimate and the limit,
before any row is written or any worker is asked.

The second review's examples: a training that took a worker from 0.6 to 11.3 GB (batch x d_sae
was not budgeted), a mean ablation that took 5 GB.
"""

from __future__ import annotations

import json
import time

import pytest

from features.tests.conftest import completed_sae_row
from mistudio.budgets import memory_budget
from mistudio.redis_client import get_redis
from mistudio.workers import heartbeat_key
from models_app.models import LanguageModel
from models_app.services import model_register
from saes.models import SparseAutoencoder
from saes.tests.conftest import HOOK, write_planted_cache

pytestmark = pytest.mark.django_db

GiB = 2**30


@pytest.fixture
def model(tiny_gpt2_folder, writer):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)


@pytest.fixture
def loaded(model):
    """The model ready on a worker (the requests below are refused before anything reaches it)."""
    LanguageModel.objects.filter(pk=model.id).update(status="ready", host_worker="budget-worker")
    model.refresh_from_db()
    return model


def over_budget(response) -> dict:
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "MEMORY_BUDGET_EXCEEDED"
    details = error["details"]
    assert details["estimate_bytes"] > details["limit_bytes"] > 0
    assert f"{details['limit_bytes'] / GiB:.2f} GiB" in error["message"]
    assert f"{details['estimate_bytes'] / GiB:.2f} GiB" in error["message"]
    return details


def beat(name: str, *, free_bytes: int) -> None:
    payload = {"name": name, "memory_free_bytes": free_bytes, "last_heartbeat": time.time()}
    get_redis().set(heartbeat_key(name), json.dumps(payload), ex=60)


def test_a_training_whose_batch_x_d_sae_is_over_the_budget_is_refused_with_the_numbers(
    model, writer, client_for, settings
):
    settings.JOB_MEMORY_LIMIT_GB = 1
    cache = write_planted_cache(model, writer, samples=32)
    body = {
        "cache_id": cache.id,
        "hook": HOOK,
        "d_sae": 65536,
        "batch_size": 4096,
    }  # 1 GiB per [batch, d_sae]
    details = over_budget(client_for(writer).post("/api/saes", body, format="json"))
    assert details["limit_bytes"] == GiB
    assert details["parts"]["one_step's_[batch,_d_sae]_tensors"] == 4 * 4096 * 65536 * 4
    assert not SparseAutoencoder.objects.exists()
    # The same SAE with a smaller batch fits, and its row records the estimate it was admitted with.
    accepted = client_for(writer).post("/api/saes", {**body, "batch_size": 256}, format="json")
    assert accepted.status_code == 202, accepted.content
    assert 0 < accepted.json()["memory_estimate_bytes"] <= GiB


def test_without_a_set_limit_the_budget_is_half_of_what_the_worker_has_free(
    model, writer, client_for, settings
):
    settings.JOB_MEMORY_LIMIT_GB = 0
    assert memory_budget() is None  # no worker alive to ask: nothing bounds it here
    beat("budget-worker", free_bytes=2 * GiB)
    try:
        assert memory_budget() == GiB
        cache = write_planted_cache(model, writer, samples=32)
        body = {"cache_id": cache.id, "hook": HOOK, "d_sae": 65536, "batch_size": 4096}
        assert over_budget(client_for(writer).post("/api/saes", body, format="json"))["limit_bytes"] == GiB
    finally:
        get_redis().delete(heartbeat_key("budget-worker"))


def test_a_mean_ablation_and_a_live_encoding_over_the_budget_are_refused_before_the_worker(
    loaded, writer, client_for, settings
):
    settings.JOB_MEMORY_LIMIT_GB = 0.05
    sae = completed_sae_row(loaded, write_planted_cache(loaded, writer, samples=32), writer)
    api = client_for(writer)
    ablate = {"type": "ablate", "hook": HOOK, "sae": sae.id, "features": [0], "mean_from": sae.cache_id}
    body = {"model_id": loaded.id, "prompt": "Hi", "max_tokens": 2, "mistudio": {"interventions": [ablate]}}
    details = over_budget(api.post("/api/generate", body, format="json"))
    assert "one_chunk_encoded" in details["parts"]
    over_budget(api.post(f"/api/saes/{sae.id}/encode", {"text": "Hello there"}, format="json"))
    # A mean ablation of neurons takes the hook's mean from the cache's statistics: no budget issue.
    neurons = {**ablate, "neurons": [0]}
    del neurons["sae"], neurons["features"]
    body["mistudio"]["interventions"] = [neurons]
    assert api.post("/api/generate", body, format="json").status_code != 400
