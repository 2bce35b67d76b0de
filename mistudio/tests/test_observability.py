"""Observability: ``/metrics`` after a real load / extraction / generation, who may read it, request
and job ids in JSON log lines, no credential in any log line, and CORS for configured origins only."""

import io
import json
import logging
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db.models import Sum
from django.test import RequestFactory
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.authtoken.models import Token

from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from generation.models import Generation
from mistudio.structured_logging import JsonFormatter, LogContextFilter, PlainFormatter, redact
from models_app.tests.live_stack import register_and_load, wait_until

METRICS_TOKEN = "scraper-token-0123456789abcdef"


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text → {sample name: [(labels, value), …]}, parsed by prometheus_client itself."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def value(found: dict, name: str, **labels: str) -> float:
    matches = [
        number for sample_labels, number in found.get(name, []) if labels.items() <= sample_labels.items()
    ]
    assert len(matches) == 1, f"{name}{labels}: {found.get(name)}"
    return matches[0]


def http(method: str, url: str, *, token: str | None = None, body: dict | None = None, **headers: str):
    if token:
        headers["Authorization"] = f"Token {token}"
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def json_lines(path) -> list[dict]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


# --- The whole flow, scraped from a live Daphne ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_metrics_after_a_real_load_extraction_and_generation(live_processes, tiny_gpt2_folder):
    base_url, worker_name, _ = live_processes
    admin = get_user_model().objects.create_user(username="olga-operator", password="operator-password")
    admin.groups.add(Group.objects.get(name="model:admin"))
    token = Token.objects.create(user=admin).key

    model_id = register_and_load(tiny_gpt2_folder, name="metrics-gpt2")
    dataset = dataset_create_from_texts(
        name="metrics-texts", texts=["The function returns a value.", "Short one.", "x y z"] * 4,
        owner=admin, source=Dataset.Source.BUILTIN,
    )  # fmt: skip
    request_id = "metrics-flow-extract-1"
    extraction_request = {
        "dataset_id": dataset.id, "hooks": ["blocks.0.hook_resid_post"], "batch_size": 4, "max_length": 16,
    }  # fmt: skip
    status, headers, body = http(
        "POST", f"{base_url}/api/models/{model_id}/extract-activations", token=token, body=extraction_request,
        **{"X-Request-ID": request_id},
    )  # fmt: skip
    assert status == 202, body
    assert headers["X-Request-ID"] == request_id
    extraction = ExtractionJob.objects.get(pk=json.loads(body)["extraction_id"])

    def extraction_done():
        extraction.refresh_from_db()
        assert extraction.status not in {"failed", "cancelled"}, extraction.error_message
        return extraction.status == "completed"

    wait_until(extraction_done, timeout=120, what="the extraction")
    status, _, body = http(
        "POST", f"{base_url}/api/generate", token=token,
        body={"model_id": model_id, "prompt": "The function", "max_tokens": 6, "temperature": 0},
    )  # fmt: skip
    assert status == 200, body

    anonymous = http("GET", f"{base_url}/metrics")
    assert anonymous[0] == 401 and json.loads(anonymous[2])["error"]["code"] == "UNAUTHENTICATED"
    status, headers, text = http("GET", f"{base_url}/metrics", token=token)
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    found = samples(text)

    assert value(found, "mistudio_up", dependency="database") == 1
    assert value(found, "mistudio_up", dependency="redis") == 1
    assert value(found, "mistudio_worker_up", worker=worker_name) == 1
    assert value(found, "mistudio_worker_loaded_models", worker=worker_name) >= 1
    assert value(found, "mistudio_worker_memory_total_bytes", worker=worker_name) > 0
    loaded = value(found, "mistudio_loaded_model_memory_bytes", worker=worker_name, model_id=model_id)
    assert loaded > 0 and loaded == pytest.approx(
        value(found, "mistudio_loaded_model_memory_bytes", model="metrics-gpt2")
    )
    assert value(found, "mistudio_models", status="ready") >= 1
    assert value(found, "mistudio_model_load_duration_seconds_count") >= 1
    assert value(found, "mistudio_model_load_duration_seconds_sum") > 0

    assert value(found, "mistudio_extraction_jobs", status="completed") >= 1
    assert value(found, "mistudio_extraction_jobs", status="failed") == 0
    assert value(found, "mistudio_extraction_duration_seconds_count") >= 1
    assert value(found, "mistudio_extraction_duration_seconds_sum") > 0
    assert value(found, "mistudio_extraction_duration_seconds_bucket", le="+Inf") >= 1
    assert value(found, "mistudio_extraction_mean_tokens_per_second") > 0
    assert (
        value(found, "mistudio_extraction_tokens_processed", status="completed")
        == extraction.tokens_processed
        > 0
    )

    assert value(found, "mistudio_generations", status="completed") >= 1
    assert value(found, "mistudio_generation_duration_seconds_count") >= 1
    total_ms = Generation.objects.filter(status="completed").aggregate(ms=Sum("total_ms"))["ms"]
    assert total_ms > 0
    assert value(found, "mistudio_generation_duration_seconds_sum") == pytest.approx(total_ms / 1000)
    assert value(found, "mistudio_generation_duration_seconds_bucket", le="300.0") >= 1  # tiny model: seconds
    completion_tokens = Generation.objects.filter(status="completed").aggregate(n=Sum("completion_tokens"))[
        "n"
    ]
    assert value(found, "mistudio_generation_tokens", kind="completion") == completion_tokens > 0

    cache_bytes = sum(number for _, number in found["mistudio_activation_cache_bytes"])
    assert cache_bytes == ActivationCache.objects.aggregate(total=Sum("file_size_bytes"))["total"] > 0
    assert sum(number for _, number in found["mistudio_activation_caches"]) == ActivationCache.objects.count()
    assert value(found, "mistudio_activation_cache_budget_bytes") == settings.ACTIVATION_CACHE_MAX_BYTES
    own_queue = {
        labels["state"]: number
        for labels, number in found["mistudio_queue_jobs"]
        if labels["worker"] == worker_name
    }
    assert set(own_queue) == {"queued", "running", "failed"} and own_queue["failed"] == 0

    # The processes' own stdout: JSON lines with the request id (web) and the job's row id (worker).
    port = urlsplit(base_url).port
    web_log = settings.DATA_DIR / f"live-web-{port}.log"
    worker_log = settings.DATA_DIR / f"live-worker-{port}.log"
    web_lines = json_lines(web_log)
    access = [line for line in web_lines if line.get("request_id") == request_id]
    assert access and access[-1]["logger"] == "mistudio.requests" and access[-1]["status"] == 202
    assert {"time", "level", "logger", "message"} <= access[-1].keys()
    job_lines = [line for line in json_lines(worker_log) if line.get("job_id") == extraction.id]
    assert job_lines, "no worker log line carries the extraction's id"
    for log in (web_log, worker_log):
        assert token not in log.read_text(errors="replace")


