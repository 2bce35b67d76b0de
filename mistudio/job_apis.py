"""One HTTP edge for every kind of job: a row's detail (read, change, delete) and its cancel.

A kind describes its edge once, as a :class:`JobApi` (where its rows live under ``/api/``, how the
caller's row is found, its JSON, the services that change, delete and cancel it) passed to
``register_job_kind``; its ``urls.py`` routes ``job_routes(Model)``. The views stay thin: the
kind's own selectors authorize the row and its own services act on it, so each kind keeps its
permissions, status codes, bodies and error codes, while the view code exists once.

The schema is each kind's own too: the routes keep their paths (drf-spectacular derives the
operation ids and tags from them), the views their names and descriptions, and a detail's answer
is described by the kind's output serializer (``register_job_kind(serializer=…)``) when it has one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.urls import URLPattern, path
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import status
from rest_framework.fields import Field
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from mistudio.job_queue import queue_position
from mistudio.jobs import JobRow, job_kind, job_kinds
from mistudio.permissions import CanWrite
from mistudio.serializers import StrictSerializer


@dataclass(frozen=True)
class JobApi:
    """How the REST API reaches one kind's rows.

    The services are called with the row under the kind's own keyword (``row``: ``vector=``,
    ``sae=``…) and ``actor=``, as the kind's services are written.
    """

    route: str  # the detail route under /api/: "steering-vectors/<str:vector_id>"
    name: str  # the URL names' stem: "<name>-detail", "<name>-cancel"
    component: str  # the views' names in the schema: "<component>DetailApi", "<component>CancelApi"
    row: str  # the services' keyword for the row
    find: Callable[..., Any]  # find(user=, **route kwargs): the row the caller may see (404 otherwise)
    body: Callable[[Any, Request], dict[str, Any]]  # the row's JSON for the caller
    cancel: Callable[..., Any]  # cancel(<row>=, actor=) -> the row
    update: Callable[..., Any] | None = None  # update(<row>=, actor=, **changes) -> the row
    update_fields: Mapping[str, Field] = field(default_factory=dict)  # what PATCH accepts
    delete: Callable[..., None] | None = None  # delete(<row>=, actor=)
    find_to_change: Callable[..., Any] | None = None  # the row for PATCH and DELETE, when not ``find``
    cancel_route: str | None = None  # default: "<route>/cancel"
    cancel_status: int = status.HTTP_202_ACCEPTED
    permission: type[BasePermission] = CanWrite  # the detail's (a cancel always needs a writer)
    also: tuple[tuple[str, str], ...] = ()  # more routes to the detail: (route, URL name)
    response: Any = dict  # what the schema says a detail is, when the kind has no output serializer
    doc: str = ""  # the detail's description in the schema
    cancel_doc: str = ""


def job_kinds_index() -> dict[str, dict[str, str]]:
    """Each kind with an edge, for ``GET /api/`` (a client reads it, never a copied table): its id
    prefix (``sv`` of ``sv_…``), its detail and cancel paths under ``/api/`` with their parameters
    in braces, and which parameter is the row's id (the others name the rows it is reached through)."""
    index = {}
    for kind in job_kinds():
        api = kind.api
        if api is None:
            continue
        index[kind.model.kind] = {
            "id_prefix": kind.model._meta.pk.default().split("_", 1)[0],
            "path": _braces(api.route),
            "cancel_path": _braces(api.cancel_route or f"{api.route}/cancel"),
            "id_parameter": re.findall(r"<(?:\w+:)?(\w+)>", api.route)[-1],
        }
    return index


def _braces(route: str) -> str:
    """``saes/<str:sae_id>`` as ``saes/{sae_id}``."""
    return re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)


def job_routes(model: type[JobRow]) -> list[URLPattern]:
    """The detail and cancel routes of a registered kind (its ``JobApi``), in that order."""
    kind = job_kind(model)
    if kind.api is None:
        raise LookupError(f"{model.__name__} has no JobApi: pass api= to register_job_kind.")
    return api_routes(kind.api, serializer=kind.serializer)


def api_routes(api: JobApi, *, serializer: Any = None) -> list[URLPattern]:
    """The routes of ``api`` (a kind of work that is not a registered job row uses it directly)."""
    detail = detail_view(api, response=serializer or api.response).as_view()
    cancel = cancel_view(api, response=serializer or api.response).as_view()
    return [
        *(path(route, detail, name=name) for route, name in api.also),
        path(api.route, detail, name=f"{api.name}-detail"),
        path(api.cancel_route or f"{api.route}/cancel", cancel, name=f"{api.name}-cancel"),
    ]


def update_serializer(api: JobApi) -> type[StrictSerializer]:
    """PATCH's input serializer, named in the schema as the views always named it."""
    meta = type("Meta", (), {"ref_name": f"{api.component}DetailApiUpdate"})
    return type(f"{api.component}UpdateSerializer", (StrictSerializer,), {**api.update_fields, "Meta": meta})


def detail_view(api: JobApi, *, response: Any) -> type[APIView]:
    """GET the row; PATCH and DELETE where the kind allows them (405 otherwise)."""
    methods: dict[str, Any] = {}
    schemas: dict[str, Any] = {}

    def get(self, request: Request, **route: str) -> Response:
        row = api.find(user=request.user, **route)
        # A queued row says where it stands in line (mistudio.job_queue), as its caller may see it.
        return Response({**api.body(row, request), "queue": queue_position(row, viewer=request.user)})

    methods["get"], schemas["get"] = get, extend_schema(responses={200: response})
    if api.update is not None:
        update = api.update
        inputs = update_serializer(api)

        def patch(self, request: Request, **route: str) -> Response:
            row = (api.find_to_change or api.find)(user=request.user, **route)
            data = inputs(data=request.data)
            data.is_valid(raise_exception=True)
            row = update(**{api.row: row}, actor=request.user, **data.validated_data)
            return Response(api.body(row, request))

        methods["patch"], schemas["patch"] = patch, extend_schema(request=inputs, responses={200: response})
    if api.delete is not None:
        delete_row = api.delete

        def delete(self, request: Request, **route: str) -> Response:
            row = (api.find_to_change or api.find)(user=request.user, **route)
            delete_row(**{api.row: row}, actor=request.user)
            return Response(status=status.HTTP_204_NO_CONTENT)

        methods["delete"], schemas["delete"] = delete, extend_schema(responses={204: None})
    view = type(
        f"{api.component}DetailApi",
        (APIView,),
        {"__doc__": api.doc or None, "permission_classes": [api.permission], **methods},
    )
    return extend_schema_view(**schemas)(view)


def cancel_view(api: JobApi, *, response: Any) -> type[APIView]:
    """POST: cancel the row (a queued one at once, a running one at its worker's next step)."""

    def post(self, request: Request, **route: str) -> Response:
        row = api.cancel(**{api.row: api.find(user=request.user, **route)}, actor=request.user)
        return Response(api.body(row, request), status=api.cancel_status)

    view = type(
        f"{api.component}CancelApi",
        (APIView,),
        {"__doc__": api.cancel_doc or None, "permission_classes": [CanWrite], "post": post},
    )
    return extend_schema_view(post=extend_schema(request=None, responses={api.cancel_status: response}))(view)
