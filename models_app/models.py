"""Language models registered in miStudio, and the state machine of their loading."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from mistudio.identifiers import new_model_id


class LanguageModel(models.Model):
    """A Hugging Face model (hub id or local folder) and where it is in its life.

    Status: ``pending → loading → ready | failed``, ``ready → unloaded`` (and back to loading).
    The worker that loaded it is its *host*; every later job for it goes to that worker's queue.
    """

    class Source(models.TextChoices):
        HUGGINGFACE = "huggingface"
        LOCAL = "local"

    class Quantization(models.TextChoices):
        NONE = "none"
        FP16 = "fp16"
        BF16 = "bf16"
        INT8 = "int8"
        INT4 = "int4"

    class Status(models.TextChoices):
        PENDING = "pending"
        LOADING = "loading"
        READY = "ready"
        FAILED = "failed"
        UNLOADED = "unloaded"

    id = models.CharField(primary_key=True, max_length=64, default=new_model_id, editable=False)
    name = models.CharField(max_length=500)
    model_type = models.CharField(max_length=100, db_index=True)
    architecture = models.CharField(max_length=100, blank=True)
    source = models.CharField(max_length=50, choices=Source.choices, db_index=True)
    identifier = models.CharField(max_length=1000, help_text="Hub repo id, or the local folder's path")
    revision = models.CharField(max_length=255, blank=True)
    config = models.JSONField(default=dict)
    quantization = models.CharField(max_length=50, choices=Quantization.choices, default=Quantization.NONE)

    status = models.CharField(max_length=50, choices=Status.choices, default=Status.PENDING, db_index=True)
    progress = models.FloatField(default=0)
    status_message = models.CharField(max_length=500, blank=True)
    memory_usage_bytes = models.BigIntegerField(null=True, blank=True)
    load_time_seconds = models.FloatField(null=True, blank=True)
    parameter_count = models.BigIntegerField(null=True, blank=True)
    hidden_size = models.IntegerField(null=True, blank=True)
    num_layers = models.IntegerField(null=True, blank=True)
    vocab_size = models.IntegerField(null=True, blank=True)
    host_worker = models.CharField(max_length=255, blank=True)
    rq_job_id = models.CharField(max_length=64, blank=True)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    loaded_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("model_read", "model:read — see models, datasets and activations"),
            ("model_write", "model:write — register, load, extract, generate"),
            ("model_admin", "model:admin — everything, everyone's"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=["pending", "loading", "ready", "failed", "unloaded"]),
                name="language_model_status_valid",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    # State transitions. Each sets fields and returns their names; the caller saves and
    # publishes through ``mistudio.events.publish`` so the row always changes before the event.

    def mark_loading(self, *, progress: float, message: str, rq_job_id: str | None = None) -> list[str]:
        self.status = self.Status.LOADING
        self.progress = progress
        self.status_message = message
        self.error_code = self.error_message = ""
        fields = ["status", "progress", "status_message", "error_code", "error_message"]
        if rq_job_id is not None:
            self.rq_job_id = rq_job_id
            fields.append("rq_job_id")
        return fields

    def mark_ready(self, *, host_worker: str, memory_usage_bytes: int, load_time_seconds: float) -> list[str]:
        self.status = self.Status.READY
        self.progress = 100
        self.status_message = "Ready"
        self.host_worker = host_worker
        self.memory_usage_bytes = memory_usage_bytes
        self.load_time_seconds = load_time_seconds
        self.loaded_at = self.last_used_at = timezone.now()
        return [
            "status", "progress", "status_message", "host_worker", "memory_usage_bytes",
            "load_time_seconds", "loaded_at", "last_used_at",
        ]  # fmt: skip

    def mark_failed(self, *, code: str, message: str) -> list[str]:
        self.status = self.Status.FAILED
        self.error_code, self.error_message = code, message
        self.status_message = "Failed"
        self.host_worker = ""
        self.memory_usage_bytes = None
        return [
            "status",
            "error_code",
            "error_message",
            "status_message",
            "host_worker",
            "memory_usage_bytes",
        ]

    def mark_unloaded(self, *, code: str = "", message: str = "") -> list[str]:
        self.status = self.Status.UNLOADED
        self.progress = 0
        self.status_message = "Unloaded"
        self.error_code, self.error_message = code, message
        self.host_worker = ""
        self.memory_usage_bytes = None
        return [
            "status", "progress", "status_message", "error_code", "error_message", "host_worker",
            "memory_usage_bytes",
        ]  # fmt: skip
