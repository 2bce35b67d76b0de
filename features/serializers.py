"""The one JSON shape of each row: the API, events and WebSocket snapshots use these."""

from typing import Any

from rest_framework import serializers

from activations.models import ActivationCache, Dataset
from features.models import Explanation, ExplanationJob, Feature, FeatureAnalysis, FeatureLabel
from mistudio.access import AUDIENCE, linked_id
from mistudio.serializers import JobOutputSerializer, OutputSerializer


def iso(value) -> str | None:
    return value.isoformat() if value else None


def analysis_state(analysis: FeatureAnalysis, *, viewer=AUDIENCE) -> dict[str, Any]:
    """An analysis as ``GET /api/saes/{id}/analyses/{aid}``, ``analysis:*`` events and snapshots show
    it to ``viewer`` (an event's: everyone it reaches): the id of the cache or the dataset it read
    only if they may see that row. ``source``: ``cache``, or ``model`` (the dataset read through the
    model as ``reading`` says, no cache written)."""
    return {
        "id": analysis.id,
        "sae_id": analysis.sae_id,
        "source": analysis.source,
        "cache_id": linked_id(viewer, analysis, ActivationCache, analysis.cache_id),
        "dataset_id": linked_id(viewer, analysis, Dataset, analysis.dataset_id),
        "reading": analysis.reading,
        "config": analysis.config,
        "status": analysis.status,
        "phase": analysis.phase,
        "progress": analysis.progress,
        "tokens": analysis.tokens,
        "tokens_per_second": analysis.tokens_per_second,
        "eta_seconds": analysis.eta_seconds,
        "summary": analysis.summary,
        "file_size_bytes": analysis.file_size_bytes,
        "memory_estimate_bytes": analysis.memory_estimate_bytes,
        "host_worker": analysis.host_worker,
        "error_code": analysis.error_code,
        "error_message": analysis.error_message,
        "owner": analysis.owner.username if analysis.owner_id else None,
        "shared": analysis.shared,
        "created_at": iso(analysis.created_at),
        "started_at": iso(analysis.started_at),
        "finished_at": iso(analysis.finished_at),
    }


def label_state(label: FeatureLabel | None) -> dict[str, Any] | None:
    if label is None:
        return None
    return {
        "label": label.label,
        "notes": label.notes,
        "owner": label.owner.username if label.owner_id else None,
        "shared": label.shared,
        "updated_at": iso(label.updated_at),
    }


def feature_summary(feature: Feature, label: FeatureLabel | None = None) -> dict[str, Any]:
    """A feature as the feature list shows it."""
    return {
        "index": feature.index,
        "density": feature.density,
        "max_activation": feature.max_activation,
        "mean_activation": feature.mean_activation,
        "dead": feature.dead,
        "auto_label": feature.auto_label,
        "label": label_state(label),
    }


def explanation_job_state(job: ExplanationJob, *, viewer=AUDIENCE) -> dict[str, Any]:
    """An explanation job as its API, ``explanation:*`` events and snapshots show it."""
    return {
        "id": job.id,
        "analysis_id": job.analysis_id,
        "sae_id": job.analysis.sae_id,
        "endpoint": job.endpoint,
        "explainer_model": job.explainer_model,
        "scorer_model": job.scorer_model,
        "selection": job.selection,
        "features": len(job.indices),
        "config": job.config,
        "estimate": job.estimate,
        "status": job.status,
        "progress": job.progress,
        "eta_seconds": job.eta_seconds,
        "features_done": job.features_done,
        "features_failed": job.features_failed,
        # Completed, but some features were not explained: shown amber, never a plain green.
        "completed_with_failures": job.status == ExplanationJob.Status.COMPLETED and job.features_failed > 0,
        "features_per_minute": job.features_per_minute,
        "requests_sent": job.requests_sent,
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "summary": job.summary,
        "host_worker": job.host_worker,
        "error_code": job.error_code,
        "error_message": job.error_message,
        "owner": job.owner.username if job.owner_id else None,
        "shared": job.shared,
        "created_at": iso(job.created_at),
        "started_at": iso(job.started_at),
        "finished_at": iso(job.finished_at),
    }


def explanation_state(explanation: Explanation, *, prompt: bool = False) -> dict[str, Any]:
    """One feature's explanation with its scores (``prompt``: with the messages the explainer saw)."""
    state = {
        "id": explanation.id,
        "job_id": explanation.job_id,
        "index": explanation.index,
        "text": explanation.text,
        "score": explanation.score,
        **{column: getattr(explanation, column) for column in Explanation.SCORE_COLUMNS.values()},
        "scoring": explanation.scoring,
        "explainer_model": explanation.explainer_model,
        "scorer_model": explanation.scorer_model,
        "prompt_version": explanation.prompt_version,
        "error_code": explanation.error_code,
        "error_message": explanation.error_message,
        "created_at": iso(explanation.created_at),
    }
    if prompt:
        state["prompt"] = explanation.prompt
    return state


