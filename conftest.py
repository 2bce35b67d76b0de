"""Shared fixtures: named users with roles and tokens, API clients, Redis, tiny models, workers."""

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from mistudio import embedded_redis
from mistudio.redis_client import get_redis


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
    from models_app.engine.loading import release
    from models_app.engine.registry import LOADED_MODELS

    for entry in LOADED_MODELS.by_last_use():
        release(LOADED_MODELS.remove(entry.model_id))


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
def tiny_gpt2_folder():
    """A tiny GPT-2 built once per session inside LOCAL_MODEL_ROOTS."""
    from models_app.engine.tiny_models import build_tiny_model

    folder = settings.LOCAL_MODEL_ROOTS[0] / "tiny-gpt2"
    if not (folder / "config.json").exists():
        build_tiny_model("gpt2", folder, size="tiny", seed=0)
    return folder


@pytest.fixture
def process_env():
    """Environment for a real miStudio subprocess that shares this test's database and Redis."""
    import os

    from django.db import connection

    def build(**extra: str) -> dict[str, str]:
        database = connection.settings_dict
        if connection.vendor == "sqlite":
            url = f"sqlite:///{database['NAME']}"
        else:
            host, port = database["HOST"] or "127.0.0.1", database["PORT"] or 5432
            url = f"postgres://{database['USER']}@{host}:{port}/{database['NAME']}"
        return {
            **os.environ, "DJANGO_SETTINGS_MODULE": "mistudio.settings", "DATABASE_URL": url,
            "REDIS_URL": settings.REDIS_URL, **extra,
        }  # fmt: skip

    return build
