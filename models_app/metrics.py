"""Prometheus metrics of model rows, read at scrape time (registered with ``mistudio.metrics``)."""

from prometheus_client.core import GaugeMetricFamily, Metric

from mistudio.metrics import LOAD_BUCKETS, histogram_from_rows, status_counts
from models_app.models import LanguageModel


def database_metrics() -> list[Metric]:
    models = GaugeMetricFamily("mistudio_models", "Model rows by status.", labels=["status"])
    for status, count in status_counts(LanguageModel.objects.all(), LanguageModel.Status.values).items():
        models.add_metric([status], count)
    load_duration = histogram_from_rows(
        name="mistudio_model_load_duration_seconds",
        documentation="Duration of each model's last load.",
        rows=LanguageModel.objects.exclude(load_time_seconds=None),
        field="load_time_seconds",
        bounds=LOAD_BUCKETS,
    )
    return [models, load_duration]


def model_names(model_ids: list[str]) -> dict[str, str]:
    """The names of the models ``model_ids`` (a worker's loaded models, labelled in its metrics)."""
    return dict(LanguageModel.objects.filter(pk__in=model_ids).values_list("pk", "name"))
