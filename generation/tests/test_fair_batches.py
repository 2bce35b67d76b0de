"""The interactive lane is shared between users: batches are made round robin between owners, the
one who had the least of the worker's time lately first (``mistudio.worker_clock``); a batch yields
to an owner who had less time than its own (or to anyone, after its slice), each row going on later
exactly where it stopped. A real (burst) worker in this process runs them.
"""

import datetime
import time

import pytest

from conftest import make_user
from generation.models import Generation
from generation.tasks import Waiting, claim_batch, fair_batch
from generation.tests.conftest import WORKER, burst
from generation.tests.test_generation_jobs import request
from mistudio import workers
from mistudio.worker_clock import CLOCK

pytestmark = pytest.mark.django_db(transaction=True)


def waiting(owner: int, minute: int, *, captures: bool = False) -> Waiting:
    at = datetime.datetime(2026, 1, 1, 12, minute, tzinfo=datetime.UTC)
    return Waiting(pk=f"gen_{owner}_{minute}", owner_id=owner, created_at=at, captures=captures)


def test_a_batch_takes_rows_round_robin_the_least_served_owner_first():
    queued = [waiting(1, minute) for minute in range(10)] + [waiting(2, 20), waiting(3, 30), waiting(3, 31)]
    assert [row.pk for row in fair_batch(queued, {}, size=5)] == [
        "gen_1_0", "gen_2_20", "gen_3_30", "gen_1_1", "gen_3_31",
    ]  # fmt: skip
    # Owner 1 was served most lately: the others go first, and owner 1 still fills what is left.
    served = {1: 50.0, 2: 1.0}
    assert [row.pk for row in fair_batch(queued, served, size=4)] == [
        "gen_3_30",
        "gen_2_20",
        "gen_1_0",
        "gen_3_31",
    ]
    # A row that captures runs alone when its owner's turn is first, and waits in a shared batch.
    capturing = [waiting(4, 1, captures=True), *queued]
    assert [row.pk for row in fair_batch(capturing, {}, size=4)] == [
        "gen_1_0",
        "gen_2_20",
        "gen_3_30",
        "gen_1_1",
    ]
    assert [row.pk for row in fair_batch(capturing, {1: 9, 2: 9, 3: 9}, size=4)] == ["gen_4_1"]


def test_a_newcomer_gets_a_place_in_the_next_batch_however_many_rows_wait(settings, loaded_llama, writer):
    settings.GENERATION_MAX_BATCH = 4
    settings.GENERATION_USER_MAX_TOKENS_IN_FLIGHT = 0
    for _ in range(3):
        request(loaded_llama, [f"Prompt {index}" for index in range(16)], owner=writer, max_tokens=4)
    other = make_user("olga-other", "model:write")
    (late,) = request(loaded_llama, ["Late"], owner=other, max_tokens=4)
    batch = claim_batch(loaded_llama.id, worker_name=WORKER)
    assert late in batch and len(batch) == 4
    assert all(
        row.status == Generation.Status.RUNNING
        for row in Generation.objects.filter(pk__in=[r.pk for r in batch])
    )


def test_a_batch_yields_to_another_user_and_every_row_ends_as_if_it_never_stopped(
    settings, loaded_llama, writer, monkeypatch
):
    from generation import tasks

    prompts = ["The river runs", "Once upon a time", "import numpy as np"]
    alone = {}
    for prompt in prompts:
        (row,) = request(loaded_llama, [prompt], owner=writer, max_tokens=80)
        burst()
        row.refresh_from_db()
        alone[prompt] = (row.output_token_ids, row.output_text)

    settings.GENERATION_MAX_BATCH = 2
    settings.GENERATION_SLICE_SECONDS = 0.0001  # yield as soon as someone else waits
    monkeypatch.setattr(tasks, "YIELD_POLL_SECONDS", 0.001)  # (a slice starts at the first poll)
    other, third = make_user("olga-other", "model:write"), make_user("theo-third", "model:write")
    mine = request(loaded_llama, prompts, owner=writer, max_tokens=80)
    (theirs,) = request(loaded_llama, ["Once upon a time"], owner=other, max_tokens=80)
    (last,) = request(loaded_llama, ["The river runs"], owner=third, max_tokens=80)
    burst()

    rows = {
        row.pk: row
        for row in Generation.objects.filter(pk__in=[*(row.pk for row in mine), theirs.pk, last.pk])
    }
    for row in [*mine, theirs, last]:
        done = rows[row.pk]
        assert done.status == Generation.Status.COMPLETED and done.finish_reason == "length"
        assert (done.output_token_ids, done.output_text) == alone[done.prompt]
    segments = [rows[row.pk].progress.get("segments", 1) for row in [*mine, theirs, last]]
    assert max(segments) >= 2  # batches of two among three owners: they took turns
    # The third user's one row did not wait for the first user's three to end.
    assert rows[last.pk].finished_at < max(rows[row.pk].finished_at for row in mine)


