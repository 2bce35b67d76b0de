"""Failure recovery with real processes and real signals.

- Redis restarted under a running web and worker: both reconnect, the next job succeeds.
- PostgreSQL stopped: ``/healthz`` and the API answer a clean 503, the worker survives, nothing
  stored is lost, and everything works again once the database is back.
- A worker killed (SIGKILL) in the middle of a load: a surviving worker marks the model
  ``unloaded`` with ``WORKER_LOST`` within the heartbeat budget; nothing stays ``loading``.
- The disk fills up (a real, small tmpfs) while a shard is written: the job fails with
  ``DISK_FULL``, its partial files are removed, the rows say so.

The Redis and PostgreSQL here are private throw-away servers (``private_servers``): the
machine's shared ones are never stopped. Each test prints what it measured (``pytest -s``).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.conf import settings

from mistudio.tests.private_servers import (
    PrivatePostgres,
    PrivateRedis,
    private_postgres,
    private_redis,
    stop_processes,
)
from models_app.tests.live_stack import ASGI_APPLICATION, free_port, process_environment, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.waits]

TEXTS = [f"Sample {index}: the quick brown fox jumps over the lazy dog." for index in range(12)]


def http(method: str, url: str, *, token: str | None = None, body: dict | None = None, timeout: float = 60):
    """(status, headers, raw body) of one request; error statuses are returned, not raised."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Token {token}"
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@dataclass
class PrivateStack:
    """Daphne and one worker on a private PostgreSQL and a private Redis."""

    postgres: PrivatePostgres
    redis: PrivateRedis
    base_url: str
    token: str
    worker_name: str
    worker: subprocess.Popen
    web: subprocess.Popen
    model_id: str
    dataset_id: str

    def call(self, method: str, path: str, body: dict | None = None, **kwargs):
        return http(method, f"{self.base_url}{path}", token=self.token, body=body, **kwargs)

    def json(self, method: str, path: str, body: dict | None = None, expect: int = 200) -> dict:
        status, _, raw = self.call(method, path, body)
        assert status == expect, (status, raw[:500])
        return json.loads(raw)

    def healthz(self) -> tuple[int, dict]:
        """Status and body, with the details: the stack's user is a ``model:admin``, an operator
        (while the database is down no credential can be checked, so no details then)."""
        status, _, raw = http("GET", f"{self.base_url}/healthz", token=self.token)
        return status, json.loads(raw)

    def worker_beating(self) -> bool:
        status, body = self.healthz()
        workers = body.get("details", {}).get("workers", [])
        return status == 200 and any(beat["name"] == self.worker_name for beat in workers)

    def extract(self, layers: list[int], timeout: float = 60) -> dict:
        """Request an extraction of the stack's model and dataset, and wait for it to end."""
        job = self.json(
            "POST",
            f"/api/models/{self.model_id}/extract-activations",
            {"dataset_id": self.dataset_id, "layer_indices": layers, "batch_size": 4, "max_length": 16},
            expect=202,
        )

        def ended():
            body = self.json("GET", f"/api/extractions/{job['extraction_id']}")
            return body if body["status"] in ("completed", "failed", "cancelled") else None

        body = wait_until(ended, timeout=timeout, interval=0.25, what="the extraction to end")
        # The row ends a moment before RQ records the job's end in Redis: a Redis stopped in that
        # moment makes RQ quit ("unhandled exception"), which is not the outage under test.
        wait_until(self.worker_idle, timeout=timeout, interval=0.1, what="RQ to finish the job")
        return body

    def worker_idle(self) -> bool:
        """Whether RQ's own records say every worker is idle: done with its last job's bookkeeping."""
        from redis import Redis
        from rq import Worker

        with Redis.from_url(self.redis.url) as connection:
            keys = [worker.key for worker in Worker.all(connection=connection)]
            # After a restart Redis is empty and RQ does not register the worker again: none to wait for.
            return all(connection.hget(key, "state") == b"idle" for key in keys)


