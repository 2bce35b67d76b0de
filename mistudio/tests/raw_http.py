"""A raw-socket HTTP client for oversize bodies, and a /healthz prober (tests and bench/request_bodies.py).

urllib cannot send a lying ``Content-Length`` or keep streaming after the server answered, and it
reads nothing until it has sent everything: this client sends the headers, streams the body from
a thread (ignoring the server closing on it), and times the arrival of the status line.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

BOUNDARY = "mistudio-oversize-boundary"
PIECE = 64 * 1024


@dataclass
class Answer:
    status: int | None  # None: the connection closed without a status line
    seconds: float  # from the first byte sent to the status line
    body: bytes
    sent_bytes: int


def body_parts(kind: str, size: int) -> tuple[str, bytes, bytes]:
    """(content type, prefix, suffix) around ``size`` filler bytes."""
    if kind == "multipart":
        prefix = (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.txt"\r\n'
            "Content-Type: text/plain\r\n\r\n"
        ).encode()
        return f"multipart/form-data; boundary={BOUNDARY}", prefix, f"\r\n--{BOUNDARY}--\r\n".encode()
    if kind == "urlencoded":
        return "application/x-www-form-urlencoded", b"username=a&password=", b""
    return "application/json", b'{"pad": "', b'"}'


def send_body(
    base_url: str,
    path: str,
    *,
    kind: str,
    size: int,
    chunked: bool = False,
    declared: int | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Answer:
    """POST ``size`` filler bytes of a ``kind`` body; ``declared`` overrides Content-Length (a lie)."""
    content_type, prefix, suffix = body_parts(kind, size)
    total = len(prefix) + size + len(suffix)
    url = urlsplit(base_url)
    lines = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", f"Content-Type: {content_type}"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {declared or total}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    connection = socket.create_connection((url.hostname, url.port), timeout=timeout)
    sent = [0]

    def frame(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data) if chunked else data

    def stream() -> None:
        try:
            connection.sendall(frame(prefix))
            left = size
            filler = b"a" * PIECE
            while left > 0:
                piece = filler[: min(PIECE, left)]
                connection.sendall(frame(piece))
                sent[0] += len(piece)
                left -= len(piece)
            connection.sendall(frame(suffix) + (b"0\r\n\r\n" if chunked else b""))
        except OSError:
            pass  # the server answered and closed: what the test wants

    started = time.monotonic()
    connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    sender = threading.Thread(target=stream, daemon=True)
    sender.start()
    received = b""
    status, seconds = None, None
    try:
        while b"\r\n\r\n" not in received:
            data = connection.recv(65536)
            if not data:
                break
            received += data
            if seconds is None:
                seconds = time.monotonic() - started
        head, _, body = received.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/"):
            status = int(head.split()[1])
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                None,
            )
            while length is not None and len(body) < length:
                data = connection.recv(65536)
                if not data:
                    break
                body += data
    except OSError:
        pass
    finally:
        connection.close()
        sender.join(timeout=10)
    return Answer(status, seconds if seconds is not None else time.monotonic() - started, body, sent[0])


@dataclass
class HealthProbe:
    """GETs ``/healthz`` every ``interval`` seconds in a thread; ``latencies`` in seconds."""

    base_url: str
    interval: float = 0.05
    latencies: list[float] = field(default_factory=list)
    failures: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with urllib.request.urlopen(f"{self.base_url}/healthz", timeout=30) as response:
                    response.read()
            except urllib.error.HTTPError:
                pass  # 503 still answers
            except OSError:
                self.failures += 1
            self.latencies.append(time.monotonic() - started)
            self._stop.wait(self.interval)
