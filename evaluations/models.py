"""SAEs judged side by side: a run of SAEBench's methods over a set of SAEs of one model, and what
each method found for each SAE."""

from django.conf import settings
from django.db import models

from mistudio.identifiers import new_bench_run_id
from mistudio.jobs import JobRow


class BenchRun(JobRow):
    """SAEBench's methods (``engine.saebench.methods``) over SAEs of one model, chosen one by one
    or as a group's members: a job on the model's worker, SAE after SAE, method after method. Each
    finished (SAE, method) pair is a :class:`BenchResult` at once, so a resumed run goes on from
    the next pair and a cancelled one keeps what it finished."""

    kind = "bench"
    task = "evaluations.tasks.run_bench"
    noun = "SAEBench run"
    failure_code = "BENCH_FAILED"
    OWNER_FIELDS = ("name", "shared")

    id = models.CharField(primary_key=True, max_length=64, default=new_bench_run_id, editable=False)
    name = models.CharField(max_length=500, blank=True)
    model = models.ForeignKey(
        "models_app.LanguageModel", null=True, on_delete=models.SET_NULL, related_name="bench_runs"
    )
    group = models.ForeignKey(
        "saes.SaeGroup", null=True, blank=True, on_delete=models.SET_NULL, related_name="bench_runs"
    )
    saes = models.JSONField(default=list, help_text="The SAE ids judged, in order")
    methods = models.JSONField(default=list, help_text="engine.saebench.methods names, in order")
    dataset = models.ForeignKey(
        "activations.Dataset", null=True, on_delete=models.SET_NULL, related_name="+",
        help_text="The text the core metrics run the model over",
    )  # fmt: skip
    probing_dataset = models.ForeignKey(
        "activations.Dataset", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="The labelled dataset sparse probing reads",
    )  # fmt: skip
    config = models.JSONField(default=dict, blank=True, help_text="Each method's settings, by method")
    summary = models.JSONField(default=dict, blank=True, help_text="Seconds per method, pairs done")
    shared = models.BooleanField(default=False, help_text="Visible to every reader")

    class Meta(JobRow.Meta):
        pass

    def __str__(self) -> str:
        return f"{self.id} ({self.name or ', '.join(self.methods)})"

    def event_groups(self) -> list[str]:
        return [f"bench.{self.id}"]

    @property
    def directory(self):
        return settings.BENCH_DIR / self.id

    def on_ended(self) -> None:
        """A failed or cancelled run keeps the results it finished (its folder goes with the row)."""

    def mark_progress(self, *, done: int, total: int) -> list[str]:
        self.progress = round(100 * done / max(1, total), 2)
        return ["progress"]

    def mark_completed(self, *, summary: dict) -> list[str]:
        self.summary = summary
        return [*super().mark_completed(), "summary"]


class BenchResult(models.Model):
    """What one method found for one SAE in one run: its scalar metrics (SAEBench's names, by
    category) and, for the core metrics, the per-feature details in the run's folder."""

    run = models.ForeignKey(BenchRun, on_delete=models.CASCADE, related_name="results")
    sae = models.ForeignKey("saes.SparseAutoencoder", on_delete=models.CASCADE, related_name="bench_results")
    method = models.CharField(max_length=50)
    method_version = models.CharField(max_length=100, help_text="The arithmetic it follows")
    metrics = models.JSONField(default=dict, help_text="SAEBench's metrics by category")
    details = models.JSONField(default=dict, blank=True, help_text="Per class, per k: what the method adds")
    seconds = models.FloatField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "sae", "method"], name="one_result_per_run_sae_method")
        ]

    def __str__(self) -> str:
        return f"{self.method} of {self.sae_id} in {self.run_id}"

    def flat_metrics(self) -> dict[str, float]:
        """Every scalar by its name (SAEBench's names are unique across a method's categories)."""
        return {
            name: value
            for group in self.metrics.values()
            if isinstance(group, dict)
            for name, value in group.items()
        }

    @property
    def feature_file(self):
        return self.run.directory / f"{self.sae_id}-{self.method}.safetensors"
