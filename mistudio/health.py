"""``GET /healthz``: database, Redis, live workers and versions; 503 when a dependency is down."""

import platform
from importlib import metadata

import redis
from django.db import DatabaseError, InterfaceError, connection
from django.http import JsonResponse
from django.views.decorators.http import require_safe

import mistudio

VERSIONED_PACKAGES = [
    "django",
    "djangorestframework",
    "channels",
    "rq",
    "torch",
    "transformers",
    "bitsandbytes",
]


def package_versions() -> dict[str, str]:
    versions = {"mistudio": mistudio.__version__, "python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def database_status() -> dict:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return {"ok": True, "vendor": connection.vendor}
    except (DatabaseError, InterfaceError):  # InterfaceError: a connection cut under us
        return {"ok": False, "vendor": connection.vendor, "error": "unreachable"}


def redis_and_workers_status() -> tuple[dict, list[dict]]:
    from mistudio.redis_client import get_redis
    from models_app.workers import read_heartbeats

    try:
        get_redis().ping()
        return {"ok": True}, read_heartbeats()
    except (redis.RedisError, OSError, RuntimeError):
        return {"ok": False, "error": "unreachable"}, []


@require_safe
def healthz(request):
    database = database_status()
    redis_status, workers = redis_and_workers_status()
    healthy = database["ok"] and redis_status["ok"]
    body = {
        "status": "ok" if healthy else "unavailable",
        "database": database,
        "redis": redis_status,
        "workers": workers,
        "versions": package_versions(),
    }
    return JsonResponse(body, status=200 if healthy else 503)
