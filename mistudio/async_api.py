"""Helpers for the few API views that must be async: those that wait on a generation.

A generation can take seconds to minutes. Under Daphne every synchronous view runs on one shared
thread, so a sync view that waited would stall all other requests; and only an async view hears
the client disconnect (Django cancels its task), which is how a dropped client stops its
generation. These views use DRF's authenticators, serializers and error codes unchanged, through
the helpers below, so the rules are the same as everywhere else in the API.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication
from rest_framework.request import Request

from mistudio.authentication import ApiTokenAuthentication, BearerTokenAuthentication, JobTokenAuthentication
from mistudio.errors import DRF_CODES, ApplicationError
from mistudio.json_input import MalformedJSON, parse_json


class _SessionAuthentication(SessionAuthentication):
    """Session auth whose CSRF check reads the plain Django request.

    The check looks for a form field before the ``X-CSRFToken`` header, i.e. it reads ``POST``;
    DRF's ``Request`` would parse that with the view's parsers, and these views have none (they
    read JSON themselves), so a browser's JSON request would fail as an unsupported media type.
    Django's own request answers ``POST`` of a JSON body with an empty form, unread.
    """

    def enforce_csrf(self, request):
        return super().enforce_csrf(request._request)


def _authenticate(request: HttpRequest, session: bool) -> Any:
    # A job token first: the DRF token classes would refuse it as an unknown key.
    authenticators = [JobTokenAuthentication(), ApiTokenAuthentication(), BearerTokenAuthentication()]
    if session:
        authenticators.append(_SessionAuthentication())  # enforces CSRF for unsafe methods
    drf_request = Request(request, authenticators=authenticators)
    try:
        user = drf_request.user
    except exceptions.APIException as error:
        raise as_application_error(error) from None
    if user is None or not user.is_authenticated:
        raise ApplicationError("UNAUTHENTICATED", "Authentication credentials were not provided.", status=401)
    # A job's own requests are its owner's: they count against the owner's generation share and rate
    # like any other (generation.admission).
    return user


def _authorize(request: HttpRequest, session: bool, permission: str) -> Any:
    user = _authenticate(request, session)
    if not user.has_perm(permission):
        role = permission.rpartition(".")[2].replace("_", ":")  # models_app.model_read -> model:read
        raise ApplicationError("PERMISSION_DENIED", f"This needs the {role} role.", status=403)
    return user


async def authenticated_user(request: HttpRequest, *, permission: str, session: bool = True) -> Any:
    """The request's user by API token (``Token`` or ``Bearer``) or, with ``session``, by session + CSRF,
    if they hold ``permission`` (the route's role, as DRF's permission classes check it elsewhere).

    Raises ``ApplicationError`` 401 ``UNAUTHENTICATED`` (or 403 for a failed CSRF check), 403
    ``PERMISSION_DENIED`` without the permission.
    """
    return await sync_to_async(_authorize)(request, session, permission)


def as_application_error(error: exceptions.APIException) -> ApplicationError:
    code = next((code for cls, code in DRF_CODES if isinstance(error, cls)), "API_ERROR")
    if isinstance(error, exceptions.ValidationError):
        return ApplicationError(
            code, "The request is not valid.", details={"fields": error.detail}, status=error.status_code
        )
    return ApplicationError(code, str(error.detail), status=error.status_code)


def json_body(request: HttpRequest) -> dict[str, Any]:
    """The request's JSON object body; 415 for another content type, 400 for malformed JSON."""
    content_type = request.content_type or ""
    if content_type != "application/json":
        raise ApplicationError(
            "UNSUPPORTED_MEDIA_TYPE",
            f"Send JSON (Content-Type: application/json), not {content_type or 'nothing'}.",
            status=415,
        )
    try:
        body = parse_json(request.body or b"null")
    except MalformedJSON as error:
        raise ApplicationError(
            "MALFORMED_REQUEST", f"The body is not valid JSON: {error}.", status=400
        ) from None
    if not isinstance(body, dict):
        raise ApplicationError("MALFORMED_REQUEST", "The body must be a JSON object.", status=400)
    return body


def validated(serializer_class, data: dict[str, Any]) -> dict[str, Any]:
    """Run a DRF serializer; its errors become the documented 400 body naming each field."""
    serializer = serializer_class(data=data)
    if not serializer.is_valid():
        raise ApplicationError(
            "VALIDATION_ERROR", "The request is not valid.", details={"fields": serializer.errors}, status=400
        )
    return serializer.validated_data
