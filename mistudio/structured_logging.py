"""Request ids, job ids and the two log formats: JSON lines for machines, plain text for a person.

Every log record passes through ``LogContextFilter`` on the console handler, which stamps it with
the id of the HTTP request (``RequestIdMiddleware``) or the RQ job (``job_context``, entered by the
worker around each job) that the code was running for. Both ids live in context variables, so they
follow the code across asgiref's sync/async hops and never leak into another request's thread.

The formatters write a fixed set of fields and nothing else from the record: Django attaches the
``HttpRequest`` (headers, cookies, ``Authorization``) to some records, and dumping a record's
attributes would put those in the log. Whatever text they do write goes through ``redact``.
"""

import contextlib
import contextvars
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
JOB_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("job_id", default=None)

REQUEST_ID_HEADER = "X-Request-ID"
# A caller's id is kept only if it is short and plain: it is echoed into headers and every log line.
ACCEPTABLE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

# Extra fields a log call may attach that are known to be safe scalars (the access line's).
SAFE_EXTRA_FIELDS = ("method", "path", "status", "duration_ms")

REDACTED = "[redacted]"
# Credentials as they appear in text: an Authorization value, "Token <key>" / "Bearer <key>", a
# named key ("api_key=…", "Incorrect API key provided: …"), Hugging Face tokens, OpenAI-style
# "sk-…" keys and this workbench's job tokens. The length floors keep words such as "token
# authentication" readable.
CREDENTIAL_PATTERNS = [
    (re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)[^\"',\s]+(?:\s+[^\"',\s]+)?"), r"\1[redacted]"),
    (re.compile(r"(?i)\b(token|bearer)\s+[A-Za-z0-9._~+/-]{20,}=*"), r"\1 [redacted]"),
    (
        re.compile(r"(?i)\b(api[ _-]?key(?: provided)?[\"']?\s*[:=]\s*[\"']?)[A-Za-z0-9._~+/*-]{12,}"),
        r"\1[redacted]",
    ),
    (re.compile(r"\bhf_[A-Za-z0-9]{16,}"), "[redacted]"),
    (re.compile(r"\bsk-[A-Za-z0-9_*-]{16,}"), "[redacted]"),
    (re.compile(r"\bmistudio-job\.[A-Za-z0-9._:-]{8,}"), "[redacted]"),
]
SHORTEST_REDACTED_SECRET = 8  # a shorter configured value would blank out ordinary words


def configured_secrets() -> list[str]:
    """The secret values in the settings and the environment, which must never appear in a log
    line or a stored error: the hub token, the metrics token, the secret key and every explainer
    endpoint's key (read from the variable its ``key_env`` names)."""
    from django.conf import settings

    if not settings.configured:
        return []
    values = [getattr(settings, name, None) for name in ("HF_TOKEN", "METRICS_TOKEN", "SECRET_KEY")]
    for spec in getattr(settings, "EXPLAINER_ENDPOINTS", {}).values():
        if spec.get("key_env"):
            values.append(os.environ.get(spec["key_env"]))
    return [value for value in values if value and len(value) >= SHORTEST_REDACTED_SECRET]


def redact(text: str) -> str:
    """``text`` with configured secrets and anything shaped like a credential replaced."""
    for secret in configured_secrets():
        text = text.replace(secret, REDACTED)
    for pattern, replacement in CREDENTIAL_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


@contextlib.contextmanager
def job_context(*, job_id: str) -> Iterator[None]:
    """Every record logged inside carries ``job_id`` (the worker enters it around each RQ job)."""
    token = JOB_ID.set(job_id)
    try:
        yield
    finally:
        JOB_ID.reset(token)


def request_id_for(request) -> str:
    """The caller's ``X-Request-ID`` when it is acceptable, else a new one."""
    offered = request.headers.get(REQUEST_ID_HEADER, "")
    return offered if ACCEPTABLE_REQUEST_ID.match(offered) else uuid.uuid4().hex


class RequestIdMiddleware:
    """Takes or makes the request id, binds it to the request's log records, returns it as a header.

    First in ``MIDDLEWARE``, so it also covers responses that other middleware answer on their own
    (redirects, CORS preflights). It writes one access line per request (``mistudio.requests``);
    the path is logged without its query string, which is where a careless client puts a token.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self.handle_async(request)
        token, started = self.begin(request)
        try:
            response = self.get_response(request)
        finally:
            REQUEST_ID.reset(token)
        return self.finish(request, response, started)

    async def handle_async(self, request):
        token, started = self.begin(request)
        try:
            response = await self.get_response(request)
        finally:
            REQUEST_ID.reset(token)
        return self.finish(request, response, started)

    @staticmethod
    def begin(request) -> tuple[contextvars.Token, float]:
        # Kept on the request too: Django logs 4xx/5xx responses after the middleware has returned.
        request.request_id = request_id_for(request)
        return REQUEST_ID.set(request.request_id), time.perf_counter()

    @staticmethod
    def finish(request, response, started: float):
        response[REQUEST_ID_HEADER] = request.request_id
        token = REQUEST_ID.set(request.request_id)
        try:
            access_logger.info(
                "%s %s %s",
                request.method,
                request.path,
                response.status_code,
                extra={
                    "method": request.method,
                    "path": request.path,
                    "status": response.status_code,
                    "duration_ms": round(1000 * (time.perf_counter() - started), 1),
                },
            )
        finally:
            REQUEST_ID.reset(token)
        return response


access_logger = logging.getLogger("mistudio.requests")


class LogContextFilter(logging.Filter):
    """Stamps ``request_id`` and ``job_id`` on every record (None where there is none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            # django.request logs error responses after the middleware ran, with the request attached.
            record.request_id = REQUEST_ID.get() or getattr(
                getattr(record, "request", None), "request_id", None
            )
        if getattr(record, "job_id", None) is None:
            record.job_id = JOB_ID.get()
        return True


def utc_timestamp(created: float) -> str:
    return datetime.fromtimestamp(created, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and request_id / job_id when known.

    Only the fields named here are written (never the record's ``__dict__``), and every text field
    is redacted, so neither request headers nor a token can reach the log.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": utc_timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for name in ("request_id", "job_id"):
            if value := getattr(record, name, None):
                entry[name] = value
        for name in SAFE_EXTRA_FIELDS:
            value = getattr(record, name, None)
            if isinstance(value, str | int | float) and not isinstance(value, bool):
                entry[name] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            entry["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(entry, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """A line a person reads in a terminal, with ``[request …]`` / ``[job …]`` when known; redacted."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        context = []
        if request_id := getattr(record, "request_id", None):
            context.append(f"request {request_id}")
        if job_id := getattr(record, "job_id", None):
            context.append(f"job {job_id}")
        record.context = f" [{', '.join(context)}]" if context else ""
        return redact(super().format(record))
