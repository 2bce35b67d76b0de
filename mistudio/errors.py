"""One application error type and the one DRF exception handler that renders every API error.

Body: ``{"error": {"code", "message", "details", "timestamp"}}`` (seed 004 §5). No stack trace,
exception text of an unexpected error or server path ever reaches a response.
"""

import logging
from http import HTTPStatus
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, JsonResponse
from django.utils import timezone
from rest_framework import exceptions
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
    if isinstance(exc, ApplicationError):
        return Response(error_body(exc.code, exc.message, exc.details), status=exc.status)
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
        if wait := getattr(exc, "wait", None):
            response["Retry-After"] = str(int(wait))
        return response
    logger.exception("unexpected error in %s", context.get("view").__class__.__name__)
    return Response(error_body("INTERNAL_ERROR", "An unexpected error occurred."), status=500)


def json_error_response(status: int, code: str | None = None, message: str | None = None) -> JsonResponse:
    """The same body for errors raised outside DRF views (unknown /api/ URLs, 500 pages)."""
    phrase = HTTPStatus(status).phrase
    return JsonResponse(
        error_body(code or phrase.upper().replace(" ", "_"), message or phrase + "."), status=status
    )
