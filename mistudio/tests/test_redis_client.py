"""The process's Redis pools: a job's time limit (an exception raised from a signal handler) may
land inside a pool's own lock and leave it held; the runner then replaces the pools, so the
failure is reported and later commands run instead of waiting for that lock forever."""

import threading

import pytest

from mistudio.redis_client import get_redis, reset_redis_pools

pytestmark = pytest.mark.django_db


def test_a_pool_left_locked_is_replaced_and_commands_run_again():
    stuck = get_redis().connection_pool
    stuck.pool.mutex.acquire()  # what a time limit landing inside the pool's queue leaves behind
    try:
        waited = threading.Thread(target=lambda: get_redis().ping(), daemon=True)
        waited.start()
        waited.join(0.5)
        assert waited.is_alive()  # through the old pool, a command waits for the lock
        reset_redis_pools()
        assert get_redis().connection_pool is not stuck
        assert get_redis().ping()
    finally:
        stuck.pool.mutex.release()
