"""Token authentication for WebSocket clients that are not browsers (browsers use the session).

A client sends ``Authorization: Token <key>`` with the handshake; the user it names replaces
the anonymous user that the session middleware found.
"""

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware


@database_sync_to_async
def user_for_token(key: str):
    from rest_framework.authtoken.models import Token

    token = Token.objects.select_related("user").filter(key=key).first()
    if token is None or not token.user.is_active:
        return None
    return token.user


class TokenAuthMiddleware(BaseMiddleware):
    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", []))
        keyword, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if keyword.lower() in {"token", "bearer"} and key.strip():
            user = await user_for_token(key.strip())
            if user is not None:
                scope = {**scope, "user": user}
        return await super().__call__(scope, receive, send)


class OriginGuard:
    """Foreign browser origins are refused; a client with no Origin header is not a browser.

    A handshake with an ``Origin`` must match ``ALLOWED_HOSTS`` (cross-site WebSocket hijacking
    rides on the victim's cookies). One without an ``Origin`` has its cookies dropped, so only
    a token can authenticate it.
    """

    def __init__(self, application):
        from channels.security.websocket import AllowedHostsOriginValidator

        self.application = application
        self.browser_application = AllowedHostsOriginValidator(application)

    async def __call__(self, scope, receive, send):
        headers = scope.get("headers", [])
        if any(name == b"origin" for name, _ in headers):
            return await self.browser_application(scope, receive, send)
        scope = {**scope, "headers": [(name, value) for name, value in headers if name != b"cookie"]}
        return await self.application(scope, receive, send)
