"""Feature analyses of SAEs over activation caches, the features they found, and researchers' labels."""

from typing import ClassVar

from django.conf import settings
from django.db import models

from mistudio.identifiers import new_analysis_id, new_explanation_job_id
from mistudio.jobs import JobRow


class FeatureAnalysis(JobRow):
    """One sweep of an SAE over an activation cache, or over a dataset read straight through the
    model (``dataset`` and ``reading``: no cache written, the rows computed as an extraction would
    store them): per-feature statistics, examples, logit effects and neighbours in
    ``FEATURES_DIR/<id>/features.safetensors``, and a :class:`Feature` row per feature for listing
    and search. ``queued → running → completed | failed | cancelled``.
    """

    kind = "analysis"
    task = "features.tasks.run_feature_analysis"
    noun = "analysis"
    failure_code = "ANALYSIS_FAILED"
    OWNER_FIELDS = ("shared",)

    id = models.CharField(primary_key=True, max_length=64, default=new_analysis_id, editable=False)
    sae = models.ForeignKey("saes.SparseAutoencoder", on_delete=models.CASCADE, related_name="analyses")
    cache = models.ForeignKey(
        "activations.ActivationCache",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="analyses",
    )
    dataset = models.ForeignKey(
        "activations.Dataset",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="analyses",
        help_text="Read through the SAE's model (no cache): its samples, tokenized as ``reading`` says",
    )
    reading = models.JSONField(
        default=dict, blank=True, help_text="From the model: sample_count, max_length, batch_size, dtype"
    )
    config = models.JSONField(default=dict, blank=True, help_text="engine.features.AnalysisConfig")
    phase = models.PositiveSmallIntegerField(default=0, help_text="Pass 1-3 of the sweep, 4 when done")
    tokens = models.BigIntegerField(default=0)
    tokens_per_second = models.FloatField(null=True, blank=True)
    summary = models.JSONField(default=dict, blank=True, help_text="Dead features, timings, notes")
    file_size_bytes = models.BigIntegerField(default=0)
    shared = models.BooleanField(
        default=False,
        help_text="Visible, with its examples of the cache's text, to every reader who may see the SAE",
    )

    class Meta(JobRow.Meta):
        verbose_name_plural = "feature analyses"

    def __str__(self) -> str:
        return f"{self.id} ({self.sae_id} over {self.cache_id or self.dataset_id})"

    @property
    def source(self) -> str:
        """``cache`` (activations read from disk) or ``model`` (a dataset read through the model)."""
        return "model" if self.reading else "cache"

    def event_groups(self) -> list[str]:
        return [f"analysis.{self.id}", f"sae.{self.sae_id}"]

    @property
    def directory(self):
        return settings.FEATURES_DIR / self.id

    @property
    def data_path(self):
        return self.directory / "features.safetensors"

    @property
    def state_directory(self):
        """The resumable sweep's state while it runs."""
        return self.directory / "state"

    def mark_running(self, *, host_worker: str, tokens: int = 0) -> list[str]:
        self.tokens = tokens
        return [*super().mark_running(host_worker=host_worker), "tokens"]

    def mark_progress(self, *, phase: int, fraction: float, tokens_per_second: float) -> list[str]:
        self.phase = phase
        self.progress = round(100 * fraction, 2)
        self.tokens_per_second = round(tokens_per_second, 1)
        remaining = (1 - fraction) * 2.25 * self.tokens  # passes 1 and 2 whole, pass 3 about a quarter
        self.eta_seconds = round(remaining / tokens_per_second, 1) if tokens_per_second > 0 else None
        return ["phase", "progress", "tokens_per_second", "eta_seconds"]

    def mark_completed(self, *, summary: dict, file_size_bytes: int) -> list[str]:
        self.phase, self.summary, self.file_size_bytes = 4, summary, file_size_bytes
        return [*super().mark_completed(), "phase", "summary", "file_size_bytes"]


class Feature(models.Model):
    """One feature as an analysis found it: what the feature list filters, sorts and searches.
    Its dashboard data (examples, histograms, logit effects) stays in the analysis's file."""

    analysis = models.ForeignKey(FeatureAnalysis, on_delete=models.CASCADE, related_name="features")
    index = models.PositiveIntegerField()
    density = models.FloatField(help_text="Fraction of the cache's tokens it fires on")
    max_activation = models.FloatField()
    mean_activation = models.FloatField(help_text="Mean of its non-zero values")
    auto_label = models.CharField(max_length=200, blank=True, help_text="Its most frequent top tokens")
    # "|tok|tok|…|": the distinct activating tokens of its top examples, stripped and lower-cased,
    # so that a token search is one indexed-free LIKE on this row.
    top_tokens = models.TextField(blank=True)

    class Meta:
        ordering = ["analysis", "index"]
        constraints = [models.UniqueConstraint(fields=["analysis", "index"], name="feature_unique_index")]
        indexes = [
            models.Index(fields=["analysis", "density"]),
            models.Index(fields=["analysis", "max_activation"]),
        ]

    def __str__(self) -> str:
        return f"{self.analysis_id}[{self.index}]"

    @property
    def dead(self) -> bool:
        return self.density == 0


