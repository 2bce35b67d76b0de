"""``GET /metrics``: Prometheus text format, read from the database and Redis at scrape time.

Web and workers are separate processes, possibly on separate machines, so nothing is counted in
process memory (no ``prometheus_client`` multiprocess mode): one collector reads the workers'
heartbeats and the queue lengths from Redis and the job rows from the database on every scrape.
Any web process answers the same numbers, and a restart loses none of them.

Counts of rows are gauges, not counters: deleting a model or a job row lowers them. Durations are
histograms over the rows that recorded one (a model's last load, completed non-cached extractions,
completed generations).

Access: ``Authorization: Bearer $METRICS_TOKEN`` (for the scraper), or a signed-in / token user
who is staff or ``model:admin``. Anonymous: 401 with the documented error body.
"""

import hmac
from collections.abc import Callable, Iterator

import redis
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.db import DatabaseError
from django.db.models import Count, Q, QuerySet, Sum
from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.decorators import (
    api_view,
    authentication_classes,
    content_negotiation_class,
    permission_classes,
    renderer_classes,
)
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import BasePermission
from rest_framework.renderers import JSONRenderer
from rest_framework.settings import api_settings

from mistudio import roles
from mistudio.workers import queue_lengths, read_heartbeats

# Bucket bounds in seconds, from what a tiny CPU model takes to what a large hub model takes.
LOAD_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
EXTRACTION_BUCKETS = (1, 5, 10, 30, 60, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600)
GENERATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def status_counts(rows: QuerySet, statuses: list[str]) -> dict[str, int]:
    """Rows per status, every status present (a series that vanishes at 0 breaks rate queries)."""
    counts = dict.fromkeys(statuses, 0)
    counts.update(rows.order_by().values_list("status").annotate(count=Count("pk")))
    return counts


def histogram_from_rows(
    *, name: str, documentation: str, rows: QuerySet, field: str, bounds: tuple[float, ...], scale: float = 1
) -> HistogramMetricFamily:
    """A histogram of ``field`` over ``rows`` in one query; ``field * scale`` is in the bounds' unit."""
    aggregates = {
        f"le_{index}": Count("pk", filter=Q(**{f"{field}__lte": bound / scale}))
        for index, bound in enumerate(bounds)
    }
    result = rows.order_by().aggregate(total=Count("pk"), sum=Sum(field), **aggregates)
    buckets = [(str(float(bound)), result[f"le_{index}"]) for index, bound in enumerate(bounds)]
    buckets.append(("+Inf", result["total"]))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=(result["sum"] or 0) * scale)


class MiStudioCollector(Collector):
    """Every miStudio series, read fresh on each scrape. A dependency that is down is reported in
    ``mistudio_up`` and its series are left out; the scrape itself still answers 200."""

    def describe(self) -> list[Metric]:
        return []  # registering must not touch the database; the series are known only at scrape time

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "mistudio_up", "1 when miStudio can reach the dependency.", labels=["dependency"]
        )
        try:
            yield from self.database_metrics()
            up.add_metric(["database"], 1)
        except DatabaseError:
            up.add_metric(["database"], 0)
        try:
            yield from self.redis_metrics()
            up.add_metric(["redis"], 1)
        except (redis.RedisError, OSError, RuntimeError):
            up.add_metric(["redis"], 0)
        yield up

    def redis_metrics(self) -> Iterator[Metric]:
        # Read everything before yielding anything, so a Redis error cannot leave half the series.
        beats = read_heartbeats()
        queues = queue_lengths(heartbeats=beats)
        model_ids = [entry["model_id"] for beat in beats for entry in beat.get("loaded_models", [])]
        try:
            names = _MODEL_NAMES[0](model_ids) if _MODEL_NAMES else {}
        except DatabaseError:
            names = {}

        worker_labels = ["worker", "device"]
        live = GaugeMetricFamily(
            "mistudio_worker_up", "1 for each worker with a live heartbeat.", labels=worker_labels
        )
        total = GaugeMetricFamily(
            "mistudio_worker_memory_total_bytes", "Memory of the worker's device (GPU, or RAM for cpu).",
            labels=worker_labels,
        )  # fmt: skip
        free = GaugeMetricFamily(
            "mistudio_worker_memory_free_bytes", "Free memory of the worker's device.", labels=worker_labels
        )
        loaded = GaugeMetricFamily(
            "mistudio_worker_loaded_models", "Models loaded in the worker.", labels=worker_labels
        )
        model_memory = GaugeMetricFamily(
            "mistudio_loaded_model_memory_bytes",
            "Memory a loaded model takes in the worker that hosts it.",
            labels=[*worker_labels, "model_id", "model", "quantization"],
        )
        for beat in beats:
            labels = [beat["name"], beat["device"]]
            live.add_metric(labels, 1)
            total.add_metric(labels, beat.get("memory_total_bytes") or 0)
            free.add_metric(labels, beat.get("memory_free_bytes") or 0)
            models = beat.get("loaded_models", [])
            loaded.add_metric(labels, len(models))
            for entry in models:
                model_memory.add_metric(
                    [
                        *labels,
                        entry["model_id"],
                        names.get(entry["model_id"], ""),
                        entry.get("quantization", ""),
                    ],
                    entry.get("memory_usage_bytes") or 0,
                )
        queue_jobs = GaugeMetricFamily(
            "mistudio_queue_jobs",
            "Jobs in miStudio's RQ queues: queued (waiting), running, failed.",
            labels=["queue", "worker", "kind", "state"],
        )
        for queue in queues:
            for state in ("queued", "running", "failed"):
                queue_jobs.add_metric(
                    [queue["name"], queue["worker"] or "", queue["kind"], state], queue[state]
                )
        yield from (live, total, free, loaded, model_memory, queue_jobs)

    def database_metrics(self) -> Iterator[Metric]:
        families: list[Metric] = []
        for collect in _DATABASE_METRICS:
            families.extend(collect())
        # Yielded only once every query has answered, so a database error leaves no half set.
        yield from families


