"""What the activations API answers: its rows (datasets, extraction jobs, caches: model serializers
that render them) and its other bodies (described for the schema, which must describe every body)."""

from rest_framework import serializers

from activations.models import ActivationCache, Dataset, ExtractionJob
from mistudio.serializers import OutputSerializer


class DatasetSamplesOutputSerializer(OutputSerializer):
    """``GET /api/datasets/{id}/samples``: a page of a dataset's texts."""

    dataset_id = serializers.CharField()
    offset = serializers.IntegerField()
    samples = serializers.ListField(child=serializers.CharField(allow_blank=True))
    total = serializers.IntegerField(help_text="The dataset's sample count")


class HookPointOutputSerializer(OutputSerializer):
    name = serializers.CharField()
    layer = serializers.IntegerField(allow_null=True)
    shape = serializers.ListField(
        child=serializers.JSONField(), help_text='["n_tokens", width]: one sample of n tokens'
    )


class HookPointsOutputSerializer(OutputSerializer):
    """``activations.selectors.hook_points``."""

    model_id = serializers.CharField()
    num_layers = serializers.IntegerField(allow_null=True)
    hook_points = HookPointOutputSerializer(many=True)
    also_accepted = serializers.ListField(child=serializers.CharField())


class TokenOutputSerializer(OutputSerializer):
    id = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)


class TokenizeOutputSerializer(OutputSerializer):
    """``POST /api/models/{id}/tokenize``: each text's tokens, and how many."""

    tokens = serializers.ListField(child=TokenOutputSerializer(many=True))
    counts = serializers.ListField(child=serializers.IntegerField())


class CacheSliceOutputSerializer(OutputSerializer):
    """A slice of a cache as JSON (``activations.selectors.json_rows``): NaN and ±inf as null."""

    hook = serializers.CharField()
    start = serializers.IntegerField()
    stop = serializers.IntegerField()
    shape = serializers.ListField(child=serializers.IntegerField())
    values = serializers.ListField(child=serializers.ListField(child=serializers.FloatField(allow_null=True)))


class CacheStatsOutputSerializer(OutputSerializer):
    """``activations.selectors.cache_stats``: per hook, its statistics by name."""

    cache_id = serializers.CharField()
    stats = serializers.DictField(child=serializers.DictField())


class CacheTopKOutputSerializer(OutputSerializer):
    """``activations.selectors.cache_top_k``: the rows as the store gives them, tokens decoded."""

    cache_id = serializers.CharField()
    hook = serializers.CharField()
    neuron = serializers.IntegerField()
    top_k = serializers.ListField(child=serializers.DictField())


class DatasetOutputSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True, default=None)

    class Meta:
        model = Dataset
        fields = [
            "id",
            "name",
            "source",
            "original_name",
            "format",
            "field",
            "label_field",
            "classes",
            "sample_count",
            "size_bytes",
            "content_hash",
            "preview",
            "shared",
            "owner",
            "created_at",
        ]


class ExtractionOutputSerializer(serializers.ModelSerializer):
    extraction_id = serializers.CharField(source="id")
    cache_id = serializers.CharField(allow_null=True)

    class Meta:
        model = ExtractionJob
        fields = [
            "extraction_id",
            "model_id",
            "dataset_id",
            "status",
            "progress",
            "samples_processed",
            "total_samples",
            "tokens_processed",
            "tokens_per_second",
            "eta_seconds",
            "hooks",
            "sample_count",
            "batch_size",
            "max_length",
            "dtype",
            "cache_id",
            "cached",
            "host_worker",
            "error_code",
            "error_message",
            "created_at",
            "started_at",
            "finished_at",
            "extraction_time_seconds",
        ]


class CacheOutputSerializer(serializers.ModelSerializer):
    """A cache from ``selectors.cache_list``: its dataset is the one shown to the requesting user."""

    dataset_id = serializers.CharField(source="shown_dataset_id", allow_null=True, read_only=True)

    class Meta:
        model = ActivationCache
        fields = [
            "id",
            "model_id",
            "dataset_id",
            "source",
            "hooks",
            "max_length",
            "dtype",
            "sample_count",
            "status",
            "file_size_bytes",
            "activation_shapes",
            "num_tokens",
            "num_samples",
            "error_code",
            "error_message",
            "created_at",
            "completed_at",
            "last_accessed_at",
        ]
