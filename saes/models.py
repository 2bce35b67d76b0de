"""Sparse autoencoders: trained here on an activation cache, or imported from a folder."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from mistudio.identifiers import new_sae_id

# engine.sae.ARCHITECTURES, named here so that the web process needs no torch to validate a request.
ARCHITECTURES = ("standard", "topk", "batchtopk", "jumprelu")


class SparseAutoencoder(models.Model):
    """One SAE at one hook point of one model, with its files in ``SAE_DIR/<id>/`` (SAELens layout).

    Trained: ``queued → running → completed | failed | cancelled``. Imported: ``completed`` at once.
    """

    # What only the owner (or an admin) may change, through whichever route (``sae_update``).
    OWNER_FIELDS = ("name", "shared")

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        CANCELLED = "cancelled"

    ACTIVE = (Status.QUEUED, Status.RUNNING)

    class Source(models.TextChoices):
        TRAINED = "trained"
        SAELENS = "saelens", "Imported SAELens folder"
        GEMMA_SCOPE = "gemma_scope", "Imported Gemma Scope params.npz"

    id = models.CharField(primary_key=True, max_length=64, default=new_sae_id, editable=False)
    name = models.CharField(max_length=500, blank=True)
    source = models.CharField(max_length=20, choices=Source.choices, default=Source.TRAINED)
    model = models.ForeignKey(
        "models_app.LanguageModel", null=True, blank=True, on_delete=models.SET_NULL, related_name="saes"
    )
    model_name = models.CharField(max_length=500, blank=True, help_text="As the SAE's cfg.json names it")
    cache = models.ForeignKey(
        "activations.ActivationCache",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="saes",
        help_text="The activation cache it was trained on",
    )
    hook_name = models.CharField(max_length=300, help_text="miStudio's hook name (TransformerLens' names)")
    architecture = models.CharField(max_length=20)
    d_in = models.PositiveIntegerField()
    d_sae = models.PositiveIntegerField()
    k = models.PositiveIntegerField(null=True, blank=True, help_text="TopK / BatchTopK")
    hyperparameters = models.JSONField(default=dict, blank=True, help_text="The training configuration")
    scaling_factor = models.FloatField(null=True, blank=True, help_text="Folded into the weights")

    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED, db_index=True)
    progress = models.FloatField(default=0)
    step = models.PositiveIntegerField(default=0)
    total_steps = models.PositiveIntegerField(default=0)
    tokens_seen = models.BigIntegerField(default=0)
    total_tokens = models.BigIntegerField(default=0)
    tokens_per_second = models.FloatField(null=True, blank=True)
    eta_seconds = models.FloatField(null=True, blank=True)
    metrics = models.JSONField(default=dict, blank=True, help_text="The latest training step's metrics")
    history = models.JSONField(default=list, blank=True, help_text="Training curves: at most ~400 points")
    evaluation = models.JSONField(default=dict, blank=True, help_text="Held-out metrics, CE loss recovered")
    evaluation_status = models.CharField(max_length=20, blank=True, help_text="queued / running / '' ")
    file_size_bytes = models.BigIntegerField(default=0)
    rq_job_id = models.CharField(max_length=100, blank=True)
    host_worker = models.CharField(max_length=255, blank=True)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    shared = models.BooleanField(
        default=False, help_text="Visible to every reader (changes stay the owner's)"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    training_time_seconds = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "sparse autoencoder"

    def __str__(self) -> str:
        return f"{self.name or self.id} ({self.hook_name})"

    @property
    def directory(self):
        """The SAELens folder (``cfg.json``, ``sae_weights.safetensors``, ``sparsity.safetensors``)."""
        return settings.SAE_DIR / self.id

    @property
    def checkpoint_directory(self):
        return self.directory / "checkpoint"

    def mark_running(self, *, host_worker: str, total_steps: int, total_tokens: int) -> list[str]:
        self.status = self.Status.RUNNING
        self.host_worker = host_worker
        self.total_steps, self.total_tokens = total_steps, total_tokens
        self.started_at = self.started_at or timezone.now()
        return ["status", "host_worker", "total_steps", "total_tokens", "started_at"]

    def mark_progress(
        self, *, step: int, tokens_seen: int, tokens_per_second: float, metrics: dict, points: list[dict]
    ) -> list[str]:
        """The latest training step's state; ``points`` are appended to the curves."""
        self.step, self.tokens_seen, self.metrics = step, tokens_seen, metrics
        self.progress = round(100 * step / self.total_steps, 2) if self.total_steps else 0.0
        self.tokens_per_second = round(tokens_per_second, 1)
        remaining = max(0, self.total_tokens - tokens_seen)
        self.eta_seconds = round(remaining / tokens_per_second, 1) if tokens_per_second > 0 else None
        fields = ["step", "tokens_seen", "metrics", "progress", "tokens_per_second", "eta_seconds"]
        if points:
            self.history = [*self.history, *points]
            fields.append("history")
        return fields

    def mark_completed(
        self, *, evaluation: dict, file_size_bytes: int, scaling_factor: float | None
    ) -> list[str]:
        self.status = self.Status.COMPLETED
        self.progress = 100
        self.evaluation = evaluation
        self.file_size_bytes = file_size_bytes
        self.scaling_factor = scaling_factor
        self.finished_at = timezone.now()
        self.eta_seconds = None
        if self.started_at:
            self.training_time_seconds = round((self.finished_at - self.started_at).total_seconds(), 3)
        return [
            "status", "progress", "evaluation", "file_size_bytes", "scaling_factor", "finished_at",
            "eta_seconds", "training_time_seconds",
        ]  # fmt: skip

    def mark_failed(self, *, code: str, message: str) -> list[str]:
        self.status = self.Status.FAILED
        self.error_code, self.error_message = code, message
        self.finished_at = timezone.now()
        self.eta_seconds = None
        return ["status", "error_code", "error_message", "finished_at", "eta_seconds"]

    def mark_cancelled(self) -> list[str]:
        self.status = self.Status.CANCELLED
        self.finished_at = timezone.now()
        self.eta_seconds = None
        return ["status", "finished_at", "eta_seconds"]

    def mark_evaluation(self, *, status: str, evaluation: dict | None = None) -> list[str]:
        """An on-demand evaluation: ``queued`` / ``running``, then ``""`` with its results merged in."""
        self.evaluation_status = status
        if evaluation is not None:
            self.evaluation = {**self.evaluation, **evaluation}
            return ["evaluation_status", "evaluation"]
        return ["evaluation_status"]
