"""The process's one stream reader (``mistudio.stream_hub``) on the real Redis: many waiters, one
blocking connection; leases that live while a follower is read and go when it closes or is left.
"""

import asyncio
import json
import threading
import time
import uuid

import pytest
from django.conf import settings

from mistudio import stream_hub as hub_module
from mistudio.redis_client import get_redis
from mistudio.stream_hub import entry_event, hub_client_name, stream_hub


def key(name: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:test-hub:{name}:{uuid.uuid4().hex[:8]}"


def add(stream: str, **event) -> None:
    get_redis().xadd(stream, {"event": json.dumps(event)})
    get_redis().expire(stream, 60)


def blocked_readers() -> int:
    """Connections blocked in a stream read right now: this process's hub, and any reader that is
    no hub (other test processes' hubs share the server in CI; so do their RQ workers, blocked in a
    list pop, which no waiter uses)."""
    blocked = [client for client in get_redis().client_list() if client.get("cmd") == "xread"]
    return sum(1 for client in blocked if not client.get("name", "").startswith("mistudio-hub-")) + sum(
        1 for client in blocked if client.get("name") == hub_client_name()
    )


async def test_three_hundred_async_waiters_share_one_blocking_connection():
    streams = [key(f"async-{index}") for index in range(300)]
    followers = [stream_hub().follow(stream, asynchronous=True) for stream in streams]
    try:
        await asyncio.sleep(0.3)  # every follower registered; the reader blocks on all of them
        assert blocked_readers() == 1
        for index, stream in enumerate(streams):
            add(stream, type="token", index=index)
        received = await asyncio.gather(*(follower.aget(5) for follower in followers))
        assert [entry_event(entries[0])["index"] for entries in received] == list(range(300))
    finally:
        for follower in followers:
            follower.close()
    assert stream_hub().follower_count() == 0


def test_sync_waiters_in_threads_and_a_late_follower_misses_nothing():
    stream = key("sync")
    add(stream, type="started")
    got: dict[int, list] = {}

    def wait(index: int) -> None:
        with stream_hub().follow(stream) as follower:
            events = []
            deadline = time.monotonic() + 5
            while len(events) < 3 and time.monotonic() < deadline:
                events += [entry_event(entry)["type"] for entry in follower.get(0.5)]
            got[index] = events

    threads = [threading.Thread(target=wait, args=(index,)) for index in range(20)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    add(stream, type="token")
    add(stream, type="done")
    for thread in threads:
        thread.join(10)
    assert got == {index: ["started", "token", "done"] for index in range(20)}
    assert blocked_readers() <= 1


def test_a_lease_lives_while_its_follower_is_read_and_goes_with_it(monkeypatch):
    monkeypatch.setattr(hub_module, "LEASE_SECONDS", 2)
    monkeypatch.setattr(hub_module, "LEASE_REFRESH_SECONDS", 0.2)
    redis = get_redis()
    stream, lease = key("leased"), key("lease")
    redis.set(lease, "1", ex=2)
    follower = stream_hub().follow(stream, lease=lease)
    for _ in range(8):  # 4 s of reads: twice the lease's life, refreshed meanwhile
        follower.get(0.5)
    assert redis.exists(lease)
    follower.close()
    assert not redis.exists(lease)  # at once: the work it guarded can be withdrawn

    # A follower nobody reads (a streamed answer whose client left before it began): it lapses.
    redis.set(lease, "1", ex=2)
    unread = stream_hub().follow(stream, lease=lease)
    try:
        deadline = time.monotonic() + 6
        while redis.exists(lease) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not redis.exists(lease)
    finally:
        unread.close()


@pytest.mark.django_db
def test_a_worker_call_answers_through_the_hub_and_is_withdrawn_when_its_client_leaves():
    """``call_worker`` waits in slices: a client gone (the request's event set) withdraws the call
    from the queue, so no worker ever computes it."""
    from mistudio.errors import ApplicationError
    from mistudio.request_lifetime import _ABANDONED
    from mistudio.workers import call_waiting_key, call_worker, interactive_queue

    abandoned = threading.Event()
    worker = f"nobody-{uuid.uuid4().hex[:6]}"
    outcome = {}

    def request_thread():
        _ABANDONED.set(abandoned)
        started = time.monotonic()
        try:
            call_worker(worker, "mistudio.tests.test_stream_hub.never_called", wait_seconds=30)
        except ApplicationError as error:
            outcome["code"], outcome["seconds"] = error.code, time.monotonic() - started

    thread = threading.Thread(target=request_thread)
    thread.start()
    time.sleep(0.5)
    queue = interactive_queue(worker)
    (waiting_job,) = queue.job_ids
    assert waiting_job.startswith("call-")
    abandoned.set()
    thread.join(5)
    assert outcome["code"] == "CLIENT_GONE" and outcome["seconds"] < 1.5
    assert queue.count == 0
    assert not get_redis().exists(call_waiting_key(waiting_job.removeprefix("call-")))


def never_called(request_id: str) -> None:  # pragma: no cover - the call is withdrawn
    raise AssertionError("a withdrawn call ran")


def sleepy_call(request_id: str) -> None:
    """A worker call that computes for 0.2 s."""
    from mistudio.workers import answer_call

    def compute():
        time.sleep(0.2)
        return {"ok": True}

    answer_call(request_id, compute, failure_code="SLEEPY_FAILED")


@pytest.mark.django_db(transaction=True)
def test_a_worker_call_is_its_callers_work_on_the_worker_clock(writer):
    """A waiting call counts as its caller's (not the system's) when the worker picks whose turn it
    is, and its compute time is charged to them."""
    from mistudio import workers
    from mistudio.worker_clock import CLOCK

    name = f"call-worker-{uuid.uuid4().hex[:6]}"
    answers = []
    thread = threading.Thread(
        target=lambda: answers.append(
            workers.call_worker(name, f"{__name__}.sleepy_call", wait_seconds=30, owner=writer)
        )
    )
    thread.start()
    identity = workers.WorkerIdentity(name=name, device="cpu")
    deadline = time.monotonic() + 5
    while not workers.call_owners(identity) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers.call_owners(identity) == {writer.id}
    workers.run_worker(name=name, device="cpu", burst=True)
    thread.join(10)
    assert answers == [{"ok": True}]
    served = CLOCK.snapshot([writer.id, None])
    assert served[writer.id] >= 0.15 and served[None] == 0


def test_following_and_closing_never_wait_for_the_shared_pool():
    """``follow`` and ``close`` run on the web's event loop: with every connection of the shared
    pool taken (a flood of requests), they still return at once (the hub's wake and leases have a
    pool of their own), instead of holding the whole process up to the pool's timeout."""
    import time

    from mistudio.redis_client import get_redis
    from mistudio.stream_hub import stream_hub

    pool = get_redis().connection_pool
    taken = [pool.get_connection() for _ in range(pool.max_connections)]
    try:
        started = time.monotonic()
        with stream_hub().follow("test:hub:pool-exhausted", lease="test:hub:pool-exhausted:lease"):
            pass
        assert time.monotonic() - started < 1.0
    finally:
        for connection in taken:
            pool.release(connection)
