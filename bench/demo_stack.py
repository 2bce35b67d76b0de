"""A real miStudio for the job benchmarks (``bench/fairness.py``, ``bench/memory_budgets.py``): the
demo model and dataset (``manage.py bootstrap_demo``, trained once per data directory), a worker
and a Daphne web server as processes of their own, two writers with API tokens, the demo model
loaded on the worker and one activation cache of the demo dataset.

Runs on the embedded default in ``MISTUDIO_DATA_DIR`` (default: a fresh temporary directory; set
it to reuse a trained demo model across runs) unless DATABASE_URL / REDIS_URL are set.
Import it before Django: it configures the environment and calls ``django.setup()``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MISTUDIO_DATA_DIR", tempfile.mkdtemp(prefix="mistudio-bench-jobs-"))
os.environ["DJANGO_SETTINGS_MODULE"] = "mistudio.settings"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("WATCH_WORKERS", "0")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402

ASGI = "mistudio.asgi:application"
HOOK = "blocks.2.hook_resid_post"
WORKER = "bench-jobs-worker"


@dataclass
class DemoStack:
    base_url: str
    tokens: dict[str, str]  # username -> API token
    users: dict[str, object]
    model_id: str
    cache_id: str
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def headers(self, user: str) -> dict[str, str]:
        return {"Authorization": f"Token {self.tokens[user]}", "Content-Type": "application/json"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition, *, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out waiting for {what}")


def first_token_seconds(client, model_id: str, *, message: str, max_tokens: int) -> float | None:
    """Seconds from sending a streamed chat completion (``client``: an OpenAI client on ``/v1``) to
    its first content chunk; None when none came back."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": message}], max_tokens=max_tokens,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = None
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if first is None and delta is not None and delta.role is None and delta.content is not None:
            first = time.perf_counter() - started
    return first


def user_with_token(username: str):
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from rest_framework.authtoken.models import Token

    user, _ = get_user_model().objects.get_or_create(username=username)
    user.groups.add(Group.objects.get(name="model:write"))
    return user, Token.objects.get_or_create(user=user)[0].key


@contextmanager
def demo_stack(*, environment: dict[str, str] | None = None):
    """The running stack (see the module docstring); everything it started stops on exit."""
    from activations.models import Dataset, ExtractionJob
    from activations.services import extraction_request
    from mistudio.access import OPERATOR
    from mistudio.jobs import JobRow, job_kinds
    from mistudio.workers import read_heartbeats, worker_queues
    from models_app.models import LanguageModel
    from models_app.services import model_load_request

    call_command("migrate", verbosity=0)
    call_command("bootstrap_demo", verbosity=0)
    # A run stopped half-way left jobs, queues and a model's state behind: start clean.
    for kind in job_kinds():
        kind.model.objects.filter(status__in=JobRow.ACTIVE).update(status="cancelled")
    LanguageModel.objects.filter(name="demo-gpt2").update(status="unloaded", host_worker="")
    for queue in worker_queues(WORKER):
        queue.empty()
    users = dict(user_with_token(name)[::-1] for name in ("alice", "bob"))  # token -> user
    tokens = {user.username: token for token, user in users.items()}
    port = free_port()
    # The worker reaches this web server's /v1 there (an explanation job's explainer).
    env = {**os.environ, "MISTUDIO_API_URL": f"http://127.0.0.1:{port}", **(environment or {})}
    data = Path(os.environ["MISTUDIO_DATA_DIR"])
    logs = {name: open(data / f"bench-{name}.log", "ab") for name in ("worker", "web")}  # noqa: SIM115
    processes = {
        "worker": subprocess.Popen(
            [sys.executable, "manage.py", "worker", "--name", WORKER, "--device", "cpu"],
            cwd=ROOT, env=env, stdout=logs["worker"], stderr=subprocess.STDOUT,
        ),
        "web": subprocess.Popen(
            [sys.executable, "-m", "mistudio.web_server", "-v", "0", "-b", "127.0.0.1", "-p", str(port),
             ASGI],
            cwd=ROOT, env=env, stdout=logs["web"], stderr=subprocess.STDOUT,
        ),
    }  # fmt: skip
    try:
        wait_for(
            lambda: any(beat["name"] == WORKER for beat in read_heartbeats()), timeout=120, what="the worker"
        )

        def web_up() -> bool:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
                return True
            except OSError as error:
                return getattr(error, "code", None) == 503

        wait_for(web_up, timeout=120, what="the web server")
        model = LanguageModel.objects.get(name="demo-gpt2")
        LanguageModel.objects.filter(pk=model.pk).update(shared=True)  # alice's and bob's to use
        if model.status != LanguageModel.Status.READY:
            model_load_request(model_id=model.id, actor=OPERATOR)

        def ready() -> bool:
            model.refresh_from_db()
            if model.status == LanguageModel.Status.FAILED:
                raise SystemExit(f"load failed: {model.error_code} {model.error_message}")
            return model.status == LanguageModel.Status.READY

        wait_for(ready, timeout=300, what="the demo model to load")
        dataset = Dataset.objects.get(name="demo-docstrings")
        for user in users.values():  # each their own request: the second reuses the first's cache
            job = extraction_request(
                model_id=model.id,
                dataset_id=dataset.id,
                owner=user,
                hooks=[HOOK],
                max_length=128,
                batch_size=32,
            )

            def extracted(job=job):
                job.refresh_from_db()
                if job.status == ExtractionJob.Status.FAILED:
                    raise SystemExit(f"extraction failed: {job.error_code} {job.error_message}")
                return job.status == ExtractionJob.Status.COMPLETED

            wait_for(extracted, timeout=600, what="the demo cache")
        yield DemoStack(
            base_url=f"http://127.0.0.1:{port}",
            tokens=tokens,
            users={user.username: user for user in users.values()},
            model_id=model.id,
            cache_id=job.cache_id,
            processes=processes,
        )
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in logs.values():
            log.close()
        if settings.EMBEDDED_REDIS:  # the server this run started for itself
            from mistudio import embedded_redis

            embedded_redis.stop(settings.EMBEDDED_REDIS_SOCKET)
