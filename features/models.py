"""Feature analyses of SAEs over activation caches, the features they found, and researchers' labels."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from mistudio.identifiers import new_analysis_id


class FeatureAnalysis(models.Model):
    """One sweep of an SAE over an activation cache: per-feature statistics, examples, logit
    effects and neighbours in ``FEATURES_DIR/<id>/features.safetensors``, and a :class:`Feature`
    row per feature for listing and search. ``queued → running → completed | failed | cancelled``.
    """

    OWNER_FIELDS = ("shared",)

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        CANCELLED = "cancelled"

    ACTIVE = (Status.QUEUED, Status.RUNNING)

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
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED, db_index=True)
    phase = models.PositiveSmallIntegerField(default=0, help_text="Pass 1-3 of the sweep, 4 when done")
    progress = models.FloatField(default=0)
    tokens = models.BigIntegerField(default=0)
    tokens_per_second = models.FloatField(null=True, blank=True)
    eta_seconds = models.FloatField(null=True, blank=True)
    summary = models.JSONField(default=dict, blank=True, help_text="Dead features, timings, notes")
    file_size_bytes = models.BigIntegerField(default=0)
    rq_job_id = models.CharField(max_length=100, blank=True)
    host_worker = models.CharField(max_length=255, blank=True)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    shared = models.BooleanField(default=False, help_text="Visible to every reader who may see the SAE")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "feature analyses"

    def __str__(self) -> str:
        return f"{self.id} ({self.sae_id} over {self.cache_id})"

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

    def mark_running(self, *, host_worker: str, tokens: int) -> list[str]:
        self.status = self.Status.RUNNING
        self.host_worker, self.tokens = host_worker, tokens
        self.started_at = self.started_at or timezone.now()
        return ["status", "host_worker", "tokens", "started_at"]

    def mark_progress(self, *, phase: int, fraction: float, tokens_per_second: float) -> list[str]:
        self.phase = phase
        self.progress = round(100 * fraction, 2)
        self.tokens_per_second = round(tokens_per_second, 1)
        remaining = (1 - fraction) * 2.25 * self.tokens  # passes 1 and 2 whole, pass 3 about a quarter
        self.eta_seconds = round(remaining / tokens_per_second, 1) if tokens_per_second > 0 else None
        return ["phase", "progress", "tokens_per_second", "eta_seconds"]

    def mark_completed(self, *, summary: dict, file_size_bytes: int) -> list[str]:
        self.status = self.Status.COMPLETED
        self.phase, self.progress, self.eta_seconds = 4, 100, None
        self.summary, self.file_size_bytes = summary, file_size_bytes
        self.finished_at = timezone.now()
        return ["status", "phase", "progress", "eta_seconds", "summary", "file_size_bytes", "finished_at"]

    def mark_failed(self, *, code: str, message: str) -> list[str]:
        self.status = self.Status.FAILED
        self.error_code, self.error_message = code, message
        self.finished_at, self.eta_seconds = timezone.now(), None
        return ["status", "error_code", "error_message", "finished_at", "eta_seconds"]

    def mark_cancelled(self) -> list[str]:
        self.status = self.Status.CANCELLED
        self.finished_at, self.eta_seconds = timezone.now(), None
        return ["status", "finished_at", "eta_seconds"]


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
