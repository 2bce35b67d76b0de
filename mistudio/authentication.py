"""API authentication: DRF tokens, also accepted as ``Authorization: Bearer <token>``."""

from importlib import import_module

from django.conf import settings
from django.contrib.auth import SESSION_KEY, get_user_model
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token


class BearerTokenAuthentication(TokenAuthentication):
    """The same API tokens as ``Authorization: Bearer <token>`` (what OpenAI clients send)."""

    keyword = "Bearer"


def token_key(authorization: str) -> str | None:
    """The key of ``Authorization: Token <key>`` or ``Bearer <key>``, else None."""
    keyword, _, key = authorization.partition(" ")
    key = key.strip()
    return key if keyword.lower() in {"token", "bearer"} and key else None


def signed_in(*, session_key: str | None, authorization: str | None) -> bool:
    """Whether the session cookie or the API token names an active user (database reads only)."""
    key = token_key(authorization or "")
    if key and Token.objects.filter(key=key, user__is_active=True).exists():
        return True
    if not session_key:
        return False
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user_id = session.get(SESSION_KEY)
    return user_id is not None and get_user_model().objects.filter(pk=user_id, is_active=True).exists()
