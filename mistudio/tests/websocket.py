"""A WebSocket client of ``/ws/events/`` on the full ASGI application, as a browser page or a script
on this server's own origin would connect (tests only)."""

from channels.testing import WebsocketCommunicator

from mistudio.asgi import application

HOST = "127.0.0.1:8000"
ORIGIN = f"http://{HOST}"


def token_header(user) -> tuple[bytes, bytes]:
    return (b"authorization", f"Token {user.auth_token.key}".encode())


def events_socket(*headers: tuple[bytes, bytes], origin: str | None = ORIGIN, host: str = HOST):
    """A communicator with ``Host`` (and, unless ``origin`` is None, ``Origin``) plus ``headers``."""
    base = [(b"host", host.encode())] + ([(b"origin", origin.encode())] if origin is not None else [])
    return WebsocketCommunicator(application, "/ws/events/", headers=base + list(headers))
