"""Prometheus metrics of extraction jobs and caches, read at scrape time (see ``mistudio.metrics``)."""

from django.conf import settings
from django.db.models import Count, Sum
from prometheus_client.core import GaugeMetricFamily, Metric

from activations.models import ActivationCache, ExtractionJob
from mistudio.metrics import EXTRACTION_BUCKETS, histogram_from_rows, status_counts


def database_metrics() -> list[Metric]:
    jobs = GaugeMetricFamily("mistudio_extraction_jobs", "Extraction job rows by status.", labels=["status"])
    for status, count in status_counts(ExtractionJob.objects.all(), ExtractionJob.Status.values).items():
        jobs.add_metric([status], count)
    families: list[Metric] = [jobs]
    completed_extractions = ExtractionJob.objects.filter(
        status=ExtractionJob.Status.COMPLETED, cached=False
    ).exclude(extraction_time_seconds=None)
    families.append(
        histogram_from_rows(
            name="mistudio_extraction_duration_seconds",
            documentation="Duration of completed extractions (cache hits left out).",
            rows=completed_extractions,
            field="extraction_time_seconds",
            bounds=EXTRACTION_BUCKETS,
        )
    )
    throughput = completed_extractions.order_by().aggregate(
        tokens=Sum("tokens_processed"), seconds=Sum("extraction_time_seconds")
    )
    mean_rate = GaugeMetricFamily(
        "mistudio_extraction_mean_tokens_per_second",
        "Tokens per second over all completed extractions (their tokens over their time).",
        value=(throughput["tokens"] or 0) / throughput["seconds"] if throughput["seconds"] else 0,
    )
    running = ExtractionJob.objects.filter(status=ExtractionJob.Status.RUNNING).order_by()
    running_rate = GaugeMetricFamily(
        "mistudio_extraction_running_tokens_per_second",
        "Tokens per second of the extractions running now, summed.",
        value=running.aggregate(rate=Sum("tokens_per_second"))["rate"] or 0,
    )
    tokens = GaugeMetricFamily(
        "mistudio_extraction_tokens_processed", "Tokens processed by extraction jobs, by status.",
        labels=["status"],
    )  # fmt: skip
    by_status = dict(
        ExtractionJob.objects.order_by().values_list("status").annotate(tokens=Sum("tokens_processed"))
    )
    for status in ExtractionJob.Status.values:
        tokens.add_metric([status], by_status.get(status) or 0)
    families += [mean_rate, running_rate, tokens]

    caches = GaugeMetricFamily(
        "mistudio_activation_caches", "Activation caches by status.", labels=["status"]
    )
    cache_bytes = GaugeMetricFamily(
        "mistudio_activation_cache_bytes", "Bytes on disk of the activation caches, by status.",
        labels=["status"],
    )  # fmt: skip
    rows = dict.fromkeys(ActivationCache.Status.values, (0, 0))
    for status, count, size in (
        ActivationCache.objects.order_by()
        .values_list("status")
        .annotate(count=Count("pk"), size=Sum("file_size_bytes"))
    ):
        rows[status] = (count, size or 0)
    for status, (count, size) in rows.items():
        caches.add_metric([status], count)
        cache_bytes.add_metric([status], size)
    budget = GaugeMetricFamily(
        "mistudio_activation_cache_budget_bytes",
        "ACTIVATION_CACHE_MAX_BYTES: the size eviction keeps the caches under.",
        value=settings.ACTIVATION_CACHE_MAX_BYTES,
    )
    families += [caches, cache_bytes, budget]
    return families
