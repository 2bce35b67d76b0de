"""What the activations API answers besides its rows (datasets, caches and extraction jobs, whose
model serializers live beside their views): for the schema, which must describe every body."""

from rest_framework import serializers

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
