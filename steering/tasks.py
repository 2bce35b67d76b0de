"""The contrastive steering-vector job: the model over both prompt lists, difference of means."""

from __future__ import annotations

import logging

from django.db import close_old_connections

from engine.errors import EngineError
from engine.extraction import extract, plan_batches, tokenize_samples
from mistudio.errors import ApplicationError
from models_app.tasks import Requeued, current_worker, model_in_this_worker
from steering.models import SteeringVector
from steering.services import MAX_TOKENS_PER_PROMPT, vector_enqueue, vector_failed, vector_store

logger = logging.getLogger(__name__)
BATCH_SIZE = 16


def mean_activation(model, tokenizer, prompts: list[str], hook: str, *, last_only: bool):
    """The mean of ``hook``'s activations over every token of ``prompts`` (or over each prompt's
    last token), float32, on the CPU: what the contrastive vector subtracts."""
    import torch

    tokenized = tokenize_samples(tokenizer, prompts, MAX_TOKENS_PER_PROMPT)
    lengths = [len(ids) for ids in tokenized]
    total, count = None, 0
    for batch in extract(model, tokenized, plan_batches(lengths, BATCH_SIZE), hooks=[hook], dtype="float32"):
        rows = batch.activations[hook].float()
        if last_only:
            last = torch.tensor([lengths[index] - 1 for index in batch.sample_index.tolist()])
            rows = rows[torch.as_tensor(batch.positions) == last]
        summed = rows.sum(dim=0, dtype=torch.float64)
        total = summed if total is None else total + summed
        count += len(rows)
    return (total / max(count, 1)).float()


def run_steering_vector(vector_id: str) -> None:
    """Compute a queued contrastive vector on this worker (loading its model if need be)."""
    close_old_connections()
    vector = SteeringVector.objects.filter(pk=vector_id).first()
    if vector is None or vector.status not in SteeringVector.ACTIVE:
        return
    identity = current_worker()
    try:
        if vector.model_id is None:
            raise ApplicationError("MODEL_NOT_FOUND", "The vector's model is gone.")
        loaded = model_in_this_worker(
            vector.model_id,
            identity.name,
            requeue=lambda: vector_enqueue(vector),
            purpose="a steering vector",
        )
        vector.save(update_fields=vector.mark_running(host_worker=identity.name))
        last_only = vector.reduction == SteeringVector.Reduction.LAST
        means = [
            mean_activation(loaded.model, loaded.tokenizer, prompts, vector.hook_name, last_only=last_only)
            for prompts in (vector.positive, vector.negative)
        ]
        vector_store(vector, means[0] - means[1])
    except Requeued:
        return
    except (ApplicationError, EngineError) as error:
        vector_failed(vector, code=error.code, message=error.message)
    except Exception as error:
        logger.exception("steering vector %s failed", vector_id)
        vector_failed(vector, code="STEERING_VECTOR_FAILED", message=f"{type(error).__name__}: {error}")
