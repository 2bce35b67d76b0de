"""What the models API answers: a model's row (a model serializer that renders it) and its other
bodies (described for the schema, which must describe every body)."""

from rest_framework import serializers

from mistudio.serializers import OutputSerializer
from models_app.models import LanguageModel


class ModelOutputSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True, default=None)
    identifier = serializers.CharField(source="display_identifier", read_only=True)

    class Meta:
        model = LanguageModel
        fields = [
            "id", "name", "model_type", "architecture", "source", "identifier", "revision", "commit_sha",
            "config", "quantization", "status", "progress", "stage", "status_message",
            "download_bytes_done", "download_bytes_total", "memory_usage_bytes", "memory_by_device",
            "memory_estimates",
            "load_time_seconds", "parameter_count", "hidden_size", "num_layers", "vocab_size",
            "context_length", "pinned", "shared", "owner", "keep_alive_seconds", "host_worker",
            "unload_reason", "rq_job_id", "error_code", "error_message", "error_details", "created_at",
            "loaded_at", "last_used_at", "updated_at",
        ]  # fmt: skip


class MemoryEstimateOutputSerializer(OutputSerializer):
    bytes = serializers.IntegerField()
    gb = serializers.FloatField()


class WorkerFitOutputSerializer(OutputSerializer):
    """Whether each quantization of the model fits one live worker (evicting unpinned models)."""

    name = serializers.CharField()
    device = serializers.CharField()
    memory_free_bytes = serializers.IntegerField(allow_null=True)
    capacity_bytes = serializers.IntegerField(allow_null=True)
    splits_models = serializers.BooleanField()
    fits = serializers.DictField(child=serializers.BooleanField())


class MemoryReportOutputSerializer(OutputSerializer):
    """``models_app.selectors.model_memory_report``."""

    model_id = serializers.CharField()
    parameter_count = serializers.IntegerField(allow_null=True)
    estimates = serializers.DictField(child=MemoryEstimateOutputSerializer())
    workers = WorkerFitOutputSerializer(many=True)


class ServiceStatusOutputSerializer(OutputSerializer):
    """Redis' or the database's: reachable or not (``error`` says why not)."""

    ok = serializers.BooleanField()
    vendor = serializers.CharField(required=False)
    error = serializers.CharField(required=False)


class QueueOutputSerializer(OutputSerializer):
    name = serializers.CharField()
    worker = serializers.CharField(allow_null=True)
    kind = serializers.CharField(help_text="shared, worker or interactive")
    worker_alive = serializers.BooleanField()
    queued = serializers.IntegerField()
    running = serializers.IntegerField()
    failed = serializers.IntegerField()


class WorkerOverviewOutputSerializer(OutputSerializer):
    """``models_app.selectors.worker_overview``: each worker as its heartbeat says, loaded models
    the caller may not see summed in ``other_models_bytes``."""

    redis = ServiceStatusOutputSerializer()
    database = ServiceStatusOutputSerializer()
    workers = serializers.ListField(child=serializers.DictField())
    queues = QueueOutputSerializer(many=True)
    server_time = serializers.FloatField(help_text="Seconds since the epoch: the clock of heartbeat ages")
