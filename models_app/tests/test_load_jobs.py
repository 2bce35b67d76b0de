"""A load enqueued through the API runs in a real SimpleWorker; its events reach a WebSocket client."""

import pytest
import torch
from asgiref.sync import sync_to_async
from transformers import AutoModelForCausalLM

from engine.registry import LOADED_MODELS
from mistudio.tests.websocket import events_socket, token_header
from mistudio.workers import read_heartbeats, run_worker, worker_queue
from models_app.models import LanguageModel
from models_app.services import model_register

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "pytest-worker"


def run_burst_worker() -> None:
    run_worker(name=WORKER, device="cpu", burst=True)


async def events_until(communicator, final_events: set[str]) -> list[dict]:
    received = []
    while True:
        message = await communicator.receive_json_from(timeout=60)
        if message["type"] == "event":
            received.append(message)
            if message["event"] in final_events:
                return received


@pytest.fixture
def tiny_model(tiny_gpt2_folder, writer):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gpt2", owner=writer)
    yield model
    LOADED_MODELS.remove(model.id)


async def test_load_and_unload_through_the_api_a_worker_and_the_websocket(writer, client_for, tiny_model):
    communicator = events_socket(token_header(writer))
    assert (await communicator.connect())[0]
    await communicator.send_json_to({"action": "subscribe", "groups": [f"model.{tiny_model.id}"]})
    assert (await communicator.receive_json_from(timeout=5))["data"]["status"] == "pending"

    api = client_for(writer)
    response = await sync_to_async(api.post)(f"/api/models/{tiny_model.id}/load", {}, format="json")
    assert response.status_code == 202, response.content
    assert response.json()["status"] == "loading"
    again = await sync_to_async(api.post)(f"/api/models/{tiny_model.id}/load", {}, format="json")
    assert again.status_code == 409 and again.json()["error"]["code"] == "ALREADY_LOADING"

    await sync_to_async(run_burst_worker, thread_sensitive=False)()

    events = await events_until(communicator, {"model:ready", "model:failed"})
    assert events[-1]["event"] == "model:ready", events[-1]
    progress = [event["data"]["progress"] for event in events if event["event"] == "model:loading"]
    assert progress == sorted(progress) and len(progress) >= 3
    ready = events[-1]["data"]
    assert ready["host_worker"] == WORKER and ready["memory_usage_bytes"] > 0

    row = await sync_to_async(LanguageModel.objects.get)(pk=tiny_model.id)
    assert row.status == "ready" and row.host_worker == WORKER and row.loaded_at is not None
    assert row.rq_job_id

    # The worker holds the real model: its logits equal a fresh load of the same folder.
    loaded = LOADED_MODELS.get(tiny_model.id)
    reference = AutoModelForCausalLM.from_pretrained(row.identifier, use_safetensors=True).eval()
    input_ids = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids).logits, reference(input_ids).logits)

    response = await sync_to_async(api.post)(f"/api/models/{tiny_model.id}/unload", {}, format="json")
    assert response.status_code == 202
    assert await sync_to_async(lambda: worker_queue(WORKER).count)() == 1  # routed to the host's own queue
    await sync_to_async(run_burst_worker, thread_sensitive=False)()
    events = await events_until(communicator, {"model:unloaded"})
    assert events[-1]["data"]["status"] == "unloaded"
    assert LOADED_MODELS.get(tiny_model.id) is None
    await communicator.disconnect()


def test_a_failed_load_leaves_the_row_failed_with_a_code(writer, client_for, tiny_model):
    (tiny_model_folder := tiny_model.identifier)
    LanguageModel.objects.filter(pk=tiny_model.id).update(identifier=tiny_model_folder + "-gone")
    response = client_for(writer).post(f"/api/models/{tiny_model.id}/load", {}, format="json")
    assert response.status_code == 202
    run_burst_worker()
    tiny_model.refresh_from_db()
    assert tiny_model.status == "failed"
    assert tiny_model.error_code == "INVALID_LOCAL_PATH"
    assert "/" not in tiny_model.error_message  # no server path in what users see


