"""Sparse autoencoders and transcoders: trained here on an activation cache or straight from a
model over a dataset (many at once, in a group), or imported from a folder."""

from pathlib import Path

from django.conf import settings
from django.db import models

from engine.sae_architectures import ARCHITECTURES, PENALIZED
from mistudio.identifiers import new_evaluation_id, new_sae_group_id, new_sae_id
from mistudio.jobs import JobRow

__all__ = ["ARCHITECTURES", "PENALIZED", "SaeEvaluation", "SaeGroup", "SparseAutoencoder"]
# Above this fraction of dead features (held out), the SAE says so.
DEAD_WARNING_FRACTION = 0.25


class TrainingProgress(models.Model):
    """Where a training stands: steps and tokens against their totals, throughput, ETA (an SAE's
    and a group's). Mixed in before :class:`JobRow`, whose ``mark_running`` it extends."""

    step = models.PositiveIntegerField(default=0)
    total_steps = models.PositiveIntegerField(default=0)
    tokens_seen = models.BigIntegerField(default=0)
    total_tokens = models.BigIntegerField(default=0)
    tokens_per_second = models.FloatField(null=True, blank=True)

    class Meta:
        abstract = True

    @property
    def checkpoint_directory(self):
        return self.directory / "checkpoint"

    def mark_running(self, *, host_worker: str, total_steps: int = 0, total_tokens: int = 0) -> list[str]:
        self.total_steps, self.total_tokens = total_steps, total_tokens
        return [*super().mark_running(host_worker=host_worker), "total_steps", "total_tokens"]

    def mark_step(self, *, step: int, tokens_seen: int, tokens_per_second: float) -> list[str]:
        """``progress``, ``eta_seconds`` (of the job row) and the counters after ``step``."""
        self.step, self.tokens_seen = step, tokens_seen
        self.progress = round(100 * step / self.total_steps, 2) if self.total_steps else 0.0
        self.tokens_per_second = round(tokens_per_second, 1)
        remaining = max(0, self.total_tokens - tokens_seen)
        self.eta_seconds = round(remaining / tokens_per_second, 1) if tokens_per_second > 0 else None
        return ["step", "tokens_seen", "progress", "tokens_per_second", "eta_seconds"]


