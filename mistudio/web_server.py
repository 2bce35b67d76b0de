"""Daphne with request bodies bounded before they are read: ``python -m mistudio.web_server``.

Daphne (Twisted's HTTP server underneath) reads a whole request body, and Twisted parses a form
body, before the application sees the request, so Django's own size limits come too late: a large
anonymous POST costs the server memory and CPU while every other request waits. This small
subclass of Daphne's request decides as soon as the headers are in:

- a request that carries no credentials (no session cookie, no ``Authorization``) may send at most
  ``ANONYMOUS_MAX_BODY_BYTES``; one that does, the route's limit (``body_limit``);
- a ``Content-Length`` over the limit is answered 413 at once, without reading the body; a chunked
  body is cut off with 413 when it passes the limit;
- a body over the anonymous limit waits (the socket is not read) until the credentials are checked
  against the database; credentials that name no active user get the anonymous limit's 413;
- Twisted's own form parsing is off (Django parses the body; Twisted's copy held it in memory);
- bodies over 100 kB go to a temporary file (Twisted), and are handed to the application a chunk
  at a time as it reads them, never queued whole in memory.

Everything else is Daphne's command line (``python -m mistudio.web_server -b HOST -p PORT
mistudio.asgi:application``). The 413 body is the API's error body (OpenAI's under ``/v1/``).
"""

import asyncio
import json
import logging
from http.cookies import CookieError, SimpleCookie
from io import BytesIO

from daphne.cli import CommandLineInterface
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.server import Server
from django.conf import settings
from twisted.internet import defer, reactor

logger = logging.getLogger("mistudio.requests")

# How long a refused connection keeps reading (and dropping) what the client still sends, so the
# client reads our 413 instead of a connection reset.
LINGER_SECONDS = 2.0
# Bytes of a body the application's queue holds at once (it reads them as it needs them).
QUEUED_BODY_CHUNKS = 4


# The routes that take uploads (POST): the setting that bounds the files, and the refusal's code.
UPLOAD_ROUTES = {
    "/api/datasets": ("DATASET_MAX_UPLOAD_BYTES", "DATASET_TOO_LARGE"),
    "/api/saes/upload": ("SAE_MAX_UPLOAD_BYTES", "REQUEST_TOO_LARGE"),
}


def body_limit(method: str, path: str) -> int:
    """The most bytes a signed-in request to ``path`` may send: uploads have their own limit."""
    upload = UPLOAD_ROUTES.get(path.rstrip("/")) if method == "POST" else None
    if upload is not None:
        return getattr(settings, upload[0]) + settings.UPLOAD_FORM_OVERHEAD_BYTES
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def refusal_body(path: str, *, limit: int, size: int | None, anonymous: bool) -> bytes:
    from mistudio.errors import error_body  # Django's settings are configured by now

    if anonymous:
        message = f"Requests without a valid sign-in may carry at most {limit} bytes."
    else:
        message = f"Request bodies to this route are limited to {limit} bytes."
    upload = UPLOAD_ROUTES.get(path.rstrip("/"))
    code = upload[1] if upload is not None and not anonymous else "REQUEST_TOO_LARGE"
    details = {"max_bytes": limit, **({"size_bytes": size} if size is not None else {})}
    if path.startswith("/v1/"):
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    else:
        body = error_body(code, message, details)
    return json.dumps(body).encode()