def test_heartbeat_lists_the_loaded_model_while_the_worker_runs(writer, client_for, tiny_model):
    client_for(writer).post(f"/api/models/{tiny_model.id}/load", {}, format="json")
    run_worker(name=WORKER, device="cpu", burst=True)
    from mistudio.redis_client import get_redis
    from mistudio.workers import WorkerIdentity, heartbeat_key, write_heartbeat

    write_heartbeat(WorkerIdentity(name=WORKER, device="cpu"), started_at=0)
    beat = next(beat for beat in read_heartbeats() if beat["name"] == WORKER)
    get_redis().delete(heartbeat_key(WORKER))
    assert [entry["model_id"] for entry in beat["loaded_models"]] == [tiny_model.id]
    assert beat["memory_total_bytes"] >= beat["memory_free_bytes"] > 0


def test_a_restarted_worker_releases_the_models_it_hosted(tiny_model):
    fields = tiny_model.mark_ready(host_worker=WORKER, memory_usage_bytes=1, load_time_seconds=1)
    tiny_model.save(update_fields=fields)
    run_burst_worker()
    tiny_model.refresh_from_db()
    assert tiny_model.status == "unloaded" and tiny_model.error_code == "WORKER_LOST"


def test_models_of_a_vanished_worker_become_unloaded_with_worker_lost(tiny_model):
    from models_app.services import worker_lost_reconcile

    fields = tiny_model.mark_ready(host_worker="worker-that-died", memory_usage_bytes=1, load_time_seconds=1)
    tiny_model.save(update_fields=fields)
    assert worker_lost_reconcile() == [tiny_model.id]
    tiny_model.refresh_from_db()
    assert tiny_model.status == "unloaded" and tiny_model.error_code == "WORKER_LOST"


@pytest.mark.slow
def test_a_worker_process_that_stops_leaves_its_models_unloaded(writer, client_for, tiny_model, process_env):
    import subprocess
    import sys
    import time

    from django.conf import settings

    client_for(writer).post(f"/api/models/{tiny_model.id}/load", {}, format="json")
    worker = subprocess.Popen(
        [sys.executable, "manage.py", "worker", "--name", "stopping-worker"],
        cwd=settings.BASE_DIR, env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            tiny_model.refresh_from_db()
            if tiny_model.status != "loading":
                break
            time.sleep(0.2)
        assert tiny_model.status == "ready" and tiny_model.host_worker == "stopping-worker"
    finally:
        worker.terminate()
        assert worker.wait(timeout=30) == 0, worker.stderr.read().decode()[-2000:]
    tiny_model.refresh_from_db()
    assert tiny_model.status == "unloaded" and tiny_model.error_code == ""


def test_a_link_out_of_the_roots_added_after_registration_is_refused_at_load(
    writer, client_for, model_copy, tmp_path
):
    import shutil

    from activations.selectors import model_folder
    from engine.inspection import InspectionError
    from engine.loading import load_weights

    folder = model_copy("linked-later", {})
    model = model_register(source="local", identifier=str(folder), name="linked-later", owner=writer)
    assert model_folder(model) == folder  # its tokenizer may be read by the web process
    # Later, a tokenizer file becomes a link to a file outside the roots.
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(folder / "tokenizer.json", outside / "tokenizer.json")
    (folder / "tokenizer.json").symlink_to(outside / "tokenizer.json")

    response = client_for(writer).post(f"/api/models/{model.id}/load", {}, format="json")
    assert response.status_code == 202, response.content
    run_burst_worker()
    model.refresh_from_db()
    assert (model.status, model.error_code, model.error_details) == (
        "failed",
        "UNSAFE_PATH",
        {"file": "tokenizer.json"},
    )
    assert LOADED_MODELS.get(model.id) is None
    assert model_folder(model) is None  # nor does the web process read its tokenizer
    # The engine refuses too, whoever calls it.
    with pytest.raises(InspectionError) as refused:
        load_weights(folder, model_type="gpt2", quantization="none", device="cpu", roots=[folder.parent])
    assert refused.value.code == "UNSAFE_PATH"
