"""One Redis reader per process for every stream a request waits on.

A request that waits for a worker (a generation's tokens, a worker call's answer) reads a Redis
stream. Holding a blocking Redis command per waiter made the connection pool the limit: 8 batch
requests of 16 prompts each held 128 blocking reads and the 101st waiter got ``Too many
connections`` (a 500, for every user). Here one thread per process reads every followed stream
with a single ``XREAD`` and hands each entry to its followers, sync (a worker call waiting in a
view's thread) or async (a generation view on Daphne's event loop): a process holds one blocking
connection whatever the number of waiters.

A new follower wakes the reader through a stream of the hub's own (``wake``), so a blocked
``XREAD`` returns at once and the next one includes the new key. A follower reads its stream
from its beginning (or from ``start``), so one that attaches late misses nothing.

**Leases.** A follower may hold a *lease* key for the work it waits on: the hub keeps the key
alive (``LEASE_SECONDS``) while the follower is read, and deletes it when the follower closes. A
worker that finds the lease gone knows nobody waits for the work any more and withdraws it: work
dies with its request on every exit path, a process that died included, and a follower left
unread (a streamed answer whose client left before its first byte) lets its lease lapse.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
import uuid
from typing import Any

import redis
from django.conf import settings

from mistudio.redis_client import ensure_redis, hub_redis

logger = logging.getLogger(__name__)

BLOCK_MS = 1000  # how long one XREAD waits server-side before the reader looks again
ENTRIES_PER_READ = 500  # per stream and read
IDLE_SECONDS = 30.0  # with no follower the thread waits this long on its own event, not on Redis
LEASE_SECONDS = 30  # a lease lapses this long after its follower was last read
LEASE_REFRESH_SECONDS = 5.0


def hub_client_name() -> str:
    """The name the hub's connection gives itself (``CLIENT LIST`` shows who waits)."""
    return f"mistudio-hub-{os.getpid()}"


def _id_tuple(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)