# Each app registers the metrics of its own rows (in its AppConfig.ready), so that this module
# needs none of the apps: () -> list of metric families, read from the database at scrape time.
_DATABASE_METRICS: list[Callable[[], list[Metric]]] = []


# The app that owns model rows says what each loaded model is called: (ids) -> {id: name}.
_MODEL_NAMES: list[Callable[[list[str]], dict[str, str]]] = []


def register_model_names(names: Callable[[list[str]], dict[str, str]]) -> None:
    _MODEL_NAMES[:] = [names]


def register_database_metrics(collect: Callable[[], list[Metric]]) -> None:
    if collect not in _DATABASE_METRICS:
        _DATABASE_METRICS.append(collect)


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(MiStudioCollector())

# The ``auth`` of a request that presented METRICS_TOKEN (it has no user).
METRICS_SCRAPER = "metrics-token"


class MetricsTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer $METRICS_TOKEN``; any other credential is left to the API's own."""

    def authenticate(self, request):
        expected = settings.METRICS_TOKEN
        scheme, _, credential = get_authorization_header(request).decode("latin-1").partition(" ")
        if not expected or scheme.lower() != "bearer":
            return None
        if not hmac.compare_digest(credential.strip().encode(), expected.encode()):
            return None  # perhaps an API token sent as Bearer: the next authenticator decides
        return AnonymousUser(), METRICS_SCRAPER

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="metrics"'  # makes a missing credential a 401, not a 403


class CanReadMetrics(BasePermission):
    """The metrics token, or a staff / ``model:admin`` user (the numbers cover every user's work)."""

    def has_permission(self, request, view) -> bool:
        if request.auth == METRICS_SCRAPER:
            return True
        user = request.user
        return bool(user and user.is_authenticated and (user.is_staff or user.has_perm(roles.ADMIN)))


class JsonErrorsWhateverIsAccepted(BaseContentNegotiation):
    """A scraper's ``Accept`` names Prometheus' formats; errors are still the documented JSON body."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


@extend_schema(exclude=True)  # not part of the REST API's schema
@api_view(["GET"])
@authentication_classes([MetricsTokenAuthentication, *api_settings.DEFAULT_AUTHENTICATION_CLASSES])
@permission_classes([CanReadMetrics])
@renderer_classes([JSONRenderer])
@content_negotiation_class(JsonErrorsWhateverIsAccepted)
def metrics(request):
    """The Prometheus exposition of ``MiStudioCollector``."""
    # Text format 0.0.4: what every Prometheus version reads; our names need none of 1.0.0's escaping.
    response = HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_PLAIN_0_0_4)
    response["Cache-Control"] = "no-store"
    return response
