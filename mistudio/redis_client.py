"""One way to reach Redis from miStudio code (queues, heartbeats, health)."""

import functools

import redis
from django.conf import settings

from mistudio import embedded_redis


def ensure_redis() -> None:
    """Start the embedded Redis server if this is the embedded default and none answers yet."""
    if settings.EMBEDDED_REDIS:
        embedded_redis.ensure_running(settings.EMBEDDED_REDIS_SOCKET)


@functools.cache
def _connection(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10, health_check_interval=30)


def get_redis() -> redis.Redis:
    """The shared connection pool for ``REDIS_URL`` (the embedded server is started on first use)."""
    ensure_redis()
    return _connection(settings.REDIS_URL)
