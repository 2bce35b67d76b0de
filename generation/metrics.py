"""Prometheus metrics of generation rows, read at scrape time (registered with ``mistudio.metrics``)."""

from django.db.models import Sum
from prometheus_client.core import GaugeMetricFamily, Metric

from generation.models import Generation
from mistudio.metrics import GENERATION_BUCKETS, histogram_from_rows, status_counts


def database_metrics() -> list[Metric]:
    generations = GaugeMetricFamily("mistudio_generations", "Generation rows by status.", labels=["status"])
    for status, count in status_counts(Generation.objects.all(), Generation.Status.values).items():
        generations.add_metric([status], count)
    completed = Generation.objects.filter(status=Generation.Status.COMPLETED).exclude(total_ms=None)
    duration = histogram_from_rows(
        name="mistudio_generation_duration_seconds",
        documentation="Duration of completed generations, worker start to last token.",
        rows=completed,
        field="total_ms",
        bounds=GENERATION_BUCKETS,
        scale=0.001,
    )
    usage = completed.order_by().aggregate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    tokens = GaugeMetricFamily(
        "mistudio_generation_tokens", "Tokens of completed generations.", labels=["kind"]
    )
    tokens.add_metric(["prompt"], usage["prompt"] or 0)
    tokens.add_metric(["completion"], usage["completion"] or 0)
    return [generations, duration, tokens]
