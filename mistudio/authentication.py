"""API authentication: DRF tokens, also accepted as ``Authorization: Bearer <token>``."""

from rest_framework.authentication import TokenAuthentication


class BearerTokenAuthentication(TokenAuthentication):
    """The same API tokens as ``Authorization: Bearer <token>`` (what OpenAI clients send)."""

    keyword = "Bearer"