class FeatureLabel(models.Model):
    """A researcher's label and notes on one feature of an SAE (not of an analysis: a label stays
    when the SAE is analysed again). One per owner and feature; ``shared`` shows it to others."""

    OWNER_FIELDS = ("label", "notes", "shared")
    OWNER_DELETED = "delete"  # one's own notes: they go with their author (mistudio.access)

    sae = models.ForeignKey("saes.SparseAutoencoder", on_delete=models.CASCADE, related_name="feature_labels")
    index = models.PositiveIntegerField()
    label = models.CharField(max_length=200, blank=True)
    notes = models.TextField(blank=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    shared = models.BooleanField(default=False, help_text="Visible to every reader who may see the SAE")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["sae", "index", "-updated_at"]
        constraints = [
            models.UniqueConstraint(fields=["sae", "index", "owner"], name="feature_label_one_per_owner")
        ]

    def __str__(self) -> str:
        return f"{self.sae_id}[{self.index}]: {self.label}"


class ExplanationJob(JobRow):
    """Automatic interpretation of some features of one analysis: an explainer model (any
    OpenAI-compatible chat endpoint) names each feature from its examples, then a scorer model
    scores the explanation on held-out examples (detection and fuzzing, as delphi defines them).
    One :class:`Explanation` row per feature. ``queued → running → completed | failed | cancelled``;
    a feature that fails is recorded as such and the job goes on."""

    kind = "explanation"
    task = "features.explanation_tasks.run_explanation_job"
    noun = "explanation job"
    failure_code = "EXPLANATION_FAILED"
    OWNER_FIELDS = ("shared",)

    id = models.CharField(primary_key=True, max_length=64, default=new_explanation_job_id, editable=False)
    analysis = models.ForeignKey(FeatureAnalysis, on_delete=models.CASCADE, related_name="explanation_jobs")
    endpoint = models.CharField(
        max_length=64, default="local", help_text="'local' (this /v1) or a configured name"
    )
    explainer_model = models.CharField(max_length=200, help_text="The model name the endpoint serves")
    scorer_model = models.CharField(max_length=200)
    selection = models.JSONField(default=dict, blank=True, help_text="How the features were chosen")
    indices = models.JSONField(default=list, blank=True, help_text="The features to explain, in order")
    config = models.JSONField(default=dict, blank=True, help_text="engine.autointerp.InterpretationConfig")
    estimate = models.JSONField(
        default=dict, blank=True, help_text="Requests and prompt tokens, before it ran"
    )
    features_done = models.PositiveIntegerField(default=0)
    features_failed = models.PositiveIntegerField(default=0)
    requests_sent = models.PositiveIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    features_per_minute = models.FloatField(null=True, blank=True)
    summary = models.JSONField(default=dict, blank=True, help_text="Score distributions, failures, notes")
    shared = models.BooleanField(
        default=False, help_text="Visible to every reader who may see the analysis (its text is the cache's)"
    )

    def __str__(self) -> str:
        return f"{self.id} ({len(self.indices)} features of {self.analysis_id})"

    def event_groups(self) -> list[str]:
        return [f"explanation.{self.id}", f"analysis.{self.analysis_id}"]

    def mark_progress(self, *, done: int, failed: int, usage: dict[str, int], per_minute: float) -> list[str]:
        self.features_done, self.features_failed = done, failed
        self.requests_sent = usage.get("requests", 0)
        self.prompt_tokens, self.completion_tokens = (
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", 0),
        )
        self.features_per_minute = round(per_minute, 2)
        total = max(1, len(self.indices))
        self.progress = round(100 * done / total, 2)
        self.eta_seconds = round((total - done) / per_minute * 60, 1) if per_minute > 0 else None
        return [
            "features_done", "features_failed", "requests_sent", "prompt_tokens", "completion_tokens",
            "features_per_minute", "progress", "eta_seconds",
        ]  # fmt: skip

    def mark_completed(self, *, summary: dict) -> list[str]:
        self.summary = summary
        return [*super().mark_completed(), "summary"]


class Explanation(models.Model):
    """One feature's explanation from one job, with its scores on held-out examples. Visible where
    its job is (it is written from the cache's text)."""

    job = models.ForeignKey(ExplanationJob, on_delete=models.CASCADE, related_name="explanations")
    analysis = models.ForeignKey(FeatureAnalysis, on_delete=models.CASCADE, related_name="explanations")
    index = models.PositiveIntegerField()
    text = models.CharField(max_length=500, blank=True)
    explainer_model = models.CharField(max_length=200)
    scorer_model = models.CharField(max_length=200)
    prompt_version = models.CharField(max_length=50)
    prompt = models.JSONField(default=list, blank=True, help_text="The messages the explainer was sent")
    detection = models.FloatField(null=True, blank=True, help_text="Balanced accuracy, delphi's detection")
    fuzzing = models.FloatField(null=True, blank=True, help_text="Balanced accuracy, delphi's fuzzing")
    intruder = models.FloatField(null=True, blank=True, help_text="Intruders found, delphi's intruder scorer")
    embedding = models.FloatField(null=True, blank=True, help_text="ROC AUC, delphi's embedding scorer")
    simulation = models.FloatField(
        null=True, blank=True, help_text="Correlation of simulated and true values, delphi's simulator"
    )
    score = models.FloatField(null=True, blank=True, help_text="Mean of the scores it has")
    scoring = models.JSONField(default=dict, blank=True, help_text="Per scorer: counts, failed prompts")
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    # The scorers (engine.autointerp.scoring) with a column of their own, and that column; every
    # scorer's counts are in ``scoring``; the classifiers' balanced accuracies make ``score``.
    SCORE_COLUMNS: ClassVar[dict[str, str]] = {
        "detection": "detection",
        "fuzzing": "fuzzing",
        "intruder": "intruder",
        "embedding": "embedding",
        "simulation": "simulation",
    }

    class Meta:
        ordering = ["analysis", "index", "-created_at"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="explanation_one_per_job")]
        indexes = [models.Index(fields=["analysis", "index"]), models.Index(fields=["analysis", "score"])]

    def __str__(self) -> str:
        return f"{self.analysis_id}[{self.index}]: {self.text[:40]}"
