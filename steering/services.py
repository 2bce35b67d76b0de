"""Steering-vector workflows: contrastive requests and their job, import, rename / share, delete.

Every front door (API, admin, ``manage.py steering_vector``) calls these.
"""

from __future__ import annotations

import math
import shutil
import uuid
from typing import Any

from django.db import transaction

from activations.services import dataset_samples, hook_names_for
from generation.services import hook_widths
from mistudio.access import check_may_change
from mistudio.errors import ApplicationError
from mistudio.workers import call_worker, enqueue
from models_app.models import LanguageModel
from models_app.services import model_host, model_job_queue
from steering.models import SteeringVector

MAX_PROMPTS = 512
MAX_PROMPT_CHARACTERS = 4000
MAX_TOKENS_PER_PROMPT = 512
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
    return prompts


def dataset_prompts(dataset) -> list[str]:
    """A dataset's first ``MAX_PROMPTS`` samples as prompts (each cut to ``MAX_PROMPT_CHARACTERS``)."""
    return [
        text[:MAX_PROMPT_CHARACTERS] for text in dataset_samples(dataset, limit=MAX_PROMPTS) if text.strip()
    ]


def vector_request(
    *,
    owner,
    model: LanguageModel,
    hook_name: str,
    positive: list[str],
    negative: list[str],
    reduction: str = SteeringVector.Reduction.MEAN,
    name: str = "",
    shared: bool = False,
) -> SteeringVector:
    """Queue a contrastive vector: mean activation at ``hook_name`` over ``positive`` minus over
    ``negative`` (every token, or each prompt's last with ``reduction="last"``)."""
    (hook_name,) = hook_names_for(model, hooks=[hook_name], layers=None)
    if reduction not in SteeringVector.Reduction.values:
        raise ApplicationError("INVALID_REDUCTION", "reduction must be mean or last.", status=400)
    with transaction.atomic():
        vector = SteeringVector.objects.create(
            name=name,
            model=model,
            hook_name=hook_name,
            positive=_prompt_list(positive, "positive"),
            negative=_prompt_list(negative, "negative"),
            reduction=reduction,
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=shared,
        )
        vector.rq_job_id = f"steering-{vector.id}"
        vector.save(update_fields=["rq_job_id"])
        vector_enqueue(vector)
    return vector


def vector_enqueue(vector: SteeringVector, *, worker_name: str | None = None) -> None:
    """To the model's host when it is loaded, else the shared queue (that worker loads it)."""
    queue = model_job_queue(vector.model_id, worker_name=worker_name)
    enqueue(queue, "steering.tasks.run_steering_vector", vector.id, job_id=vector.rq_job_id)


def vector_failed(vector: SteeringVector, *, code: str, message: str) -> None:
    vector.save(update_fields=vector.mark_failed(code=code, message=message))
    files_removed_on_commit(vector)


def vector_store(vector: SteeringVector, values) -> None:
    """Write ``values`` ([width] float32) as the vector's file and mark it completed."""
    import torch
    from safetensors.torch import save_file

    values = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
    vector.directory.mkdir(parents=True, exist_ok=True)
    temporary = vector.path.with_suffix(".partial")
    save_file({VECTOR_TENSOR: values}, str(temporary), metadata={"hook_name": vector.hook_name})
    temporary.replace(vector.path)
    vector.save(update_fields=vector.mark_completed(width=len(values), norm=float(values.norm())))


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
    with transaction.atomic():
        vector = SteeringVector.objects.create(
            name=name, source=SteeringVector.Source.IMPORTED, model=model, hook_name=hook_name,
            owner=owner if getattr(owner, "is_authenticated", False) else None, shared=shared,
        )  # fmt: skip
        vector_store(vector, values)
    return vector


def vector_update(*, vector: SteeringVector, actor, **changes: Any) -> SteeringVector:
    check_may_change(vector, actor, what="steering vector")
    for name, value in changes.items():
        if name in SteeringVector.OWNER_FIELDS:
            setattr(vector, name, value)
    vector.save(update_fields=[name for name in changes if name in SteeringVector.OWNER_FIELDS])
    return vector


def vector_delete(*, vector: SteeringVector, actor) -> None:
    check_may_change(vector, actor, what="steering vector")
    vector.delete()


def vector_resume_on_worker_start(identity) -> None:
    """A starting worker re-queues the vectors it was computing when it died (they start over)."""
    for vector in SteeringVector.objects.filter(
        host_worker=identity.name, status=SteeringVector.Status.RUNNING
    ):
        vector.rq_job_id = f"steering-{vector.id}-{uuid.uuid4().hex[:6]}"
        vector.save(update_fields=["rq_job_id"])
        vector_enqueue(vector, worker_name=identity.name)


def vector_files_follow_row(sender, instance: SteeringVector, **kwargs) -> None:
    files_removed_on_commit(instance)


def files_removed_on_commit(vector: SteeringVector) -> None:
    directory = vector.directory
    transaction.on_commit(lambda: shutil.rmtree(directory, ignore_errors=True))


# --- patching and the logit lens (answered by the model's worker) ---------------------------------

MAX_PROBE_TOKENS = 64
MAX_PATCH_HOOKS = 128
PROBE_WAIT_SECONDS = 120


def patching_request(
    *,
    model: LanguageModel,
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
    return call_worker(
        worker, "steering.tasks.run_patching", model.id, clean, corrupted, answer, wrong_answer, hooks or [],
        wait_seconds=PROBE_WAIT_SECONDS,
    )  # fmt: skip


def logit_lens_request(*, model: LanguageModel, prompt: str, top: int = 5) -> dict[str, Any]:
    """The top next-token predictions read out after every block at every position of ``prompt``."""
    worker = model_host(model)
    return call_worker(
        worker, "steering.tasks.run_logit_lens", model.id, prompt, top, wait_seconds=PROBE_WAIT_SECONDS
    )
