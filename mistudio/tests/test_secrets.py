"""A canary ``HF_TOKEN`` goes through a whole flow — register a gated hub model, download and load it,
extract, generate with capture, read everything back — with Daphne and a worker as real processes,
and is then looked for everywhere: every response (bodies and headers), both processes' logs, every
Redis key miStudio's run wrote, every row of every table, and the activation caches' files. The
token must have been used (the gated download succeeds only with it) and must be found nowhere."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from django.apps import apps
from django.conf import settings

from activations.services import dataset_create_from_texts
from conftest import make_user
from engine.testing.hub_standin import LocalHub
from engine.testing.tiny_models import build_tiny_model
from models_app.tests.live_stack import (
    ASGI_APPLICATION,
    WEB_SERVER,
    free_port,
    process_environment,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CANARY = "hf_canary_3c9e1f7a_must_never_be_seen_anywhere"
REPO = "acme/gated-canary"


@pytest.fixture
def gated_hub(tmp_path):
    with LocalHub(tmp_path / "hub", gated={REPO: CANARY}) as hub:
        hub.add_repo(REPO, build_tiny_model("gpt2", tmp_path / "source", size="tiny", seed=3))
        yield hub


@pytest.fixture
def stack_with_token(gated_hub, tmp_path):
    """Daphne and a worker, both with the canary ``HF_TOKEN`` and the stand-in hub; their log files."""
    port = free_port()
    environment = process_environment(
        HF_TOKEN=CANARY,
        HF_ENDPOINT=gated_hub.url,
        HF_HUB_OFFLINE="0",
        MODEL_CACHE_DIR=str(tmp_path / "model-cache"),
        LOG_LEVEL="DEBUG",  # the chattiest logs are the likeliest to leak
    )
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "web")}
    commands = {
        "worker": [sys.executable, "manage.py", "worker", "--name", f"canary-{port}"],
        "web": [*WEB_SERVER, "-b", "127.0.0.1", "-p", str(port), ASGI_APPLICATION],
    }
    processes = []
    try:
        for name, command in commands.items():
            with open(logs[name], "wb") as log:
                processes.append(
                    subprocess.Popen(
                        command, cwd=settings.BASE_DIR, env=environment, stdout=log, stderr=subprocess.STDOUT
                    )
                )
        base_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _status(f"{base_url}/healthz") in (200, 503), timeout=60, what="daphne")
        yield base_url, logs
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


class Recorder:
    """An API client that keeps every response it got, headers and body."""

    def __init__(self, base_url: str, token: str):
        self.base_url, self.token = base_url, token
        self.seen: list[str] = []

    def __call__(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | bytes]:
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status, headers, raw = response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            status, headers, raw = error.code, error.headers, error.read()
        self.seen.append(str(headers) + raw.decode("utf-8", "replace"))
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def wait_for(self, path: str, field: str, wanted: str) -> dict:
        def reached():
            _, body = self("GET", path)
            assert body.get(field) not in ("failed", "cancelled"), body
            return body if body.get(field) == wanted else None

        return wait_until(reached, timeout=120, interval=0.5, what=f"{path} {field}={wanted}")


def redis_contents() -> str:
    """Every key this test run's processes wrote (its prefix, RQ's keys), with its value."""
    from mistudio.redis_client import get_redis

    redis = get_redis()
    text = []
    for pattern in (f"{settings.REDIS_KEY_PREFIX}*", "rq:*", "asgi*"):
        for key in redis.scan_iter(match=pattern, count=1000):
            kind = redis.type(key).decode()
            value = {
                "string": lambda key=key: redis.get(key),
                "hash": lambda key=key: redis.hgetall(key),
                "list": lambda key=key: redis.lrange(key, 0, -1),
                "set": lambda key=key: redis.smembers(key),
                "zset": lambda key=key: redis.zrange(key, 0, -1, withscores=True),
                "stream": lambda key=key: redis.xrange(key),
            }.get(kind, lambda: b"")()
            text.append(f"{key!r} {value!r}")
    return "\n".join(text)


def database_contents() -> str:
    return "\n".join(
        repr(list(model._default_manager.values())) for model in apps.get_models() if model._meta.managed
    )


def test_a_canary_hf_token_appears_nowhere_after_a_full_flow(stack_with_token, gated_hub):
    base_url, logs = stack_with_token
    user = make_user("tess-token", "model:admin")
    api = Recorder(base_url, user.auth_token.key)

    status, model = api("POST", "/api/models", {"model_identifier": REPO, "name": "gated"})
    assert status == 201, model
    assert api("POST", f"/api/models/{model['id']}/load", {})[0] == 202
    api.wait_for(f"/api/models/{model['id']}", "status", "ready")
    assert gated_hub.served(REPO, "model.safetensors") > 0  # downloaded, which needs the token

    dataset = dataset_create_from_texts(
        name="canary texts", texts=["one two", "three"], owner=user, source="upload"
    )
    status, job = api(
        "POST",
        f"/api/models/{model['id']}/extract-activations",
        {"dataset_id": dataset.id, "layer_indices": [0, 1], "max_length": 16},
    )
    assert status == 202, job
    job = api.wait_for(f"/api/extractions/{job['extraction_id']}", "status", "completed")
    cache_id = job["cache_id"]
    for path in (
        f"/api/activation-caches/{cache_id}",
        f"/api/activation-caches/{cache_id}/download",
        f"/api/activation-caches/{cache_id}/top-k?hook=blocks.0.hook_resid_post&neuron=0",
        f"/api/models/{model['id']}",
        "/api/workers",
        "/api/extractions",
        "/healthz",
        "/metrics",
    ):
        assert api("GET", path)[0] == 200, path
    status, generated = api(
        "POST",
        "/api/generate",
        {
            "model_id": model["id"],
            "prompt": "one two",
            "max_tokens": 4,
            "mistudio": {"capture": ["blocks.1.hook_resid_post"]},
        },
    )
    assert status == 200 and generated["usage"]["completion_tokens"] == 4, generated
    time.sleep(1.5)  # a heartbeat or two more in the logs and in Redis

    places = {
        "responses": "\n".join(api.seen),
        "web log": logs["web"].read_text(errors="replace"),
        "worker log": logs["worker"].read_text(errors="replace"),
        "redis": redis_contents(),
        "database": database_contents(),
        "activation caches": "\n".join(
            path.read_text(errors="replace") for path in settings.ACTIVATION_CACHE_DIR.rglob("*.json")
        ),
    }
    assert places["worker log"] and places["redis"] and places["database"]  # something was looked at
    leaked = [name for name, text in places.items() if CANARY in text or CANARY[:20] in text]
    assert leaked == [], f"the canary token was found in: {leaked}"
