"""The workers page and ``GET /api/workers``: real heartbeats, a model really loaded by a burst worker,
real queue lengths, the empty state, and an unreachable Redis said rather than raised."""

import re
import time

import pytest
from django.conf import settings
from django.test import Client

from engine.registry import LOADED_MODELS
from mistudio.redis_client import get_redis
from mistudio.workers import WorkerIdentity, heartbeat_key, run_worker, worker_queue, write_heartbeat
from models_app.services import model_register

WORKER = "page-worker"
GONE = "gone-worker"


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


@pytest.fixture
def clean_queues():
    """No jobs left in any queue by earlier tests (the page's totals count every queue)."""
    from rq import Queue

    for queue in Queue.all(connection=get_redis()):
        if settings.REDIS_KEY_PREFIX in queue.name:
            queue.empty()
    yield
    for name in (WORKER, GONE):
        worker_queue(name).empty()
        get_redis().delete(heartbeat_key(name))


@pytest.mark.django_db
def test_no_worker_shows_how_to_start_one(writer, clean_queues):
    page = signed_in(writer).get("/workers/").content.decode()
    assert "No worker is running" in page and "python manage.py worker" in page
    assert 'data-testid="worker-count">0<' in page
    assert '<span class="badge status-ready">reachable</span>' in page  # Redis
    assert f'data-queue="{settings.SHARED_QUEUE}"' in page  # the shared queue is always listed


@pytest.mark.django_db(transaction=True)
def test_a_live_worker_with_a_loaded_model_and_queued_jobs(
    writer, client_for, tiny_gpt2_folder, clean_queues
):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="page-gpt2", owner=None)
    assert client_for(writer).post(f"/api/models/{model.id}/load", {}, format="json").status_code == 202
    run_worker(name=WORKER, device="cpu", burst=True)  # loads it into this process's registry
    assert LOADED_MODELS.get(model.id) is not None  # released after the test by the root conftest
    write_heartbeat(WorkerIdentity(name=WORKER, device="cpu"), started_at=time.time() - 125)
    # Jobs wait in the worker's own queue, and in the queue of a worker that is gone.
    for _ in range(2):
        worker_queue(WORKER).enqueue("models_app.tasks.unload_model", model.id, job_timeout=60)
    worker_queue(GONE).enqueue("models_app.tasks.unload_model", model.id, job_timeout=60)

    page = signed_in(writer).get("/workers/").content.decode()
    body = client_for(writer).get("/api/workers").json()

    assert f'data-worker="{WORKER}"' in page and 'data-testid="device">cpu<' in page
    assert f'<a href="/models/{model.id}/">page-gpt2</a>' in page
    assert 'class="bar memory level-' in page and 'role="meter"' in page
    assert "up 2m 5s" in page or "up 2m 6s" in page
    assert 'data-testid="own-queue">2 waiting · 0 running<' in page
    totals = re.search(r'data-testid="job-totals">([^<]*)<', page).group(1)
    assert totals == "3 waiting · 0 running", (totals, body["queues"])
    assert f'<code>{GONE}</code> <span class="badge status-gone">gone</span>' in page

    assert body["redis"] == {"ok": True} and body["database"]["ok"] is True
    beat = next(beat for beat in body["workers"] if beat["name"] == WORKER)
    assert beat["device"] == "cpu" and beat["memory_total_bytes"] >= beat["memory_free_bytes"] > 0
    assert [(entry["model_id"], entry["name"]) for entry in beat["loaded_models"]] == [
        (model.id, "page-gpt2")
    ]
    assert beat["loaded_models"][0]["memory_usage_bytes"] > 0
    queues = {queue["name"]: queue for queue in body["queues"]}
    own = queues[f"{settings.REDIS_KEY_PREFIX}.worker.{WORKER}"]
    assert (own["kind"], own["worker"], own["worker_alive"], own["queued"]) == ("worker", WORKER, True, 2)
    gone = queues[f"{settings.REDIS_KEY_PREFIX}.worker.{GONE}"]
    assert (gone["worker"], gone["worker_alive"], gone["queued"]) == (GONE, False, 1)
    assert queues[settings.SHARED_QUEUE]["kind"] == "shared" and queues[settings.SHARED_QUEUE]["queued"] == 0
    assert abs(body["server_time"] - time.time()) < 60


