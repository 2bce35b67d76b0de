"""Memory budgets: a job or worker request over its worker's budget is refused before anything
is allocated.

The estimate comes from :mod:`engine.budgets`; the budget is ``JOB_MEMORY_LIMIT_GB`` (capped by
what the worker has free), or by default half of what the worker's device has free — the rest
stays for its loaded models, interactive work and the system. The web checks against the
heartbeat of the worker that will run the work (the model's host, else the freest live worker);
the worker checks again against its free memory before it starts (``mistudio.job_runner``).
"""

from __future__ import annotations

from django.conf import settings

from engine.budgets import MemoryEstimate, gib
from mistudio.errors import ApplicationError
from mistudio.workers import WorkerIdentity, device_memory, read_heartbeats


def worker_free_bytes(identity: WorkerIdentity) -> int:
    """What the worker's compute device (its GPU, else the machine) has free now."""
    return device_memory(identity.compute_device)[1]


def memory_budget(*, worker_name: str | None = None) -> int | None:
    """The most one job or request may take on ``worker_name`` (None: on the freest live worker);
    None when nothing bounds it (no limit set and no worker alive to ask)."""
    beats = read_heartbeats()
    if worker_name:
        beats = [beat for beat in beats if beat["name"] == worker_name]
    free = max((int(beat.get("memory_free_bytes") or 0) for beat in beats), default=None)
    configured = int(settings.JOB_MEMORY_LIMIT_GB * 2**30)
    if configured:
        return configured if free is None else min(configured, free)
    return None if free is None else free // 2


def memory_budget_check(estimate: MemoryEstimate, *, what: str, worker_name: str | None = None) -> int:
    """Refuse ``what`` (400 ``MEMORY_BUDGET_EXCEEDED``, the estimate and the limit in the message and
    details) when its estimated peak is over the budget; return the estimate in bytes."""
    limit = memory_budget(worker_name=worker_name)
    if limit is not None and estimate.total > limit:
        raise ApplicationError(
            "MEMORY_BUDGET_EXCEEDED",
            f"{what[0].upper()}{what[1:]} would need about {estimate.describe()} at its peak, over the "
            f"{gib(limit)} one job may take on its worker: make it smaller.",
            details={"estimate_bytes": estimate.total, "limit_bytes": limit, "parts": estimate.as_details()},
        )
    return estimate.total
