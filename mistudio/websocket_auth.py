"""WebSocket authentication: the browser's session (same origin only) or an API token.

A client that is not a browser sends ``Authorization: Token <key>`` with the handshake; the user it
names replaces the anonymous user that the session middleware found. ``current_user`` says, at any
later moment, whether the socket's credentials still hold (the consumer asks before relaying).
"""

from importlib import import_module
from urllib.parse import urlsplit

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.contrib.auth import SESSION_KEY, get_user_model
from django.http.request import split_domain_port, validate_host

from mistudio.api_tokens import user_of_key
from mistudio.authentication import token_key

DEFAULT_PORTS = {"http": 80, "https": 443}


def token_user(key: str):
    """The active user the token names (DRF's or a named one), or None."""
    return user_of_key(key)


def current_user(scope):
    """The socket's user, fresh from the database, if its token or session still names them."""
    if scope.get("auth_token"):
        return token_user(scope["auth_token"])
    user, session = scope.get("user"), scope.get("session")
    if user is None or session is None or not session.session_key:
        return None
    stored = import_module(settings.SESSION_ENGINE).SessionStore(session.session_key)
    if str(stored.get(SESSION_KEY)) != str(user.pk):
        return None  # signed out (or the session was flushed)
    return get_user_model().objects.filter(pk=user.pk, is_active=True).first()


class TokenAuthMiddleware(BaseMiddleware):
    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", []))
        key = token_key(headers.get(b"authorization", b"").decode("latin-1"))
        if key:
            user = await database_sync_to_async(token_user)(key)
            if user is not None:
                scope = {**scope, "user": user, "auth_token": key}
        return await super().__call__(scope, receive, send)


def origin_key(url: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of an origin or a URL, default ports filled in."""
    try:
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or port is None:
        return None
    return parts.scheme, parts.hostname.lower(), port


def same_origin(scope) -> bool:
    """Whether the handshake's ``Origin`` is this server as the client reached it — scheme, host
    and port of its ``Host`` header (an allowed host) — or one of ``CSRF_TRUSTED_ORIGINS``."""
    headers = dict(scope.get("headers", []))
    origin = headers.get(b"origin", b"").decode("latin-1")
    asked = origin_key(origin)
    if asked is None:
        return False
    if any(origin_key(trusted) == asked for trusted in settings.CSRF_TRUSTED_ORIGINS if "*" not in trusted):
        return True
    host = headers.get(b"host", b"").decode("latin-1")
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    scheme = "https" if scope.get("scheme") in {"wss", "https"} else "http"
    return origin_key(f"{scheme}://{host}") == asked


class OriginGuard:
    """Foreign browser origins are refused; a client with no Origin header is not a browser.

    A handshake with an ``Origin`` must come from this very origin (cross-site WebSocket hijacking
    rides on the victim's cookies; another port of the same host is another origin). One without
    an ``Origin`` has its cookies dropped, so only a token can authenticate it.
    """

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        headers = scope.get("headers", [])
        if any(name == b"origin" for name, _ in headers):
            if not same_origin(scope):
                return await WebsocketDenier.as_asgi()(scope, receive, send)
            return await self.application(scope, receive, send)
        scope = {**scope, "headers": [(name, value) for name, value in headers if name != b"cookie"]}
        return await self.application(scope, receive, send)
