"""OpenAPI descriptions of the generation endpoints that are async Django views, not DRF ones:
drf-spectacular documents DRF views only, so each such view carries a DRF class (``cls``, as DRF's
own ``@api_view`` functions do) whose method says what its request body is. Django never calls
that class; the async view answers the request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.utils import PolymorphicProxySerializer, extend_schema
from rest_framework.views import APIView

from generation.serializers import (
    GenerateBatchOutputSerializer,
    GenerateInputSerializer,
    GenerateResultOutputSerializer,
)
from mistudio.permissions import CanWrite


class GenerateOperation(APIView):
    """``POST /api/generate``: generate for one prompt, a list of prompts, or messages; capture and
    interventions go in ``mistudio`` (``mistudio.interventions``: ``Intervention`` objects)."""

    permission_classes = [CanWrite]

    @extend_schema(
        request=GenerateInputSerializer,
        responses={
            (200, "application/json"): PolymorphicProxySerializer(
                component_name="GenerateAnswer",
                serializers=[GenerateResultOutputSerializer, GenerateBatchOutputSerializer],
                resource_type_field_name=None,
            ),
            (200, "text/event-stream"): str,
        },
        operation_id="api_generate_create",
    )
    def post(self, request: Any) -> Any:
        raise NotImplementedError("described only: generation.apis.generate answers")


def described(view: Callable[..., Any], operation: type[APIView]) -> Callable[..., Any]:
    """``view`` with ``operation`` as the class the schema generator reads."""
    view.cls = operation  # type: ignore[attr-defined]
    view.initkwargs = {}  # type: ignore[attr-defined]
    return view
