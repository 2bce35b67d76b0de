"""Steering vectors: a direction at one hook point of one model, for ``add`` interventions."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from mistudio.identifiers import new_steering_vector_id


class SteeringVector(models.Model):
    """One vector of a hook's width in ``STEERING_DIR/<id>/vector.safetensors``.

    Contrastive (``queued → running → completed | failed``): the mean activation over the
    ``positive`` prompts minus the mean over the ``negative`` ones, computed by a job over the
    model. Imported: ``completed`` at once.
    """

    OWNER_FIELDS = ("name", "shared")

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"

    ACTIVE = (Status.QUEUED, Status.RUNNING)

    class Source(models.TextChoices):
        CONTRASTIVE = "contrastive", "Difference of means of two prompt lists"
        IMPORTED = "imported", "Imported safetensors file"

    class Reduction(models.TextChoices):
        MEAN = "mean", "Every token of each prompt"
        LAST = "last", "The last token of each prompt"

    id = models.CharField(primary_key=True, max_length=64, default=new_steering_vector_id, editable=False)
    name = models.CharField(max_length=500, blank=True)
    source = models.CharField(max_length=20, choices=Source.choices, default=Source.CONTRASTIVE)
    model = models.ForeignKey(
        "models_app.LanguageModel", null=True, blank=True, on_delete=models.SET_NULL, related_name="vectors"
    )
    hook_name = models.CharField(max_length=300)
    width = models.PositiveIntegerField(null=True, blank=True)
    positive = models.JSONField(default=list, blank=True, help_text="Prompts the vector points towards")
    negative = models.JSONField(default=list, blank=True, help_text="Prompts it points away from")
    reduction = models.CharField(max_length=10, choices=Reduction.choices, default=Reduction.MEAN)
    norm = models.FloatField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED, db_index=True)
    rq_job_id = models.CharField(max_length=100, blank=True)
    host_worker = models.CharField(max_length=255, blank=True)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    shared = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.id} ({self.name or self.hook_name})"

    @property
    def directory(self):
        return settings.STEERING_DIR / self.id

    @property
    def path(self):
        return self.directory / "vector.safetensors"

    def mark_running(self, *, host_worker: str) -> list[str]:
        self.status, self.host_worker = self.Status.RUNNING, host_worker
        return ["status", "host_worker"]

    def mark_completed(self, *, width: int, norm: float) -> list[str]:
        self.status, self.width, self.norm = self.Status.COMPLETED, width, norm
        self.finished_at = timezone.now()
        return ["status", "width", "norm", "finished_at"]

    def mark_failed(self, *, code: str, message: str) -> list[str]:
        self.status, self.error_code, self.error_message = self.Status.FAILED, code, message
        self.finished_at = timezone.now()
        return ["status", "error_code", "error_message", "finished_at"]
