"""Whether the client of the request being served went away: work it started must die with it.

Django (on ASGI) cancels a request's task when its client disconnects. An async view sees that as
``CancelledError``; a sync view runs in a thread that nothing can interrupt, so it would go on
waiting for a worker's answer nobody will read, and the worker would compute it. This middleware
gives every request a :class:`threading.Event` (through a context variable, which sync views see
in their thread) that is set when the request's task is cancelled: code that waits (a worker
call, ``mistudio.workers.call_worker``) waits in slices and withdraws its work once it is set.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

_ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "request_abandoned", default=None
)
_NEVER = threading.Event()  # outside a request (commands, tasks): never set


def release_database() -> None:
    """Give this thread's database connections back to the pool before a long wait (for a worker,
    for room in a budget): a request waiting minutes must not hold a pooled connection meanwhile
    (ten waiting requests took the whole pool of a web process, and everyone else's failed). One in
    a transaction stays: closing it would end the transaction."""
    from django.db import connections

    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            connection.close()


def request_abandoned() -> threading.Event:
    """The current request's event, set once its client has gone (never set outside a request)."""
    return _ABANDONED.get() or _NEVER


class RequestLifetimeMiddleware:
    """Sets the request's :func:`request_abandoned` event when Django cancels the request."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self.handle_async(request)
        return self.get_response(request)  # WSGI: no disconnect is ever reported

    async def handle_async(self, request):
        abandoned = threading.Event()
        token = _ABANDONED.set(abandoned)
        try:
            return await self.get_response(request)
        except asyncio.CancelledError:
            abandoned.set()
            raise
        finally:
            _ABANDONED.reset(token)
