"""Steering-vector workflows: contrastive requests (a job), import, rename / share, delete; and
patching and the logit lens, answered by the model's worker.

Every front door (API, admin, ``manage.py steering_vector``) calls these.
"""

from __future__ import annotations

import math
from typing import Any

from django.db import transaction

from activations.models import Dataset
from activations.services import dataset_samples, hook_names_for
from generation.services import hook_widths
from mistudio import jobs
from mistudio.access import OPERATOR, check_may_change, reach
from mistudio.budgets import memory_budget_check
from mistudio.errors import ApplicationError
from mistudio.text import check_label_text
from mistudio.workers import call_worker
from models_app.models import LanguageModel
from models_app.services import model_host, model_job_queue, model_probe_memory, model_worker_name
from steering.models import SteeringVector

MAX_PROMPTS = 512
MAX_PROMPT_CHARACTERS = 4000
MAX_PROMPT_BYTES = 256 * 1024  # of one side's prompts, as UTF-8: what a row may hold
MAX_TOKENS_PER_PROMPT = 512
BATCH_SIZE = 16
VECTOR_TENSOR = "vector"


def _prompt_list(prompts: Any, field: str) -> list[str]:
    if (
        not isinstance(prompts, list)
        or not 1 <= len(prompts) <= MAX_PROMPTS
        or not all(isinstance(prompt, str) and prompt.strip() for prompt in prompts)
        or any(len(prompt) > MAX_PROMPT_CHARACTERS for prompt in prompts)
    ):
        raise ApplicationError(
            "INVALID_PROMPTS",
            f"{field} must be 1 to {MAX_PROMPTS} non-empty prompts of at most "
            f"{MAX_PROMPT_CHARACTERS} characters.",
            details={"fields": {field: ["A list of prompts."]}},
            status=400,
        )
    size = sum(len(prompt.encode()) for prompt in prompts)
    if size > MAX_PROMPT_BYTES:
        raise ApplicationError(
            "INVALID_PROMPTS",
            f"{field} holds {size:,} bytes of text, over {MAX_PROMPT_BYTES:,}: use a dataset "
            f"({field}_dataset_id) for more.",
            details={"fields": {field: [f"At most {MAX_PROMPT_BYTES:,} bytes."]}},
            status=400,
        )
    return prompts


def dataset_prompts(dataset: Dataset) -> list[str]:
    """A dataset's first ``MAX_PROMPTS`` samples as prompts (each cut to ``MAX_PROMPT_CHARACTERS``)."""
    return [
        text[:MAX_PROMPT_CHARACTERS] for text in dataset_samples(dataset, limit=MAX_PROMPTS) if text.strip()
    ]


def vector_prompts(vector: SteeringVector) -> tuple[list[str], list[str]]:
    """The two prompt lists of a contrastive vector: its own, or its datasets' first samples."""

    def side(prompts: list[str], dataset: Dataset | None, field: str) -> list[str]:
        if prompts:
            return prompts
        if dataset is None:
            raise ApplicationError("DATASET_NOT_FOUND", f"The {field} dataset is gone.", status=404)
        return dataset_prompts(dataset)

    return (
        side(vector.positive, vector.positive_dataset, "positive"),
        side(vector.negative, vector.negative_dataset, "negative"),
    )


def vector_request(
    *,
    owner,
    model: LanguageModel,
    hook_name: str,
    positive: list[str] | None = None,
    negative: list[str] | None = None,
    positive_dataset: Dataset | None = None,
    negative_dataset: Dataset | None = None,
    reduction: str = SteeringVector.Reduction.MEAN,
    name: str = "",
    shared: bool = False,
) -> SteeringVector:
    """Queue a contrastive vector: mean activation at ``hook_name`` over the positive prompts minus
    over the negative ones (every token, or each prompt's last with ``reduction="last"``). Each
    side is a list of prompts (at most ``MAX_PROMPT_BYTES``) or a dataset the owner may read
    (referenced: the job reads its first ``MAX_PROMPTS`` samples)."""
    (hook_name,) = hook_names_for(model, hooks=[hook_name], layers=None)
    if reduction not in SteeringVector.Reduction.values:
        raise ApplicationError("INVALID_REDUCTION", "reduction must be mean or last.", status=400)
    check_label_text(name, field="name")
    sides = {}
    for field, prompts, dataset in (
        ("positive", positive, positive_dataset),
        ("negative", negative, negative_dataset),
    ):
        if (prompts is None) == (dataset is None):
            raise ApplicationError(
                "INVALID_PROMPTS",
                f"Give either {field} (prompts) or {field}_dataset_id.",
                details={"fields": {field: ["Prompts or a dataset."]}},
            )
        sides[field] = (
            _prompt_list(prompts, field) if prompts is not None else [],
            reach(owner or OPERATOR, dataset) if dataset else None,
        )
    with transaction.atomic():
        jobs.job_admit(owner=owner, tokens=2 * MAX_PROMPTS * MAX_TOKENS_PER_PROMPT)
        estimate = memory_budget_check(
            model_probe_memory(
                model, tokens=BATCH_SIZE * MAX_TOKENS_PER_PROMPT, longest=MAX_TOKENS_PER_PROMPT
            ),
            what="this steering vector",
            worker_name=model_worker_name(model),
        )
        vector = SteeringVector.objects.create(
            name=name,
            model=model,
            hook_name=hook_name,
            positive=sides["positive"][0],
            negative=sides["negative"][0],
            positive_dataset=sides["positive"][1],
            negative_dataset=sides["negative"][1],
            reduction=reduction,
            memory_estimate_bytes=estimate,
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=shared,
        )
        jobs.job_submit(vector, queue=model_job_queue(vector.model_id))
    return vector


