"""/healthz: a live worker's heartbeat (for operators), and 503 when Redis is unreachable."""

import subprocess
import sys
import time

import pytest
from django.conf import settings

pytestmark = pytest.mark.django_db(transaction=True)


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.25)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_healthz_reports_a_live_worker_process(model_admin, client_for, process_env):
    client = client_for(model_admin)  # the details are for operators
    worker = subprocess.Popen(
        [sys.executable, "manage.py", "worker", "--name", "health-probe", "--device", "cpu"],
        cwd=settings.BASE_DIR, env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        def probe_listed():
            body = client.get("/healthz").json()["details"]
            return next((w for w in body["workers"] if w["name"] == "health-probe"), None) and body

        body = wait_for(probe_listed)
        beat = next(w for w in body["workers"] if w["name"] == "health-probe")
        assert body["database"]["ok"] and body["redis"]["ok"]
        assert beat["device"] == "cpu" and beat["loaded_models"] == []
        assert beat["memory_total_bytes"] >= beat["memory_free_bytes"] > 0
        assert time.time() - beat["last_heartbeat"] < 10
        assert body["versions"]["torch"].startswith("2.13.0")
        first = beat["last_heartbeat"]
        wait_for(
            lambda: client.get("/healthz").json()["details"]["workers"][0]["last_heartbeat"] > first,
            timeout=10,
        )
    finally:
        worker.terminate()
        assert worker.wait(timeout=30) == 0, worker.stderr.read().decode()[-2000:]
    # A worker that stops says so: its heartbeat is gone at once.
    assert all(w["name"] != "health-probe" for w in client.get("/healthz").json()["details"]["workers"])


def test_healthz_is_503_when_redis_is_unreachable(client, settings):
    settings.EMBEDDED_REDIS = False
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # the discard port: nothing listens
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {
        "status": "unavailable",
        "dependencies": {"database": "up", "redis": "down", "workers": "down"},
    }


def test_healthz_is_200_and_needs_no_login(client, model_admin, client_for):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert set(response.json()) == {"status", "dependencies"}  # nothing more for an anonymous probe
    details = client_for(model_admin).get("/healthz").json()["details"]
    assert details["database"]["vendor"] in {"postgresql", "sqlite"}
