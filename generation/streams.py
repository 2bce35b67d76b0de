"""The token path from a worker to whoever waits for a generation: one Redis stream per generation.

The worker appends events (``started``, ``token``…, then ``done`` or ``failed``) with XADD, one
round trip per token on a connection it keeps. Readers (the HTTP view that streams server-sent
events, the CLI) read the stream from its beginning with a blocking XREAD, so a reader that
attaches late misses nothing and events arrive in order; entry ids double as sequence numbers.
Streams expire ``STREAM_TTL_SECONDS`` after their last event.

A cancel request is a flag key the worker polls between tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

from django.conf import settings

from mistudio.redis_client import ensure_redis, get_redis

STREAM_TTL_SECONDS = 600
STREAM_MAX_EVENTS = 20_000  # a 2,048-token generation fits many times over
FINAL_EVENTS = frozenset({"done", "failed"})


def stream_key(generation_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}generation:{generation_id}:events"


def cancel_key(generation_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}generation:{generation_id}:cancel"


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


def request_cancel(generation_id: str) -> None:
    get_redis().set(cancel_key(generation_id), "1", ex=STREAM_TTL_SECONDS)


def cancel_requested(generation_ids: Iterable[str]) -> set[str]:
    """Which of ``generation_ids`` have a cancel request (one round trip)."""
    ids = list(generation_ids)
    if not ids:
        return set()
    pipeline = get_redis().pipeline(transaction=False)
    for generation_id in ids:
        pipeline.exists(cancel_key(generation_id))
    return {generation_id for generation_id, found in zip(ids, pipeline.execute(), strict=True) if found}


def _decode(entries) -> Iterator[dict[str, Any]]:
    for _entry_id, fields in entries:
        raw = fields.get(b"event") or fields.get("event")
        yield json.loads(raw)


class _Cursor:
    """Where a reader is in a stream, and when it last heard from it (shared by both readers)."""

    def __init__(self, generation_id: str, check_every: float):
        self.key, self.last_id = stream_key(generation_id), "0-0"
        self.check_every, self.last_event = check_every, time.monotonic()
        self.finished = False

    def check_due(self) -> bool:
        if time.monotonic() - self.last_event < self.check_every:
            return False
        self.last_event = time.monotonic()
        return True

    def take(self, reply) -> list[dict[str, Any]]:
        """The events of an XREAD reply, up to and including a final one."""
        self.last_event = time.monotonic()
        entries = reply[0][1]
        self.last_id = entries[-1][0]
        events = []
        for event in _decode(entries):
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
    block_ms: int = 500,
) -> Iterator[dict[str, Any]]:
    """Reader side, synchronous (CLI): every event from the first, until ``done``/``failed``.

    After ``check_every`` seconds of silence ``check()`` is asked; a final event it returns (the
    worker died, the stream expired) is yielded and ends the iteration.
    """
    connection = get_redis()
    cursor = _Cursor(generation_id, check_every)
    while not cursor.finished:
        reply = connection.xread({cursor.key: cursor.last_id}, block=block_ms, count=500)
        if reply:
            yield from cursor.take(reply)
        elif check is not None and cursor.check_due() and (final := check()) is not None:
            yield final
            return


_ASYNC_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _async_redis():
    """One asyncio Redis client per event loop (Daphne runs one loop per process)."""
    import redis.asyncio

    loop = asyncio.get_running_loop()
    client = _ASYNC_CLIENTS.get(loop)
    if client is None:
        ensure_redis()
        # No socket timeout: with one, redis-py wraps each command in asyncio.wait_for, which on
        # Python 3.11 can swallow the cancellation of a reader whose client went away (gh-86296).
        client = redis.asyncio.Redis.from_url(
            settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=None
        )
        _ASYNC_CLIENTS[loop] = client
    return client


async def read_events(
    generation_id: str,
    *,
    check: Callable[[], Awaitable[dict[str, Any] | None]] | None = None,
    check_every: float = 5.0,
    block_ms: int = 500,
) -> AsyncIterator[dict[str, Any]]:
    """Reader side, async (views): like :func:`iter_events`, without holding a thread."""
    connection = _async_redis()
    cursor = _Cursor(generation_id, check_every)
    while not cursor.finished:
        reply = await connection.xread({cursor.key: cursor.last_id}, block=block_ms, count=500)
        if reply:
            for event in cursor.take(reply):
                yield event
        elif check is not None and cursor.check_due() and (final := await check()) is not None:
            yield final
            return