def manage(environment: dict, *arguments: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *arguments], cwd=settings.BASE_DIR, env=environment,
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def start_process(environment: dict, arguments: list[str], log_name: str) -> subprocess.Popen:
    """A miStudio process; its output goes to a log in the test data directory, for debugging."""
    with open(settings.DATA_DIR / f"recovery-{log_name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, *arguments],
            cwd=settings.BASE_DIR,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture(scope="module")
def private_stack(tiny_gpt2_folder):
    with private_postgres() as postgres, private_redis() as redis_server:
        port = free_port()
        worker_name = f"recovery-worker-{port}"
        environment = process_environment(
            DATABASE_URL=postgres.url, REDIS_URL=redis_server.url, WORKER_HEARTBEAT_SECONDS="1"
        )
        manage(environment, "migrate", "--noinput")
        token = manage(environment, "create_user", "rhea-recovery", "--role", "model:admin").strip()
        processes: list[subprocess.Popen] = []
        try:
            daphne = ["-m", "mistudio.web_server", "-b", "127.0.0.1", "-p", str(port), ASGI_APPLICATION]
            worker = start_process(
                environment, ["manage.py", "worker", "--name", worker_name], f"worker-{port}"
            )
            processes.append(worker)
            web = start_process(environment, daphne, f"web-{port}")
            processes.append(web)
            base_url = f"http://127.0.0.1:{port}"

            def web_up():
                try:
                    return http("GET", f"{base_url}/healthz", timeout=2)[0] in (200, 503)
                except OSError:
                    return False

            wait_until(web_up, timeout=60, interval=0.2, what="daphne")
            stack = PrivateStack(postgres, redis_server, base_url, token, worker_name, worker, web, "", "")
            wait_until(stack.worker_beating, timeout=60, interval=0.2, what="the worker's heartbeat")

            registration = {"source": "local", "model_identifier": str(tiny_gpt2_folder)}
            stack.model_id = stack.json("POST", "/api/models", registration, expect=201)["id"]
            corpus = settings.LOCAL_DATA_ROOTS[0] / f"recovery-{port}.jsonl"
            corpus.parent.mkdir(parents=True, exist_ok=True)
            corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
            dataset = stack.json("POST", "/api/datasets", {"local_path": str(corpus)}, expect=201)
            stack.dataset_id = dataset["id"]
            stack.json("POST", f"/api/models/{stack.model_id}/load", {}, expect=202)

            def ready():
                body = stack.json("GET", f"/api/models/{stack.model_id}")
                assert body["status"] != "failed", body
                return body["status"] == "ready"

            wait_until(ready, timeout=90, interval=0.25, what="the model to load")
            yield stack
        finally:
            stop_processes(processes)


def test_redis_restart_web_and_worker_reconnect_and_the_next_job_succeeds(private_stack):
    stack = private_stack
    assert stack.extract([0])["status"] == "completed"  # the stack works before

    stopped = time.monotonic()
    stack.redis.stop()
    try:
        status, body = stack.healthz()
        assert status == 503 and body["details"]["redis"] == {"ok": False, "error": "unreachable"}
        assert body["details"]["database"]["ok"] is True
        time.sleep(3)  # an outage of a few seconds: the worker's dequeue loop backs off meanwhile
        assert stack.worker.poll() is None and stack.web.poll() is None
    finally:
        stack.redis.start()  # empty: no persistence, as after a crash
    restarted = time.monotonic()
    beating = wait_until(stack.worker_beating, timeout=60, interval=0.2, what="the worker's heartbeat")
    heartbeat_back = time.monotonic() - restarted
    status, body = stack.healthz()
    assert beating and status == 200 and body["dependencies"]["redis"] == "up"

    job = stack.extract([1])  # a new job: enqueued by the web, run by the same worker
    job_done = time.monotonic() - restarted
    assert job["status"] == "completed", job
    assert stack.worker.poll() is None and stack.web.poll() is None
    model = stack.json("GET", f"/api/models/{stack.model_id}")
    assert model["status"] == "ready" and model["error_code"] in ("", None)  # not mistaken for lost
    print(
        f"\nredis down {restarted - stopped:.1f} s; worker heartbeat back after {heartbeat_back:.1f} s; "
        f"next extraction completed {job_done:.1f} s after the restart"
    )


def assert_clean_error(raw: bytes) -> dict:
    text = raw.decode()
    for leak in ("Traceback", 'File "', str(settings.BASE_DIR), "psycopg", "OperationalError", "127.0.0.1"):
        assert leak not in text, (leak, text)
    return json.loads(text)


def test_postgres_stopped_gives_clean_503s_then_everything_works_again(private_stack):
    stack = private_stack
    models_before = stack.json("GET", "/api/models")
    extractions_before = stack.json("GET", "/api/extractions")
    assert models_before["total"] == 1

    stack.postgres.stop()
    stopped = time.monotonic()
    try:
        status, body = stack.healthz()
        assert status == 503 and body["status"] == "unavailable"
        assert body["dependencies"]["database"] == "down" and body["dependencies"]["redis"] == "up"

        for method, path, payload in [
            ("GET", "/api/models", None),
            ("GET", f"/api/models/{stack.model_id}", None),
            ("POST", f"/api/models/{stack.model_id}/unload", {}),
            ("POST", "/api/generate", {"model": stack.model_id, "prompt": "Hello", "max_tokens": 2}),
        ]:
            status, headers, raw = stack.call(method, path, payload)
            assert status == 503, (path, status, raw[:300])
            error = assert_clean_error(raw)["error"]
            assert set(error) == {"code", "message", "details", "timestamp"}, path
            assert error["code"] == "DATABASE_UNAVAILABLE" and headers["Retry-After"] == "5", path

        status, _, raw = stack.call("GET", "/v1/models")  # the OpenAI routes keep OpenAI's error shape
        assert status == 503 and assert_clean_error(raw)["error"]["code"] == "DATABASE_UNAVAILABLE"

        time.sleep(3)  # a few heartbeats (and their database reconcile) fail meanwhile
        assert stack.worker.poll() is None and stack.web.poll() is None
    finally:
        if not stack.postgres.running():
            stack.postgres.start()
    restarted = time.monotonic()

    def api_back():
        return stack.call("GET", "/api/models")[0] == 200

    wait_until(api_back, timeout=30, interval=0.2, what="the API after PostgreSQL is back")
    api_back_after = time.monotonic() - restarted
    assert stack.healthz()[0] == 200
    assert stack.json("GET", "/api/models") == models_before  # nothing stored was lost
    assert stack.json("GET", "/api/extractions") == extractions_before

    job = stack.extract([0, 1])  # the worker's next job reconnects to the database
    assert job["status"] == "completed", job
    print(
        f"\npostgres down {restarted - stopped:.1f} s; API 200 again {api_back_after:.1f} s after it was "
        f"back; next extraction completed {time.monotonic() - restarted:.1f} s after"
    )


@dataclass
class SlowDownload:
    hub: object
    model: object
    environment: dict

    def load_until_downloading(self) -> None:
        """Request the load; return once the worker is downloading (its host is on the row)."""
        from mistudio.access import OPERATOR
        from models_app.services import model_load_request

        model_load_request(model_id=self.model.id, actor=OPERATOR)

        def downloading():
            self.model.refresh_from_db()
            return (
                self.model.status == "loading"
                and self.model.host_worker
                and (self.model.download_bytes_done or 0) > 0
            )

        wait_until(downloading, timeout=60, interval=0.1, what="the download to start")

    def seconds_until_not_loading(self, since: float) -> float:
        """Wait (2 minutes at most) until the model leaves ``loading``; the seconds since ``since``."""

        def no_longer_loading():
            self.model.refresh_from_db()
            return self.model.status != "loading"

        wait_until(no_longer_loading, timeout=120, interval=0.25, what="the model to leave 'loading'")
        return time.monotonic() - since


@pytest.fixture
def slow_download(tmp_path, tiny_gpt2_folder, monkeypatch):
    """A hub model whose download takes about 35 s (0.7 MB at 20 kB/s), so a load is surely still
    downloading when its worker is killed; and the environment of processes that use that hub,
    with a heartbeat every second, lost after 8 s (production: 5 s and 30 s, the same code at a
    quarter of the wait) and the web's worker watch on."""
    import huggingface_hub.constants as hub_constants

    from engine.testing.hub_standin import LocalHub
    from models_app.services import model_register

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    with LocalHub(tmp_path / "hub", throttle_bytes_per_second=20_000) as hub:
        hub.add_repo("acme/slow", tiny_gpt2_folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        environment = process_environment(
            HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, MODEL_CACHE_DIR=str(tmp_path / "model-cache"),
            WORKER_HEARTBEAT_SECONDS="1", WORKER_LOST_AFTER_SECONDS="8", WATCH_WORKERS="1",
        )  # fmt: skip
        model = model_register(source="huggingface", identifier="acme/slow", owner=None)
        yield SlowDownload(hub=hub, model=model, environment=environment)


def wait_for_heartbeats(names) -> None:
    from mistudio.workers import read_heartbeats

    wait_until(
        lambda: set(names) <= {beat["name"] for beat in read_heartbeats()},
        timeout=60, interval=0.2, what=f"the heartbeats of {sorted(names)}",
    )  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_mid_load_leaves_the_model_unloaded_with_worker_lost(slow_download):
    """Two workers; the one loading is killed; the other notices and later takes the model."""
    model = slow_download.model
    suffix = free_port()
    workers = {
        name: start_process(slow_download.environment, ["manage.py", "worker", "--name", name], name)
        for name in (f"kill-a-{suffix}", f"kill-b-{suffix}")
    }
    try:
        wait_for_heartbeats(workers)
        slow_download.load_until_downloading()
        host = model.host_worker
        workers[host].send_signal(signal.SIGKILL)
        workers[host].wait(timeout=10)
        noticed_after = slow_download.seconds_until_not_loading(time.monotonic())
        assert model.status == "unloaded" and model.error_code == "WORKER_LOST", model.error_code
        assert model.host_worker == "" and noticed_after < 120

        # The surviving worker takes the next load of the same model.
        from mistudio.access import OPERATOR
        from models_app.models import LanguageModel
        from models_app.services import model_load_request

        (survivor,) = set(workers) - {host}
        slow_download.hub.throttle_bytes_per_second = None
        model_load_request(model_id=model.id, actor=OPERATOR)
        wait_until(
            lambda: LanguageModel.objects.filter(pk=model.id, status="ready").exists(),
            timeout=60, interval=0.2, what="the reload on the surviving worker",
        )  # fmt: skip
        model.refresh_from_db()
        assert model.host_worker == survivor
    finally:
        stop_processes(list(workers.values()))
    print(f"\nWORKER_LOST {noticed_after:.1f} s after the SIGKILL (heartbeat 1 s, lost after 8 s)")


@pytest.mark.django_db(transaction=True)
def test_the_last_worker_killed_mid_load_is_noticed_by_the_web(slow_download):
    """One worker only, killed while downloading: no worker is left to compare heartbeats, so the
    web process's worker watch must mark the model WORKER_LOST."""
    model = slow_download.model
    port = free_port()
    name = f"alone-{port}"
    daphne = ["-m", "mistudio.web_server", "-b", "127.0.0.1", "-p", str(port), ASGI_APPLICATION]
    web = start_process(slow_download.environment, daphne, f"web-{port}")
    worker = start_process(slow_download.environment, ["manage.py", "worker", "--name", name], name)
    try:
        wait_for_heartbeats([name])
        slow_download.load_until_downloading()
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        noticed_after = slow_download.seconds_until_not_loading(time.monotonic())
        assert model.status == "unloaded" and model.error_code == "WORKER_LOST", model.error_code
        assert web.poll() is None  # the web noticed it, and kept serving
    finally:
        stop_processes([worker, web])
    print(f"\nlast worker lost: WORKER_LOST {noticed_after:.1f} s after the SIGKILL, noticed by the web")


@pytest.fixture
def small_disk():
    """A real 512 KiB file system (tmpfs): writes beyond it fail with ENOSPC, as on a full disk."""
    directory = Path(tempfile.mkdtemp(prefix="mistudio-small-disk-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0755", "tmpfs", str(directory)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        directory.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=False)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.django_db(transaction=True)
def test_a_full_disk_while_writing_a_shard_fails_the_job_with_disk_full(
    small_disk, settings, tiny_gpt2_folder, writer, client_for
):
    from activations.models import Dataset
    from activations.services import dataset_create_from_texts, extraction_request
    from mistudio.workers import run_worker
    from models_app.services import model_register

    settings.ACTIVATION_CACHE_DIR = small_disk
    settings.ACTIVATION_SHARD_MAX_TOKENS = 512  # several shards: the disk fills up after the first ones
    texts = [f"Sample {index}: " + "the quick brown fox jumps over the lazy dog " * 3 for index in range(400)]
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None)
    dataset = dataset_create_from_texts(name="big", texts=texts, owner=None, source=Dataset.Source.BUILTIN)
    job = extraction_request(
        model_id=model.id, dataset_id=dataset.id, owner=writer, layers=[0, 1], batch_size=8, max_length=48
    )
    started = time.monotonic()
    run_worker(name="disk-full-worker", device="cpu", burst=True)
    elapsed = time.monotonic() - started

    job.refresh_from_db()
    cache = job.cache
    cache.refresh_from_db()
    assert job.status == "failed" and job.error_code == "DISK_FULL", (job.status, job.error_code)
    assert "disk is full" in job.error_message
    assert cache.status == "failed" and cache.error_code == "DISK_FULL"
    assert list(small_disk.iterdir()) == []  # the partial files are gone
    assert shutil.disk_usage(small_disk).used < 64 * 1024
    body = client_for(writer).get(f"/api/extractions/{job.id}").json()
    assert body["status"] == "failed" and body["error_code"] == "DISK_FULL"
    print(
        f"\nDISK_FULL after {elapsed:.1f} s; {job.samples_processed} of {len(texts)} samples were processed"
    )


def test_a_freshly_restarted_redis_defers_the_worker_lost_reconcile(settings):
    """A Redis that restarted empty has lost every heartbeat: until live workers have written theirs
    again, their models must not be taken for lost."""
    from mistudio.workers import redis_restarted_recently

    with private_redis() as server:
        settings.EMBEDDED_REDIS, settings.REDIS_URL = False, server.url
        settings.WORKER_LOST_AFTER_SECONDS = 30
        assert redis_restarted_recently()
        settings.WORKER_LOST_AFTER_SECONDS = 0.001
        time.sleep(1.1)
        assert not redis_restarted_recently()
