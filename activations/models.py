"""Datasets, extraction jobs, and the activation caches they produce."""

import shutil

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from mistudio.identifiers import new_cache_id, new_dataset_id, new_extraction_id
from mistudio.jobs import JobRow


class Dataset(models.Model):
    """A text dataset stored as one JSON Lines file of ``{"text": …}`` samples under DATASET_DIR."""

    # What only the owner (or an admin) may change, through whichever route (``dataset_update``).
    OWNER_FIELDS = ("name", "shared")

    class Source(models.TextChoices):
        UPLOAD = "upload"
        LOCAL = "local"
        BUILTIN = "builtin"

    id = models.CharField(primary_key=True, max_length=64, default=new_dataset_id, editable=False)
    name = models.CharField(max_length=500)
    source = models.CharField(max_length=50, choices=Source.choices)
    original_name = models.CharField(max_length=500, blank=True, help_text="Uploaded file name or local path")
    format = models.CharField(
        max_length=50, blank=True, help_text="text_lines, text_paragraphs, jsonl, csv, hf_disk"
    )
    field = models.CharField(max_length=200, blank=True, help_text="JSONL field or CSV / dataset column")
    label_field = models.CharField(
        max_length=200, blank=True, help_text="The key or column of each sample's class (a labelled dataset)"
    )
    classes = models.JSONField(default=dict, blank=True, help_text="Class name to sample count (labelled)")
    sample_count = models.PositiveIntegerField()
    size_bytes = models.BigIntegerField()
    content_hash = models.CharField(max_length=64, db_index=True, help_text="sha256 of the stored samples")
    preview = models.JSONField(default=list, blank=True, help_text="The first samples, shortened")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    shared = models.BooleanField(
        default=False, help_text="Visible to every reader (changes stay the owner's)"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    @property
    def storage_path(self):
        return settings.DATASET_DIR / f"{self.id}.jsonl"


class ActivationCache(models.Model):
    """One extraction result on disk, unique on its key (model identity, dataset content, hooks, …).

    ``completed`` only once every shard is written and verified (see ``activations.store``).
    """

    class Status(models.TextChoices):
        WRITING = "writing"
        COMPLETED = "completed"
        FAILED = "failed"

    class Source(models.TextChoices):
        DATASET = "dataset"
        GENERATION = "generation"

    id = models.CharField(primary_key=True, max_length=64, default=new_cache_id, editable=False)
    key_hash = models.CharField(max_length=64, unique=True)
    key = models.JSONField()
    model = models.ForeignKey("models_app.LanguageModel", on_delete=models.CASCADE, related_name="caches")
    dataset = models.ForeignKey(
        Dataset, null=True, blank=True, on_delete=models.SET_NULL, related_name="caches"
    )
    source = models.CharField(max_length=20, choices=Source.choices, default=Source.DATASET)
    hooks = models.JSONField(default=list)
    max_length = models.PositiveIntegerField()
    dtype = models.CharField(max_length=20)
    sample_count = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.WRITING, db_index=True)
    file_size_bytes = models.BigIntegerField(default=0)
    activation_shapes = models.JSONField(default=dict, blank=True, help_text="[tokens, width] per hook")
    num_tokens = models.BigIntegerField(default=0)
    num_samples = models.PositiveIntegerField(default=0)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    last_accessed_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.id

    @property
    def directory(self):
        return settings.ACTIVATION_CACHE_DIR / self.id

    def mark_completed(self, *, manifest: dict, size_bytes: int) -> list[str]:
        """``completed`` with the sizes a finalized cache's manifest records; the fields changed."""
        self.status = self.Status.COMPLETED
        self.file_size_bytes = size_bytes
        self.num_tokens, self.num_samples = manifest["num_tokens"], manifest["num_samples"]
        self.activation_shapes = {
            hook["name"]: [manifest["num_tokens"], hook["width"]] for hook in manifest["hooks"]
        }
        self.completed_at = self.last_accessed_at = timezone.now()
        return [
            "status", "file_size_bytes", "num_tokens", "num_samples", "activation_shapes", "completed_at",
            "last_accessed_at",
        ]  # fmt: skip

    def mark_failed(self, *, code: str, message: str) -> list[str]:
        self.status = self.Status.FAILED
        self.error_code, self.error_message = code, message
        return ["status", "error_code", "error_message"]