class SparseAutoencoder(TrainingProgress, JobRow):
    """One SAE at one hook point of one model, with its files in ``SAE_DIR/<id>/`` (SAELens layout).

    Trained, or imported from a folder (by a job too: the folder is checked on a worker):
    ``queued → running → completed | failed | cancelled``.
    """

    kind = "sae"
    noun = "SAE"
    failure_code = "TRAINING_FAILED"
    # What only the owner (or an admin) may change, through whichever route (``sae_update``).
    OWNER_FIELDS = ("name", "shared")

    class Source(models.TextChoices):
        TRAINED = "trained"
        SAELENS = "saelens", "a SAELens folder"
        GEMMA_SCOPE = "gemma_scope", "a Gemma Scope params.npz"
        CIRCUIT_TRACER = "circuit_tracer", "a circuit-tracer transcoder file"
        CLT = "clt", "a cross-layer transcoder folder"

    id = models.CharField(primary_key=True, max_length=64, default=new_sae_id, editable=False)
    name = models.CharField(max_length=500, blank=True)
    source = models.CharField(max_length=20, choices=Source.choices, default=Source.TRAINED)
    group = models.ForeignKey(
        "saes.SaeGroup",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="members",
        help_text="The group it trained in, from the model: the group is the job",
    )
    group_index = models.PositiveIntegerField(null=True, blank=True)
    dataset = models.ForeignKey(
        "activations.Dataset",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="saes",
        help_text="The dataset it was trained on, from the model on the fly",
    )
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
    hook_name_out = models.CharField(
        max_length=300, blank=True, help_text="A transcoder's output hook (it reads hook_name)"
    )
    architecture = models.CharField(max_length=30)
    d_in = models.PositiveIntegerField()
    d_sae = models.PositiveIntegerField()
    d_out = models.PositiveIntegerField(null=True, blank=True, help_text="A transcoder's output width")
    k = models.PositiveIntegerField(null=True, blank=True, help_text="TopK / BatchTopK")
    n_layers = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="A cross-layer transcoder's layers: d_sae features each, read at hook_name's layer and "
        "onward, writing into their own layer's MLP output and every later one's",
    )  # fmt: skip
    hyperparameters = models.JSONField(default=dict, blank=True, help_text="The training configuration")
    scaling_factor = models.FloatField(null=True, blank=True, help_text="Folded into the weights")
    import_path = models.CharField(
        max_length=4096, blank=True, help_text="The folder an import reads (never shown to users)"
    )
    content_hash = models.CharField(
        max_length=64,
        blank=True,
        db_index=True,
        help_text="Of an imported SAE's files: a re-import reuses it",
    )

    metrics = models.JSONField(default=dict, blank=True, help_text="The latest training step's metrics")
    history = models.JSONField(default=list, blank=True, help_text="Training curves: at most ~400 points")
    evaluation = models.JSONField(default=dict, blank=True, help_text="Held-out metrics, CE loss recovered")
    file_size_bytes = models.BigIntegerField(default=0)
    shared = models.BooleanField(
        default=False, help_text="Visible to every reader (changes stay the owner's)"
    )
    training_time_seconds = models.FloatField(null=True, blank=True)

    class Meta(JobRow.Meta):
        verbose_name = "sparse autoencoder"

    def __str__(self) -> str:
        return f"{self.name or self.id} ({self.hook_name})"

    @classmethod
    def jobs(cls):
        """A member of a group is part of its group's job, not a job of its own."""
        return cls.objects.filter(group__isnull=True)

    @property
    def is_transcoder(self) -> bool:
        return bool(self.hook_name_out)

    @property
    def is_cross_layer(self) -> bool:
        """A cross-layer transcoder (CLT): one row, ``d_sae`` features per layer."""
        return self.n_layers is not None

    @property
    def total_features(self) -> int:
        return self.d_sae * (self.n_layers or 1)

    @property
    def feature_hook(self) -> str:
        """Where its features live (what they write): a transcoder's output hook, else its hook."""
        return self.hook_name_out or self.hook_name

    def task_name(self) -> str:
        if self.source == self.Source.TRAINED:
            return "saes.tasks.run_sae_training"
        return "saes.tasks.run_sae_import"

    def event_groups(self) -> list[str]:
        return [f"sae.{self.id}", *([f"model.{self.model_id}"] if self.model_id else [])]

    @property
    def directory(self):
        """The SAELens folder (``cfg.json``, ``sae_weights.safetensors``, ``sparsity.safetensors``)."""
        return settings.SAE_DIR / self.id

    @property
    def uploaded_folder(self) -> Path | None:
        """Where an upload's files wait until its import ends (``saes.services.sae_upload``)."""
        folder = Path(self.import_path) if self.import_path else None
        return folder if folder is not None and folder.parent == Path(settings.SAE_UPLOAD_DIR) else None

    def leftovers(self) -> list[Path]:
        uploaded = self.uploaded_folder
        return [*super().leftovers(), *([uploaded] if uploaded is not None else [])]

    @property
    def evaluation_status(self) -> str:
        """``queued`` / ``running`` while an evaluation of the SAE is, else ``""`` (its newest active
        :class:`SaeEvaluation`; ``saes.selectors.sae_list`` prefetches them)."""
        active = getattr(self, "active_evaluations", None)
        if active is None:
            active = list(self.evaluations.filter(status__in=JobRow.ACTIVE).order_by("-created_at")[:1])
        return active[0].status if active else ""

    @property
    def warnings(self) -> list[str]:
        """What a researcher should know before trusting this SAE: a sparsity penalty too weak for
        the model (L0 over a quarter of d_in) and most features dead on held-out tokens."""
        found = []
        l0 = self.evaluation.get("l0", self.metrics.get("l0"))
        dense = isinstance(l0, int | float) and self.d_in and l0 > self.d_in / 4
        coefficient = PENALIZED.get(self.architecture)
        if dense and coefficient:
            found.append(
                f"L0 is {l0:,.0f}, over a quarter of d_in ({self.d_in}): the sparsity penalty is too weak "
                f"for this model; train again with a larger {coefficient} "
                f"(now {self.hyperparameters.get(coefficient, '?')}), or use TopK."
            )
        dead = self.evaluation.get("dead_features")
        if isinstance(dead, int) and self.d_sae and dead > DEAD_WARNING_FRACTION * self.d_sae:
            found.append(
                f"{dead:,} of {self.d_sae:,} features ({100 * dead / self.d_sae:.0f} %) never fired on "
                "held-out tokens: train on more tokens, or lower dead_after_steps so that AuxK revives "
                "them sooner."
            )
        return found

    def mark_progress(
        self, *, step: int, tokens_seen: int, tokens_per_second: float, metrics: dict, points: list[dict]
    ) -> list[str]:
        """The latest training step's state; ``points`` are appended to the curves."""
        self.metrics = metrics
        fields = [
            "metrics",
            *self.mark_step(step=step, tokens_seen=tokens_seen, tokens_per_second=tokens_per_second),
        ]
        if points:
            self.history = [*self.history, *points]
            fields.append("history")
        return fields

    def mark_completed(
        self, *, evaluation: dict, file_size_bytes: int, scaling_factor: float | None
    ) -> list[str]:
        self.evaluation = evaluation
        self.file_size_bytes = file_size_bytes
        self.scaling_factor = scaling_factor
        fields = super().mark_completed()
        if self.started_at:
            self.training_time_seconds = round((self.finished_at - self.started_at).total_seconds(), 3)
        return [*fields, "evaluation", "file_size_bytes", "scaling_factor", "training_time_seconds"]