class AnalysisOutputSerializer(JobOutputSerializer):
    """:func:`analysis_state`."""

    id = serializers.CharField()
    sae_id = serializers.CharField()
    source = serializers.ChoiceField(choices=["cache", "model"])
    cache_id = serializers.CharField(allow_null=True)
    dataset_id = serializers.CharField(allow_null=True)
    reading = serializers.DictField()
    config = serializers.DictField()
    phase = serializers.IntegerField()
    tokens = serializers.IntegerField()
    tokens_per_second = serializers.FloatField(allow_null=True)
    eta_seconds = serializers.FloatField(allow_null=True)
    summary = serializers.DictField()
    file_size_bytes = serializers.IntegerField()
    memory_estimate_bytes = serializers.IntegerField()


class LabelOutputSerializer(OutputSerializer):
    """:func:`label_state`."""

    label = serializers.CharField(allow_blank=True)
    notes = serializers.CharField(allow_blank=True)
    owner = serializers.CharField(allow_null=True)
    shared = serializers.BooleanField()
    updated_at = serializers.DateTimeField(allow_null=True)


class FeatureSummaryOutputSerializer(OutputSerializer):
    """:func:`feature_summary`."""

    index = serializers.IntegerField()
    density = serializers.FloatField()
    max_activation = serializers.FloatField()
    mean_activation = serializers.FloatField()
    dead = serializers.BooleanField()
    auto_label = serializers.CharField(allow_blank=True)
    label = LabelOutputSerializer(allow_null=True)


class ExplanationJobOutputSerializer(JobOutputSerializer):
    """:func:`explanation_job_state`."""

    id = serializers.CharField()
    analysis_id = serializers.CharField()
    sae_id = serializers.CharField()
    endpoint = serializers.CharField(allow_blank=True)
    explainer_model = serializers.CharField(allow_blank=True)
    scorer_model = serializers.CharField(allow_blank=True)
    selection = serializers.DictField()
    features = serializers.IntegerField(help_text="How many features it explains")
    config = serializers.DictField()
    estimate = serializers.DictField()
    eta_seconds = serializers.FloatField(allow_null=True)
    features_done = serializers.IntegerField()
    features_failed = serializers.IntegerField()
    completed_with_failures = serializers.BooleanField()
    features_per_minute = serializers.FloatField(allow_null=True)
    requests_sent = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    summary = serializers.DictField()


class ExplanationOutputSerializer(OutputSerializer):
    """:func:`explanation_state` (``prompt`` only where asked for), with a score per scorer column
    (``Explanation.SCORE_COLUMNS``: a new scorer's column is described as it is shown)."""

    id = serializers.IntegerField()
    job_id = serializers.CharField()
    index = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)
    score = serializers.FloatField(allow_null=True)
    scoring = serializers.DictField()
    explainer_model = serializers.CharField(allow_blank=True)
    scorer_model = serializers.CharField(allow_blank=True)
    prompt_version = serializers.CharField(allow_blank=True)
    error_code = serializers.CharField(allow_blank=True)
    error_message = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField(allow_null=True)
    prompt = serializers.ListField(child=serializers.DictField(), required=False)

    def get_fields(self):
        fields = super().get_fields()
        for column in Explanation.SCORE_COLUMNS.values():
            fields[column] = serializers.FloatField(allow_null=True, read_only=True)
        return fields


class AnalysisListOutputSerializer(OutputSerializer):
    """``GET /api/saes/{id}/analyses``: the newest 200 and how many there are."""

    analyses = AnalysisOutputSerializer(many=True)
    total = serializers.IntegerField()


class BestExplanationOutputSerializer(OutputSerializer):
    """A feature's best-scored explanation the caller may see, as the feature list shows it."""

    id = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)
    score = serializers.FloatField(allow_null=True)
    explainer_model = serializers.CharField(allow_blank=True)


class FeatureRowOutputSerializer(FeatureSummaryOutputSerializer):
    explanation = BestExplanationOutputSerializer(allow_null=True)


class FeaturePageOutputSerializer(OutputSerializer):
    """``features.selectors.feature_page``."""

    analysis_id = serializers.CharField()
    total = serializers.IntegerField()
    page = serializers.IntegerField()
    page_size = serializers.IntegerField()
    features = FeatureRowOutputSerializer(many=True)


class HistogramOutputSerializer(OutputSerializer):
    counts = serializers.ListField(child=serializers.IntegerField())
    edges = serializers.ListField(child=serializers.FloatField())


class FeatureLabelOutputSerializer(LabelOutputSerializer):
    mine = serializers.BooleanField()


