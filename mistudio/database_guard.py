"""A database outage answers 503 with the documented error body, never Django's HTML 500 page.

DRF views map the database errors in ``mistudio.errors.api_exception_handler``; this middleware
does the same for every other view: pages, admin, the async ``/api/generate`` and ``/v1/*``
views (OpenAI's error shape there). The response names no host, path or driver message; the log
keeps the driver's message for the operator.
"""

import logging

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.deprecation import MiddlewareMixin

from mistudio.errors import DATABASE_ERRORS, database_unavailable, error_body, with_retry_after

logger = logging.getLogger(__name__)


class DatabaseUnavailableMiddleware(MiddlewareMixin):
    """``process_exception``: ``OperationalError`` / ``InterfaceError`` from a view become a 503."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, DATABASE_ERRORS):
            return None
        logger.warning("database unavailable for %s %s: %s", request.method, request.path, exception)
        error = database_unavailable()
        if request.path.startswith("/v1/"):
            from models_app.generation.openai_api import openai_error_response

            response = openai_error_response(error)
        elif request.path.startswith("/api/") or "application/json" in request.headers.get("Accept", ""):
            response = JsonResponse(error_body(error.code, error.message, error.details), status=error.status)
        else:
            response = HttpResponse(
                "The database is unavailable; try again shortly.\n",
                status=error.status,
                content_type="text/plain",
            )
        return with_retry_after(response, error)
