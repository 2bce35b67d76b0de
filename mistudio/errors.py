"""One application error type and the one DRF exception handler that renders every API error.

Body: ``{"error": {"code", "message", "details", "timestamp"}}`` (seed 004 §5). No stack trace,
exception text of an unexpected error or server path ever reaches a response.
"""

import logging
import math
from http import HTTPStatus
from typing import Any, TypeVar

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpResponseBase, JsonResponse
from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication
from rest_framework.response import Response

logger = logging.getLogger(__name__)


class ApplicationError(Exception):
    """A failure the client should see: a stable code, a human message, an HTTP status."""

    def __init__(self, code: str, message: str, *, status: int = 400, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.details = details or {}


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "error": {
            "code": code,
            "message": message,
            "details": details or {},
            "timestamp": timezone.now().isoformat().replace("+00:00", "Z"),
        }
    }


# What Django raises when the database cannot be reached: the connection failed (server down,
# restarting, out of connections) or was cut under an open session. The client gets a 503 it may
# retry, never a 500; PostgreSQL rolls back a transaction whose connection dropped, so nothing is
# left half-written.
DATABASE_ERRORS = (OperationalError, InterfaceError)
DATABASE_RETRY_AFTER_SECONDS = 5


def database_unavailable() -> ApplicationError:
    return ApplicationError(
        "DATABASE_UNAVAILABLE",
        "The database is unavailable; try again shortly.",
        status=503,
        details={"retry_after_seconds": DATABASE_RETRY_AFTER_SECONDS},
    )


def rate_limited(
    message: str, *, retry_after_seconds: float | None, details: dict[str, Any] | None = None
) -> ApplicationError:
    """429 ``RATE_LIMITED`` with ``details.retry_after_seconds`` (whole seconds, at least 1).

    Every refusal for a limit — a DRF throttle, the extraction caps, the async generation views —
    is built here, so the body and the ``Retry-After`` header are the same at every door.
    """
    seconds = max(1, math.ceil(retry_after_seconds if retry_after_seconds is not None else 1))
    return ApplicationError(
        "RATE_LIMITED", message, status=429, details={**(details or {}), "retry_after_seconds": seconds}
    )


AnyResponse = TypeVar("AnyResponse", bound=HttpResponseBase)


def with_retry_after(response: AnyResponse, error: ApplicationError) -> AnyResponse:
    """Copy ``details.retry_after_seconds`` into a ``Retry-After`` header (clients and proxies read that)."""
    seconds = error.details.get("retry_after_seconds")
    if seconds is not None:
        response["Retry-After"] = str(seconds)
    return response


# DRF's own exceptions, by class, to our codes. Order matters: subclasses first.
DRF_CODES: list[tuple[type[exceptions.APIException], str]] = [
    (exceptions.NotAuthenticated, "UNAUTHENTICATED"),
    (exceptions.AuthenticationFailed, "UNAUTHENTICATED"),
    (exceptions.PermissionDenied, "PERMISSION_DENIED"),
    (exceptions.NotFound, "NOT_FOUND"),
    (exceptions.MethodNotAllowed, "METHOD_NOT_ALLOWED"),
    (exceptions.NotAcceptable, "NOT_ACCEPTABLE"),
    (exceptions.UnsupportedMediaType, "UNSUPPORTED_MEDIA_TYPE"),
    (exceptions.Throttled, "RATE_LIMITED"),
    (exceptions.ParseError, "MALFORMED_REQUEST"),
    (exceptions.ValidationError, "VALIDATION_ERROR"),
]


def api_exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    """DRF's EXCEPTION_HANDLER: every error an API view raises becomes the documented body."""
    if isinstance(exc, exceptions.Throttled):  # a plain DRF throttle: the same body as ours
        exc = rate_limited(str(exc.detail), retry_after_seconds=exc.wait)
    elif isinstance(exc, DATABASE_ERRORS):
        logger.warning("database unavailable in %s: %s", context.get("view").__class__.__name__, exc)
        exc = database_unavailable()
    if isinstance(exc, ApplicationError):
        return with_retry_after(
            Response(error_body(exc.code, exc.message, exc.details), status=exc.status), exc
        )
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, exceptions.APIException):
        code = next((code for cls, code in DRF_CODES if isinstance(exc, cls)), "API_ERROR")
        if isinstance(exc, exceptions.ValidationError):
            message, details = "The request is not valid.", {"fields": exc.detail}
            if isinstance(exc.detail, list):
                details = {"non_field_errors": exc.detail}
        else:
            message, details = str(exc.detail), {}
        response = Response(error_body(code, message, details), status=exc.status_code)
        if auth_header := getattr(exc, "auth_header", None):
            response["WWW-Authenticate"] = auth_header
        return response
    logger.exception("unexpected error in %s", context.get("view").__class__.__name__)
    return Response(error_body("INTERNAL_ERROR", "An unexpected error occurred."), status=500)


def error_response(error: ApplicationError) -> JsonResponse:
    """``error`` as the documented body, outside DRF views (async views, middleware). A 401 names the
    scheme to authenticate with, as DRF's views do (RFC 9110 requires the header)."""
    response = JsonResponse(error_body(error.code, error.message, error.details), status=error.status)
    if error.status == 401:
        response["WWW-Authenticate"] = TokenAuthentication().authenticate_header(None)
    return with_retry_after(response, error)


def json_error_response(status: int, code: str | None = None, message: str | None = None) -> JsonResponse:
    """The same body for errors raised outside DRF views (unknown /api/ URLs, 500 pages)."""
    phrase = HTTPStatus(status).phrase
    return JsonResponse(
        error_body(code or phrase.upper().replace(" ", "_"), message or phrase + "."), status=status
    )