def vector_cancel(*, vector: SteeringVector, actor) -> SteeringVector:
    """A queued vector is cancelled at once; a running one stops after its current batch."""
    return jobs.job_cancel(vector, actor=actor)


def vector_store(vector: SteeringVector, values) -> None:
    """Write ``values`` ([width] float32) as the vector's file and mark it completed."""
    import torch
    from safetensors.torch import save_file

    values = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
    vector.directory.mkdir(parents=True, exist_ok=True)
    temporary = vector.path.with_suffix(".partial")
    save_file({VECTOR_TENSOR: values}, str(temporary), metadata={"hook_name": vector.hook_name})
    temporary.replace(vector.path)
    jobs.job_publish(vector, "completed", vector.mark_completed(width=len(values), norm=float(values.norm())))


def vector_tensor(vector_id: str):
    """The vector's values ([width] float32), read from its file (safetensors only)."""
    from safetensors.torch import load_file

    vector = SteeringVector.objects.filter(pk=vector_id, status=SteeringVector.Status.COMPLETED).first()
    if vector is None:
        raise ApplicationError(
            "STEERING_VECTOR_NOT_FOUND", f"The steering vector {vector_id} is gone.", status=404
        )
    return load_file(str(vector.path))[VECTOR_TENSOR]


def vector_import(
    *, owner, model: LanguageModel, hook_name: str, data: bytes, name: str = "", shared: bool = False
) -> SteeringVector:
    """A vector from a safetensors file holding one 1-D tensor (named ``vector``, or alone) of the
    hook's width; refused with 400 ``INVALID_VECTOR`` otherwise (nothing is kept)."""
    import torch
    from safetensors.torch import load

    (hook_name,) = hook_names_for(model, hooks=[hook_name], layers=None)
    try:
        tensors = load(data)
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise ApplicationError("INVALID_VECTOR", f"Not a safetensors file ({error}).", status=400) from None
    values = tensors.get(VECTOR_TENSOR, next(iter(tensors.values())) if len(tensors) == 1 else None)
    width = hook_widths(model, []).get(hook_name)
    if values is None or values.dim() != 1 or (width is not None and len(values) != width):
        raise ApplicationError(
            "INVALID_VECTOR",
            f"The file must hold one 1-D tensor ({VECTOR_TENSOR!r}) of {hook_name}'s width {width}.",
            status=400,
        )
    values = values.to(torch.float32)
    if not bool(torch.isfinite(values).all()) or not math.isfinite(float(values.norm())):
        raise ApplicationError("INVALID_VECTOR", "The vector has non-finite values.", status=400)
    check_label_text(name, field="name")
    with transaction.atomic():
        vector = SteeringVector.objects.create(
            name=name, source=SteeringVector.Source.IMPORTED, model=model, hook_name=hook_name,
            owner=owner if getattr(owner, "is_authenticated", False) else None, shared=shared,
        )  # fmt: skip
        vector_store(vector, values)
    return vector


def vector_update(*, vector: SteeringVector, actor, **changes: Any) -> SteeringVector:
    jobs.job_update(vector, actor=actor, changes=changes)
    return vector


def vector_delete(*, vector: SteeringVector, actor) -> None:
    """Delete the row; its file follows on commit. A vector being computed must be cancelled
    first (409 ``STEERING_VECTOR_BUSY``)."""
    check_may_change(vector, actor, what="steering vector")
    if vector.status in SteeringVector.ACTIVE:
        raise ApplicationError(
            "STEERING_VECTOR_BUSY", "The steering vector is being computed; cancel it first.", status=409
        )
    vector.delete()


# --- patching and the logit lens (answered by the model's worker) ---------------------------------

MAX_PROBE_TOKENS = 64
MAX_PATCH_HOOKS = 128
PROBE_WAIT_SECONDS = 120


def patching_request(
    *,
    model: LanguageModel,
    actor=None,
    clean: str,
    corrupted: str,
    answer: str,
    wrong_answer: str,
    hooks: list[str] | None = None,
) -> dict[str, Any]:
    """The activation-patching grid (``engine.patching.patching_grid``) of two prompts of the same
    token length, the metric being logit(answer) - logit(wrong_answer) at the last position; by
    default every block's ``hook_resid_pre``. Runs on the model's worker."""
    if hooks:
        hooks = hook_names_for(model, hooks=hooks, layers=None)
        if len(hooks) > MAX_PATCH_HOOKS:
            raise ApplicationError("TOO_MANY_HOOKS", f"At most {MAX_PATCH_HOOKS} hook points.", status=400)
    worker = model_host(model)
    memory_budget_check(
        model_probe_memory(model, tokens=MAX_PROBE_TOKENS, longest=MAX_PROBE_TOKENS, runs=3),
        what="patching on this model",
        worker_name=worker,
    )
    return call_worker(
        worker, "steering.tasks.run_patching", model.id, clean, corrupted, answer, wrong_answer, hooks or [],
        wait_seconds=PROBE_WAIT_SECONDS, owner=actor,
    )  # fmt: skip


def logit_lens_request(*, model: LanguageModel, prompt: str, top: int = 5, actor=None) -> dict[str, Any]:
    """The top next-token predictions read out after every block at every position of ``prompt``."""
    worker = model_host(model)
    memory_budget_check(
        model_probe_memory(model, tokens=MAX_PROBE_TOKENS, longest=MAX_PROBE_TOKENS, runs=1),
        what="the logit lens on this model",
        worker_name=worker,
    )
    return call_worker(
        worker,
        "steering.tasks.run_logit_lens",
        model.id,
        prompt,
        top,
        wait_seconds=PROBE_WAIT_SECONDS,
        owner=actor,
    )
