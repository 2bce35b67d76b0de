"""Request rate limits: DRF throttles whose counts live in Redis, shared by every web process.

The rates are ``REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]`` (set from the environment in
``settings.py``; a scope set to ``None`` is off). A signed-in client is counted by user id, so
no header can reset its limit; an anonymous one by its address as DRF's ``get_ident`` finds it,
which with ``NUM_PROXIES`` set ignores the ``X-Forwarded-For`` entries a client can write itself.

DRF views list the classes in ``throttle_classes``. Generation is limited by the work it asks
for, not by requests: its admission (``generation.admission``) calls :func:`charge_work` with a
request's tokens. Either way a refusal is ``mistudio.errors.rate_limited``: 429 ``RATE_LIMITED``
with ``details.retry_after_seconds`` and a ``Retry-After`` header.

The extraction caps are not request rates but counts of jobs in flight, checked where jobs are
created (``activations.services.extraction_request``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.throttling import BaseThrottle, SimpleRateThrottle

from mistudio.errors import rate_limited

PERIOD_WORDS = {1: "second", 60: "minute", 3600: "hour", 86400: "day"}


class UserRateThrottle(SimpleRateThrottle):
    """A rate per user (per client address for anonymous requests) for one ``scope``.

    Unlike DRF's own classes, the rate is read when the throttle is made rather than when the
    module is imported, so a changed setting (tests, ``override_settings``) takes effect.
    """

    scope: str
    what: str  # for the message: "model loads"
    cache_format = "throttle:%(scope)s:%(ident)s"

    def get_rate(self) -> str | None:
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)

    def get_cache_key(self, request: Request, view: Any) -> str:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            ident = f"user:{user.pk}"
        else:
            ident = f"address:{self.get_ident(request)}"
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def throttle_failure(self) -> bool:
        """Refuse with the documented error instead of DRF's bare ``Throttled``: it names the limit."""
        period = PERIOD_WORDS.get(self.duration, f"{self.duration} s")
        raise rate_limited(
            f"Too many {self.what}: at most {self.num_requests} per {period}.",
            retry_after_seconds=self.wait(),
            details={"scope": self.scope, "limit": self.num_requests, "period_seconds": self.duration},
        )


def client_address(request: HttpRequest) -> str | None:
    """The client's address as every limit counts it (DRF's rule: ``REMOTE_ADDR``, or with
    ``NUM_PROXIES`` the entry of ``X-Forwarded-For`` that many from the right). Also the address
    sign-in attempts are counted under (``AXES_CLIENT_IP_CALLABLE``)."""
    return BaseThrottle().get_ident(request)


def sign_in_locked_out(request: HttpRequest, credentials: Any, *args: Any, **kwargs: Any) -> HttpResponse:
    """django-axes' answer to a sign-in while the account or address is locked out: 429 with
    ``Retry-After`` and a page that says what happened (``AXES_LOCKOUT_CALLABLE``)."""
    minutes = settings.LOGIN_LOCKOUT_MINUTES
    response = render(
        request,
        "registration/locked_out.html",
        {"minutes": round(minutes), "limit": settings.LOGIN_FAILURE_LIMIT},
        status=429,
    )
    response["Retry-After"] = str(math.ceil(minutes * 60))
    return response


class ModelLoadThrottle(UserRateThrottle):
    """``POST /api/models/{id}/load``: loads are slow and can evict other users' models."""

    scope = "model_load"
    what = "model loads"


class ModelRegisterThrottle(ModelLoadThrottle):
    """``POST /api/models`` counts against the load limit only when it asks for ``auto_load``."""

    def allow_request(self, request: Request, view: Any) -> bool:
        if request.method != "POST" or not isinstance(request.data, dict):
            return True
        try:
            auto_load = serializers.BooleanField().to_internal_value(request.data.get("auto_load", False))
        except serializers.ValidationError:
            return True  # the view's serializer names the bad field; nothing is loaded
        return super().allow_request(request, view) if auto_load else True


class WorkerCallThrottle(UserRateThrottle):
    """Live encoding, patching and the logit lens (one shared count): each holds a model's worker."""

    scope = "worker_call"
    what = "worker calls (live encoding, patching, the logit lens)"


# A work rate's window is counted in this many buckets: one small entry per user, however many
# requests they send (a list of every request grew with a flood, and was read and written whole).
WORK_BUCKETS = 12


def charge_work(*, scope: str, user: Any, tokens: int, what: str) -> None:
    """Count ``tokens`` of work against ``user``'s rate for ``scope`` (work per period, not
    requests: a 16-prompt batch costs 16 rows' tokens), or refuse with 429 ``RATE_LIMITED``.

    The window slides by buckets of a ``WORK_BUCKETS``-th of the period, kept as one small entry
    in the shared cache. A request larger than the whole rate still passes when nothing else was
    counted in the window. Callers serialize a user's charges (generation's admission lock).
    """
    rate = api_settings.DEFAULT_THROTTLE_RATES.get(scope)
    if rate is None:
        return
    limit, duration = SimpleRateThrottle.parse_rate(None, rate)
    width = duration / WORK_BUCKETS
    key = f"throttle:work:{scope}:user:{user.pk}"
    cache = SimpleRateThrottle.cache
    now = time.time()
    current = int(now // width)
    buckets = {index: cost for index, cost in cache.get(key, {}).items() if index > current - WORK_BUCKETS}
    used = sum(buckets.values())
    if used and used + tokens > limit:
        # The window frees enough once its oldest buckets leave it.
        freed, wait = 0, duration
        for index in sorted(buckets):
            freed += buckets[index]
            if used - freed + tokens <= limit:
                wait = (index + WORK_BUCKETS) * width - now
                break
        raise rate_limited(
            f"Too much {what}: at most {limit:,} tokens per {PERIOD_WORDS.get(duration, f'{duration} s')} "
            f"({used:,} counted, this request {tokens:,}; a token of work is a prompt token or a token "
            "a row may generate).",
            retry_after_seconds=max(1.0, wait),
            details={"scope": scope, "limit": limit, "period_seconds": duration, "unit": "tokens"}
            | {"used": used},
        )
    buckets[current] = buckets.get(current, 0) + tokens
    cache.set(key, buckets, duration)


class GraphViewThrottle(UserRateThrottle):
    """``GET /api/graphs/{id}/nodes`` and ``/export``: each view is the web process's CPU, even
    served as rendered (a loop of views on a few connections took a core)."""

    scope = "graph_view"
    what = "graph views"
