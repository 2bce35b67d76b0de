"""Steering vectors: a direction at one hook point of one model, for ``add`` interventions."""

from django.conf import settings
from django.db import models

from mistudio.identifiers import new_steering_vector_id
from mistudio.jobs import JobRow


class SteeringVector(JobRow):
    """One vector of a hook's width in ``STEERING_DIR/<id>/vector.safetensors``.

    Contrastive (``queued → running → completed | failed | cancelled``): the mean activation over
    the ``positive`` prompts minus the mean over the ``negative`` ones, computed by a job over the
    model; either side may be a dataset instead (referenced, its samples read by the job, never
    copied into the row). Imported: ``completed`` at once.
    """

    kind = "vector"
    task = "steering.tasks.run_steering_vector"
    noun = "steering vector"
    failure_code = "STEERING_VECTOR_FAILED"
    OWNER_FIELDS = ("name", "shared")

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
    positive_dataset = models.ForeignKey(
        "activations.Dataset", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="Instead of positive prompts: the first samples of this dataset",
    )  # fmt: skip
    negative_dataset = models.ForeignKey(
        "activations.Dataset", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="Instead of negative prompts: the first samples of this dataset",
    )  # fmt: skip
    reduction = models.CharField(max_length=10, choices=Reduction.choices, default=Reduction.MEAN)
    norm = models.FloatField(null=True, blank=True)
    shared = models.BooleanField(default=False)

    class Meta(JobRow.Meta):
        pass

    def __str__(self) -> str:
        return f"{self.id} ({self.name or self.hook_name})"

    def event_groups(self) -> list[str]:
        return [f"vector.{self.id}", *([f"model.{self.model_id}"] if self.model_id else [])]

    @property
    def directory(self):
        return settings.STEERING_DIR / self.id

    @property
    def path(self):
        return self.directory / "vector.safetensors"

    def mark_completed(self, *, width: int, norm: float) -> list[str]:
        self.width, self.norm = width, norm
        return [*super().mark_completed(), "width", "norm"]