def test_one_user_alone_is_never_interrupted(settings, loaded_llama, writer):
    settings.GENERATION_SLICE_SECONDS = 0.0001
    rows = request(loaded_llama, ["One", "Two"], owner=writer, max_tokens=40)
    burst()
    for row in Generation.objects.filter(pk__in=[row.pk for row in rows]):
        assert row.status == Generation.Status.COMPLETED and len(row.output_token_ids) == 40
        assert row.progress == {}


def test_between_a_jobs_steps_a_batch_gives_the_time_back_after_its_slice(settings, loaded_llama, writer):
    (whole,) = request(loaded_llama, ["Lending"], owner=writer, max_tokens=300)
    burst()
    whole.refresh_from_db()

    settings.GENERATION_SLICE_SECONDS = 0.05
    (row,) = request(loaded_llama, ["Lending"], owner=writer, max_tokens=300)
    identity = workers.WorkerIdentity(name=WORKER, device="cpu")
    workers.CURRENT_WORKER = identity
    job_owner = make_user("jo-job-owner", "model:write").id
    try:
        # The writer had more of the worker's time lately than the job's owner: the job goes on.
        assert CLOCK.served(writer.id) > 0
        assert workers.serve_interactive(identity, most=1, owner=job_owner) == 0
        CLOCK.charge(CLOCK.served(writer.id) + 1, [job_owner])  # the job has had more now
        assert workers.serve_interactive(identity, most=1, owner=job_owner) == 1  # between its steps
    finally:
        workers.CURRENT_WORKER = None
    row.refresh_from_db()
    assert row.status == Generation.Status.QUEUED and 0 < len(row.output_token_ids) < 300
    assert row.progress["segments"] == 2
    burst()
    row.refresh_from_db()
    assert row.status == Generation.Status.COMPLETED
    assert row.output_token_ids == whole.output_token_ids and row.output_text == whole.output_text


def test_a_batch_yields_at_once_to_whoever_had_less_of_the_worker(settings, loaded_llama, writer):
    """A chat of a few tokens arriving while someone's long batch decodes waits one poll, not the
    batch's slice; between a job's steps the batch yields as soon as the job's owner had less time."""

    from generation.tasks import YIELD_POLL_SECONDS, YieldPoll

    settings.GENERATION_SLICE_SECONDS = 60  # far away: only the clock decides here
    heavy = make_user("hugo-heavy", "model:write")
    batch = request(loaded_llama, ["Long"], owner=heavy, max_tokens=5)
    CLOCK.charge(10.0, [heavy.id])
    workers.CURRENT_WORKER = workers.WorkerIdentity(name=WORKER, device="cpu")

    def decoding(lender=None) -> YieldPoll:
        """A poll whose batch's prefill took no time (its first poll at once), one poll later: its
        next answer is a decision (a first poll, or one before the batch has decoded as long as its
        prefill took, always says no, and a stall of the machine could stretch a measured prefill)."""
        poll = YieldPoll(batch, lender=lender)
        assert poll() is False
        time.sleep(YIELD_POLL_SECONDS)
        return poll

    try:
        poll = decoding()
        assert poll() is False  # nobody else waits
        request(loaded_llama, ["Hi"], owner=writer, max_tokens=4)
        time.sleep(YIELD_POLL_SECONDS)
        assert poll() is True  # the writer had none of the worker's time

        CLOCK.charge(20.0, [writer.id])  # the writer has had more than the batch's owner now
        assert decoding()() is False
        # the job's owner had more: the batch goes on until its slice
        assert decoding(workers.Lender(owner=writer.id))() is False
        CLOCK.reset()
        CLOCK.charge(10.0, [heavy.id])
        assert decoding(workers.Lender(owner=writer.id))() is True
    finally:
        workers.CURRENT_WORKER = None


def test_a_jobs_own_requests_are_served_between_its_steps(loaded_llama, writer):
    """An explanation job's requests are its owner's: between the job's steps they are served, the
    job's owner and theirs being one (one snapshot of the clock: an owner always equals itself)."""
    CLOCK.charge(5.0, [writer.id])
    (row,) = request(loaded_llama, ["Mine"], owner=writer, max_tokens=4)
    identity = workers.WorkerIdentity(name=WORKER, device="cpu")
    workers.CURRENT_WORKER = identity
    try:
        assert workers.serve_interactive(identity, most=1, owner=writer.id) == 1
    finally:
        workers.CURRENT_WORKER = None
    row.refresh_from_db()
    assert row.status == Generation.Status.COMPLETED and len(row.output_token_ids) == 4


