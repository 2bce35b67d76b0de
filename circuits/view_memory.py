"""The web process's memory budget for graph views (``GRAPH_VIEW_MEMORY_MB``).

A graph view (``/api/graphs/{id}/nodes``, ``/export``, the page's explorer) prunes the graph's
bounded view (``engine.attribution.prunable``), never its full matrix: its peak memory is known
before it starts from the nodes the prune keeps (:func:`view_memory_bytes`). Each view reserves
that much of the budget first. A view that alone would take more is refused (400
``GRAPH_VIEW_TOO_LARGE``, with the widest node threshold that fits); one that finds the budget
taken by others waits for them (they take a fraction of a second) up to
``GRAPH_VIEW_WAIT_SECONDS``, then is refused (503 ``GRAPH_VIEWS_BUSY``, with ``Retry-After``).
So the memory graph views take in a web process stays within the budget, however large the graphs
and however many viewers.

The worker sizes each view to the budget when it makes it (:func:`stored_nodes_cap`): a view at
its widest threshold fits the budget alone.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings

from engine.attribution.prunable import PRUNE_BYTES_PER_CELL, prune_memory_bytes
from mistudio.errors import ApplicationError, rate_limited
from mistudio.request_lifetime import release_database

# The most links a view shows (a browser draws no more; 400 GRAPH_VIEW_TOO_LARGE past it), and
# what each one takes while its JSON is built and rendered (380 bytes measured, nodes included).
MAX_LINKS = 100_000
LINK_BYTES = 512
RETRY_AFTER_SECONDS = 2


def view_memory_bytes(kept: int) -> int:
    """The most a view of a graph whose prune keeps ``kept`` nodes takes: the prune, then the JSON
    of at most ``MAX_LINKS`` links among them."""
    return prune_memory_bytes(kept) + min(kept * kept, MAX_LINKS) * LINK_BYTES


def mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def budget_bytes() -> int:
    return int(settings.GRAPH_VIEW_MEMORY_MB * 2**20)


def stored_nodes_cap(fixed: int) -> int:
    """The most nodes besides the ``fixed`` tokens and logits that a graph's view keeps: at most
    ``GRAPH_VIEW_MAX_NODES``, and so that a prune of all of them fits the budget alone (at least
    one, so that the view holds some node threshold)."""
    cells = max(0, budget_bytes() - prune_memory_bytes(0) - MAX_LINKS * LINK_BYTES) // PRUNE_BYTES_PER_CELL
    within = math.isqrt(cells)
    return max(1, min(settings.GRAPH_VIEW_MAX_NODES, within - fixed))


_changed = threading.Condition()
_held = 0
_viewing: set = set()  # the users with a view running in this process


def held_bytes() -> int:
    """What the graph views running in this process have reserved now."""
    return _held


@contextmanager
def view_memory(nbytes: int, *, what: str, advice: str, viewer: object = None) -> Iterator[None]:
    """Hold ``nbytes`` of the budget while the body runs (see the module's docstring). One view at a
    time per ``viewer``: another view of theirs waits for it (up to ``GRAPH_VIEW_WAIT_SECONDS``,
    then 429 ``RATE_LIMITED``), so one user's parallel views take one thread's worth of the web
    process, whatever their number."""
    global _held
    limit = budget_bytes()
    if nbytes > limit:
        raise ApplicationError(
            "GRAPH_VIEW_TOO_LARGE",
            f"{what} would take about {mib(nbytes)} in the web process, over the {mib(limit)} that graph "
            f"views may take (GRAPH_VIEW_MEMORY_MB): {advice}",
            details={"estimate_bytes": nbytes, "limit_bytes": limit},
        )
    deadline = time.monotonic() + settings.GRAPH_VIEW_WAIT_SECONDS
    with _changed:
        while (mine := viewer is not None and viewer in _viewing) or _held + nbytes > limit:
            left = deadline - time.monotonic()
            if left > 0:
                release_database()
                _changed.wait(left)
            elif mine:
                raise rate_limited(
                    "You have another graph view being computed; views of one user run one at a time.",
                    retry_after_seconds=RETRY_AFTER_SECONDS,
                    details={"scope": "graph_views", "limit": 1},
                )
            else:
                raise ApplicationError(
                    "GRAPH_VIEWS_BUSY",
                    "Other graph views are taking the memory the web process keeps for them; try again "
                    "in a moment.",
                    status=503,
                    details={"retry_after_seconds": RETRY_AFTER_SECONDS, "limit_bytes": limit},
                )
        _held += nbytes
        _viewing.add(viewer)
    try:
        yield
    finally:
        with _changed:
            _held -= nbytes
            _viewing.discard(viewer)
            _changed.notify_all()
