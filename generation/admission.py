"""What a generation request costs, and whether it may start now.

**The unit: a work token.** A row costs the tokens of its prompt plus the tokens it may generate
(``max_tokens``; a default one counts as it will run, shrunk to the model's context). Prompts are
tokenized on the worker, so admission counts a prompt's characters divided by
``CHARACTERS_PER_TOKEN``. A row costs at least ``MIN_ROW_WORK`` (its fixed cost: a forward pass,
a stream, a database row). A request of 16 prompts costs 16 rows; a sweep of 8 strengths costs its
9 rows. Every limit on generation counts in this unit:

* **One request** may cost at most one user's share (below): a larger one could never be admitted
  next to anything, so it is refused with 400 ``GENERATION_TOO_LARGE`` (fewer prompts, a smaller
  ``max_tokens``).
* **In flight, per user** (``GENERATION_USER_MAX_TOKENS_IN_FLIGHT``): the work of a user's queued
  and running rows, this request's included. Beyond it, 429 ``RATE_LIMITED`` (scope
  ``generation_in_flight``) with ``Retry-After``; nothing is written. An explanation job's own
  requests (through ``/v1``) are its owner's, and count the same.
* **In flight, per worker** (``GENERATION_MAX_TOKENS_IN_FLIGHT``): the work of every queued and
  running row of the models a worker hosts. Beyond it, 503 ``MODEL_BUSY`` with ``Retry-After``
  (the message tells no one what others have in flight).
* **Per minute, per user** (``RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE``): the work admitted in the
  last minute (``mistudio.throttling.charge_work``); 429 ``RATE_LIMITED`` (scope ``generation``).

Requests take turns here, so concurrent requests cannot all take the last share: first a user's
requests among themselves in each web process (:func:`admission_turn`, waited for with no database
connection held, so one user's flood neither queues in front of others nor holds the pool), then
everyone's (an advisory lock on PostgreSQL; SQLite's transactions are already ``IMMEDIATE``).
Admission runs before any row, stream or queue entry exists: a refusal leaves nothing behind.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings
from django.db.models import Q, Sum

from generation.models import Generation
from mistudio.errors import ApplicationError, rate_limited
from mistudio.request_lifetime import release_database
from mistudio.throttling import charge_work
from mistudio.transaction_locks import take_turns

CHARACTERS_PER_TOKEN = 4
# PostgreSQL advisory lock that generation admissions take turns on ("mistudio-gen").
GENERATION_ADMISSION_LOCK = 0x6D69_7374_2D67_656E
# When a share is likely to free: rows finish in seconds on a loaded model.
USER_RETRY_AFTER_SECONDS = 2
BUSY_RETRY_AFTER_SECONDS = 5
# How long a request waits for its user's earlier requests to be admitted before a 429.
USER_TURN_WAIT_SECONDS = 30.0


# The least a row costs, however short: its forward pass, stream and row are not free.
MIN_ROW_WORK = 32


def row_work(text: str, max_tokens: int, *, explicit: bool = True, context: int | None = None) -> int:
    """A row's work tokens: its prompt (estimated from its characters) plus what it may generate
    (a default ``max_tokens``, not ``explicit``, as the worker will run it: shrunk to ``context``)."""
    prompt = math.ceil(len(text) / CHARACTERS_PER_TOKEN)
    if not explicit and context is not None:
        max_tokens = max(1, min(max_tokens, context - prompt))
    return max(MIN_ROW_WORK, prompt + max_tokens)


def _in_flight(rows) -> int:
    return rows.filter(status__in=Generation.ACTIVE).aggregate(total=Sum("work_tokens"))["total"] or 0


_USER_TURNS: dict[int, threading.Lock] = {}
_USER_TURNS_LOCK = threading.Lock()


@contextmanager
def admission_turn(owner) -> Iterator[None]:
    """Hold ``owner``'s turn to be admitted in this process (a user's requests one at a time),
    waited for with the database connection given back: a user's hundred concurrent requests wait
    here, holding nothing, instead of on the advisory lock inside a transaction, each holding one
    of the process's pooled connections (the pool is per process, so is this turn). Past
    ``USER_TURN_WAIT_SECONDS``, 429 ``RATE_LIMITED``. Enter it before the transaction."""
    if not getattr(owner, "is_authenticated", False):
        yield
        return
    with _USER_TURNS_LOCK:
        turn = _USER_TURNS.setdefault(owner.pk, threading.Lock())
    if not turn.acquire(blocking=False):
        release_database()
        if not turn.acquire(timeout=USER_TURN_WAIT_SECONDS):
            raise rate_limited(
                "Your other generation requests are still being admitted: send this one again in a second.",
                retry_after_seconds=1,
                details={"scope": "generation_in_flight"},
            )
    try:
        yield
    finally:
        turn.release()


def generation_admit(*, owner, host: str, tokens: int) -> None:
    """Admit ``tokens`` of work for ``owner`` on the worker ``host`` (see the module docstring), or
    raise 400 / 429 / 503. Call it inside the transaction that creates the rows, just before,
    within the owner's :func:`admission_turn`."""
    user = owner if getattr(owner, "is_authenticated", False) else None
    per_user = settings.GENERATION_USER_MAX_TOKENS_IN_FLIGHT
    total = settings.GENERATION_MAX_TOKENS_IN_FLIGHT
    limits = [limit for limit in (per_user if user is not None else 0, total) if limit]
    if limits and tokens > (largest := min(limits)):
        raise ApplicationError(
            "GENERATION_TOO_LARGE",
            f"This request is {tokens:,} tokens of work (prompts plus max_tokens, per row); one request "
            f"may be at most {largest:,}. Send fewer prompts or a smaller max_tokens.",
            status=400,
            details={"request": tokens, "limit": largest, "unit": "tokens"},
        )
    take_turns(GENERATION_ADMISSION_LOCK)
    if user is not None and per_user:
        mine = _in_flight(Generation.objects.filter(owner=user))
        if mine + tokens > per_user:
            raise rate_limited(
                f"You have {mine:,} tokens of generation in flight; with this request's {tokens:,} that "
                f"is more than one user's share ({per_user:,}). Send it again when your requests end.",
                retry_after_seconds=USER_RETRY_AFTER_SECONDS,
                details={
                    "scope": "generation_in_flight", "limit": per_user, "in_flight": mine,
                    "request": tokens, "unit": "tokens",
                },
            )  # fmt: skip
    if total:
        hosted = Generation.objects.filter(Q(host_worker=host) | Q(host_worker="", model__host_worker=host))
        if _in_flight(hosted) + tokens > total:
            raise ApplicationError(
                "MODEL_BUSY",
                "The model's worker has as much generation in flight as it takes: send this request "
                "again in a few seconds.",
                status=503,
                details={"retry_after_seconds": BUSY_RETRY_AFTER_SECONDS},
            )
    if user is not None:
        charge_work(scope="generation", user=user, tokens=tokens, what="generation work")