class ExtractionJob(JobRow):
    """One extraction request: ``queued → running → completed | failed | cancelled``."""

    kind = "extraction"
    task = "activations.tasks.run_extraction"
    noun = "extraction"
    failure_code = "EXTRACTION_FAILED"

    id = models.CharField(primary_key=True, max_length=64, default=new_extraction_id, editable=False)
    model = models.ForeignKey(
        "models_app.LanguageModel", on_delete=models.CASCADE, related_name="extractions"
    )
    dataset = models.ForeignKey(Dataset, null=True, on_delete=models.SET_NULL, related_name="extractions")
    cache = models.ForeignKey(
        ActivationCache, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    cached = models.BooleanField(default=False, help_text="Answered from an existing cache")
    hooks = models.JSONField(default=list)
    sample_count = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the whole dataset")
    batch_size = models.PositiveIntegerField(default=16)
    max_length = models.PositiveIntegerField(default=512)
    dtype = models.CharField(max_length=20, default="float32")

    samples_processed = models.PositiveIntegerField(default=0)
    total_samples = models.PositiveIntegerField(default=0)
    tokens_processed = models.BigIntegerField(default=0)
    tokens_per_second = models.FloatField(null=True, blank=True)
    extraction_time_seconds = models.FloatField(null=True, blank=True)

    class Meta(JobRow.Meta):
        pass

    def __str__(self) -> str:
        return self.id

    def event_groups(self) -> list[str]:
        return [f"extraction.{self.id}", f"model.{self.model_id}"]

    def leftovers(self) -> list:
        return []  # its files are its cache's (a row of its own)

    def on_ended(self) -> None:
        """An unfinished cache goes with a cancelled job (its files on commit); a failed job's cache
        says ``failed`` with its code, and after a full disk its partial files are removed."""
        cache = self.cache
        if cache is None or cache.status == ActivationCache.Status.COMPLETED:
            return
        if self.status == self.Status.CANCELLED:
            cache.delete()  # its files follow on commit (cache_files_follow_row)
            return
        cache.save(update_fields=cache.mark_failed(code=self.error_code, message=self.error_message))
        if self.error_code == "DISK_FULL":
            directory = cache.directory
            transaction.on_commit(lambda: shutil.rmtree(directory, ignore_errors=True))

    def mark_running(self, *, host_worker: str, total_samples: int = 0) -> list[str]:
        self.total_samples = total_samples
        return [*super().mark_running(host_worker=host_worker), "total_samples"]

    def mark_progress(
        self, *, samples_processed: int, tokens_processed: int, tokens_per_second: float
    ) -> list[str]:
        self.samples_processed = samples_processed
        self.tokens_processed = tokens_processed
        self.progress = (
            round(100 * samples_processed / self.total_samples, 2) if self.total_samples else 100.0
        )
        self.tokens_per_second = round(tokens_per_second, 1)
        remaining = self.total_samples - samples_processed
        rate = samples_processed / max(self.elapsed_seconds(), 1e-6)
        self.eta_seconds = round(remaining / rate, 1) if rate > 0 else None
        return ["samples_processed", "tokens_processed", "progress", "tokens_per_second", "eta_seconds"]

    def mark_completed(self, *, cache: ActivationCache, cached: bool = False) -> list[str]:
        self.cache = cache
        self.cached = cached
        fields = super().mark_completed()
        self.extraction_time_seconds = round(self.elapsed_seconds(), 3) if not cached else 0.0
        return [*fields, "cache", "cached", "extraction_time_seconds"]
