"""Hub models through the whole stack: register, download during load, cancel, retry, gated, CLI.

The hub is ``LocalHub`` on 127.0.0.1 serving repos in the Hub's layout; huggingface_hub's own
code does the talking.
"""

import io
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.management import call_command
from huggingface_hub import constants as hub_constants

from engine.registry import LOADED_MODELS
from engine.testing.hub_standin import LocalHub
from engine.testing.tiny_models import build_tiny_model
from mistudio.access import OPERATOR
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.services import model_cancel_load, model_load_request, model_register

pytestmark = pytest.mark.django_db(transaction=True)
GATED_TOKEN = "hf_canary_token_never_shown_0123456789"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-sources")
    return {
        "tiny": build_tiny_model("gpt2", root / "tiny", size="tiny", seed=0),
        "small": build_tiny_model("gpt2", root / "small", size="small", seed=1),
    }


@pytest.fixture
def hub(tmp_path, sources, monkeypatch, settings):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    settings.MODEL_CACHE_DIR = tmp_path / "model-cache"
    settings.LOAD_RETRY_BASE_SECONDS = 0.01
    with LocalHub(tmp_path / "hub", gated={"acme/gated": GATED_TOKEN}) as server:
        server.add_repo("acme/tiny", sources["tiny"])
        server.add_repo("acme/small", sources["small"])
        server.add_repo("acme/gated", sources["tiny"])
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


class EventRecorder:
    """Joins a channel-layer group like a browser would and keeps what arrives."""

    def __init__(self, group: str):
        self.layer = get_channel_layer()
        self.channel = async_to_sync(self.layer.new_channel)()
        async_to_sync(self.layer.group_add)(group, self.channel)

    def drain(self) -> list[dict]:
        async def receive_all():
            import asyncio

            events = []
            while True:
                try:
                    events.append(await asyncio.wait_for(self.layer.receive(self.channel), timeout=0.5))
                except TimeoutError:
                    return events

        return async_to_sync(receive_all)()


def burst() -> None:
    run_worker(name="hub-worker", device="cpu", burst=True)


def test_register_reads_metadata_only_then_load_downloads_with_byte_progress(
    hub, sources, writer, client_for
):
    api = client_for(writer)
    response = api.post("/api/models", {"model_identifier": "acme/tiny"}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    weights_size = (sources["tiny"] / "model.safetensors").stat().st_size
    assert body["commit_sha"] and body["source"] == "huggingface" and body["model_type"] == "gpt2"
    assert hub.served("acme/tiny", "model.safetensors") < weights_size  # the header only

    events = EventRecorder(f"model.{body['id']}")
    assert api.post(f"/api/models/{body['id']}/load", {}, format="json").status_code == 202
    burst()
    model = LanguageModel.objects.get(pk=body["id"])
    assert model.status == "ready", (model.error_code, model.error_message)
    assert model.download_bytes_done == model.download_bytes_total >= weights_size
    received = events.drain()
    downloading = [event["data"] for event in received if event["event"] == "model:downloading"]
    assert downloading and downloading[-1]["download_bytes_done"] == downloading[-1]["download_bytes_total"]
    done = [event["download_bytes_done"] for event in downloading]
    assert done == sorted(done)
    stages = [event["data"]["stage"] for event in received if event["data"].get("stage")]
    first_seen = list(dict.fromkeys(stages))
    assert first_seen == ["resolve", "download", "weights", "place", "warm-up"]
    assert received[-1]["event"] == "model:ready"
    LOADED_MODELS.remove(model.id)


def test_cancel_during_the_download_then_a_new_load_resumes(hub, sources):
    hub.throttle_bytes_per_second = 6 * 2**20
    model = model_register(source="huggingface", identifier="acme/small", owner=None)
    model_load_request(model_id=model.id, actor=OPERATOR)
    worker = threading.Thread(target=burst)
    worker.start()
    deadline = time.monotonic() + 60
    while not (model.download_bytes_done or 0) and time.monotonic() < deadline:
        time.sleep(0.05)
        model.refresh_from_db()
    model_cancel_load(model_id=model.id)
    worker.join(timeout=60)
    model.refresh_from_db()
    assert model.status == "failed" and model.error_code == "LOAD_CANCELLED"
    weights_size = (sources["small"] / "model.safetensors").stat().st_size
    # Cancellation lands between download chunks (10 MiB) or stages; what was fetched is kept.

    hub.throttle_bytes_per_second = None
    model_load_request(model_id=model.id, actor=OPERATOR)
    burst()
    model.refresh_from_db()
    assert model.status == "ready"
    assert hub.served("acme/small", "model.safetensors") < 2 * weights_size  # resumed, not restarted
    LOADED_MODELS.remove(model.id)


def test_an_unreachable_hub_is_retried_three_times_then_fails(hub):
    model = model_register(source="huggingface", identifier="acme/tiny", owner=None)
    hub.stop()
    events = EventRecorder(f"model.{model.id}")
    model_load_request(model_id=model.id, actor=OPERATOR)
    burst()
    model.refresh_from_db()
    assert model.status == "failed" and model.error_code == "HUB_UNREACHABLE"
    retries = [e for e in events.drain() if "Retrying" in e["data"].get("message", "")]
    assert len(retries) == 3


def test_gated_models_need_the_token_which_is_never_shown(hub, writer, client_for, settings):
    api = client_for(writer)
    response = api.post("/api/models", {"model_identifier": "acme/gated"}, format="json")
    assert response.status_code == 403 and response.json()["error"]["code"] == "GATED_MODEL"

    settings.HF_TOKEN = GATED_TOKEN
    response = api.post("/api/models", {"model_identifier": "acme/gated"}, format="json")
    assert response.status_code == 201
    model_id = response.json()["id"]
    model_load_request(model_id=model_id, actor=OPERATOR)
    burst()
    model = LanguageModel.objects.get(pk=model_id)
    assert model.status == "ready"
    everything = api.get(f"/api/models/{model_id}").content.decode() + str(
        list(LanguageModel.objects.values())
    )
    assert GATED_TOKEN not in everything
    LOADED_MODELS.remove(model_id)


def test_download_model_command_draws_a_byte_progress_bar_and_reuses_the_cache(hub, sources):
    model = model_register(source="huggingface", identifier="acme/tiny", owner=None)
    out = io.StringIO()
    call_command("download_model", model.id, stdout=out, stderr=io.StringIO())
    assert "100%" in out.getvalue()
    served = hub.served("acme/tiny", "model.safetensors")
    call_command("download_model", model.id, stdout=io.StringIO(), stderr=io.StringIO())
    assert hub.served("acme/tiny", "model.safetensors") == served  # nothing fetched twice
    model.refresh_from_db()
    assert model.status == "pending"  # a download alone does not claim to load
    assert model.download_bytes_done == model.download_bytes_total > 0
