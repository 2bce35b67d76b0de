"""``GET /healthz``: up or down per dependency for anyone; details for operators. 503 when the
database or Redis is down.

Anonymous probes (load balancers, docker's healthcheck) learn only what they need: ``status`` and
``dependencies`` (``"up"`` / ``"down"`` for the database, Redis and the workers). Worker hosts,
pids, loaded models, memory and package versions are for whoever may read ``/metrics`` (the
``METRICS_TOKEN``, staff, ``model:admin``), under ``details``.
"""

import platform
from importlib import metadata

import redis
from django.db import DatabaseError, InterfaceError, connection
from django.http import JsonResponse
from django.views.decorators.http import require_safe
from rest_framework.exceptions import APIException
from rest_framework.request import Request
from rest_framework.settings import api_settings

import mistudio
from mistudio.errors import DATABASE_ERRORS
from mistudio.metrics import CanReadMetrics, MetricsTokenAuthentication
from mistudio.redis_client import get_redis
from mistudio.workers import read_heartbeats

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

    try:
        get_redis().ping()
        return {"ok": True}, read_heartbeats()
    except (redis.RedisError, OSError, RuntimeError):
        return {"ok": False, "error": "unreachable"}, []


def may_read_operations(request) -> bool:
    """Whether the request may see operational details: the rule of ``/metrics`` (its token, staff
    or ``model:admin``, by any of the API's credentials). A bad credential is just anonymous here."""

    authenticators = [MetricsTokenAuthentication()]
    authenticators += [authenticator() for authenticator in api_settings.DEFAULT_AUTHENTICATION_CLASSES]
    try:
        return CanReadMetrics().has_permission(Request(request, authenticators=authenticators), None)
    except (APIException, *DATABASE_ERRORS):  # no credential can be checked while the database is down
        return False


def up(ok: bool) -> str:
    return "up" if ok else "down"


@require_safe
def healthz(request):
    database = database_status()
    redis_status, workers = redis_and_workers_status()
    healthy = database["ok"] and redis_status["ok"]
    body = {
        "status": "ok" if healthy else "unavailable",
        "dependencies": {
            "database": up(database["ok"]),
            "redis": up(redis_status["ok"]),
            "workers": up(bool(workers)),
        },
    }
    if may_read_operations(request):
        body["details"] = {
            "database": database,
            "redis": redis_status,
            "workers": workers,
            "versions": package_versions(),
        }
    return JsonResponse(body, status=200 if healthy else 503)
