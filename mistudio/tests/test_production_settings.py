"""Production settings: docker-compose's environment passes Django's deployment checks; the HTTPS,
CORS, metrics and logging variables are parsed, and a bad one stops start-up naming it.

Each case starts a fresh Django in a subprocess, since settings are read once per process.
"""

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from django.conf import settings

COMPOSE_FILE = Path(settings.BASE_DIR) / "docker-compose.yml"
SUBSTITUTION = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")
# Where docker-compose mounts volumes: moved under the test's own directory here.
CONTAINER_PATHS = {
    "MISTUDIO_DATA_DIR": "data",
    "MODEL_CACHE_DIR": "data/model_cache",
    "ACTIVATION_CACHE_DIR": "data/activations",
    "LOCAL_MODEL_ROOTS": "models",
    "LOCAL_DATA_ROOTS": "datasets",
}
# What `manage.py check --deploy` reads from the process, rather than from the settings.
INHERITED = ("PATH", "HOME", "LANG", "VIRTUAL_ENV")


def compose_environment(root: Path, **dotenv: str) -> dict[str, str]:
    """docker-compose's service environment as compose would resolve it with ``dotenv`` as the
    .env file (``${NAME:-default}`` takes the .env value, else the default), paths under ``root``."""
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    service = document["services"]["web"]["environment"]

    def resolve(value) -> str:
        return SUBSTITUTION.sub(lambda match: dotenv.get(match.group(1)) or match.group(2) or "", str(value))

    environment = {name: resolve(value) for name, value in service.items()}
    for name, relative in CONTAINER_PATHS.items():
        assert name in environment, f"docker-compose.yml no longer sets {name}"
        environment[name] = str(root / relative)
    return environment