@pytest.mark.django_db(transaction=True)
def test_a_split_worker_shows_its_budgets_and_what_a_model_keeps_on_disk(
    writer, client_for, tiny_llama_folder, clean_queues
):
    model = model_register(source="local", identifier=str(tiny_llama_folder), name="split-llama", owner=None)
    budgets = {"cpu": int(0.9 * model.memory_estimates["none"])}
    assert client_for(writer).post(f"/api/models/{model.id}/load", {}, format="json").status_code == 202
    run_worker(name=WORKER, device="auto", max_memory=budgets, burst=True)
    model.refresh_from_db()
    assert model.status == "ready" and model.memory_by_device["disk"] > 0
    identity = WorkerIdentity(name=WORKER, device="auto", max_memory=tuple(budgets.items()))
    write_heartbeat(identity, started_at=time.time())

    page = signed_in(writer).get("/workers/").content.decode()

    assert f'data-testid="device">{identity.placement.describe()}<' in page
    assert "rest on disk" in page and "Memory within the budgets" in page
    assert re.search(r'class="mem">[^<]+ \+ [^<]+ on disk<', page)
    detail = signed_in(writer).get(f"/models/{model.id}/").content.decode()
    assert 'data-field="placement"' in detail and "disk" in detail


@pytest.mark.django_db
def test_an_unreachable_redis_is_said_on_the_page_and_in_the_api(writer, client_for, settings):
    settings.EMBEDDED_REDIS = False
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # the discard port: nothing listens
    page = signed_in(writer).get("/workers/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "Redis is unreachable." in text and '<span class="badge status-failed">unreachable</span>' in text
    assert "No worker is running" not in text  # we cannot know: the heartbeats live in Redis
    body = client_for(writer).get("/api/workers").json()
    assert body["redis"] == {"ok": False, "error": "unreachable"}
    assert body["workers"] == [] and body["queues"] == [] and body["database"]["ok"] is True


@pytest.mark.django_db
def test_a_reader_may_see_the_workers_and_visitors_must_sign_in(reader):
    assert signed_in(reader).get("/workers/").status_code == 200
    response = Client().get("/workers/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.django_db(transaction=True)
def test_another_users_private_model_on_a_worker_is_not_named_to_anyone_else(
    writer, reader, model_admin, client_for, tiny_gpt2_folder, clean_queues
):
    """The workers API and page, and anonymous /healthz, named other users'
    private models (and showed hosts, pids, versions to anyone)."""
    from conftest import make_user
    from mistudio.access import OPERATOR
    from models_app.services import model_load_request

    other = make_user("olga-other", "model:write")
    no_role = make_user("nora-norole", None)
    model = model_register(
        source="local", identifier=str(tiny_gpt2_folder), name="walts-secret", owner=writer
    )
    model_load_request(model_id=model.id, actor=OPERATOR)
    run_worker(name=WORKER, device="cpu", burst=True)
    write_heartbeat(WorkerIdentity(name=WORKER, device="cpu"), started_at=time.time() - 5)
    loaded_bytes = LOADED_MODELS.get(model.id).memory_usage_bytes

    for user in (other, reader):
        body = client_for(user).get("/api/workers")
        page = signed_in(user).get("/workers/")
        for answer in (body.content.decode(), page.content.decode()):
            assert model.id not in answer and "walts-secret" not in answer
        beat = next(beat for beat in body.json()["workers"] if beat["name"] == WORKER)
        assert beat["loaded_models"] == [] and beat["other_models_bytes"] == loaded_bytes
        assert "hostname" not in beat and "pid" not in beat
        assert "Other users' private models" in page.content.decode()
    assert client_for(no_role).get("/api/workers").status_code == 403

    for user in (writer, model_admin):  # the owner, and an admin, see it named
        beat = next(b for b in client_for(user).get("/api/workers").json()["workers"] if b["name"] == WORKER)
        assert [entry["name"] for entry in beat["loaded_models"]] == ["walts-secret"]
        assert beat["other_models_bytes"] == 0
    assert "hostname" in next(
        b for b in client_for(model_admin).get("/api/workers").json()["workers"] if b["name"] == WORKER
    )

    anonymous = Client().get("/healthz")
    assert anonymous.status_code == 200
    assert anonymous.json() == {
        "status": "ok",
        "dependencies": {"database": "up", "redis": "up", "workers": "up"},
    }
    detailed = client_for(model_admin).get("/healthz").json()
    beat = next(beat for beat in detailed["details"]["workers"] if beat["name"] == WORKER)
    assert beat["loaded_models"][0]["model_id"] == model.id and beat["pid"] > 0
    assert "torch" in detailed["details"]["versions"]
    assert "details" not in client_for(writer).get("/healthz").json()  # a writer is not an operator