class SaeEvaluation(JobRow):
    """One evaluation of a completed SAE on the held-out part of a cache, with CE loss recovered:
    its results are merged into the SAE's ``evaluation`` when it completes (an error, when it
    fails). Its events go to the SAE's group."""

    kind = "evaluation"
    task = "saes.tasks.run_sae_evaluation"
    noun = "SAE evaluation"
    failure_code = "EVALUATION_FAILED"

    id = models.CharField(primary_key=True, max_length=64, default=new_evaluation_id, editable=False)
    sae = models.ForeignKey(SparseAutoencoder, on_delete=models.CASCADE, related_name="evaluations")
    cache = models.ForeignKey(
        "activations.ActivationCache", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    results = models.JSONField(default=dict, blank=True)

    class Meta(JobRow.Meta):
        pass

    def __str__(self) -> str:
        return f"{self.id} ({self.sae_id} on {self.cache_id})"

    def event_groups(self) -> list[str]:
        return [f"sae.{self.sae_id}"]

    def audience_rows(self) -> list[tuple[str, str]]:
        return [("sae", self.sae_id)]

    def leftovers(self) -> list:
        return []

    def on_ended(self) -> None:
        """The SAE stays ``completed``; its evaluation records the error (or the cancel)."""
        error = {
            "code": self.error_code or "EVALUATION_CANCELLED",
            "message": self.error_message or "Cancelled.",
        }
        self.sae.evaluation = {**self.sae.evaluation, "error": error}
        self.sae.save(update_fields=["evaluation", "updated_at"])


class SaeGroup(TrainingProgress, JobRow):
    """SAEs and transcoders trained together straight from a model over a dataset: every forward
    pass feeds all of them (several hooks, several hyper-parameter variants), no activation is
    written to disk. The group is the job; each member is a :class:`SparseAutoencoder` row with
    its own curves and evaluation, whose status follows the group's."""

    kind = "sae_group"
    task = "saes.tasks.run_sae_group_training"
    noun = "SAE group"
    failure_code = "TRAINING_FAILED"
    OWNER_FIELDS = ("name", "shared")

    id = models.CharField(primary_key=True, max_length=64, default=new_sae_group_id, editable=False)
    name = models.CharField(max_length=500, blank=True)
    model = models.ForeignKey(
        "models_app.LanguageModel", null=True, on_delete=models.SET_NULL, related_name="sae_groups"
    )
    dataset = models.ForeignKey(
        "activations.Dataset", null=True, on_delete=models.SET_NULL, related_name="sae_groups"
    )
    settings = models.JSONField(
        default=dict,
        blank=True,
        help_text="How the model reads the dataset: max_length, batches, held-out samples",
    )
    shared = models.BooleanField(
        default=False, help_text="Visible to every reader (changes stay the owner's)"
    )
    analyze_members = models.BooleanField(
        default=False,
        help_text="When it completes, analyse each member over its dataset through the model "
        "(dashboards, labels, graph node names)",
    )

    class Meta(JobRow.Meta):
        verbose_name = "SAE group"

    def __str__(self) -> str:
        return f"{self.name or self.id}"

    def event_groups(self) -> list[str]:
        return [f"sae_group.{self.id}", *([f"model.{self.model_id}"] if self.model_id else [])]

    @property
    def stop_key(self) -> str:
        """Set (``saes.groups.sae_group_stop``): stop training at the next step, keep the members."""
        return f"{settings.REDIS_KEY_PREFIX}:stop:{self.kind}:{self.pk}"

    @property
    def directory(self):
        """The group's checkpoints (each member's SAELens folder is its own row's)."""
        return settings.SAE_DIR / self.id

    def on_ended(self) -> None:
        """Its members end as it did (failed with its error, or cancelled); the checkpoints go."""
        for member in self.members.filter(status__in=JobRow.ACTIVE):
            if self.status == JobRow.Status.FAILED:
                fields = member.mark_failed(code=self.error_code, message=self.error_message)
            else:
                fields = member.mark_cancelled()
            member.save(update_fields=[*fields, "updated_at"])
            member.release_leftovers()
        self.release_leftovers()
