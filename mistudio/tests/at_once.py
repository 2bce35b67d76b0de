"""Identical requests sent at the same moment, for the tests of check-then-insert races."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from threading import Barrier
from typing import Any


def at_once(send: Callable[[], Any], count: int = 4) -> list[Any]:
    """``send()`` from ``count`` threads released together, their results in order. Each thread
    has its own database connection (each request is its own transaction), closed after."""
    from django.db import connection

    barrier = Barrier(count)

    def one():
        try:
            barrier.wait()
            return send()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=count) as pool:
        return [future.result() for future in [pool.submit(one) for _ in range(count)]]
