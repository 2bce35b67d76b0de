"""Oversize request bodies are refused before they are read (mistudio/web_server.py), against the
real web server process: anonymous and signed-in, multipart, urlencoded, chunked and lying
Content-Length. Meanwhile /healthz keeps answering fast and the server's memory stays flat."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import psutil
import pytest
from django.conf import settings
from django.test import Client

from conftest import make_user
from mistudio.tests.raw_http import HealthProbe, send_body
from models_app.tests.live_stack import running_web

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MiB = 2**20
TOO_LARGE, UPLOAD_TOO_LARGE = "REQUEST_TOO_LARGE", "DATASET_TOO_LARGE"
UPLOAD_LIMIT = 8 * MiB  # the web process's DATASET_MAX_UPLOAD_BYTES here, to keep the test quick


@pytest.fixture
def web(transactional_db, tmp_path):
    """The web server alone (no worker is needed to refuse a body), with a small upload limit."""
    with running_web(tmp_path / "web.log", DATASET_MAX_UPLOAD_BYTES=str(UPLOAD_LIMIT)) as (base_url, pid):
        yield base_url, psutil.Process(pid)


class PeakMemory:
    """The highest resident size of a process, sampled every 20 ms in a thread."""

    def __init__(self, process: psutil.Process):
        self.process, self.peak, self._stop = process, process.memory_info().rss, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def error_code(answer) -> str:
    return json.loads(answer.body)["error"]["code"]


def test_oversize_bodies_are_refused_before_they_are_read_and_others_keep_answering(web):
    base_url, process = web
    writer = make_user("walt-writer", "model:write")
    token = {"Authorization": f"Token {writer.auth_token.key}"}
    anonymous_limit = settings.ANONYMOUS_MAX_BODY_BYTES
    send_body(base_url, "/login/", kind="urlencoded", size=10)  # warm the server up first
    baseline = process.memory_info().rss

    attacks = [
        # (what, path, body kind, size, send_body options, expected code)
        ("anonymous multipart upload", "/api/datasets", "multipart", 100 * MiB, {}, TOO_LARGE),
        ("anonymous urlencoded sign-in", "/login/", "urlencoded", 20 * MiB, {}, TOO_LARGE),
        ("anonymous chunked sign-in", "/login/", "urlencoded", 20 * MiB, {"chunked": True}, TOO_LARGE),
        ("anonymous chunked upload", "/api/datasets", "multipart", 20 * MiB, {"chunked": True}, TOO_LARGE),
        ("a lying Content-Length", "/api/generate", "json", 1024, {"declared": 2**30}, TOO_LARGE),
        ("signed-in upload over its limit", "/api/datasets", "multipart", 150 * MiB, {"headers": token},
         UPLOAD_TOO_LARGE),
        ("signed-in chunked upload", "/api/datasets", "multipart", 30 * MiB,
         {"headers": token, "chunked": True}, UPLOAD_TOO_LARGE),
        ("signed-in JSON over its limit", "/api/generate", "json", 20 * MiB, {"headers": token},
         TOO_LARGE),
        ("a token that names nobody", "/api/datasets", "multipart", 4 * MiB,
         {"headers": {"Authorization": "Token not-a-token"}}, TOO_LARGE),
        ("a session cookie that names nobody", "/api/datasets", "multipart", 4 * MiB,
         {"headers": {"Cookie": f"{settings.SESSION_COOKIE_NAME}=forged"}}, TOO_LARGE),
    ]  # fmt: skip
    with HealthProbe(base_url) as health, PeakMemory(process) as memory:
        for what, path, kind, size, options, code in attacks:
            answer = send_body(base_url, path, kind=kind, size=size, **options)
            assert answer.status == 413, (what, answer)
            assert error_code(answer) == code, (what, answer.body)
            assert answer.seconds < 2.0, (what, answer.seconds)
            body = json.loads(answer.body)["error"]
            if "headers" not in options or "not-a-token" in str(options) or "forged" in str(options):
                assert body["details"]["max_bytes"] == anonymous_limit, what
        # Probes after the last refusal too, and at least six in all: under CI's load the refusals
        # can all be over in fewer probe intervals than that.
        wanted, deadline = max(6, len(health.latencies) + 2), time.monotonic() + 10
        while len(health.latencies) < wanted and time.monotonic() < deadline:
            time.sleep(0.05)

    assert health.failures == 0
    assert len(health.latencies) > 5
    assert max(health.latencies) < 0.2, sorted(health.latencies)[-5:]
    assert memory.peak - baseline < 50 * MiB, (baseline, memory.peak)


def signed_in_headers(user, how: str) -> dict[str, str]:
    if how == "token":
        return {"Authorization": f"Token {user.auth_token.key}"}
    client = Client()
    client.force_login(user)
    csrf = "c" * 32  # the session route needs the CSRF cookie and header to agree
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    return {"Cookie": f"{settings.SESSION_COOKIE_NAME}={session}; csrftoken={csrf}", "X-CSRFToken": csrf}


@pytest.mark.parametrize("how", ["token", "session"])
def test_a_signed_in_upload_within_its_limit_streams_through(web, how):
    """What is allowed still arrives whole (through the server's temporary file, not its memory)."""
    base_url, _ = web
    writer = make_user("walt-writer", "model:write")
    lines = b"".join(b"sample %d of the upload\n" % number for number in range(250_000))  # ~6 MiB
    assert settings.ANONYMOUS_MAX_BODY_BYTES < len(lines) < UPLOAD_LIMIT
    boundary = "b0undary"
    form = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="format"\r\n\r\ntext_lines\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="lines.txt"\r\n'
        "Content-Type: text/plain\r\n\r\n"
    )
    request = urllib.request.Request(
        f"{base_url}/api/datasets",
        data=form.encode() + lines + f"\r\n--{boundary}--\r\n".encode(),
        headers={
            **signed_in_headers(writer, how),
            "Content-Type": f"multipart/form-data; boundary={boundary}",
        },
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        created = json.loads(response.read())
    assert response.status == 201
    assert created["sample_count"] == 250_000
    assert created["preview"][0] == "sample 0 of the upload"
