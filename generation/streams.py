"""The token path from a worker to whoever waits for a generation: one Redis stream per generation.

The worker appends events (``started``, ``token``…, then ``done`` or ``failed``) with XADD, one
round trip per token on a connection it keeps. Readers (the HTTP view that streams server-sent
events, the CLI) follow the stream from its beginning through the process's one stream reader
(``mistudio.stream_hub``: one blocking XREAD for every waiter), so a reader that attaches late
misses nothing and events arrive in order.
Streams expire ``STREAM_TTL_SECONDS`` after their last event.

A cancel request is a flag key the worker polls between tokens. So is the *lease*
(``reader_key``): a reader holds it while it waits (``mistudio.stream_hub``), and a row whose lease
is gone (its request ended, however it ended) is withdrawn like a cancelled one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

from django.conf import settings

from mistudio.redis_client import get_redis
from mistudio.stream_hub import LEASE_SECONDS, entry_event, stream_hub

STREAM_TTL_SECONDS = 600
STREAM_MAX_EVENTS = 20_000  # a 2,048-token generation fits many times over
FINAL_EVENTS = frozenset({"done", "failed"})


def stream_key(generation_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}generation:{generation_id}:events"


def cancel_key(generation_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}generation:{generation_id}:cancel"


def reader_key(generation_id: str) -> str:
    """The generation's lease (``mistudio.stream_hub``): alive while someone waits for its result."""
    return f"{settings.REDIS_KEY_PREFIX}generation:{generation_id}:reader"


def grant_leases(*generation_ids: str) -> None:
    """Leases for new rows, until their reader takes them over (``LEASE_SECONDS``): rows whose
    request dies before it reads them are withdrawn when these lapse."""
    pipeline = get_redis().pipeline(transaction=False)
    for generation_id in generation_ids:
        pipeline.set(reader_key(generation_id), "1", ex=LEASE_SECONDS)
    pipeline.execute()


class GenerationStream:
    """Worker side: appends one generation's events to its stream."""

    def __init__(self, generation_id: str, connection=None):
        self.generation_id = generation_id
        self.key = stream_key(generation_id)
        self.redis = connection or get_redis()
        self._expiry_set = False

    def emit(self, event_type: str, **data: Any) -> None:
        pipeline = self.redis.pipeline(transaction=False)
        self.add_to(pipeline, event_type, **data)
        pipeline.execute()

    def add_to(self, pipeline, event_type: str, **data: Any) -> None:
        """Queue the event on ``pipeline`` (several streams' events go out in one round trip)."""
        payload = json.dumps({"type": event_type, **data}, separators=(",", ":"))
        pipeline.xadd(self.key, {"event": payload}, maxlen=STREAM_MAX_EVENTS, approximate=True)
        if not self._expiry_set or event_type in FINAL_EVENTS:
            pipeline.expire(self.key, STREAM_TTL_SECONDS)
            self._expiry_set = True

    def emit_event(self, event: dict[str, Any]) -> None:
        """:meth:`emit` of an event dict that carries its own ``type``."""
        data = dict(event)
        self.emit(data.pop("type"), **data)


def request_cancel(*generation_ids: str) -> None:
    """Ask the worker to stop these generations after their current token (one round trip)."""
    pipeline = get_redis().pipeline(transaction=False)
    for generation_id in generation_ids:
        pipeline.set(cancel_key(generation_id), "1", ex=STREAM_TTL_SECONDS)
    pipeline.execute()


def cancel_requested(generation_ids: Iterable[str]) -> set[str]:
    """Which of ``generation_ids`` should stop: a cancel was asked, or nobody waits for them any
    more (their lease is gone). One round trip."""
    ids = list(generation_ids)
    if not ids:
        return set()
    pipeline = get_redis().pipeline(transaction=False)
    for generation_id in ids:
        pipeline.exists(cancel_key(generation_id))
        pipeline.exists(reader_key(generation_id))
    found = pipeline.execute()
    return {
        generation_id
        for generation_id, cancelled, waited_for in zip(ids, found[::2], found[1::2], strict=True)
        if cancelled or not waited_for
    }


class _Cursor:
    """Where a reader is in a stream, and when it last heard from it (shared by both readers)."""

    def __init__(self, check_every: float):
        self.check_every, self.last_event = check_every, time.monotonic()
        self.finished = False

    def check_due(self) -> bool:
        if time.monotonic() - self.last_event < self.check_every:
            return False
        self.last_event = time.monotonic()
        return True

    def take(self, entries: list[dict]) -> list[dict[str, Any]]:
        """The events of the entries that arrived, up to and including a final one."""
        self.last_event = time.monotonic()
        events = []
        for fields in entries:
            event = entry_event(fields)
            events.append(event)
            if event["type"] in FINAL_EVENTS:
                self.finished = True
                break
        return events


def iter_events(
    generation_id: str,
    *,
    check: Callable[[], dict[str, Any] | None] | None = None,
    check_every: float = 5.0,
    wait_seconds: float = 0.5,
) -> Iterator[dict[str, Any]]:
    """Reader side, synchronous (CLI): every event from the first, until ``done``/``failed``.

    After ``check_every`` seconds of silence ``check()`` is asked; a final event it returns (the
    worker died, the stream expired) is yielded and ends the iteration.
    """
    cursor = _Cursor(check_every)
    with stream_hub().follow(stream_key(generation_id), lease=reader_key(generation_id)) as follower:
        while not cursor.finished:
            entries = follower.get(wait_seconds)
            if entries:
                yield from cursor.take(entries)
            elif check is not None and cursor.check_due() and (final := check()) is not None:
                yield final
                return


def follow_to_end(
    generation_ids: list[str],
    *,
    timeout: float,
    check: Callable[[str], dict[str, Any] | None] | None = None,
    check_every: float = 5.0,
) -> bool:
    """Reader side for several generations at once (the CLI's sweep): read every stream, each
    holding its row's lease (rows nobody reads are withdrawn), until each has its final event
    (or ``check(generation_id)``, asked after ``check_every`` seconds of silence, returns one).
    False when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as followed:
        reading = {
            generation_id: (
                followed.enter_context(
                    stream_hub().follow(stream_key(generation_id), lease=reader_key(generation_id))
                ),
                _Cursor(check_every),
            )
            for generation_id in generation_ids
        }
        while reading:
            if time.monotonic() > deadline:
                return False
            for generation_id, (follower, cursor) in list(reading.items()):
                entries = follower.get(0.05)
                if entries:
                    cursor.take(entries)
                elif check is not None and cursor.check_due() and check(generation_id) is not None:
                    cursor.finished = True
                if cursor.finished:
                    del reading[generation_id]
    return True


async def read_events(
    generation_id: str,
    *,
    check: Callable[[], Awaitable[dict[str, Any] | None]] | None = None,
    check_every: float = 5.0,
    wait_seconds: float = 0.5,
) -> AsyncIterator[dict[str, Any]]:
    """Reader side, async (views): like :func:`iter_events`, on the process's one stream reader
    (``mistudio.stream_hub``): waiting holds no Redis connection of its own."""
    cursor = _Cursor(check_every)
    follower = stream_hub().follow(
        stream_key(generation_id), asynchronous=True, lease=reader_key(generation_id)
    )
    try:
        while not cursor.finished:
            entries = await follower.aget(wait_seconds)
            if entries:
                for event in cursor.take(entries):
                    yield event
            elif check is not None and cursor.check_due() and (final := await check()) is not None:
                yield final
                return
    finally:
        follower.close()