class FeatureDetailOutputSerializer(FeatureSummaryOutputSerializer):
    """A feature's dashboard (``features.selectors.Dashboards.detail``)."""

    sae_id = serializers.CharField()
    analysis_id = serializers.CharField()
    nonzero_count = serializers.IntegerField()
    tokens = serializers.IntegerField(help_text="The tokens the analysis read")
    histogram = HistogramOutputSerializer()
    top_examples = serializers.ListField(child=serializers.DictField())
    interval_examples = serializers.ListField(child=serializers.DictField())
    logit_effects = serializers.DictField(allow_null=True)
    similar = serializers.ListField(child=serializers.DictField())
    labels = FeatureLabelOutputSerializer(many=True)
    explanations = ExplanationOutputSerializer(many=True)


class LabelChangeOutputSerializer(OutputSerializer):
    """A feature's label after a change (null once cleared)."""

    index = serializers.IntegerField()
    label = LabelOutputSerializer(allow_null=True)


class EncodedFeatureOutputSerializer(OutputSerializer):
    index = serializers.IntegerField()
    value = serializers.FloatField()


class FeatureNamesOutputSerializer(OutputSerializer):
    auto_label = serializers.CharField(allow_blank=True)
    label = serializers.CharField(allow_blank=True)


class EncodeOutputSerializer(OutputSerializer):
    """A text's features (``features.selectors.with_feature_names``)."""

    token_ids = serializers.ListField(child=serializers.IntegerField())
    tokens = serializers.ListField(child=serializers.CharField(allow_blank=True))
    per_token = serializers.ListField(child=EncodedFeatureOutputSerializer(many=True))
    overall = serializers.ListField(child=serializers.DictField())
    analysis_id = serializers.CharField(allow_null=True)
    features = serializers.DictField(child=FeatureNamesOutputSerializer())


class SearchResultOutputSerializer(OutputSerializer):
    index = serializers.IntegerField()
    cosine = serializers.FloatField()
    source = serializers.CharField(help_text="explanation or label")
    text = serializers.CharField(allow_blank=True)
    explanation_id = serializers.IntegerField(allow_null=True)
    score = serializers.FloatField(allow_null=True)
    explainer_model = serializers.CharField(allow_null=True)
    auto_label = serializers.CharField(allow_blank=True)
    density = serializers.FloatField(allow_null=True)


class SearchOutputSerializer(OutputSerializer):
    """``features.search.feature_search``."""

    analysis_id = serializers.CharField()
    query = serializers.CharField(allow_blank=True)
    results = SearchResultOutputSerializer(many=True)


class ExplainerEndpointOutputSerializer(OutputSerializer):
    name = serializers.CharField()
    url = serializers.CharField()
    kind = serializers.CharField(help_text="local or external")
    has_key = serializers.BooleanField()
    context_tokens = serializers.IntegerField(required=False)


class ExplainersOutputSerializer(OutputSerializer):
    """``GET /api/explainers``: the endpoints a job may use and the prompts it sends."""

    endpoints = ExplainerEndpointOutputSerializer(many=True)
    prompt_version = serializers.CharField()
    templates = serializers.DictField(child=serializers.CharField())


class ExplanationJobListOutputSerializer(OutputSerializer):
    jobs = ExplanationJobOutputSerializer(many=True)
    total = serializers.IntegerField()


class RefusalOutputSerializer(OutputSerializer):
    status = serializers.IntegerField()
    code = serializers.CharField()
    message = serializers.CharField()
    details = serializers.JSONField(allow_null=True)


class ExplanationDryRunOutputSerializer(OutputSerializer):
    """A dry run's answer: what the job would cost, and whether it would be refused."""

    estimate = serializers.DictField()
    limits = serializers.DictField()
    refusal = RefusalOutputSerializer(allow_null=True)
    warnings = serializers.ListField(child=serializers.CharField())
    indices = serializers.ListField(child=serializers.IntegerField())
    config = serializers.DictField()
    prompt_version = serializers.CharField()


class ExplanationPageOutputSerializer(OutputSerializer):
    """``GET /api/saes/{id}/explanations/{job}/results``: a page of a job's explanations."""

    job_id = serializers.CharField()
    total = serializers.IntegerField()
    page = serializers.IntegerField()
    page_size = serializers.IntegerField()
    explanations = ExplanationOutputSerializer(many=True)


class FeatureExportOutputSerializer(OutputSerializer):
    """``features.exports.analysis_export_stream``: every feature in Neuronpedia-like fields."""

    schema = serializers.CharField()
    model_id = serializers.CharField(allow_blank=True, help_text="The model as the SAE's config names it")
    sae_id = serializers.CharField()
    hook_name = serializers.CharField()
    d_sae = serializers.IntegerField()
    analysis_id = serializers.CharField()
    cache_id = serializers.CharField(allow_null=True)
    tokens = serializers.IntegerField()
    features = serializers.ListField(child=serializers.DictField())
