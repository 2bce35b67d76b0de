"""The test suite's settings: the real settings module, on a throw-away data directory.

Everything else — DATABASE_URL, REDIS_URL — comes from the environment exactly as in
production, so the same suite runs on PostgreSQL + Redis (CI) and on the embedded default.
"""

import os
import tempfile

_xdist_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _xdist_worker:
    # An xdist worker inherits the controller's environment, settings included: each worker gets its
    # own data directory and Redis keys (pytest-django gives it its own test database).
    os.environ["MISTUDIO_DATA_DIR"] = tempfile.mkdtemp(prefix=f"mistudio-test-{_xdist_worker}-")
    os.environ["MISTUDIO_REDIS_PREFIX"] = f"mistudio-test-{os.getpid()}"
os.environ.setdefault("MISTUDIO_DATA_DIR", tempfile.mkdtemp(prefix="mistudio-test-"))
os.environ.setdefault("MISTUDIO_REDIS_PREFIX", f"mistudio-test-{os.getpid()}")
os.environ.setdefault("WORKER_HEARTBEAT_SECONDS", "0.5")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WATCH_WORKERS", "0")  # tests that want the web's worker watch turn it on
os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production")

from mistudio.settings import *  # noqa: E402, F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast; tests create many users

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    # A file, not memory, so that real worker subprocesses can share the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test.sqlite3")}  # noqa: F405
