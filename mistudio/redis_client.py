"""One way to reach Redis from miStudio code (queues, heartbeats, health).

* :func:`get_redis` — the pool for commands answered at once; ``REDIS_SOCKET_TIMEOUT_SECONDS``
  bounds a read, so a dead connection is noticed quickly.
* Reads that wait on the server (a generation's tokens, a worker call's answer) go through the
  process's one stream reader (``mistudio.stream_hub``), on a connection of its own with no
  client-side read timeout: a timeout shorter than the wait turned every long wait into an error,
  and a connection per waiter exhausted the pool.

An RQ worker gets a connection of its own (:func:`worker_redis`): RQ sets its read timeout just
above its own blocking dequeue. The stream reader's short commands (waking it, its leases) use a
pool of their own (:func:`hub_redis`): they run on the web's event loop, which must never wait for
a connection of the shared pool.
"""

import functools
import time

import redis
from django.conf import settings

from mistudio import embedded_redis

# How long a process trusts that the embedded server answered: every Redis command goes through
# ensure_redis, and a ping on a fresh connection each time was a seventh of a busy worker's time.
EMBEDDED_CHECK_SECONDS = 1.0
_embedded_answered_at = -EMBEDDED_CHECK_SECONDS


def ensure_redis() -> None:
    """Start the embedded Redis server if this is the embedded default and none answers yet
    (checked at most every ``EMBEDDED_CHECK_SECONDS`` in a process)."""
    global _embedded_answered_at
    if settings.EMBEDDED_REDIS and time.monotonic() - _embedded_answered_at >= EMBEDDED_CHECK_SECONDS:
        embedded_redis.ensure_running(settings.EMBEDDED_REDIS_SOCKET)
        _embedded_answered_at = time.monotonic()


def _options(url: str) -> dict:
    """What every pool gets: a short connect timeout, health checks, and TCP keepalive (which a
    unix socket has no use for)."""
    options: dict = {"socket_connect_timeout": 2, "health_check_interval": 30}
    if not url.startswith("unix://"):
        options["socket_keepalive"] = True
    return options


@functools.cache
def _connection(url: str, *, socket_timeout: float | None, max_connections: int | None) -> redis.Redis:
    if max_connections is None:  # unbounded: never waits for a connection
        return redis.Redis.from_url(url, socket_timeout=socket_timeout, **_options(url))
    # Bounded: a thread that finds every connection taken waits for one (commands are short)
    # instead of opening another; a web process under load keeps at most this many.
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=socket_timeout, socket_timeout=socket_timeout,
        **_options(url),
    )  # fmt: skip
    return redis.Redis(connection_pool=pool)


def get_redis() -> redis.Redis:
    """The shared connection pool for ``REDIS_URL`` (the embedded server is started on first use),
    at most ``REDIS_MAX_CONNECTIONS`` connections a process."""
    ensure_redis()
    return _connection(
        settings.REDIS_URL,
        socket_timeout=settings.REDIS_SOCKET_TIMEOUT_SECONDS,
        max_connections=settings.REDIS_MAX_CONNECTIONS,
    )


def reset_redis_pools() -> None:
    """Forget this process's pools: the next call makes new ones. For after an exception raised
    from a signal handler (a job's time limit), which may have landed inside a pool's own lock
    and left it held: every later command through that pool would wait for it forever."""
    _connection.cache_clear()


def hub_redis() -> redis.Redis:
    """A pool of its own for the stream hub's quick commands (``mistudio.stream_hub``: its wake,
    its leases), called on the event loop: when every connection of :func:`get_redis`'s pool is
    taken, these must not wait for one (the whole process would wait with them). Unbounded, as
    few connections as such calls run at once."""
    ensure_redis()
    return _connection(
        settings.REDIS_URL, socket_timeout=settings.REDIS_SOCKET_TIMEOUT_SECONDS, max_connections=None
    )


def worker_redis() -> redis.Redis:
    """A connection pool of its own for an RQ worker's dequeue loop."""
    ensure_redis()
    return redis.Redis.from_url(settings.REDIS_URL, **_options(settings.REDIS_URL))