class Follower:
    """One waiter's view of one stream: entries arrive from the hub's thread, in order."""

    def __init__(
        self, hub: StreamHub, key: str, start: str, loop: asyncio.AbstractEventLoop | None, lease: str | None
    ):
        self.hub, self.key, self.last_id, self.lease = hub, key, start, lease
        self.last_read = time.monotonic()
        self._entries: collections.deque = collections.deque()
        self._loop = loop
        self._ready = threading.Event() if loop is None else None
        self._async_ready = asyncio.Event() if loop is not None else None

    # --- the hub's side (its thread) ---------------------------------------------------------

    def deliver(self, entries: list[tuple[bytes, dict]]) -> None:
        fresh = [entry for entry in entries if _id_tuple(entry[0]) > _id_tuple(self.last_id)]
        if not fresh:
            return
        self.last_id = fresh[-1][0].decode() if isinstance(fresh[-1][0], bytes) else fresh[-1][0]
        self._entries.extend(fresh)
        if self._loop is None:
            self._ready.set()
        else:
            try:
                self._loop.call_soon_threadsafe(self._async_ready.set)
            except RuntimeError:  # the loop closed under a follower that never closed itself
                self.hub.unfollow(self)

    # --- the waiter's side -------------------------------------------------------------------

    def _take(self) -> list[dict]:
        self.last_read = time.monotonic()
        taken = []
        while self._entries:
            taken.append(self._entries.popleft()[1])
        return taken

    def get(self, timeout: float) -> list[dict]:
        """The entries (field dicts) that arrived, waiting up to ``timeout`` seconds for one."""
        if not self._entries:
            self._ready.wait(timeout)
        self._ready.clear()
        return self._take()

    async def aget(self, timeout: float) -> list[dict]:
        """:meth:`get` for a coroutine on the event loop the follower was made on."""
        if not self._entries:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._async_ready.wait(), timeout)
        self._async_ready.clear()
        return self._take()

    def close(self) -> None:
        self.hub.unfollow(self)

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamHub:
    """The process's reader: :meth:`follow` a key, read from the returned :class:`Follower`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._followers: dict[str, list[Follower]] = {}
        self._has_followers = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_key = f"{settings.REDIS_KEY_PREFIX}:hub:{uuid.uuid4().hex}"
        self._wake_id = "0-0"
        self._connection: redis.Redis | None = None

    def follow(
        self, key: str, *, start: str = "0-0", asynchronous: bool = False, lease: str | None = None
    ) -> Follower:
        """Follow ``key`` from after ``start``; ``asynchronous`` for a coroutine (call it on the
        event loop that will read it); ``lease``: a key kept alive while the follower is read."""
        loop = asyncio.get_running_loop() if asynchronous else None
        follower = Follower(self, key, start, loop, lease)
        with self._lock:
            self._followers.setdefault(key, []).append(follower)
            self._has_followers.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stream-hub", daemon=True)
                self._thread.start()
        self._wake()
        return follower

    def unfollow(self, follower: Follower) -> None:
        with self._lock:
            followers = self._followers.get(follower.key, [])
            if follower in followers:
                followers.remove(follower)
            if not followers:
                self._followers.pop(follower.key, None)
            if not self._followers:
                self._has_followers.clear()
            lease_held = follower.lease is not None and any(
                other.lease == follower.lease for others in self._followers.values() for other in others
            )
        if follower.lease is not None and not lease_held:
            with contextlib.suppress(redis.RedisError):
                hub_redis().delete(follower.lease)

    def _refresh_leases(self) -> None:
        """Keep alive the leases of the followers read lately (from the hub's thread)."""
        now = time.monotonic()
        with self._lock:
            leases = {
                follower.lease
                for followers in self._followers.values()
                for follower in followers
                if follower.lease is not None and now - follower.last_read < LEASE_SECONDS
            }
        if leases:
            pipeline = hub_redis().pipeline(transaction=False)
            for lease in leases:
                pipeline.set(lease, "1", ex=LEASE_SECONDS)
            pipeline.execute()

    def follower_count(self) -> int:
        with self._lock:
            return sum(len(followers) for followers in self._followers.values())

    def _redis(self) -> redis.Redis:
        """The hub's own connection. Its read timeout outlasts an XREAD's server-side wait by a few
        seconds: a connection that died without a word (a dropped network) is noticed and made
        anew, rather than stalling every stream of the process for ever."""
        if self._connection is None:
            ensure_redis()
            self._connection = redis.Redis.from_url(
                settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=BLOCK_MS / 1000 + 5,
                health_check_interval=30, max_connections=1, client_name=hub_client_name(),
            )  # fmt: skip
        return self._connection

    def _wake(self) -> None:
        """Nudge the reader to take a new follower's stream now; best effort: without it the reader
        takes the stream at its next XREAD (at most ``BLOCK_MS`` later), so a failure never fails
        the request. redis-py can raise ValueError ("I/O operation on closed file") when a new
        connection's health check times out under load (seen in CI: a 500 on /api/generate)."""
        try:
            pipeline = hub_redis().pipeline(transaction=False)
            pipeline.xadd(self._wake_key, {"w": "1"}, maxlen=16, approximate=True)
            pipeline.expire(self._wake_key, 3600)
            pipeline.execute()
        except (redis.RedisError, ValueError):
            logger.warning("stream hub: could not wake the reader", exc_info=True)

    def _streams(self) -> dict[str, str]:
        with self._lock:
            streams = {
                key: min((follower.last_id for follower in followers), key=_id_tuple)
                for key, followers in self._followers.items()
            }
        streams[self._wake_key] = self._wake_id
        return streams

    def _run(self) -> None:
        refreshed = 0.0
        while True:
            if not self._has_followers.wait(IDLE_SECONDS):
                continue
            try:
                if time.monotonic() - refreshed >= LEASE_REFRESH_SECONDS:
                    self._refresh_leases()
                    refreshed = time.monotonic()
                reply = self._redis().xread(self._streams(), block=BLOCK_MS, count=ENTRIES_PER_READ)
            except redis.RedisError as error:
                logger.warning("stream hub: reading failed (%s); retrying", error)
                self._connection = None
                time.sleep(0.5)
                continue
            except Exception:
                logger.exception("stream hub: unexpected error")
                time.sleep(0.5)
                continue
            for raw_key, entries in reply or ():
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                if key == self._wake_key:
                    last = entries[-1][0]
                    self._wake_id = last.decode() if isinstance(last, bytes) else last
                    continue
                with self._lock:
                    followers = list(self._followers.get(key, ()))
                for follower in followers:
                    follower.deliver(entries)


_HUB: StreamHub | None = None
_HUB_LOCK = threading.Lock()


def stream_hub() -> StreamHub:
    """This process's hub (made on first use)."""
    global _HUB
    with _HUB_LOCK:
        if _HUB is None:
            _HUB = StreamHub()
        return _HUB


def entry_event(fields: dict[Any, Any]) -> Any:
    """The JSON payload an entry carries in its ``event`` field (how every writer adds one)."""
    import json

    raw = fields.get(b"event") or fields.get("event")
    return json.loads(raw)
