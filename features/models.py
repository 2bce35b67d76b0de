"""Feature analyses of SAEs over activation caches, the features they found, and researchers' labels."""

from django.conf import settings
from django.db import models

from mistudio.identifiers import new_analysis_id
from mistudio.jobs import JobRow


class FeatureAnalysis(JobRow):
    """One sweep of an SAE over an activation cache: per-feature statistics, examples, logit
    effects and neighbours in ``FEATURES_DIR/<id>/features.safetensors``, and a :class:`Feature`
    row per feature for listing and search. ``queued → running → completed | failed | cancelled``.
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
        return f"{self.id} ({self.sae_id} over {self.cache_id})"

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
