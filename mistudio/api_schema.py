"""The OpenAPI schema (drf-spectacular): names that do not collide, and the Bearer token scheme.

Views declare their small input serializers as nested classes (``ModelListApi.InputSerializer``,
``DatasetListApi.InputSerializer``); drf-spectacular would name both components ``Input`` and keep
only one, so the schema would describe the wrong body for one of the routes. Components are named
after the view and the serializer instead (``ModelListApiInput``).
"""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema


class MiStudioAutoSchema(AutoSchema):
    def get_serializer_name(self, serializer, direction) -> str:
        qualified = type(serializer).__qualname__
        return (
            qualified.replace(".", "")
            if "." in qualified
            else super().get_serializer_name(serializer, direction)
        )


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """``Authorization: Bearer <token>``: the same API tokens, as OpenAI clients send them."""

    target_class = "mistudio.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer"}
