"""Every documented API error as a typed exception carrying its code and details.

The server answers errors as ``{"error": {"code", "message", "details", "timestamp"}}``; the
client raises the class of the HTTP status (``NotFound``, ``Conflict``, …), each an
:class:`ApiError` whose ``code`` is the documented code (``MODEL_NOT_LOADED``, ``INVALID_HOOK``, …).
A failed job raises :class:`JobFailed` with the job's own ``error_code``.
"""

from __future__ import annotations

import contextlib
from typing import Any


class MistudioError(Exception):
    """Anything the client refuses or the server answers with an error."""


class VersionMismatch(MistudioError):
    """The server speaks an API version this client does not."""


class ApiError(MistudioError):
    """An error answer: ``status`` (HTTP), ``code`` (documented), ``message``, ``details``."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}


class BadRequest(ApiError):
    """400: validation and refusals (``VALIDATION_ERROR``, ``INVALID_HOOK``, ``PROMPT_TOO_LONG``…)."""


class Unauthorized(ApiError):
    """401: no or a wrong token."""


class PermissionDenied(ApiError):
    """403: the token's role may not do this, or the row is not yours to change."""


class NotFound(ApiError):
    """404: no such row, or one you may not see."""


class Conflict(ApiError):
    """409: the row's state forbids it (``MODEL_NOT_LOADED``, ``NOT_RUNNING``…)."""


class PayloadTooLarge(ApiError):
    """413: the upload is over the server's limit."""


class RateLimited(ApiError):
    """429: over a rate limit or a job cap; ``retry_after`` seconds when the server said."""

    retry_after: float | None = None


class ServerError(ApiError):
    """5xx: the server failed (``WORKER_LOST``, ``MODEL_BUSY``…)."""


_BY_STATUS = {
    400: BadRequest,
    401: Unauthorized,
    403: PermissionDenied,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    429: RateLimited,
}


def error_from_response(status: int, body: Any, headers: Any = None) -> ApiError:
    """The typed exception of an error answer (any body: a proxy's HTML page too)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"code": f"HTTP_{status}", "message": f"The server answered {status}."}
    kind = _BY_STATUS.get(status, ServerError if status >= 500 else ApiError)
    raised = kind(
        status, str(error.get("code", f"HTTP_{status}")), str(error.get("message", "")), error.get("details")
    )
    if isinstance(raised, RateLimited) and headers is not None and headers.get("Retry-After"):
        with contextlib.suppress(ValueError):
            raised.retry_after = float(headers["Retry-After"])
    return raised


class JobFailed(MistudioError):
    """A job ended ``failed`` (or ``cancelled``): its ``kind``, ``id``, ``status`` and ``code``."""

    def __init__(self, kind: str, job_id: str, status: str, code: str, message: str) -> None:
        super().__init__(f"{kind} {job_id} {status}: {code}: {message}")
        self.kind, self.id, self.status, self.code, self.message = kind, job_id, status, code, message
