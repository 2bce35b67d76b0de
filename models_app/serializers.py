"""What the models API answers besides a model's row (``ModelOutputSerializer``, beside its views):
for the schema, which must describe every body."""

from rest_framework import serializers

from mistudio.serializers import OutputSerializer


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