def test_between_items_a_batch_job_goes_first_when_its_owner_had_less_of_the_worker(loaded_llama, writer):
    """The worker's lanes follow the clock too: with both lanes waiting, a batch job of an owner who
    had less of the worker's time than everyone the interactive lane waits for goes first
    (``mistudio.workers.batch_turn``); otherwise the interactive lane does."""
    from saes.models import SaeGroup

    identity = workers.WorkerIdentity(name=WORKER, device="cpu")
    queues = workers.worker_queues(WORKER)
    alice = make_user("alice-trainer", "model:write")
    request(loaded_llama, ["Chat"], owner=writer, max_tokens=4)  # the interactive lane waits
    SaeGroup.objects.create(owner=alice, status="queued", queue_name=queues[1].name)
    queues[1].enqueue("mistudio.job_runner.run_next_job", queues[1].name)  # its token
    workers.CURRENT_WORKER = identity
    try:
        CLOCK.charge(5.0, [writer.id])
        assert workers.batch_turn(queues) is True  # alice had none of the worker: her job first
        CLOCK.charge(10.0, [alice.id])
        assert workers.batch_turn(queues) is False
    finally:
        workers.CURRENT_WORKER = None
        for queue in queues:
            queue.empty()


def poll_after(poll, seconds: float) -> bool:
    time.sleep(seconds)
    return poll()


def test_a_batch_slice_starts_after_its_prefill(settings, loaded_llama, writer):
    """A slice counts decoding, from the batch's first poll: a prompt whose prefill takes longer
    than a slice still makes progress before it yields (else it would prefill again, for ever)."""
    from generation.tasks import YieldPoll

    settings.GENERATION_SLICE_SECONDS = 0.2
    heavy = make_user("hugo-heavy", "model:write")
    batch = request(loaded_llama, ["Long"], owner=writer, max_tokens=5)
    request(loaded_llama, ["Wait"], owner=heavy, max_tokens=5)  # waits; had more: only the slice decides
    CLOCK.charge(100.0, [heavy.id])
    workers.CURRENT_WORKER = workers.WorkerIdentity(name=WORKER, device="cpu")
    try:
        poll = YieldPoll(batch, lender=None, started=time.monotonic() - 0.3)  # a 0.3 s prefill
        assert poll() is False
        assert poll_after(poll, 0.35) is True
    finally:
        workers.CURRENT_WORKER = None


def test_a_lent_batch_of_the_jobs_own_rows_is_not_sliced(settings, loaded_llama, writer):
    """Between a job's steps, the job's own requests (an explainer's) run to their end: yielding
    them back to the job would only make it wait for them."""
    from generation.tasks import YieldPoll

    settings.GENERATION_SLICE_SECONDS = 0.05
    own = request(loaded_llama, ["Explain"], owner=writer, max_tokens=5)
    workers.CURRENT_WORKER = workers.WorkerIdentity(name=WORKER, device="cpu")
    try:
        poll = YieldPoll(own, lender=workers.Lender(owner=writer.id))
        poll()
        assert poll_after(poll, 0.1) is False
        other = request(loaded_llama, ["Other"], owner=make_user("olga", "model:write"), max_tokens=5)
        poll = YieldPoll(other, lender=workers.Lender(owner=writer.id))
        poll()
        assert poll_after(poll, 0.1) is True  # someone else's rows: the job gets its time back
    finally:
        workers.CURRENT_WORKER = None


def test_a_lent_batch_of_the_jobs_own_rows_yields_to_whoever_had_less(settings, loaded_llama, writer):
    """An explainer's own requests run to their end between its steps, but not in front of a chat
    of someone who had less of the worker (a job at concurrency 32 made every chat wait)."""
    from generation.tasks import YieldPoll

    settings.GENERATION_SLICE_SECONDS = 60
    own = request(loaded_llama, ["Explain"], owner=writer, max_tokens=5)
    CLOCK.charge(10.0, [writer.id])
    workers.CURRENT_WORKER = workers.WorkerIdentity(name=WORKER, device="cpu")
    try:
        poll = YieldPoll(own, lender=workers.Lender(owner=writer.id))
        poll()
        assert poll_after(poll, 0.06) is False
        request(loaded_llama, ["Hi"], owner=make_user("bob-chat", "model:write"), max_tokens=4)
        assert poll_after(poll, 0.06) is True
    finally:
        workers.CURRENT_WORKER = None


def test_no_batch_yields_before_it_has_decoded_as_long_as_its_prefill(settings, loaded_llama, writer):
    """A yield costs the rows their prefill again: whoever waits (a worker call every few
    milliseconds), a batch first decodes as long as its prefill took, so at most half of the
    worker's time goes to prefills made again."""
    from generation.tasks import YieldPoll

    settings.GENERATION_SLICE_SECONDS = 60
    batch = request(loaded_llama, ["Long prompt"], owner=writer, max_tokens=5)
    CLOCK.charge(10.0, [writer.id])
    request(loaded_llama, ["Hi"], owner=make_user("bob-chat", "model:write"), max_tokens=4)  # had less
    workers.CURRENT_WORKER = workers.WorkerIdentity(name=WORKER, device="cpu")
    try:
        poll = YieldPoll(batch, lender=None, started=time.monotonic() - 0.4)  # a 0.4 s prefill
        assert poll() is False
        assert poll_after(poll, 0.1) is False
        assert poll_after(poll, 0.35) is True
    finally:
        workers.CURRENT_WORKER = None
