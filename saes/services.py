"""SAE workflows: train requests, enqueue, cancel, resume, import, evaluate, rename / share, delete.

Every front door (API, pages, admin, ``manage.py`` commands) calls these. Rows change through
their ``mark_*`` methods and every change is announced by :func:`sae_publish` (on commit).
"""

import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from activations.models import ActivationCache
from activations.selectors import hook_points
from activations.services import cache_touch, hook_names_for
from mistudio.access import check_may_change
from mistudio.errors import ApplicationError
from mistudio.events import publish, rows_audience
from mistudio.local_paths import path_inside_roots
from mistudio.redis_client import get_redis
from mistudio.workers import cancel_if_queued, enqueue
from models_app.models import LanguageModel
from models_app.services import model_job_queue
from saes.models import ARCHITECTURES, SparseAutoencoder
from saes.serializers import sae_state

logger = logging.getLogger(__name__)

# Held-out part of a cache (its last samples): never trained on, used for evaluation.
HOLDOUT_FRACTION = 0.05
MAX_SAE_PARAMETERS = 2**28  # d_in x d_sae: 1 GiB per weight matrix in float32
B_DEC_INITS = ("geometric_median", "mean", "zeros")


def sae_groups(sae: SparseAutoencoder) -> list[str]:
    groups = [f"sae.{sae.id}"]
    if sae.model_id:
        groups.append(f"model.{sae.model_id}")
    return groups


def sae_publish(sae: SparseAutoencoder, event: str, fields: list[str], **extra: Any) -> None:
    """Save ``fields`` and announce ``event`` with the SAE's state (its curves only in snapshots
    and the REST detail: events carry the newest points in ``points``)."""
    publish(
        event,
        {**sae_state(sae, with_history=False), **extra},
        groups=sae_groups(sae),
        instance=sae,
        fields=fields,
        audience=rows_audience(("sae", sae.id)),
    )


# --- training ------------------------------------------------------------------------------------


