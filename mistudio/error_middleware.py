"""Errors that escape a view still get the documented body: the last middleware of the stack.

DRF views render their own errors (``mistudio.errors.api_exception_handler``). Everything else —
pages, admin, and the async ``/api/generate`` and ``/v1/*`` views — reaches this middleware:

- a database outage (``OperationalError`` / ``InterfaceError``) is a 503 ``DATABASE_UNAVAILABLE``
  everywhere, with ``Retry-After``;
- on ``/api/`` and ``/v1/`` any other exception is a JSON answer, never Django's HTML page: an
  ``ApplicationError`` with its own status, anything unexpected a 500 ``INTERNAL_ERROR`` (logged
  with its traceback for the operator; the client sees no exception text).

``/v1/`` answers in OpenAI's error shape. Pages keep Django's own error pages (plain text for the
database outage). No response names a host, path or driver message.
"""

import logging

from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

from mistudio.errors import DATABASE_ERRORS, ApplicationError, database_unavailable, error_response
from mistudio.openai_errors import OPENAI_PATH_PREFIX, openai_error_response

logger = logging.getLogger(__name__)

API_PATH_PREFIX = "/api/"


class ErrorResponseMiddleware(MiddlewareMixin):
    """``process_exception``: the view's exception as the documented error response (see above)."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        api = request.path.startswith((API_PATH_PREFIX, OPENAI_PATH_PREFIX))
        if isinstance(exception, DATABASE_ERRORS):
            logger.warning("database unavailable for %s %s: %s", request.method, request.path, exception)
            error = database_unavailable()
        elif not api:
            return None  # a page: Django's own error handling
        elif isinstance(exception, ApplicationError):
            error = exception
        else:
            logger.error("unexpected error in %s %s", request.method, request.path, exc_info=exception)
            error = ApplicationError("INTERNAL_ERROR", "An unexpected error occurred.", status=500)
        if request.path.startswith(OPENAI_PATH_PREFIX):
            return openai_error_response(error)
        if api or "application/json" in request.headers.get("Accept", ""):
            return error_response(error)
        response = HttpResponse(
            "The database is unavailable; try again shortly.\n",
            status=error.status,
            content_type="text/plain",
        )
        response["Retry-After"] = str(error.details["retry_after_seconds"])
        return response