# --- Who may read /metrics (in-process) ----------------------------------------------------------


@pytest.mark.django_db
def test_metrics_access(client, reader, model_admin, client_for, settings):
    settings.METRICS_TOKEN = METRICS_TOKEN
    anonymous = client.get("/metrics")
    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert anonymous.json()["error"]["code"] == "UNAUTHENTICATED"
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-the-metrics-token-at-all")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "UNAUTHENTICATED"
    scraper = client.get(
        "/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}", HTTP_ACCEPT="application/openmetrics-text"
    )
    assert scraper.status_code == 200 and b"mistudio_up" in scraper.content
    assert scraper["Cache-Control"] == "no-store"
    forbidden = client_for(reader).get("/metrics")
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "PERMISSION_DENIED"
    assert client_for(model_admin).get("/metrics").status_code == 200
    staff = get_user_model().objects.create_user(
        username="sam-staff", password="staff-password", is_staff=True
    )
    client.force_login(staff)
    assert client.get("/metrics").status_code == 200


@pytest.mark.django_db
def test_metrics_token_unset_means_only_users(client, settings):
    settings.METRICS_TOKEN = None
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer anything-at-all-here").status_code == 401


# --- Request ids and log lines -------------------------------------------------------------------


@pytest.fixture
def json_log():
    """The root logger's records as this project's JSON console handler writes them."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(LogContextFilter())
    root = logging.getLogger()
    root.addHandler(handler)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    root.removeHandler(handler)


@pytest.mark.django_db
def test_request_id_is_taken_or_made_returned_and_logged(client, json_log):
    given = client.get("/healthz", HTTP_X_REQUEST_ID="trace-42.a:b")
    assert given["X-Request-ID"] == "trace-42.a:b"
    made = client.get("/healthz")
    assert len(made["X-Request-ID"]) == 32 and made["X-Request-ID"] != given["X-Request-ID"]
    unacceptable = client.get("/healthz", HTTP_X_REQUEST_ID="two words\nand a newline")
    assert (
        unacceptable["X-Request-ID"] != "two words\nand a newline" and len(unacceptable["X-Request-ID"]) == 32
    )
    # Django logs a 4xx after the middleware returned: the line still carries the request id.
    missing = client.get("/api/no-such-thing", HTTP_X_REQUEST_ID="trace-404")
    assert missing.status_code in (401, 404) and missing["X-Request-ID"] == "trace-404"

    lines = json_log()
    access = [line for line in lines if line["logger"] == "mistudio.requests"]
    assert access[0]["request_id"] == "trace-42.a:b" and access[0]["message"] == "GET /healthz 200"
    assert access[0]["path"] == "/healthz" and access[0]["status"] == 200 and access[0]["duration_ms"] >= 0
    assert access[1]["request_id"] == made["X-Request-ID"]
    logged_after = [line for line in lines if line["logger"] == "django.request"]
    assert logged_after and logged_after[-1]["request_id"] == "trace-404"
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    assert all("job_id" not in line for line in lines)


@pytest.mark.django_db
def test_no_credential_reaches_a_log_line(client, reader, json_log, settings):
    settings.HF_TOKEN = "hf_" + "s3cr3t" * 6
    api_key = reader.auth_token.key
    client.get("/api/no-such-endpoint", HTTP_AUTHORIZATION=f"Token {api_key}")
    client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {api_key}")
    logger = logging.getLogger("mistudio.tests")
    logger.warning("hub said no to Authorization: Bearer %s", settings.HF_TOKEN)
    logger.warning("retrying with token %s", settings.HF_TOKEN)
    try:
        raise RuntimeError(f"header was Token {api_key}")
    except RuntimeError:
        logger.exception("failed")

    # A record with the request attached (as django.request logs it) writes none of its headers.
    request = RequestFactory().get(
        "/x", HTTP_AUTHORIZATION=f"Token {api_key}", HTTP_COOKIE="sessionid=abc123"
    )
    logger.error("Forbidden: /x", extra={"request": request, "status_code": 403})

    written = json.dumps(json_log())
    assert api_key not in written and settings.HF_TOKEN not in written and "sessionid" not in written
    assert written.count("[redacted]") >= 3

    plain = PlainFormatter().format(
        logging.LogRecord("x", logging.INFO, __file__, 1, "token %s", (settings.HF_TOKEN,), None)
    )
    assert settings.HF_TOKEN not in plain and "[redacted]" in plain
    assert redact("token authentication failed") == "token authentication failed"  # words stay


def test_explainer_keys_and_credential_shaped_text_are_redacted(settings, monkeypatch):
    """The key of every configured explainer endpoint is a secret like HF_TOKEN; and text shaped
    like a key (OpenAI's ``sk-…``, ``api_key=…``, this workbench's job tokens) is redacted even when
    no setting names it."""
    from mistudio.structured_logging import configured_secrets

    key = "explainer-key-5f1b2c9d7e"
    monkeypatch.setenv("PAID_EXPLAINER_KEY", key)
    settings.EXPLAINER_ENDPOINTS = {
        "paid": {"url": "https://example.invalid/v1", "key_env": "PAID_EXPLAINER_KEY", "context_tokens": 4096}
    }
    assert key in configured_secrets()
    assert key not in redact(f"The endpoint answered 401: bad key {key}")
    for text, secret in [
        ("Incorrect API key provided: sk-proj-abcdefghijklmnop1234.", "sk-proj-abcdefghijklmnop1234"),
        ("request failed, api_key=ZXhhbXBsZWtleXZhbHVl", "ZXhhbXBsZWtleXZhbHVl"),
        ("sent Authorization with mistudio-job..eJyrVkrOz0nJLFayUkjNyc_LV6oFAE9oBqk:1vKx", "eJyrVkrOz0nJ"),
    ]:
        assert secret not in redact(text) and "[redacted]" in redact(text), text
    for words in ("api key authentication failed", "the api_key: was empty", "task-management"):
        assert redact(words) == words


def test_job_id_is_on_records_logged_during_a_job():
    from mistudio.structured_logging import job_context

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(LogContextFilter())
    logger = logging.getLogger("mistudio.tests.jobs")
    logger.addHandler(handler)
    try:
        with job_context(job_id="extract-ext_123"):
            logger.warning("inside")
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["job_id"] == "extract-ext_123" and "job_id" not in outside


# --- CORS --------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_cors_headers_only_for_a_configured_origin(client, reader, settings):
    token = f"Token {reader.auth_token.key}"
    preflight = {
        "HTTP_ORIGIN": "https://notebook.example.org",
        "HTTP_ACCESS_CONTROL_REQUEST_METHOD": "GET",
        "HTTP_ACCESS_CONTROL_REQUEST_HEADERS": "authorization",
    }
    assert "Access-Control-Allow-Origin" not in client.options("/api/models", **preflight)  # none by default

    settings.CORS_ALLOWED_ORIGINS = ["https://notebook.example.org"]
    allowed = client.options("/api/models", **preflight)
    assert allowed["Access-Control-Allow-Origin"] == "https://notebook.example.org"
    assert "authorization" in allowed["Access-Control-Allow-Headers"]
    actual = client.get("/api/models", HTTP_ORIGIN="https://notebook.example.org", HTTP_AUTHORIZATION=token)
    assert actual.status_code == 200
    assert actual["Access-Control-Allow-Origin"] == "https://notebook.example.org"
    assert "x-request-id" in actual["Access-Control-Expose-Headers"].lower()

    other = client.get("/api/models", HTTP_ORIGIN="https://evil.example.com", HTTP_AUTHORIZATION=token)
    assert other.status_code == 200 and "Access-Control-Allow-Origin" not in other
    other_preflight = client.options(
        "/api/models", **{**preflight, "HTTP_ORIGIN": "https://evil.example.com"}
    )
    assert "Access-Control-Allow-Origin" not in other_preflight
    page = client.get("/healthz", HTTP_ORIGIN="https://notebook.example.org")
    assert "Access-Control-Allow-Origin" not in page  # the APIs only
