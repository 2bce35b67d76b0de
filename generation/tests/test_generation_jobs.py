"""Generation jobs in a real (burst) worker: batching, cancel, failures, events to the browser group."""

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from generation.models import Generation, storable_text
from generation.services import SamplingRequest, generation_request, generation_stop
from generation.streams import iter_events
from generation.tests.conftest import burst
from mistudio.events import BACKGROUND_PUBLISHER
from mistudio.tests.websocket import events_socket, token_header
from models_app.models import LanguageModel

pytestmark = pytest.mark.django_db(transaction=True)


def browser(user) -> WebsocketCommunicator:
    return events_socket(token_header(user))


def request(model, prompts, *, owner=None, **sampling) -> list[Generation]:
    return generation_request(
        model_id=model.id,
        owner=owner,
        prompts=prompts,
        sampling=SamplingRequest(temperature=0, ignore_eos=True, max_tokens_explicit=True, **sampling),
        interface=Generation.Interface.CLI,
    )


def test_queued_requests_run_as_one_batch_with_their_own_results(loaded_llama):
    alone = {}
    for prompt in ["One prompt", "Another, longer prompt here"]:
        [row] = request(loaded_llama, [prompt], max_tokens=8)
        burst()
        row.refresh_from_db()
        alone[prompt] = row.output_token_ids
    rows = [
        *request(loaded_llama, ["One prompt"], max_tokens=8),
        *request(loaded_llama, ["Another, longer prompt here"], max_tokens=8),
    ]
    burst()  # the first job takes both; the second job finds its row taken and returns
    for row in rows:
        row.refresh_from_db()
        assert row.status == "completed" and row.output_token_ids == alone[row.prompt]
        assert row.started_at is not None and row.completion_tokens == 8
    events = list(iter_events(rows[1].id))
    assert [event["type"] for event in events] == ["started", *["token"] * 8, "done"]
    assert (
        storable_text("".join(event.get("text", "") for event in events if event["type"] == "token"))
        == rows[1].output_text
    )


def test_a_request_cancelled_while_queued_never_runs(loaded_llama):
    [row] = request(loaded_llama, ["Never mind"], max_tokens=8)
    generation_stop(row.id)
    row.refresh_from_db()
    assert row.status == "cancelled"
    assert [event["type"] for event in iter_events(row.id)] == ["done"]
    burst()
    row.refresh_from_db()
    assert row.status == "cancelled" and row.output_token_ids == []


def test_a_model_unloaded_before_its_job_runs_fails_the_row(loaded_llama):
    from engine.loading import release
    from engine.registry import LOADED_MODELS

    [row] = request(loaded_llama, ["Too late"], max_tokens=4)
    release(LOADED_MODELS.remove(loaded_llama.id))
    burst()
    row.refresh_from_db()
    assert row.status == "failed" and row.error_code == "MODEL_NOT_LOADED"
    final = list(iter_events(row.id))[-1]
    assert final["type"] == "failed" and final["status"] == 409


def test_an_unexpected_error_fails_the_rows_instead_of_leaving_them_running(loaded_llama):
    [row] = request(loaded_llama, ["Broken"], max_tokens=4)
    Generation.objects.filter(pk=row.pk).update(parameters={"broken": True})  # a row the task cannot read
    burst()
    row.refresh_from_db()
    assert row.status == "failed" and row.error_code == "GENERATION_FAILED"
    assert list(iter_events(row.id))[-1]["type"] == "failed"


def test_a_prompt_over_the_context_fails_with_a_client_error(loaded_llama):
    [row] = request(loaded_llama, ["word " * 50], max_tokens=4090)
    burst()
    row.refresh_from_db()
    assert row.status == "failed" and row.error_code == "CONTEXT_LENGTH_EXCEEDED"
    assert list(iter_events(row.id))[-1]["status"] == 400


async def test_tokens_reach_the_generation_group_of_a_subscribed_browser(loaded_llama, writer):
    [row] = await sync_to_async(request)(loaded_llama, ["Stream to the page"], owner=writer, max_tokens=24)
    communicator = browser(writer)
    connected, _ = await communicator.connect()
    assert connected
    await communicator.send_json_to({"action": "subscribe", "groups": [f"generation.{row.id}"]})
    snapshot = await communicator.receive_json_from(timeout=5)
    assert snapshot["type"] == "snapshot" and snapshot["data"]["status"] == "queued"
    await sync_to_async(burst)()
    await sync_to_async(BACKGROUND_PUBLISHER.flush)()
    events = []
    while not events or events[-1]["event"] != "generation:completed":
        events.append(await communicator.receive_json_from(timeout=5))
    await communicator.disconnect()
    names = [event["event"] for event in events]
    assert names[0] == "generation:started" and "generation:tokens" in names
    text = "".join(event["data"]["text"] for event in events if event["event"] == "generation:tokens")
    await sync_to_async(row.refresh_from_db)()
    assert storable_text(text) == row.output_text
    assert events[-1]["data"]["usage"]["completion_tokens"] == 24


async def test_another_user_cannot_subscribe_to_a_generation(loaded_llama, writer, reader):
    [row] = await sync_to_async(generation_request)(
        model_id=loaded_llama.id, owner=writer, prompts=["Mine"], sampling=SamplingRequest(max_tokens=2)
    )
    communicator = browser(reader)
    connected, _ = await communicator.connect()
    assert connected
    await communicator.send_json_to({"action": "subscribe", "groups": [f"generation.{row.id}"]})
    reply = await communicator.receive_json_from(timeout=5)
    assert reply["type"] == "error"
    await communicator.disconnect()


