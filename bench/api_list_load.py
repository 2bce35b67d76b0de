"""Bounded load test of ``GET /api/models`` with 1,000 registered models, on loopback.

Daphne (the production ASGI server, one process, as ``make run`` and docker-compose run it) serves
a database holding ``--models`` model rows. An open-loop client sends ``--rate`` requests per second
for ``--seconds`` (at most 60) from a thread pool, each as a reader with an API token and the
API's default page (50 models, newest first, with the total). Latency is measured from the moment
a request was *due*, not when a thread got to it, so a server that falls behind shows it (no
coordinated omission). Goal: p95 ≤ 200 ms and 0 % errors at 50 requests/s.

Runs on the embedded default in a temporary data directory unless DATABASE_URL / REDIS_URL are set
(CI's pair: PostgreSQL + Redis). Only loopback is contacted; the run stops by itself.

    .venv/bin/python bench/api_list_load.py [--models 1000] [--rate 50] [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MISTUDIO_DATA_DIR", tempfile.mkdtemp(prefix="mistudio-bench-list-"))
os.environ["DJANGO_SETTINGS_MODULE"] = "mistudio.settings"

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402


def register_rows(count: int, owner) -> None:
    """``count`` model rows as registration leaves them (inspected, pending), half of them shared."""
    from models_app.models import LanguageModel

    LanguageModel.objects.filter(identifier__startswith="bench-org/").delete()
    config = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}
    LanguageModel.objects.bulk_create(
        [
            LanguageModel(
                name=f"bench-model-{index:04d}",
                source=LanguageModel.Source.HUGGINGFACE,
                identifier=f"bench-org/model-{index:04d}",
                model_type="gpt2",
                architecture="GPT2LMHeadModel",
                config=config,
                parameter_count=124_439_808,
                hidden_size=768,
                num_layers=12,
                vocab_size=50257,
                context_length=1024,
                memory_estimates={"none": 497_759_232, "int8": 163_842_048, "int4": 121_384_960},
                owner=owner if index % 2 else None,
                shared=index % 4 == 1,
            )
            for index in range(count)
        ],
        batch_size=500,
    )


def make_user(username: str, role: str):
    """A user with a role and an API token."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from rest_framework.authtoken.models import Token

    user = get_user_model().objects.create_user(username=username)
    user.groups.add(Group.objects.get(name=role))
    Token.objects.create(user=user)
    return user


def start_daphne(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mistudio.web_server",
            "-b",
            "127.0.0.1",
            "-p",
            str(port),
            "mistudio.asgi:application",
        ],
        cwd=ROOT,
        env={**os.environ, "LOG_LEVEL": "WARNING"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).close()
            return process
        except urllib.error.HTTPError:
            return process  # 503 (no worker here) still means it serves
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("daphne did not start")


def run_load(url: str, token: str, *, rate: float, seconds: float) -> tuple[list[float], list[str], int]:
    """Open loop: request i is due at start + i / rate. Latencies in ms from the due time."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    total = int(rate * seconds)
    start = time.perf_counter() + 0.5

    def one(index: int) -> None:
        due = start + index / rate
        time.sleep(max(0.0, due - time.perf_counter()))
        request = urllib.request.Request(url, headers={"Authorization": f"Token {token}"})  # noqa: S310 (http only)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
                body = response.read()
                ok = response.status == 200 and body.startswith(b'{"models":')
                problem = None if ok else f"HTTP {response.status}"
        except (urllib.error.HTTPError, OSError) as error:
            problem = f"{type(error).__name__}: {error}"
        elapsed = (time.perf_counter() - due) * 1000
        with lock:
            latencies.append(elapsed)
            if problem:
                errors.append(problem)

    with ThreadPoolExecutor(max_workers=64) as pool:
        list(pool.map(one, range(total)))
    return latencies, errors, total


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="duration, at most 60")
    arguments = parser.parse_args()
    seconds = min(arguments.seconds, 60.0)

    call_command("migrate", verbosity=0)
    from django.contrib.auth import get_user_model

    get_user_model().objects.filter(username__in=["bench-reader", "bench-owner"]).delete()
    reader = make_user("bench-reader", "model:read")
    owner = make_user("bench-owner", "model:write")
    register_rows(arguments.models, owner)
    from models_app.models import LanguageModel
    from models_app.selectors import model_list

    visible = model_list(user=reader).count()
    port = 8750 + os.getpid() % 200
    daphne = start_daphne(port)
    try:
        url = f"http://127.0.0.1:{port}/api/models"
        run_load(url, reader.auth_token.key, rate=arguments.rate, seconds=3)  # warm-up, not counted
        latencies, errors, total = run_load(url, reader.auth_token.key, rate=arguments.rate, seconds=seconds)
    finally:
        daphne.terminate()
        daphne.wait(timeout=30)
        LanguageModel.objects.filter(identifier__startswith="bench-org/").delete()

    database = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    print(
        f"GET /api/models · {arguments.models} models registered "
        f"({visible} visible to the reader) · {database}"
    )
    print(
        f"{total} requests at {arguments.rate:g}/s over {seconds:g} s (open loop, latency from the due time)"
    )
    print(
        f"p50 {percentile(latencies, 0.50):.1f} ms · p95 {percentile(latencies, 0.95):.1f} ms · "
        f"p99 {percentile(latencies, 0.99):.1f} ms · max {max(latencies):.1f} ms · "
        f"mean {statistics.fmean(latencies):.1f} ms"
    )
    print(
        f"errors: {len(errors)} ({100 * len(errors) / total:.2f} %)"
        + (f" e.g. {errors[0]}" if errors else "")
    )
    goal = percentile(latencies, 0.95) <= 200 and not errors
    print("goal (p95 <= 200 ms, 0 % errors):", "met" if goal else "NOT met")


if __name__ == "__main__":
    main()
