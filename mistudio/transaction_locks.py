"""Requests that would write the same thing take turns: check-then-insert without duplicates.

A service that looks for an earlier row and creates one when there is none (an SAE import that
reuses the same files' earlier import, an analysis refused while one is running) is only correct
if no other request runs the same check between its check and its commit. :func:`take_turns`,
called first in the transaction, makes requests with the same key wait for each other until the
first one commits: the second then sees the first one's row.

PostgreSQL: a transaction-scoped advisory lock on a 64-bit number derived from the key (released
at commit or rollback, never leaked by an error). SQLite: every write transaction is already
``IMMEDIATE`` (settings), so transactions take turns from their first statement.
"""

from __future__ import annotations

import hashlib

from django.db import connection


def lock_number(*key: object) -> int:
    """The signed 64-bit advisory lock number of ``key`` (an int alone is used as it is)."""
    if len(key) == 1 and isinstance(key[0], int):
        return key[0]
    digest = hashlib.blake2b("\x1f".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def take_turns(*key: object) -> None:
    """Wait until no other open transaction holds ``key``, then hold it until this one ends.

    Call it inside ``transaction.atomic()``, before the check whose result the insert depends on.
    Transactions that take several keys must take them in the same order (the admission key last).
    """
    if connection.vendor != "postgresql":
        return
    if not connection.in_atomic_block:
        raise RuntimeError("take_turns() outside a transaction would hold nothing.")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [lock_number(*key)])
