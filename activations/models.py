"""Datasets to extract activations over (extraction jobs and caches come with the extraction work)."""

from django.conf import settings
from django.db import models

from mistudio.identifiers import new_dataset_id


class Dataset(models.Model):
    """A text dataset stored as one JSON Lines file of ``{"text": …}`` samples under DATASET_DIR."""

    class Source(models.TextChoices):
        UPLOAD = "upload"
        LOCAL = "local"
        BUILTIN = "builtin"

    id = models.CharField(primary_key=True, max_length=64, default=new_dataset_id, editable=False)
    name = models.CharField(max_length=500)
    source = models.CharField(max_length=50, choices=Source.choices)
    original_name = models.CharField(max_length=500, blank=True)
    sample_count = models.PositiveIntegerField()
    size_bytes = models.BigIntegerField()
    content_hash = models.CharField(max_length=64, db_index=True, help_text="sha256 of the stored samples")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    @property
    def storage_path(self):
        return settings.DATASET_DIR / f"{self.id}.jsonl"
