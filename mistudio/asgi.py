"""ASGI entry point served by Daphne: Django (HTTP, static files through WhiteNoise) + WebSockets."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mistudio.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs the app registry ready)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from mistudio.redis_client import ensure_redis  # noqa: E402
from mistudio.routing import websocket_urlpatterns  # noqa: E402
from mistudio.websocket_auth import OriginGuard, TokenAuthMiddleware  # noqa: E402

ensure_redis()
if settings.WATCH_WORKERS:
    from mistudio.workers import start_worker_watch

    start_worker_watch()  # marks the models of a worker that died WORKER_LOST, even if it was the last

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": OriginGuard(AuthMiddlewareStack(TokenAuthMiddleware(URLRouter(websocket_urlpatterns)))),
    }
)
