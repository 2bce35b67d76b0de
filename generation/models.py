"""Generation rows: one request (a prompt or a chat) in, tokens out, run by the model's host worker."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from mistudio.identifiers import new_generation_id
from mistudio.jobs import JobStatus
from models_app.models import LanguageModel


def storable_text(text: str) -> str:
    """The text as a row keeps it: PostgreSQL text cannot hold NUL, which a model may well
    generate, so U+FFFD takes its place (the token ids stay exact; clients get the exact text)."""
    return text.replace("\x00", "\ufffd")


class Generation(models.Model):
    """One generation request: a prompt (or chat) in, tokens out, run by the model's host worker.

    Status: ``queued → running → completed | failed | cancelled``. Tokens stream to the client
    through a Redis stream (``generation.streams``) and to browsers through the
    ``generation.<id>`` group; the row keeps the request and its final result.
    """

    Status = JobStatus  # the status machine of every job row (its rows are batched, not claimed)

    class Interface(models.TextChoices):
        API = "api"
        OPENAI_CHAT = "openai_chat"
        OPENAI_COMPLETION = "openai_completion"
        CLI = "cli"
        PLAYGROUND = "playground"

    ACTIVE = (Status.QUEUED, Status.RUNNING)

    id = models.CharField(primary_key=True, max_length=64, default=new_generation_id, editable=False)
    model = models.ForeignKey(LanguageModel, on_delete=models.CASCADE, related_name="generations")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    interface = models.CharField(max_length=30, choices=Interface.choices, default=Interface.API)
    batch_id = models.CharField(max_length=64, blank=True, help_text="Rows submitted together share it")
    prompt = models.TextField(blank=True)
    messages = models.JSONField(default=list, blank=True)
    system_prompt = models.TextField(blank=True)
    chat_template = models.BooleanField(
        null=True, blank=True, help_text="Empty: on when the tokenizer has one"
    )
    parameters = models.JSONField(default=dict, help_text="Sampling parameters as resolved")
    max_tokens_explicit = models.BooleanField(default=False)
    capture_hooks = models.JSONField(default=list, blank=True)
    capture_dtype = models.CharField(max_length=20, default="float32")
    # Interventions applied while generating (generation.interventions' JSON shape, validated).
    interventions = models.JSONField(default=list, blank=True)
    # The SAE feature whose activation on the output is measured ({"sae", "feature", "hook"}), and
    # what was measured (engine.effects.SteeringEffect, with that feature named).
    measure = models.JSONField(default=dict, blank=True)
    effect = models.JSONField(default=dict, blank=True)
    # Rows of one coefficient sweep share the batch and carry their place in it.
    sweep_coefficient = models.FloatField(null=True, blank=True)
    store_activations = models.BooleanField(default=True)

    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED, db_index=True)
    host_worker = models.CharField(max_length=255, blank=True)
    input_token_ids = models.JSONField(default=list, blank=True)
    output_token_ids = models.JSONField(default=list, blank=True)
    output_text = models.TextField(blank=True)
    finish_reason = models.CharField(max_length=20, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    prefill_ms = models.FloatField(null=True, blank=True)
    decode_tokens_per_second = models.FloatField(null=True, blank=True)
    total_ms = models.FloatField(null=True, blank=True)
    cache = models.ForeignKey(
        "activations.ActivationCache", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # What the request may cost, in work tokens (``generation.admission``): counted against its
    # owner's share and the worker's while the row is queued or running.
    work_tokens = models.PositiveIntegerField(default=0)
    # A row whose batch yielded to other users' rows before it ended: where it stands
    # (``engine.generation.Progress`` as JSON) and its timings so far; empty otherwise.
    progress = models.JSONField(default=dict, blank=True)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)  # as a job row's (``JobRow``)

    class Meta:
        ordering = ["-created_at"]
        # The table it had in models_app, kept so that moving the model into this app moved no data.
        db_table = "models_app_generation"

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    @property
    def usage(self) -> dict[str, int]:
        """Token counts in OpenAI's shape."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    @property
    def timings(self) -> dict[str, float | None]:
        return {
            "prefill_ms": self.prefill_ms,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "total_ms": self.total_ms,
        }

    def mark_running(self, *, host_worker: str, input_token_ids: list[int]) -> list[str]:
        self.status = self.Status.RUNNING
        self.host_worker = host_worker
        self.input_token_ids = input_token_ids
        self.prompt_tokens = len(input_token_ids)
        self.started_at = self.started_at or timezone.now()  # a row going on after a yield keeps it
        return ["status", "host_worker", "input_token_ids", "prompt_tokens", "started_at"]

    def mark_finished(
        self,
        *,
        output_token_ids: list[int],
        output_text: str,
        finish_reason: str,
        prefill_ms: float,
        decode_tokens_per_second: float | None,
        total_ms: float,
    ) -> list[str]:
        """``completed``, or ``cancelled`` when the client (or a cancel request) stopped it."""
        self.status = self.Status.CANCELLED if finish_reason == "cancelled" else self.Status.COMPLETED
        self.output_token_ids, self.output_text = output_token_ids, storable_text(output_text)
        self.finish_reason = finish_reason
        self.completion_tokens = len(output_token_ids)
        self.prefill_ms, self.decode_tokens_per_second, self.total_ms = (
            prefill_ms,
            decode_tokens_per_second,
            total_ms,
        )
        self.finished_at = timezone.now()
        return [
            "status", "output_token_ids", "output_text", "finish_reason", "completion_tokens", "prefill_ms",
            "decode_tokens_per_second", "total_ms", "finished_at",
        ]  # fmt: skip

    def mark_yielded(self, *, progress: dict, output_token_ids: list[int], output_text: str) -> list[str]:
        """Back to ``queued`` with its ``progress``: its batch yielded the worker to other users'
        rows before it ended; it goes on from there in a later batch (the output so far is kept,
        so a cancel meanwhile answers with it)."""
        self.status = self.Status.QUEUED
        self.progress = progress
        self.output_token_ids, self.output_text = output_token_ids, storable_text(output_text)
        self.completion_tokens = len(output_token_ids)
        return ["status", "progress", "output_token_ids", "output_text", "completion_tokens"]

    def mark_failed(self, *, code: str, message: str) -> list[str]:
        self.status = self.Status.FAILED
        self.error_code, self.error_message = code, message
        self.finished_at = timezone.now()
        return ["status", "error_code", "error_message", "finished_at"]