def training_hyperparameters(
    *,
    architecture: str,
    d_in: int,
    d_sae: int | None,
    expansion_factor: int | None,
    k: int | None,
    l1_coefficient: float | None,
    l0_coefficient: float | None,
    lr: float,
    batch_size: int,
    total_tokens: int,
    b_dec_init: str,
) -> dict[str, Any]:
    """The training configuration, validated, with the defaults a researcher expects filled in."""
    if architecture not in ARCHITECTURES:
        raise ApplicationError(
            "INVALID_ARCHITECTURE",
            f"architecture must be one of {', '.join(ARCHITECTURES)}.",
            details={"valid": list(ARCHITECTURES)},
        )
    if b_dec_init not in B_DEC_INITS:
        raise ApplicationError("INVALID_PARAMETER", f"b_dec_init must be one of {', '.join(B_DEC_INITS)}.")
    if d_sae is not None and expansion_factor is not None and d_sae != expansion_factor * d_in:
        raise ApplicationError("INVALID_PARAMETER", "Give d_sae or expansion_factor, not both.")
    d_sae = d_sae or (expansion_factor or 8) * d_in
    if d_in * d_sae > MAX_SAE_PARAMETERS:
        raise ApplicationError(
            "SAE_TOO_LARGE",
            f"d_in x d_sae = {d_in * d_sae:,} is over the limit of {MAX_SAE_PARAMETERS:,} per matrix.",
            details={"d_in": d_in, "d_sae": d_sae},
        )
    config: dict[str, Any] = {
        "architecture": architecture,
        "d_sae": d_sae,
        "lr": lr,
        "batch_size": batch_size,
        "total_tokens": total_tokens,
        "b_dec_init": b_dec_init,
        "warmup_steps": min(1000, max(1, -(-total_tokens // batch_size) // 20)),
    }
    if architecture in ("topk", "batchtopk"):
        k = k or 32
        if k > d_sae:
            raise ApplicationError("INVALID_PARAMETER", f"k ({k}) must not exceed d_sae ({d_sae}).")
        config["k"] = k
    elif k is not None:
        raise ApplicationError("INVALID_PARAMETER", f"k applies to topk and batchtopk, not {architecture}.")
    if architecture == "standard":
        config["l1_coefficient"] = 5.0 if l1_coefficient is None else l1_coefficient
    if architecture == "jumprelu":
        config["l0_coefficient"] = 1.0 if l0_coefficient is None else l0_coefficient
    return config


def training_tokens(cache: ActivationCache) -> int:
    """Tokens of a cache that training may use: all but the held-out part."""
    return max(1, int(cache.num_tokens * (1 - HOLDOUT_FRACTION)))


def sae_train_request(
    *,
    owner,
    cache: ActivationCache,
    hook: str,
    architecture: str = "topk",
    d_sae: int | None = None,
    expansion_factor: int | None = None,
    k: int | None = None,
    l1_coefficient: float | None = None,
    l0_coefficient: float | None = None,
    lr: float = 3e-4,
    batch_size: int = 4096,
    total_tokens: int | None = None,
    b_dec_init: str = "geometric_median",
    name: str = "",
    shared: bool = False,
) -> SparseAutoencoder:
    """Queue the training of an SAE on ``cache``'s activations at ``hook`` (a completed cache the
    caller may read). ``total_tokens`` defaults to one pass over the training part of the cache;
    more passes reshuffle it."""
    if cache.status != ActivationCache.Status.COMPLETED:
        raise ApplicationError("CACHE_NOT_READY", f"The cache is {cache.status}.", status=409)
    if hook not in cache.hooks:
        raise ApplicationError(
            "INVALID_HOOK",
            f"The cache has no hook {hook!r}.",
            details={"invalid": [hook], "valid": cache.hooks},
        )
    d_in = int(cache.activation_shapes[hook][1])
    total_tokens = total_tokens or training_tokens(cache)
    config = training_hyperparameters(
        architecture=architecture, d_in=d_in, d_sae=d_sae, expansion_factor=expansion_factor, k=k,
        l1_coefficient=l1_coefficient, l0_coefficient=l0_coefficient, lr=lr, batch_size=batch_size,
        total_tokens=total_tokens, b_dec_init=b_dec_init,
    )  # fmt: skip
    with transaction.atomic():
        sae = SparseAutoencoder.objects.create(
            name=name,
            model=cache.model,
            model_name=cache.model.display_identifier,
            cache=cache,
            hook_name=hook,
            architecture=architecture,
            d_in=d_in,
            d_sae=config["d_sae"],
            k=config.get("k"),
            hyperparameters=config,
            total_tokens=total_tokens,
            total_steps=-(-total_tokens // batch_size),
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=shared,
        )
        sae.name = sae.name or f"{architecture} {hook} ({sae.id})"
        sae.rq_job_id = f"sae-{sae.id}"
        sae_publish(sae, "sae:queued", ["name", "rq_job_id"])
        sae_enqueue(sae, "saes.tasks.run_sae_training", sae.id)
    return sae


def sae_enqueue(sae: SparseAutoencoder, task: str, *args: Any, worker_name: str | None = None) -> None:
    """To the model's host if it is loaded there (a job that ends with CE loss recovered then needs
    no second copy of the model), else to the shared queue."""
    enqueue(model_job_queue(sae.model_id, worker_name=worker_name), task, *args, job_id=sae.rq_job_id)


def sae_cancel_key(sae_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:cancel:sae:{sae_id}"


def sae_cancel_requested(sae_id: str) -> bool:
    return bool(get_redis().exists(sae_cancel_key(sae_id)))


def sae_cancel(*, sae: SparseAutoencoder) -> SparseAutoencoder:
    """A queued training is cancelled at once; a running one stops after its current step."""
    with transaction.atomic():
        sae = SparseAutoencoder.objects.select_for_update().get(pk=sae.pk)
        if sae.status not in SparseAutoencoder.ACTIVE:
            raise ApplicationError("NOT_RUNNING", "The SAE is not queued or training.", status=409)
        get_redis().set(sae_cancel_key(sae.id), "1", ex=7 * 24 * 3600)
        queued = cancel_if_queued(sae.rq_job_id)
        if queued:
            sae_discard(sae)
    return sae


def sae_discard(sae: SparseAutoencoder) -> None:
    """The training is ``cancelled``; its files (checkpoint, partial weights) go on commit."""
    sae_publish(sae, "sae:cancelled", sae.mark_cancelled())
    files_removed_on_commit(sae)


def sae_failed(sae: SparseAutoencoder, *, code: str, message: str) -> None:
    """``failed`` with its code; the checkpoint and partial files are removed (nothing half-made stays)."""
    sae_publish(sae, "sae:failed", sae.mark_failed(code=code, message=message), code=code, message=message)
    files_removed_on_commit(sae)


def sae_training_lease(sae: SparseAutoencoder) -> None:
    """Keep the training cache out of eviction while the SAE reads it (renewed as it goes)."""
    if sae.cache_id:
        cache_touch(sae.cache, lease_seconds=900)


def sae_resume_on_worker_start(identity) -> None:
    """The worker hook: a starting worker resumes the trainings it was running when it died."""
    sae_resume_after_restart(worker_name=identity.name)


def sae_resume_after_restart(*, worker_name: str) -> list[str]:
    """Re-queue, on this worker's own queue, the trainings it was running when it died; they go on
    from their last checkpoint. Returns their ids."""
    resumed = []
    for sae in SparseAutoencoder.objects.filter(
        host_worker=worker_name, status=SparseAutoencoder.Status.RUNNING
    ):
        sae.rq_job_id = f"sae-{sae.id}-{uuid.uuid4().hex[:6]}"
        sae.save(update_fields=["rq_job_id"])
        sae_enqueue(sae, "saes.tasks.run_sae_training", sae.id, worker_name=worker_name)
        resumed.append(sae.id)
    return resumed


# --- evaluation ------------------------------------------------------------------------------------


def sae_evaluate_request(
    *, sae: SparseAutoencoder, cache: ActivationCache | None = None
) -> SparseAutoencoder:
    """Queue an evaluation on the held-out part of ``cache`` (default: the training cache), with
    CE loss recovered (the job loads the model where it runs if no worker has it)."""
    cache = cache or sae.cache
    if sae.status != SparseAutoencoder.Status.COMPLETED:
        raise ApplicationError("SAE_NOT_READY", f"The SAE is {sae.status}.", status=409)
    if cache is None:
        raise ApplicationError("CACHE_REQUIRED", "Name an activation cache to evaluate on (cache_id).")
    if cache.status != ActivationCache.Status.COMPLETED:
        raise ApplicationError("CACHE_NOT_READY", f"The cache is {cache.status}.", status=409)
    width = (cache.activation_shapes.get(sae.hook_name) or [0, 0])[1]
    if sae.hook_name not in cache.hooks or width != sae.d_in:
        raise ApplicationError(
            "INVALID_HOOK",
            f"The cache has no {sae.hook_name!r} activations of width {sae.d_in}.",
            details={"hook_name": sae.hook_name, "cache_hooks": cache.hooks},
        )
    if sae.model_id is None and cache.model_id is None:
        raise ApplicationError("MODEL_REQUIRED", "The SAE names no registered model.")
    if sae.evaluation_status:
        raise ApplicationError("EVALUATION_IN_PROGRESS", "An evaluation is already queued.", status=409)
    with transaction.atomic():
        if sae.model_id is None:
            sae.model = cache.model
            sae.save(update_fields=["model"])
        sae.rq_job_id = f"sae-eval-{sae.id}-{uuid.uuid4().hex[:6]}"
        sae_publish(sae, "sae:evaluation", [*sae.mark_evaluation(status="queued"), "rq_job_id"])
        sae_enqueue(sae, "saes.tasks.run_sae_evaluation", sae.id, cache.id)
    return sae


# --- import, export, changes ---------------------------------------------------------------------


def sae_import(
    *,
    owner,
    local_path: str,
    format: str = "auto",
    model: LanguageModel | None = None,
    hook: str | None = None,
    name: str = "",
    shared: bool = False,
) -> SparseAutoencoder:
    """Import an SAE from a folder under ``LOCAL_MODEL_ROOTS``: a SAELens folder (``cfg.json`` +
    ``sae_weights.safetensors``) or a Gemma Scope ``params.npz``. It is validated, then stored
    here as a SAELens folder, so export gives it back in SAELens' layout."""
    from engine.sae.formats import (
        CFG_FILENAME,
        GEMMA_SCOPE_FILENAME,
        SaeFormatError,
        load_gemma_scope,
        load_saelens,
        save_saelens,
    )

    folder = path_inside_roots(local_path, settings.LOCAL_MODEL_ROOTS, setting="LOCAL_MODEL_ROOTS")
    if not folder.is_dir():
        raise ApplicationError("INVALID_LOCAL_PATH", "The local path is not a folder.")
    if format == "auto":
        format = "gemma_scope" if (folder / GEMMA_SCOPE_FILENAME).is_file() else "saelens"
    if format == "saelens" and not (folder / CFG_FILENAME).is_file():
        raise ApplicationError(
            "INVALID_SAE", f"Not a SAELens folder: no {CFG_FILENAME} (or use format=gemma_scope)."
        )
    try:
        if format == "gemma_scope":
            sae_module, described = load_gemma_scope(folder), {"hook_name": None, "model_name": None}
        else:
            sae_module, described = load_saelens(folder)
    except SaeFormatError as error:
        raise ApplicationError(error.code, error.message, details=error.details) from None
    hook_name = hook or described.get("hook_name")
    if not hook_name:
        raise ApplicationError("HOOK_REQUIRED", "The folder names no hook point: give hook.")
    shape = sae_module.shape
    sae = SparseAutoencoder(
        name=name or folder.name,
        source=SparseAutoencoder.Source.GEMMA_SCOPE
        if format == "gemma_scope"
        else SparseAutoencoder.Source.SAELENS,
        model=model,
        model_name=(model.display_identifier if model else None) or described.get("model_name") or "",
        hook_name=hook_name,
        architecture=shape.architecture,
        d_in=shape.d_in,
        d_sae=shape.d_sae,
        k=shape.k,
        status=SparseAutoencoder.Status.COMPLETED,
        progress=100,
        owner=owner if getattr(owner, "is_authenticated", False) else None,
        shared=shared,
    )
    if model is not None:
        check_hook_width(model, hook_name, shape.d_in)
    save_saelens(
        sae_module, sae.directory, hook_name=hook_name, model_name=sae.model_name,
        metadata={"mistudio_sae_id": sae.id},
    )  # fmt: skip
    sae.file_size_bytes = folder_size(sae.directory)
    try:
        sae.save()
    except Exception:
        shutil.rmtree(sae.directory, ignore_errors=True)
        raise
    sae_publish(sae, "sae:completed", [])
    return sae


def check_hook_width(model: LanguageModel, hook_name: str, d_in: int) -> None:
    """The hook exists on ``model`` with width ``d_in`` (from its structure: no weights loaded)."""
    hook_names_for(model, hooks=[hook_name], layers=None)
    widths = {point["name"]: point["shape"][-1] for point in hook_points(model)["hook_points"]}
    if hook_name in widths and widths[hook_name] != d_in:
        raise ApplicationError(
            "HOOK_WIDTH_MISMATCH",
            f"{hook_name} of this model has width {widths[hook_name]}, the SAE takes {d_in}.",
            details={"hook_width": widths[hook_name], "d_in": d_in},
        )


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def sae_update(*, sae: SparseAutoencoder, actor, **changes: Any) -> SparseAutoencoder:
    """Rename or share / unshare (``SparseAutoencoder.OWNER_FIELDS``): the owner, an admin or the
    operator only (403 ``NOT_OWNER``)."""
    check_may_change(sae, actor, what="SAE")
    fields = [field for field in SparseAutoencoder.OWNER_FIELDS if field in changes]
    for field in fields:
        setattr(sae, field, changes[field])
    sae_publish(sae, "sae:updated", fields)
    return sae


def sae_delete(*, sae: SparseAutoencoder, actor) -> None:
    """Delete the row; its folder follows on commit (``sae_files_follow_row``). A training in
    flight must be cancelled first (409 ``SAE_BUSY``)."""
    check_may_change(sae, actor, what="SAE")
    if sae.status in SparseAutoencoder.ACTIVE:
        raise ApplicationError("SAE_BUSY", "The SAE is training; cancel it first.", status=409)
    sae.delete()


def sae_files_follow_row(sender, instance: SparseAutoencoder, **kwargs) -> None:
    """pre_delete of an SAE row, however it goes: its folder is removed once the deletion commits."""
    files_removed_on_commit(instance)


def files_removed_on_commit(sae: SparseAutoencoder) -> None:
    """The SAE's folder is removed once the current transaction commits (never while it could
    still roll back); the path is read now, since a deleted row has no id."""
    directory = sae.directory
    transaction.on_commit(lambda: shutil.rmtree(directory, ignore_errors=True))