class BoundedRequest(WebRequest):
    """Daphne's request with the body limits above (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parsePOSTFormSubmission = False
        self.body_limit = settings.ANONYMOUS_MAX_BODY_BYTES
        self.body_received = 0
        self.refused = False
        self.checking_credentials: defer.Deferred | None = None
        self.held_request: tuple | None = None

    # --- headers in: decide ---------------------------------------------------------------------
    def gotLength(self, length):
        super().gotLength(length)
        method = self.channel._command.decode("latin-1").upper()
        path = self.channel._path.split(b"?", 1)[0].decode("latin-1")
        session_key, authorization = self.credentials()
        anonymous_limit = settings.ANONYMOUS_MAX_BODY_BYTES
        route_limit = body_limit(method, path)
        if not (session_key or authorization):
            self.body_limit = min(anonymous_limit, route_limit)
            if length is not None and length > self.body_limit:
                self.refuse(path, size=length, anonymous=True)
            return
        self.body_limit = route_limit
        if length is not None and length > route_limit:
            self.refuse(path, size=length, anonymous=False)
        elif length is None or length > anonymous_limit:
            self.check_credentials(path, session_key, authorization)

    def credentials(self) -> tuple[str | None, str | None]:
        authorization = self.requestHeaders.getRawHeaders(b"authorization", [b""])[0].decode("latin-1")
        session_key = None
        for header in self.requestHeaders.getRawHeaders(b"cookie", []):
            try:
                cookie = SimpleCookie(header.decode("latin-1"))
            except CookieError:
                continue
            if settings.SESSION_COOKIE_NAME in cookie:
                session_key = cookie[settings.SESSION_COOKIE_NAME].value
        return session_key or None, authorization.strip() or None

    def check_credentials(self, path: str, session_key: str | None, authorization: str | None) -> None:
        """Stop reading the socket until the database says whether the credentials are good."""
        from asgiref.sync import sync_to_async
        from django.db import close_old_connections

        from mistudio.authentication import signed_in

        def verify() -> bool:
            close_old_connections()
            try:
                return signed_in(session_key=session_key, authorization=authorization)
            finally:
                close_old_connections()

        self.channel.transport.pauseProducing()
        future = asyncio.ensure_future(sync_to_async(verify, thread_sensitive=False)())
        self.checking_credentials = defer.Deferred.fromFuture(future)
        self.checking_credentials.addCallbacks(
            lambda good: self.credentials_checked(path, good),
            lambda failure: self.credentials_checked(path, False, failure),
        )

    def credentials_checked(self, path: str, good: bool, failure=None) -> None:
        self.checking_credentials = None
        if failure is not None:
            logger.warning("could not check the credentials of a large request", exc_info=failure.value)
        if self.refused or getattr(self, "channel", None) is None:
            return
        if not good:
            self.refuse(path, size=None, anonymous=True, limit=settings.ANONYMOUS_MAX_BODY_BYTES)
            return
        self.channel.transport.resumeProducing()
        if self.held_request is not None:
            held, self.held_request = self.held_request, None
            super().requestReceived(*held)

    # --- body in: count, and refuse past the limit ----------------------------------------------
    def handleContentChunk(self, data):
        if self.refused:
            return
        self.body_received += len(data)
        if self.body_received > self.body_limit:
            path = self.channel._path.split(b"?", 1)[0].decode("latin-1")
            self.refuse(path, size=None, anonymous=self.body_limit < body_limit("POST", path))
            return
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if self.refused:
            return
        if self.checking_credentials is not None:
            self.held_request = (command, path, version)  # the whole body came before the answer
            return
        super().requestReceived(command, path, version)

    # --- the body goes to the application as it reads it ----------------------------------------
    def process(self):
        """Daphne's ``process``, except that a body on disk is not queued whole into memory."""
        if isinstance(self.content, BytesIO):
            return super().process()
        self.body_file, self.content = self.content, BytesIO()  # Daphne queues an empty body …
        return super().process()

    def refuse(self, path: str, *, size: int | None, anonymous: bool, limit: int | None = None) -> None:
        """Answer 413 now, drop the rest of the body, and close once the client had time to read."""
        self.refused = True
        limit = self.body_limit if limit is None else limit
        body = refusal_body(path, limit=limit, size=size, anonymous=anonymous)
        channel, transport = self.channel, self.channel.transport
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after the answer
        transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
            + body
        )
        channel.dataReceived = lambda data: None
        transport.resumeProducing()
        if hasattr(transport, "loseWriteConnection"):
            transport.loseWriteConnection()
        reactor.callLater(LINGER_SECONDS, transport.abortConnection)
        logger.info("413 %s: a request body over %s bytes refused before it was read", path, limit)


class BoundedServer(Server):
    """Daphne's server, answering HTTP with :class:`BoundedRequest`."""

    def create_application(self, protocol, scope):
        queue = super().create_application(protocol, scope)
        body_file = getattr(protocol, "body_file", None)
        if queue is None or body_file is None:
            return queue
        application = self.connections[protocol]["application_instance"]
        return BodyFeeder(queue, body_file, application=application, chunk_size=self.request_buffer_size)

    def kill_all_applications(self):
        # Daphne assumes every connection has an application; a refused body never got one.
        for protocol, details in list(self.connections.items()):
            if "application_instance" not in details:
                del self.connections[protocol]
        return super().kill_all_applications()

    @property
    def http_factory(self):
        return self._http_factory

    @http_factory.setter
    def http_factory(self, factory):
        # Daphne's run() makes an HTTPFactory; ours builds BoundedRequest instead of WebRequest.
        self._http_factory = BoundedHTTPFactory(self) if type(factory) is HTTPFactory else factory


class BoundedHTTPFactory(HTTPFactory):
    def buildProtocol(self, addr):
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = BoundedRequest
        return protocol


class BodyFeeder:
    """Stands in for the application's input queue: feeds a body on disk a few chunks at a time."""

    def __init__(self, queue: asyncio.Queue, body_file, *, application: asyncio.Future, chunk_size: int):
        self.queue, self.body_file, self.chunk_size = queue, body_file, chunk_size
        self.application = application
        self.task: asyncio.Task | None = None

    def put_nowait(self, message: dict) -> None:
        if message.get("type") == "http.request" and self.task is None:
            self.task = asyncio.ensure_future(self.feed())  # Daphne's empty body: ours instead
            return
        self.queue.put_nowait(message)  # http.disconnect

    async def feed(self) -> None:
        try:
            while True:
                while self.queue.qsize() >= QUEUED_BODY_CHUNKS:
                    if self.application.done():
                        return  # it answered without reading the rest
                    await asyncio.sleep(0.001)
                chunk = self.body_file.read(self.chunk_size)
                more = len(chunk) == self.chunk_size
                self.queue.put_nowait({"type": "http.request", "body": chunk, "more_body": more})
                if not more:
                    return
        except ValueError:  # the file was closed: the client went away
            self.queue.put_nowait({"type": "http.disconnect"})
        finally:
            if not self.body_file.closed:
                self.body_file.close()


class BoundedCommandLine(CommandLineInterface):
    server_class = BoundedServer


if __name__ == "__main__":
    BoundedCommandLine.entrypoint()
