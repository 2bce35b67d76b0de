"""Pages: workers and health."""

from django.conf import settings
from django.shortcuts import render
from django.views.decorators.http import require_safe

from frontend.access import reader_required
from models_app.selectors import worker_overview

DATABASE_NAMES = {
    "sqlite": "SQLite",
    "postgresql": "PostgreSQL",
    "mysql": "MySQL",
}
# Memory use from which a bar turns amber, then red (percent).
MEMORY_WARN_PERCENT = 75
MEMORY_HIGH_PERCENT = 90


def duration_human(seconds: float) -> str:
    """``42s``, ``3m 5s``, ``2h 10m``: the same as ``mi.duration`` in app.js (which ticks the ages on)."""
    seconds = max(round(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes}m {seconds % 60}s"
    return f"{minutes // 60}h {minutes % 60}m"


def memory_level(percent: float) -> str:
    if percent >= MEMORY_HIGH_PERCENT:
        return "high"
    return "warn" if percent >= MEMORY_WARN_PERCENT else "ok"


def worker_view(beat: dict, *, now: float, own_queue: dict | None) -> dict:
    """A heartbeat with what the page shows derived from it."""
    total, free = beat.get("memory_total_bytes") or 0, beat.get("memory_free_bytes") or 0
    used = max(total - free, 0)
    used_percent = round(100 * used / total, 1) if total else 0
    models_bytes = beat.get("other_models_bytes", 0) + sum(
        entry.get("memory_usage_bytes") or 0 for entry in beat["loaded_models"]
    )
    limit = beat.get("memory_limit_bytes") or 0
    budget_percent = round(min(100 * models_bytes / limit, 100), 1) if limit else 0
    age = max(now - beat.get("last_heartbeat", now), 0)
    return {
        **beat,
        "memory_used_bytes": used,
        "memory_used_percent": used_percent,
        "memory_level": memory_level(used_percent),
        "models_bytes": models_bytes,
        "budget_percent": budget_percent,
        "budget_level": memory_level(budget_percent),
        "late": age > 2 * settings.WORKER_HEARTBEAT_SECONDS,
        "heartbeat_age": duration_human(age),
        "uptime": duration_human(now - beat.get("started_at", now)),
        "loaded_models": [
            {**entry, "idle": duration_human(entry.get("idle_seconds") or 0)}
            for entry in beat["loaded_models"]
        ],
        "own_queue": own_queue,
    }


@reader_required
@require_safe
def workers_page(request):
    """Each live worker (device, memory, loaded models), the queues, Redis and the database.

    The page renders the state now; ``workers.js`` asks for the same state again every 5 s
    (``?fragment=state``: only ``partials/workers_state.html``) and swaps it in.
    """
    overview = worker_overview(user=request.user)
    own_queues = {queue["worker"]: queue for queue in overview["queues"] if queue["kind"] == "worker"}
    workers = [
        worker_view(beat, now=overview["server_time"], own_queue=own_queues.get(beat["name"]))
        for beat in overview["workers"]
    ]
    fragment = request.GET.get("fragment") == "state"
    return render(
        request,
        "frontend/partials/workers_state.html" if fragment else "frontend/workers.html",
        {
            **overview,
            "workers": workers,
            "queued_total": sum(queue["queued"] for queue in overview["queues"]),
            "running_total": sum(queue["running"] for queue in overview["queues"]),
            "database_label": DATABASE_NAMES.get(
                overview["database"]["vendor"], overview["database"]["vendor"]
            ),
        },
    )
