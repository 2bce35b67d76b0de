"""Fixtures of the generation tests: a model ready on a worker that never runs anything, and the
tiny Llama loaded by a real (burst) worker in this process."""

import pytest

from generation.streams import stream_key
from mistudio.access import OPERATOR
from mistudio.redis_client import get_redis
from mistudio.stream_hub import entry_event
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.services import model_load_request, model_register

WORKER = "generation-worker"


def token_times(generation_id: str) -> list[float]:
    """When each token event of the generation's stream was written (entry ids are milliseconds)."""
    return [
        int(entry_id.decode().partition("-")[0]) / 1000
        for entry_id, fields in get_redis().xrange(stream_key(generation_id))
        if entry_event(fields)["type"] == "token"
    ]


def burst() -> None:
    """Run what waits for the test worker, in this process, until its queues are empty."""
    run_worker(name=WORKER, device="cpu", burst=True)


@pytest.fixture
def ready_model(writer, tiny_gpt2_folder):
    """A registered model, ``ready`` on a worker that never runs anything here: admitted rows stay
    queued."""
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), owner=writer, shared=True)
    LanguageModel.objects.filter(pk=model.pk).update(
        status=LanguageModel.Status.READY, host_worker="idle-worker"
    )
    return LanguageModel.objects.get(pk=model.pk)


@pytest.fixture
def loaded_llama(tiny_llama_folder, writer):
    """The tiny Llama (shared: every test user may generate with it), loaded by :func:`burst`."""
    model = model_register(
        source="local", identifier=str(tiny_llama_folder), name="tiny-llama", owner=writer, shared=True
    )
    model_load_request(model_id=model.id, actor=OPERATOR)
    burst()
    model.refresh_from_db()
    assert model.status == LanguageModel.Status.READY
    return model