def run_django(code_or_command: list[str], environment: dict[str, str]) -> subprocess.CompletedProcess:
    """A fresh process with only ``environment`` (no test settings, nothing from this shell)."""
    env = {name: os.environ[name] for name in INHERITED if name in os.environ}
    env.update(environment, DJANGO_SETTINGS_MODULE="mistudio.settings")
    return subprocess.run(
        [sys.executable, *code_or_command], cwd=settings.BASE_DIR, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def settings_values(environment: dict[str, str], *names: str) -> dict:
    code = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        f"print(json.dumps({{n: getattr(s, n) for n in {list(names)!r}}}))"
    )
    result = run_django(["-c", code], environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def operator_key() -> str:
    """What an operator puts in .env: a long random key (``check --deploy`` rejects a weak one)."""
    return secrets.token_urlsafe(50)


def test_docker_compose_environment_passes_the_security_deployment_checks(tmp_path, operator_key):
    environment = compose_environment(tmp_path, SECRET_KEY=operator_key)
    result = run_django(
        ["manage.py", "check", "--deploy", "--fail-level", "WARNING", "--tag", "security"], environment
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout

    values = settings_values(
        environment, "DEBUG", "SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE",
        "SECURE_HSTS_SECONDS", "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_HSTS_PRELOAD", "LOG_FORMAT",
        "CORS_ALLOWED_ORIGINS", "METRICS_TOKEN",
    )  # fmt: skip
    assert values == {
        "DEBUG": False, "SECURE_SSL_REDIRECT": True,
        "SESSION_COOKIE_SECURE": True, "CSRF_COOKIE_SECURE": True,
        "SECURE_HSTS_SECONDS": 31536000, "SECURE_HSTS_INCLUDE_SUBDOMAINS": True, "SECURE_HSTS_PRELOAD": True,
        "LOG_FORMAT": "json", "CORS_ALLOWED_ORIGINS": [], "METRICS_TOKEN": None,
    }  # fmt: skip


def test_docker_compose_environment_passes_every_deployment_check(tmp_path, operator_key):
    environment = compose_environment(tmp_path, SECRET_KEY=operator_key)
    result = run_django(["manage.py", "check", "--deploy", "--fail-level", "WARNING"], environment)
    assert result.returncode == 0, result.stdout + result.stderr


def test_docker_compose_without_a_secret_key_refuses_to_start(tmp_path):
    result = run_django(["manage.py", "check"], compose_environment(tmp_path))
    assert result.returncode != 0
    assert "ImproperlyConfigured: SECRET_KEY must be set when DEBUG is off" in result.stderr


def test_debug_off_with_an_external_redis_only_needs_a_secret_key(tmp_path):
    environment = {
        "MISTUDIO_DATA_DIR": str(tmp_path),
        "REDIS_URL": "redis://127.0.0.1:6379/11",
        "DEBUG": "off",
    }
    result = run_django(["-c", "import django; django.setup()"], environment)
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_the_embedded_default_makes_its_own_key_and_serves_plain_http(tmp_path):
    values = settings_values(
        {"MISTUDIO_DATA_DIR": str(tmp_path)},
        "EMBEDDED_DEFAULT", "SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE",
        "SECURE_HSTS_SECONDS", "SECURE_PROXY_SSL_HEADER", "LOG_FORMAT", "SECRET_KEY",
    )  # fmt: skip
    assert values.pop("SECRET_KEY") == (tmp_path / "secret_key").read_text().strip()
    assert values == {
        "EMBEDDED_DEFAULT": True, "SECURE_SSL_REDIRECT": False, "SESSION_COOKIE_SECURE": False,
        "CSRF_COOKIE_SECURE": False, "SECURE_HSTS_SECONDS": 0, "SECURE_PROXY_SSL_HEADER": None,
        "LOG_FORMAT": "plain",
    }  # fmt: skip


def test_proxy_header_origins_and_log_format_are_parsed(tmp_path):
    values = settings_values(
        {
            "MISTUDIO_DATA_DIR": str(tmp_path),
            "SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto",
            "CSRF_TRUSTED_ORIGINS": "https://lab.example.org, https://*.example.net",
            "CORS_ALLOWED_ORIGINS": "https://notebook.example.org,http://127.0.0.1:8888/",
            "LOG_FORMAT": "JSON",
            "SECURE_SSL_REDIRECT": "yes",
        },
        "SECURE_PROXY_SSL_HEADER", "CSRF_TRUSTED_ORIGINS", "CORS_ALLOWED_ORIGINS", "LOG_FORMAT",
        "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE",
    )  # fmt: skip
    assert values == {
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
        "CSRF_TRUSTED_ORIGINS": ["https://lab.example.org", "https://*.example.net"],
        "CORS_ALLOWED_ORIGINS": ["https://notebook.example.org", "http://127.0.0.1:8888"],
        "LOG_FORMAT": "json",
        "SESSION_COOKIE_SECURE": True,  # secure cookies follow SECURE_SSL_REDIRECT unless set
        "CSRF_COOKIE_SECURE": True,
    }


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("SECURE_SSL_REDIRECT", "maybe", "is not a boolean"),
        ("SESSION_COOKIE_SECURE", "sometimes", "is not a boolean"),
        ("SECURE_HSTS_SECONDS", "a year", "is not an integer"),
        ("SECURE_HSTS_SECONDS", "-1", "must be at least 0"),
        ("SECURE_PROXY_SSL_HEADER", "X-Forwarded-Proto: https", "is not a header name"),
        ("CSRF_TRUSTED_ORIGINS", "lab.example.org", "is not an origin"),
        ("CORS_ALLOWED_ORIGINS", "https://*.example.org", "is not an origin"),
        ("CORS_ALLOWED_ORIGINS", "https://example.org/api", "is not an origin"),
        ("METRICS_TOKEN", "short", "at least 16 characters"),
        ("LOG_FORMAT", "xml", "is not one of json, plain"),
        ("LOG_LEVEL", "loud", "is not one of debug"),
    ],
)
def test_a_bad_value_stops_start_up_naming_the_variable(tmp_path, variable, value, says):
    result = run_django(
        ["-c", "import django; django.setup()"], {"MISTUDIO_DATA_DIR": str(tmp_path), variable: value}
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert variable in result.stderr and says in result.stderr
