"""Settings fail at start, with the variable named, on a bad value."""

import os
import subprocess
import sys

import pytest
from django.conf import settings


def start_django(**environment: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "mistudio.settings", **environment}
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("DEBUG", "maybe", "is not a boolean"),
        ("ACTIVATION_CACHE_MAX_BYTES", "lots", "is not an integer"),
        ("MODEL_MEMORY_LIMIT_GB", "-3", "must be at least 0"),
        ("REDIS_URL", "http://127.0.0.1:6379", "must start with redis://"),
        ("LOCAL_MODEL_ROOTS", "relative/models", "is not an absolute path"),
        ("DATABASE_URL", "nosuchdb://x", "DATABASE_URL is not a valid database URL"),
    ],
)
def test_a_bad_value_stops_start_up_with_a_clear_message(variable, value, says):
    result = start_django(**{variable: value})
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert variable in result.stderr and says in result.stderr


def test_secret_key_is_required_with_a_real_database_and_debug_off(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SECRET_KEY"}
    env.update(DJANGO_SETTINGS_MODULE="mistudio.settings", DATABASE_URL="postgres://u@127.0.0.1/x", DEBUG="0")
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_good_values_are_parsed(tmp_path):
    roots = f"{tmp_path}/a:{tmp_path}/b"
    code = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.LOCAL_MODEL_ROOTS, s.ACTIVATION_CACHE_MAX_BYTES, s.DEBUG, s.MODEL_CACHE_DIR)"
    )
    env = {
        **os.environ, "DJANGO_SETTINGS_MODULE": "mistudio.settings", "LOCAL_MODEL_ROOTS": roots,
        "ACTIVATION_CACHE_MAX_BYTES": "1024", "DEBUG": "yes", "MODEL_CACHE_DIR": str(tmp_path / "cache"),
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"PosixPath('{tmp_path}/a'), PosixPath('{tmp_path}/b')" in result.stdout
    assert "1024 True" in result.stdout
    assert (tmp_path / "cache").is_dir()
