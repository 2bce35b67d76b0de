"""Work dies with its request: every way a generation request ends without its answer withdraws
its rows — its time limit, an error, its client gone, the process that made it gone (the lease
lapses) — and rows nobody will run leave their owner's share (the reconcile)."""

import time

import pytest

from generation.models import Generation
from generation.services import SamplingRequest, generation_request
from generation.streams import reader_key
from generation.tasks import generations_reconcile
from generation.tests.conftest import burst, token_times
from mistudio.redis_client import get_redis
from models_app.models import LanguageModel

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_request_past_its_time_limit_is_a_504_and_its_rows_are_withdrawn(
    settings, ready_model, client_for, writer
):
    settings.GENERATION_REQUEST_TIMEOUT_SECONDS = 1
    api = client_for(writer)
    started = time.monotonic()
    response = api.post(
        "/api/generate",
        {"model_id": ready_model.id, "prompt": ["a", "b", "c"], "max_tokens": 5},
        format="json",
    )
    assert response.status_code == 504 and response.json()["error"]["code"] == "GENERATION_TIMEOUT"
    assert time.monotonic() - started < 5
    rows = Generation.objects.filter(owner=writer)
    assert rows.count() == 3 and set(rows.values_list("status", flat=True)) == {"cancelled"}
    # A stream that does not start in time: the same, in OpenAI's shape.
    chat = {"model": ready_model.id, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    streamed = api.post("/v1/chat/completions", chat, format="json")
    assert streamed.status_code == 504 and streamed.json()["error"]["code"] == "GENERATION_TIMEOUT"
    assert not Generation.objects.filter(owner=writer, status__in=Generation.ACTIVE).exists()


def test_rows_whose_request_died_are_withdrawn_before_they_run(loaded_llama, writer):
    rows = generation_request(
        model_id=loaded_llama.id, owner=writer, prompts=["one", "two"],
        sampling=SamplingRequest(max_tokens=50, max_tokens_explicit=True, ignore_eos=True),
    )  # fmt: skip
    # The process that made them died: nobody read them, their leases lapsed.
    get_redis().delete(*(reader_key(row.id) for row in rows))
    burst()
    for row in Generation.objects.filter(pk__in=[row.pk for row in rows]):
        assert row.status == "cancelled" and row.output_token_ids == [] and token_times(row.id) == []


def test_rows_nobody_will_run_are_settled_and_leave_the_share(settings, ready_model, writer):
    rows = generation_request(
        model_id=ready_model.id, owner=writer, prompts=["one", "two"], sampling=SamplingRequest(max_tokens=5)
    )
    Generation.objects.filter(pk=rows[0].pk).update(status="running", host_worker="idle-worker")
    # idle-worker has no heartbeat: the running row is lost; the model is unloaded: the queued one cannot run.
    LanguageModel.objects.filter(pk=ready_model.pk).update(status="unloaded")
    assert sorted(generations_reconcile()) == sorted(row.id for row in rows)
    lost, unloaded = (Generation.objects.get(pk=row.pk) for row in rows)
    assert (lost.status, lost.error_code) == ("failed", "WORKER_LOST")
    assert (unloaded.status, unloaded.error_code) == ("failed", "MODEL_NOT_LOADED")
    assert generations_reconcile() == []
