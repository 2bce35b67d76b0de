"""How much of this worker's time each owner had lately: who goes next, in every lane.

A worker shares one device between a batch job (an SAE training, an extraction) and the interactive
lane (generation batches, worker calls). Counting requests would let one user's 16-prompt batches
of 100 tokens crowd out another's 8-token chat; counting lanes would let a flood of one user's
generation starve another's training. The worker instead counts *seconds of its own time* per owner,
decaying by half every ``HALF_LIFE_SECONDS``:

* a running job charges its owner for the time between its steps;
* a generation batch charges each of its rows' owners a share of the time it ran.

At a job's step boundary the worker serves the interactive lane only when an owner waiting there had
no more time lately than the job's owner (``mistudio.workers.interactive_turn``); between items it
takes a batch job before interactive work when the job's owner had less time
(``mistudio.workers.batch_turn``); a generation batch yields to an owner who had less time than its
own owners (``generation.tasks.YieldPoll``); and batches are filled least-served owner first. A
chat of a few tokens is served at the next step boundary; two heavy users alternate.

One clock per worker process (a worker's fairness is about its own device).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

HALF_LIFE_SECONDS = 30.0

Owner = int | None  # a user id; None: the operator's and system work


class OwnerClock:
    """Decaying seconds of worker time per owner (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: dict[Owner, tuple[float, float]] = {}

    def _decayed(self, owner: Owner, now: float) -> float:
        seconds, at = self._served.get(owner, (0.0, now))
        return seconds * 0.5 ** ((now - at) / HALF_LIFE_SECONDS)

    def served(self, owner: Owner) -> float:
        return self.snapshot([owner])[owner]

    def snapshot(self, owners: Iterable[Owner]) -> dict[Owner, float]:
        """Each owner's time, all read at one moment: compare values of one snapshot only (two
        reads at two moments differ by the decay between them, and an owner would not equal
        itself)."""
        with self._lock:
            now = time.monotonic()
            return {owner: self._decayed(owner, now) for owner in owners}

    def before(self, owners: Iterable[Owner], other: Owner) -> bool:
        """Whether one of ``owners`` had no more time than ``other`` (one snapshot)."""
        owners = list(owners)
        served = self.snapshot([*owners, other])
        return min((served[owner] for owner in owners), default=float("inf")) <= served[other]

    def charge(self, seconds: float, owners: Iterable[Owner]) -> None:
        """Charge ``seconds`` of worker time, shared equally by ``owners`` (one entry per row: an
        owner with two rows of a batch of four pays half)."""
        owners = list(owners)
        if not owners or seconds <= 0:
            return
        share = seconds / len(owners)
        with self._lock:
            now = time.monotonic()
            for owner in owners:
                self._served[owner] = (self._decayed(owner, now) + share, now)

    def reset(self) -> None:
        with self._lock:
            self._served.clear()


CLOCK = OwnerClock()
