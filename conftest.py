"""Shared fixtures: named users with roles and tokens, API clients, Redis, tiny models, workers."""

import shutil

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from mistudio import embedded_redis
from mistudio.redis_client import get_redis
from models_app.tests.live_stack import live_processes, live_stack  # noqa: F401  (end-to-end fixtures)


@pytest.fixture(scope="session", autouse=True)
def redis_for_tests():
    """The suite's Redis: the configured server, or an embedded one started for the session.

    Keys live under a per-run prefix and are deleted at the end, so a shared server is left clean.
    """
    connection = get_redis()
    yield connection
    for key in connection.scan_iter(match=f"{settings.REDIS_KEY_PREFIX}*", count=500):
        connection.delete(key)
    for key in connection.scan_iter(match=f"rq:*{settings.REDIS_KEY_PREFIX}*", count=500):
        connection.delete(key)
    if settings.EMBEDDED_REDIS:
        embedded_redis.stop(settings.EMBEDDED_REDIS_SOCKET)


@pytest.fixture(autouse=True)
def no_models_left_loaded():
    """Each test starts with an empty in-process model registry (burst workers share this process)."""
    yield
    from engine.loading import release
    from engine.registry import LOADED_MODELS

    for entry in LOADED_MODELS.by_last_use():
        release(LOADED_MODELS.remove(entry.model_id))


@pytest.fixture(autouse=True)
def fresh_worker_clock():
    """Each test starts with no owner served by this process's workers (``mistudio.worker_clock``:
    burst workers run in this process, and user ids can come back after a rollback)."""
    from mistudio.worker_clock import CLOCK

    CLOCK.reset()


@pytest.fixture(autouse=True)
def fresh_rate_limits(redis_for_tests):
    """Each test starts with nothing counted against a rate limit (mistudio.throttling).

    The counts live in Redis, not in the database, so a rolled-back test would otherwise leave
    them to the next one (on SQLite even under the same user id).
    """
    pattern = f"{settings.REDIS_KEY_PREFIX}:cache:*throttle:*"
    for key in redis_for_tests.scan_iter(match=pattern, count=500):
        redis_for_tests.delete(key)


def make_user(username: str, role: str | None):
    user = get_user_model().objects.create_user(username=username, password=f"{username}-password")
    if role:
        user.groups.add(Group.objects.get(name=role))
    Token.objects.create(user=user)
    return user


@pytest.fixture
def reader(db):
    return make_user("rita-reader", "model:read")


@pytest.fixture
def writer(db):
    return make_user("walt-writer", "model:write")


@pytest.fixture
def model_admin(db):
    return make_user("ada-admin", "model:admin")


@pytest.fixture
def client_for():
    """An API client authenticated with the given user's token."""

    def build(user) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {user.auth_token.key}")
        return client

    return build


@pytest.fixture(scope="session")
def load_tiny(tmp_path_factory):
    """``load_tiny(family, quantization="none")``: a tiny model, built and loaded once per session.

    Shared by the engine tests: a test that changes a model (its generation config) restores it.
    """
    from engine.loading import load_weights
    from engine.testing.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-engine-models")
    loaded = {}

    def load(family: str, quantization: str = "none"):
        if (family, quantization) not in loaded:
            folder = root / family
            if not (folder / "config.json").exists():
                build_tiny_model(family, folder, size="tiny", seed=0)
            loaded[family, quantization] = load_weights(
                folder, model_type=family, quantization=quantization, device="cpu"
            )
        return loaded[family, quantization]

    return load


@pytest.fixture(scope="session")
def tiny_gpt2_folder():
    """A tiny GPT-2 built once per session inside LOCAL_MODEL_ROOTS."""
    from engine.testing.tiny_models import build_tiny_model

    folder = settings.LOCAL_MODEL_ROOTS[0] / "tiny-gpt2"
    if not (folder / "config.json").exists():
        build_tiny_model("gpt2", folder, size="tiny", seed=0)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_folder():
    """A tiny Llama built once per session inside LOCAL_MODEL_ROOTS, with a 4,096-token context.

    Rotary position embeddings have no weights, so the long context costs nothing; it lets
    tests run generations long enough to cancel or disconnect mid-way.
    """
    import json

    from engine.testing.tiny_models import build_tiny_model

    folder = settings.LOCAL_MODEL_ROOTS[0] / "tiny-llama"
    if not (folder / "config.json").exists():
        build_tiny_model("llama", folder, size="tiny", seed=0)
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = 4096
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture
def process_env():
    """Environment for a real miStudio subprocess that shares this test's database and Redis."""
    from models_app.tests.live_stack import process_environment

    return process_environment


@pytest.fixture
def model_copy(tiny_gpt2_folder, tmp_path):
    """``model_copy(name, links)``: a copy of the tiny GPT-2 inside the root whose files in
    ``links`` are links to copies kept outside the roots (``"outside"``) or elsewhere inside
    the root (``"inside"``)."""
    made = []

    def build(name: str, links: dict[str, str]):
        folder = settings.LOCAL_MODEL_ROOTS[0] / name
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tiny_gpt2_folder, folder)
        elsewhere = {
            "outside": tmp_path / "outside",
            "inside": settings.LOCAL_MODEL_ROOTS[0] / f"{name}-files",
        }
        for file_name, where in links.items():
            elsewhere[where].mkdir(parents=True, exist_ok=True)
            target = elsewhere[where] / file_name
            shutil.move(folder / file_name, target)
            (folder / file_name).symlink_to(target)
        made.extend([folder, elsewhere["inside"]])
        return folder

    yield build
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
