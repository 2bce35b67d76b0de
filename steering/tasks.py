"""The contrastive steering-vector job (the model over both prompt lists, difference of means),
and patching and the logit lens answered for a waiting request."""

from __future__ import annotations

import logging
from typing import Any

from engine.extraction import extract, plan_batches, tokenize_samples
from engine.hooks import num_layers
from engine.patching import logit_lens, patching_grid
from mistudio.errors import ApplicationError
from mistudio.job_runner import JobContext, job_task
from mistudio.workers import answer_call, worker_task
from models_app.tasks import model_in_this_worker, model_loaded_here
from steering.models import SteeringVector
from steering.services import (
    BATCH_SIZE,
    MAX_PROBE_TOKENS,
    MAX_TOKENS_PER_PROMPT,
    vector_prompts,
    vector_store,
)

logger = logging.getLogger(__name__)


def mean_activation(model, tokenizer, prompts: list[str], hook: str, *, last_only: bool, should_cancel=None):
    """The mean of ``hook``'s activations over every token of ``prompts`` (or over each prompt's
    last token), float32, on the CPU: what the contrastive vector subtracts."""
    import torch

    tokenized = tokenize_samples(tokenizer, prompts, MAX_TOKENS_PER_PROMPT)
    lengths = [len(ids) for ids in tokenized]
    total, count = None, 0
    batches = extract(
        model, tokenized, plan_batches(lengths, BATCH_SIZE), hooks=[hook], dtype="float32",
        should_cancel=should_cancel,
    )  # fmt: skip
    for batch in batches:
        rows = batch.activations[hook].float()
        if last_only:
            last = torch.tensor([lengths[index] - 1 for index in batch.sample_index.tolist()])
            rows = rows[torch.as_tensor(batch.positions) == last]
        summed = rows.sum(dim=0, dtype=torch.float64)
        total = summed if total is None else total + summed
        count += len(rows)
    return (total / max(count, 1)).float()


@job_task(SteeringVector, timeout=3600)
def run_steering_vector(vector: SteeringVector, job: JobContext) -> None:
    """Compute a queued contrastive vector on this worker (loading its model if need be)."""
    if vector.model_id is None:
        raise ApplicationError("MODEL_NOT_FOUND", "The vector's model is gone.")
    loaded = model_in_this_worker(vector.model_id, vector, purpose="a steering vector")
    last_only = vector.reduction == SteeringVector.Reduction.LAST
    means = [
        mean_activation(
            loaded.model,
            loaded.tokenizer,
            prompts,
            vector.hook_name,
            last_only=last_only,
            should_cancel=job.should_cancel,
        )
        for prompts in vector_prompts(vector)
    ]
    job.check_cancel()
    vector_store(vector, means[0] - means[1])


def _probe_ids(tokenizer, text: str, field: str) -> list[int]:
    ids = tokenize_samples(tokenizer, [text], MAX_PROBE_TOKENS + 1)[0]
    if not ids or len(ids) > MAX_PROBE_TOKENS:
        raise ApplicationError(
            "INVALID_PROMPT", f"{field} must be 1 to {MAX_PROBE_TOKENS} tokens.", details={"field": field}
        )
    return ids


def _one_token(tokenizer, text: str, field: str) -> int:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise ApplicationError(
            "ANSWER_NOT_ONE_TOKEN",
            f"{field} must be exactly one token; {text!r} is {len(ids)}.",
            details={"field": field, "token_ids": ids},
        )
    return ids[0]


@worker_task(timeout=600)
def run_patching(
    request_id: str, model_id: str, clean: str, corrupted: str, answer: str, wrong: str, hooks: list[str]
) -> None:
    def compute() -> dict[str, Any]:
        loaded = model_loaded_here(model_id)
        tokenizer = loaded.tokenizer
        clean_ids = _probe_ids(tokenizer, clean, "clean")
        corrupted_ids = _probe_ids(tokenizer, corrupted, "corrupted")
        answer_id, wrong_id = (
            _one_token(tokenizer, answer, "answer"),
            _one_token(tokenizer, wrong, "wrong_answer"),
        )
        names = hooks or [f"blocks.{layer}.hook_resid_pre" for layer in range(num_layers(loaded.model))]
        result = patching_grid(
            loaded.model, clean_ids, corrupted_ids, answer_id=answer_id, wrong_id=wrong_id, hooks=names
        )
        spread = result.clean_metric - result.corrupted_metric

        def normalized(value: float) -> float | None:
            return round((value - result.corrupted_metric) / spread, 6) if abs(spread) > 1e-9 else None

        return {
            "tokens": [tokenizer.decode([token]) for token in clean_ids],
            "corrupted_tokens": [tokenizer.decode([token]) for token in corrupted_ids],
            "answer_id": answer_id,
            "wrong_id": wrong_id,
            "hooks": result.hooks,
            "clean_metric": result.clean_metric,
            "corrupted_metric": result.corrupted_metric,
            "grid": result.grid,
            "normalized": [[normalized(value) for value in row] for row in result.grid],
            "all_positions": result.all_positions,
            "warning": patching_warning(spread),
        }

    answer_call(request_id, compute, failure_code="PATCHING_FAILED")


# Below this difference of logit differences between the clean and corrupted runs the corruption
# barely moves the answer: normalized effects divide by it and read as noise (a spread of 0.035
# turned a change of 0.034 into "1.972"). Half a logit is the answer's odds against the wrong one
# changing by a factor of about 1.65.
PATCHING_MIN_SPREAD = 0.5


def patching_warning(spread: float) -> str | None:
    """What to say when clean and corrupted barely differ (None when they differ enough)."""
    if abs(spread) >= PATCHING_MIN_SPREAD:
        return None
    return (
        f"The clean and corrupted runs differ by {abs(spread):.3g} in logit difference (under "
        f"{PATCHING_MIN_SPREAD}): the corruption barely changes the answer, so normalized effects "
        "divide by a small number and mostly show noise. Choose prompts whose answers differ."
    )


@worker_task(timeout=120)
def run_logit_lens(request_id: str, model_id: str, prompt: str, top: int) -> None:
    def compute() -> dict[str, Any]:
        loaded = model_loaded_here(model_id)
        ids = _probe_ids(loaded.tokenizer, prompt, "prompt")
        lens = logit_lens(loaded.model, ids, top=top)
        decode = loaded.tokenizer.decode
        return {
            "tokens": [decode([token]) for token in ids],
            "layers": lens.layers,
            "top": [
                [
                    [
                        {"token_id": token, "token": decode([token]), "probability": round(p, 6)}
                        for token, p in row
                    ]
                    for row in layer
                ]
                for layer in lens.top
            ],
        }

    answer_call(request_id, compute, failure_code="LOGIT_LENS_FAILED")