def test_a_generated_nul_character_reaches_the_client_and_the_row_keeps_a_placeholder(loaded_llama):
    """PostgreSQL text cannot hold NUL; a model that generates one must not fail the request."""
    import torch

    from engine.registry import LOADED_MODELS

    loaded = LOADED_MODELS.get(loaded_llama.id)
    [nul_id] = loaded.tokenizer.encode("\x00", add_special_tokens=False)
    bias = torch.zeros(loaded.model.config.vocab_size)
    bias[nul_id] = 1e4  # steer the real model: every next token is the NUL byte

    handle = loaded.model.lm_head.register_forward_hook(lambda module, args, output: output + bias)
    try:
        [row] = request(loaded_llama, ["Say nothing"], max_tokens=3)
        burst()
    finally:
        handle.remove()
    row.refresh_from_db()
    assert row.status == "completed" and row.output_token_ids == [nul_id] * 3
    assert row.output_text == "\ufffd" * 3
    final = list(iter_events(row.id))[-1]
    assert final["type"] == "done" and final["output_text"] == "\x00" * 3


def test_the_list_of_generations_leaves_out_prompts_outputs_and_token_ids(writer, client_for):
    """A list of up to 200 rows must not carry each one's whole prompt and tokens (bounded rows)."""
    model = LanguageModel.objects.create(name="m", source="local", identifier="/nowhere", model_type="gpt2")
    Generation.objects.create(
        model=model, owner=writer, prompt="p" * 5000, output_text="o" * 5000,
        input_token_ids=list(range(3000)), output_token_ids=list(range(3000)), parameters={},
    )  # fmt: skip
    (row,) = client_for(writer).get("/api/generations").json()["results"]
    assert (row["prompt_preview"], row["output_preview"]) == ("p" * 200, "o" * 200)
    assert not {"prompt", "output_text", "input_token_ids", "output_token_ids", "messages"} & set(row)
    whole = client_for(writer).get(f"/api/generations/{row['request_id']}").json()
    assert len(whole["prompt"]) == 5000 and len(whole["output_token_ids"]) == 3000


def test_a_worker_that_died_mid_batch_fails_its_rows_when_it_starts_again(loaded_llama):
    """A claimed row belongs to its worker from the claim on; rows still ``running`` under the name
    of a worker that starts were its last process's (its heartbeat under the same name would hide
    them from the reconcile): they fail ``WORKER_LOST`` with a final event, and count no more."""
    from generation.tasks import claim_batch, generations_on_worker_start
    from generation.tests.conftest import WORKER
    from mistudio import workers

    rows = request(loaded_llama, ["Crash", "Here"], max_tokens=4)
    identity = workers.WorkerIdentity(name=WORKER, device="cpu")
    claimed = claim_batch(loaded_llama.id, worker_name=WORKER)  # and the process dies here
    assert {row.pk for row in claimed} == {row.pk for row in rows}
    assert set(Generation.objects.values_list("host_worker", flat=True)) == {WORKER}
    generations_on_worker_start(workers.WorkerIdentity(name="another-worker", device="cpu"))
    assert set(Generation.objects.values_list("status", flat=True)) == {Generation.Status.RUNNING}
    generations_on_worker_start(identity)
    for row in Generation.objects.all():
        assert (row.status, row.error_code) == (Generation.Status.FAILED, "WORKER_LOST")
        assert list(iter_events(row.id))[-1]["type"] == "failed"


def test_a_batch_stopped_by_its_worker_fails_its_rows_and_lets_the_stop_through(
    loaded_llama, monkeypatch, settings
):
    """A signal or a time limit that stops the worker mid-batch (a BaseException: also the time
    limit of a job the batch ran between the steps of) leaves no row ``running`` behind it, and
    the rows still waiting keep a token."""
    from generation import tasks
    from generation.tests.conftest import WORKER
    from mistudio import workers

    def stopped(rows, poll):
        raise SystemExit("stopped")

    settings.GENERATION_MAX_BATCH = 1
    first, second = (request(loaded_llama, [prompt], max_tokens=4)[0] for prompt in ("Stop", "Wait"))
    queue = workers.interactive_queue(WORKER)
    queue.empty()
    monkeypatch.setattr(tasks, "run_batch", stopped)
    monkeypatch.setattr(workers, "CURRENT_WORKER", workers.WorkerIdentity(name=WORKER, device="cpu"))
    with pytest.raises(SystemExit):
        tasks.run_generation(first.id)
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, first.error_code) == (Generation.Status.FAILED, "WORKER_LOST")
    assert second.status == Generation.Status.QUEUED and queue.count == 1
    monkeypatch.undo()
    burst()
    second.refresh_from_db()
    assert second.status == Generation.Status.COMPLETED


def test_a_token_that_took_no_row_passes_on_while_rows_wait(loaded_llama, writer):
    """Between a job's steps a token may claim nothing (its rows' owners had more of the worker
    than the job's owner): it must not be lost while they wait, or they would wait for ever."""
    from conftest import make_user
    from generation import tasks
    from mistudio import workers
    from mistudio.worker_clock import CLOCK

    (row,) = request(loaded_llama, ["Later"], owner=writer, max_tokens=4)
    queue = workers.interactive_queue(loaded_llama.host_worker)
    queue.empty()
    CLOCK.charge(10.0, [writer.id])
    workers.CURRENT_WORKER = workers.WorkerIdentity(name=loaded_llama.host_worker, device="cpu")
    workers._LENDING.lender = workers.Lender(owner=make_user("jo-job-owner", "model:write").id)
    try:
        tasks.run_generation(row.id)
    finally:
        workers._LENDING.lender = None
        workers.CURRENT_WORKER = None
    row.refresh_from_db()
    assert row.status == Generation.Status.QUEUED and queue.count == 1
    burst()
    row.refresh_from_db()
    assert row.status == Generation.Status.COMPLETED
