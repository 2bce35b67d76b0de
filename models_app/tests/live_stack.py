"""A real miStudio for end-to-end tests: Daphne and a worker as subprocesses, tiny models loaded.

The ``live_stack`` fixture (exposed by the root conftest) shares the test database (committed
rows: it is transactional, so the subprocesses see them) and the test Redis.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from django.conf import settings


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, *, timeout: float = 120.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


ASGI_APPLICATION = "mistudio.asgi:application"
# The web process as production starts it (Daphne with bounded request bodies), plus -b/-p and the app.
WEB_SERVER = [sys.executable, "-m", "mistudio.web_server"]


@dataclass
class LiveStack:
    base_url: str
    token: str
    worker_name: str
    models: dict[str, str] = field(default_factory=dict)  # family -> model id
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def api(self) -> str:
        return f"{self.base_url}/api"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}", "Content-Type": "application/json"}


def process_environment(**extra: str) -> dict[str, str]:
    import os

    from django.db import connection

    database = connection.settings_dict
    if connection.vendor == "sqlite":
        url = f"sqlite:///{database['NAME']}"
    else:
        host, port = database["HOST"] or "127.0.0.1", database["PORT"] or 5432
        url = f"postgres://{database['USER']}@{host}:{port}/{database['NAME']}"
    return {
        **os.environ, "DJANGO_SETTINGS_MODULE": "mistudio.settings", "DATABASE_URL": url,
        "REDIS_URL": settings.REDIS_URL, "HF_HUB_OFFLINE": "1", **extra,
    }  # fmt: skip


@contextmanager
def running_web(log_path, **environment: str):
    """The web server process alone on a free port: ``(base_url, pid)``, stopped on exit."""
    port = free_port()
    command = [*WEB_SERVER, "-b", "127.0.0.1", "-p", str(port), ASGI_APPLICATION]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=settings.BASE_DIR, env=process_environment(**environment), stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"

    def up():
        try:
            with urllib.request.urlopen(f"{base_url}/healthz", timeout=2):
                return True
        except OSError as error:
            return getattr(error, "code", None) == 503

    try:
        wait_until(up, timeout=60, what="the web server")
        yield base_url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def register_and_load(folder, *, name: str, timeout: float = 120.0) -> str:
    from mistudio.access import OPERATOR
    from models_app.models import LanguageModel
    from models_app.services import model_load_request, model_register

    model = model_register(source="local", identifier=str(folder), name=name, owner=None)
    model_load_request(model_id=model.id, actor=OPERATOR)

    def ready():
        model.refresh_from_db()
        if model.status == LanguageModel.Status.FAILED:
            raise AssertionError(f"load failed: {model.error_code} {model.error_message}")
        return model.status == LanguageModel.Status.READY

    wait_until(ready, timeout=timeout, what=f"{name} to load")
    return model.id


@pytest.fixture(scope="module")
def live_processes(django_db_setup, django_db_blocker):
    """Daphne on a free port and one worker process, for the tests of one module."""
    port = free_port()
    worker_name = f"live-worker-{port}"
    # The worker reaches this web server's /v1 there (an explanation job's explainer).
    environment = process_environment(MISTUDIO_API_URL=f"http://127.0.0.1:{port}")
    processes: list[subprocess.Popen] = []
    commands = [
        [sys.executable, "manage.py", "worker", "--name", worker_name],
        [*WEB_SERVER, "-b", "127.0.0.1", "-p", str(port), ASGI_APPLICATION],
    ]
    try:
        for command, log_name in zip(commands, ("worker", "web"), strict=True):
            # Logs land in the test data directory, for whoever debugs a failure.
            log = open(settings.DATA_DIR / f"live-{log_name}-{port}.log", "wb")  # noqa: SIM115
            processes.append(
                subprocess.Popen(
                    command, cwd=settings.BASE_DIR, env=environment, stdout=log, stderr=subprocess.STDOUT
                )
            )
            log.close()
        base_url = f"http://127.0.0.1:{port}"

        def web_up():
            try:
                with urllib.request.urlopen(f"{base_url}/healthz", timeout=2) as response:
                    return response.status in (200, 503)
            except OSError as error:
                return getattr(error, "code", None) == 503

        wait_until(web_up, timeout=60, what="daphne")
        yield base_url, worker_name, processes
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture
def live_stack(transactional_db, live_processes, tiny_gpt2_folder, tiny_llama_folder):
    """The module's Daphne + worker, with a model:write user and a tiny GPT-2 and Llama loaded.

    Rows are made per test (a transactional test empties the tables after it); the processes
    live for the module.
    """
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from rest_framework.authtoken.models import Token

    base_url, worker_name, processes = live_processes
    user = get_user_model().objects.create_user(username="live-writer", password="live-password")
    user.groups.add(Group.objects.get(name="model:write"))
    token = Token.objects.create(user=user)
    stack = LiveStack(base_url=base_url, token=token.key, worker_name=worker_name, processes=processes)
    stack.models["gpt2"] = register_and_load(tiny_gpt2_folder, name="live-gpt2")
    stack.models["llama"] = register_and_load(tiny_llama_folder, name="live-llama")
    return stack
