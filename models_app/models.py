"""Language models registered in miStudio, and the state machine of their loading."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from mistudio.identifiers import new_model_id
from mistudio.local_paths import path_shown


class LanguageModel(models.Model):
    """A Hugging Face model (hub id or local folder) and where it is in its life.

    Status: ``pending → loading → ready | failed``, ``ready → unloaded`` (and back to loading).
    The worker that loaded it is its *host*; every later job for it goes to that worker's queue.
    """

    # What only the owner (or an admin) may change, through whichever route (``model_update``).
    OWNER_FIELDS = ("name", "pinned", "shared", "keep_alive_seconds", "quantization")

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

    commit_sha = models.CharField(
        max_length=64, blank=True, help_text="The hub commit the revision resolved to"
    )
    context_length = models.IntegerField(null=True, blank=True)
    memory_estimates = models.JSONField(
        default=dict, help_text="Bytes per quantization option, before loading"
    )
    pinned = models.BooleanField(default=False, help_text="Never evicted to make room for another model")
    keep_alive_seconds = models.PositiveIntegerField(
        null=True, blank=True, help_text="Unload after this long unused (empty: stay loaded)"
    )

    status = models.CharField(max_length=50, choices=Status.choices, default=Status.PENDING, db_index=True)
    progress = models.FloatField(default=0)
    stage = models.CharField(
        max_length=20, blank=True, help_text="resolve, download, weights, place, warm-up"
    )
    status_message = models.CharField(max_length=500, blank=True)
    download_bytes_done = models.BigIntegerField(null=True, blank=True)
    download_bytes_total = models.BigIntegerField(null=True, blank=True)
    unload_reason = models.CharField(max_length=50, blank=True)
    memory_usage_bytes = models.BigIntegerField(null=True, blank=True)
    memory_by_device = models.JSONField(
        default=dict,
        blank=True,
        help_text='Bytes of the loaded model on each device, e.g. {"cuda:0": ..., "cpu": ..., "disk": ...}',
    )
    load_time_seconds = models.FloatField(null=True, blank=True)
    parameter_count = models.BigIntegerField(null=True, blank=True)
    hidden_size = models.IntegerField(null=True, blank=True)
    num_layers = models.IntegerField(null=True, blank=True)
    vocab_size = models.IntegerField(null=True, blank=True)
    host_worker = models.CharField(max_length=255, blank=True)
    rq_job_id = models.CharField(max_length=64, blank=True)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    error_details = models.JSONField(default=dict, blank=True)

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    shared = models.BooleanField(
        default=False, help_text="Visible to every reader (changes stay the owner's)"
    )
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
            models.UniqueConstraint(
                fields=["source", "identifier", "revision", "quantization"],
                name="language_model_unique_source",
            ),
            models.CheckConstraint(
                condition=models.Q(status__in=["pending", "loading", "ready", "failed", "unloaded"]),
                name="language_model_status_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    @property
    def display_identifier(self) -> str:
        """What clients see as the identifier: the hub id, or a local folder relative to its
        ``LOCAL_MODEL_ROOTS`` root (the absolute server path stays on the server)."""
        if self.source != self.Source.LOCAL:
            return self.identifier

        return path_shown(self.identifier, settings.LOCAL_MODEL_ROOTS)

    # State transitions. Each sets fields and returns their names; the caller saves and
    # publishes through ``mistudio.events.publish`` so the row always changes before the event.

    def mark_loading(
        self, *, progress: float, message: str, stage: str = "", rq_job_id: str | None = None
    ) -> list[str]:
        self.status = self.Status.LOADING
        self.progress = progress
        self.stage = stage
        self.status_message = message
        self.error_code = self.error_message = self.unload_reason = ""
        self.error_details = {}
        fields = [
            "status", "progress", "stage", "status_message", "error_code", "error_message", "error_details",
            "unload_reason",
        ]  # fmt: skip
        if rq_job_id is not None:
            self.rq_job_id = rq_job_id
            fields.append("rq_job_id")
        return fields

    def mark_downloading(self, *, bytes_done: int, bytes_total: int) -> list[str]:
        """Byte progress of a download. During a load it is the first part: 5 to 60 % of the bar.

        A download on its own (``manage.py download_model``) leaves the status as it is.
        """
        self.download_bytes_done, self.download_bytes_total = bytes_done, bytes_total
        fields = ["download_bytes_done", "download_bytes_total"]
        if self.status == self.Status.LOADING:
            fraction = bytes_done / bytes_total if bytes_total else 1.0
            fields += self.mark_loading(
                progress=round(5 + 55 * fraction, 1), message="Downloading", stage="download"
            )
        return fields

    def mark_ready(
        self,
        *,
        host_worker: str,
        memory_usage_bytes: int,
        load_time_seconds: float,
        memory_by_device: dict[str, int] | None = None,
    ) -> list[str]:
        """``memory_usage_bytes`` is what the model holds in memory; ``memory_by_device`` where
        it sits (a split model's disk part included)."""
        self.status = self.Status.READY
        self.progress = 100
        self.stage = ""
        self.status_message = "Ready"
        self.host_worker = host_worker
        self.memory_usage_bytes = memory_usage_bytes
        self.memory_by_device = memory_by_device or {}
        self.load_time_seconds = load_time_seconds
        self.loaded_at = self.last_used_at = timezone.now()
        return [
            "status", "progress", "stage", "status_message", "host_worker", "memory_usage_bytes",
            "memory_by_device", "load_time_seconds", "loaded_at", "last_used_at",
        ]  # fmt: skip

    def mark_failed(self, *, code: str, message: str, details: dict | None = None) -> list[str]:
        self.status = self.Status.FAILED
        self.error_code, self.error_message = code, message
        self.error_details = details or {}
        self.status_message = "Failed"
        self.stage = ""
        self.host_worker = ""
        self.memory_usage_bytes = None
        self.memory_by_device = {}
        return [
            "status", "error_code", "error_message", "error_details", "status_message", "stage",
            "host_worker", "memory_usage_bytes", "memory_by_device",
        ]  # fmt: skip

    def mark_unloaded(self, *, reason: str, code: str = "", message: str = "") -> list[str]:
        """Reasons: requested, evicted, idle, deleted, worker_stopped, worker_lost."""
        self.status = self.Status.UNLOADED
        self.progress = 0
        self.stage = ""
        self.status_message = "Unloaded"
        self.unload_reason = reason
        self.error_code, self.error_message = code, message
        self.error_details = {}
        self.host_worker = ""
        self.memory_usage_bytes = None
        self.memory_by_device = {}
        return [
            "status", "progress", "stage", "status_message", "unload_reason", "error_code", "error_message",
            "error_details", "host_worker", "memory_usage_bytes", "memory_by_device",
        ]  # fmt: skip
