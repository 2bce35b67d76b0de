"""The one JSON shape of a SAEBench run and of a result: the API, events and snapshots show these."""

from typing import Any

from rest_framework import serializers

from activations.models import Dataset
from evaluations.models import BenchResult, BenchRun
from mistudio.access import AUDIENCE, linked_id
from mistudio.serializers import JobOutputSerializer, OutputSerializer
from saes.models import SaeGroup, SparseAutoencoder


def iso(value) -> str | None:
    return value.isoformat() if value else None


def bench_state(run: BenchRun, *, viewer=AUDIENCE) -> dict[str, Any]:
    """A run as ``GET /api/saebench/{id}`` shows it to ``viewer``: the ids of its SAEs, group and
    datasets only where they may see those rows (None in their place otherwise)."""
    return {
        "id": run.id,
        "name": run.name,
        "model_id": run.model_id,
        "group_id": linked_id(viewer, run, SaeGroup, run.group_id),
        "sae_ids": [linked_id(viewer, run, SparseAutoencoder, sae_id) for sae_id in run.saes],
        "methods": run.methods,
        "dataset_id": linked_id(viewer, run, Dataset, run.dataset_id),
        "probing_dataset_id": linked_id(viewer, run, Dataset, run.probing_dataset_id),
        "config": run.config,
        "summary": run.summary,
        "status": run.status,
        "progress": run.progress,
        "eta_seconds": run.eta_seconds,
        "memory_estimate_bytes": run.memory_estimate_bytes,
        "host_worker": run.host_worker,
        "error_code": run.error_code,
        "error_message": run.error_message,
        "owner": run.owner.username if run.owner_id else None,
        "shared": run.shared,
        "created_at": iso(run.created_at),
        "started_at": iso(run.started_at),
        "finished_at": iso(run.finished_at),
    }


def bench_event_state(run: BenchRun) -> dict[str, Any]:
    return bench_state(run)


def result_state(result: BenchResult) -> dict[str, Any]:
    """A result as ``GET /api/saebench/{id}/results`` lists it (the caller may see its SAE)."""
    return {
        "run_id": result.run_id,
        "sae_id": result.sae_id,
        "method": result.method,
        "method_version": result.method_version,
        "metrics": result.metrics,
        "details": result.details,
        "seconds": result.seconds,
        "created_at": iso(result.created_at),
    }


class BenchOutputSerializer(JobOutputSerializer):
    """:func:`bench_state`."""

    id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    model_id = serializers.CharField(allow_null=True)
    group_id = serializers.CharField(allow_null=True)
    sae_ids = serializers.ListField(
        child=serializers.CharField(allow_null=True), help_text="None where the caller may not see it"
    )
    methods = serializers.ListField(child=serializers.CharField())
    dataset_id = serializers.CharField(allow_null=True)
    probing_dataset_id = serializers.CharField(allow_null=True)
    config = serializers.DictField(help_text="Each method's settings, by method")
    summary = serializers.DictField()
    eta_seconds = serializers.FloatField(allow_null=True)
    memory_estimate_bytes = serializers.IntegerField()


class BenchEstimateSerializer(serializers.Serializer):
    """What ``POST /api/saebench`` with ``estimate_only`` answers: the run it would queue."""

    methods = serializers.ListField(child=serializers.CharField())
    config = serializers.DictField(
        help_text="Each method's settings; absorption's plan: words, prompts, tokens, seconds"
    )
    tokens = serializers.IntegerField(help_text="Tokens the model would read")
    memory_estimate_bytes = serializers.IntegerField()


class BenchListOutputSerializer(OutputSerializer):
    runs = BenchOutputSerializer(many=True)
    total = serializers.IntegerField()


class ResultOutputSerializer(OutputSerializer):
    run_id = serializers.CharField()
    sae_id = serializers.CharField()
    method = serializers.CharField()
    method_version = serializers.CharField()
    metrics = serializers.DictField(help_text="SAEBench's metrics by category")
    details = serializers.DictField()
    seconds = serializers.FloatField()
    created_at = serializers.CharField()


class ResultListOutputSerializer(OutputSerializer):
    results = ResultOutputSerializer(many=True)


class ComparisonOutputSerializer(OutputSerializer):
    """``GET /api/saebench/compare``: every method's columns, and a row per SAE with the newest value
    of each (null where no result has it) and the run each method's values came from."""

    columns = serializers.ListField(child=serializers.DictField())
    rows = serializers.ListField(child=serializers.DictField())


class SaeBenchJsonOutputSerializer(OutputSerializer):
    """SAEBench's results JSON of one SAE and one method (its ``BaseEvalOutput`` fields)."""

    eval_type_id = serializers.CharField(help_text="core, sparse_probing, absorption_first_letter")
    eval_config = serializers.DictField()
    eval_id = serializers.CharField(help_text="The run's id")
    datetime_epoch_millis = serializers.IntegerField()
    eval_result_metrics = serializers.DictField(help_text="The metrics by category")
    eval_result_details = serializers.ListField(
        child=serializers.DictField(), help_text="Per feature / dataset"
    )
    sae_bench_commit_hash = serializers.CharField()
    sae_lens_id = serializers.CharField()
    sae_lens_release_id = serializers.CharField()
    sae_lens_version = serializers.CharField(allow_null=True)
    sae_cfg_dict = serializers.DictField(help_text="The SAE's SAELens cfg.json")
    eval_result_unstructured = serializers.DictField(allow_null=True)
