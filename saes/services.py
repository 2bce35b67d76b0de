"""SAE workflows: train requests, cancel, import, evaluate, rename / share, delete.

Every front door (API, pages, admin, ``manage.py`` commands) calls these. Trainings, imports and
evaluations are jobs (``mistudio.jobs``): admitted against the caps and budgets, then run by a
worker; rows change through their ``mark_*`` methods and every change is announced (on commit).
"""

import logging
import shutil
from pathlib import Path
from typing import Any

import xxhash
from django.conf import settings
from django.db import transaction

from activations.models import ActivationCache
from activations.selectors import hook_points
from activations.services import cache_touch, hook_names_for
from engine import budgets
from engine.errors import EngineError
from engine.hooks import MAX_HOOK_NAME_LENGTH, is_hook_name, transcoder_hooks
from engine.inspection import confined_folder_entries
from engine.inspection.sae_folders import (
    SaeFiles,
    inspect_circuit_tracer_folder,
    inspect_clt_folder,
    inspect_sae_folder,
)
from engine.sae_architectures import (
    DEFAULT_EXPANSION,
    K_SPARSE,
    architecture_named,
    default_dead_after_steps,
    default_expansion,
    default_k,
    default_total_tokens,
)
from engine.sae_architectures import matryoshka_widths as matryoshka_default_widths
from mistudio import jobs
from mistudio.access import OPERATOR, check_may_change, reach
from mistudio.budgets import memory_budget_check
from mistudio.errors import ApplicationError
from mistudio.identifiers import new_id
from mistudio.local_paths import path_inside_roots
from mistudio.text import check_label_text
from mistudio.transaction_locks import take_turns
from mistudio.workers import shared_queue
from models_app.models import LanguageModel
from models_app.services import model_job_queue, model_worker_name
from saes.cache_data import INIT_SAMPLE_ROWS, evaluation_rows, training_buffered_rows
from saes.models import ARCHITECTURES, SaeEvaluation, SparseAutoencoder

logger = logging.getLogger(__name__)

# Held-out part of a cache (its last samples): never trained on, used for evaluation.
HOLDOUT_FRACTION = 0.05
MAX_SAE_PARAMETERS = 2**28  # d_in x d_sae: 1 GiB per weight matrix in float32
B_DEC_INITS = ("geometric_median", "mean", "zeros")


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
    dead_after_steps: int | None = None,
    matryoshka_widths: list[int] | None = None,
    skip: bool = False,
    default_k_for=default_k,
) -> dict[str, Any]:
    """The training configuration, validated, with the defaults a researcher expects filled in:
    sized to the model (``default_k_for(d_in)``) and to the run (:func:`default_dead_after_steps`).
    ``skip``: a skip transcoder's linear path."""
    try:
        kind = architecture_named(architecture)
    except ValueError:
        raise ApplicationError(
            "INVALID_ARCHITECTURE",
            f"architecture must be one of {', '.join(ARCHITECTURES)}.",
            details={"valid": list(ARCHITECTURES)},
        ) from None
    if b_dec_init not in B_DEC_INITS:
        raise ApplicationError("INVALID_PARAMETER", f"b_dec_init must be one of {', '.join(B_DEC_INITS)}.")
    if d_sae is not None and expansion_factor is not None and d_sae != expansion_factor * d_in:
        raise ApplicationError("INVALID_PARAMETER", "Give d_sae or expansion_factor, not both.")
    d_sae = d_sae or (expansion_factor or DEFAULT_EXPANSION) * d_in
    check_sae_size(d_in, d_sae)
    config: dict[str, Any] = {
        "architecture": architecture,
        "d_sae": d_sae,
        "lr": lr,
        "batch_size": batch_size,
        "total_tokens": total_tokens,
        "b_dec_init": b_dec_init,
        "warmup_steps": min(1000, max(1, -(-total_tokens // batch_size) // 20)),
        "dead_after_steps": dead_after_steps or default_dead_after_steps(-(-total_tokens // batch_size)),
    }
    if kind.k_sparse:
        k = k or default_k_for(d_in)
        if k > d_sae:
            raise ApplicationError("INVALID_PARAMETER", f"k ({k}) must not exceed d_sae ({d_sae}).")
        config["k"] = k
    elif k is not None:
        raise ApplicationError(
            "INVALID_PARAMETER", f"k applies to {', '.join(K_SPARSE)}, not {architecture}."
        )
    penalty = kind.penalty
    if penalty is not None:
        given = {"l1_coefficient": l1_coefficient, "l0_coefficient": l0_coefficient}[penalty]
        config[penalty] = kind.default_penalty if given is None else given
    if kind.nested:
        try:
            config["matryoshka_widths"] = list(matryoshka_default_widths(d_sae, matryoshka_widths))
        except ValueError as error:
            raise ApplicationError("INVALID_PARAMETER", str(error)) from None
    elif matryoshka_widths:
        raise ApplicationError("INVALID_PARAMETER", "matryoshka_widths applies to matryoshka_batchtopk.")
    if skip:
        config["skip"] = True
    return config


def check_sae_size(d_in: int, d_sae: int) -> None:
    if d_in * d_sae > MAX_SAE_PARAMETERS:
        raise ApplicationError(
            "SAE_TOO_LARGE",
            f"d_in x d_sae = {d_in * d_sae:,} is over the limit of {MAX_SAE_PARAMETERS:,} per matrix.",
            details={"d_in": d_in, "d_sae": d_sae},
        )


def training_memory(config: dict[str, Any], *, d_in: int) -> budgets.MemoryEstimate:
    """The estimated peak of a training job with ``config`` (``engine.budgets.sae_training``)."""
    return budgets.sae_training(
        architecture=config["architecture"],
        d_in=d_in,
        d_sae=config["d_sae"],
        batch_size=config["batch_size"],
        buffered_rows=training_buffered_rows(config["batch_size"]),
        sample_rows=INIT_SAMPLE_ROWS,
        evaluation_rows=evaluation_rows(config["d_sae"]),
    )


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
    dead_after_steps: int | None = None,
    name: str = "",
    shared: bool = False,
) -> SparseAutoencoder:
    """Queue the training of an SAE on ``cache``'s activations at ``hook`` (a completed cache the
    caller may read). ``total_tokens`` defaults to one pass over the training part of the cache,
    or 512 steps when that is more (``engine.sae.default_total_tokens``); more passes reshuffle it.
    Neither ``d_sae`` nor ``expansion_factor``: 8, less on a small cache (``default_expansion``)."""
    check_label_text(name, field="name")
    if cache.status != ActivationCache.Status.COMPLETED:
        raise ApplicationError("CACHE_NOT_READY", f"The cache is {cache.status}.", status=409)
    if hook not in cache.hooks:
        raise ApplicationError(
            "INVALID_HOOK",
            f"The cache has no hook {hook!r}.",
            details={"invalid": [hook], "valid": cache.hooks},
        )
    d_in = int(cache.activation_shapes[hook][1])
    available = training_tokens(cache)
    total_tokens = total_tokens or default_total_tokens(available, batch_size)
    if d_sae is None and expansion_factor is None:
        expansion_factor = default_expansion(d_in, available)
    config = training_hyperparameters(
        architecture=architecture, d_in=d_in, d_sae=d_sae, expansion_factor=expansion_factor, k=k,
        l1_coefficient=l1_coefficient, l0_coefficient=l0_coefficient, lr=lr, batch_size=batch_size,
        total_tokens=total_tokens, b_dec_init=b_dec_init, dead_after_steps=dead_after_steps,
    )  # fmt: skip
    with transaction.atomic():
        jobs.job_admit(owner=owner, tokens=total_tokens)
        estimate = memory_budget_check(
            training_memory(config, d_in=d_in),
            what="this training",
            worker_name=model_worker_name(cache.model),
        )
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
            memory_estimate_bytes=estimate,
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=shared,
        )
        sae.name = sae.name or f"{architecture} {hook} ({sae.id})"
        # To the model's host if it is loaded there (a job that ends with CE loss recovered then
        # needs no second copy of the model), else to the shared queue.
        jobs.job_submit(sae, queue=model_job_queue(sae.model_id), fields=["name"])
    return sae


def sae_cancel(*, sae: SparseAutoencoder, actor) -> SparseAutoencoder:
    """A queued training or import is cancelled at once; a running one stops after its current step.
    A member of a group is part of its group's job: the group is cancelled."""
    if sae.group_id is not None:
        jobs.job_cancel(sae.group, actor=actor)
        sae.refresh_from_db()
        return sae
    return jobs.job_cancel(sae, actor=actor)


def sae_training_lease(sae: SparseAutoencoder) -> None:
    """Keep the training cache out of eviction while the SAE reads it (renewed as it goes)."""
    if sae.cache_id:
        cache_touch(sae.cache, lease_seconds=900)


# --- evaluation ------------------------------------------------------------------------------------


def default_cache(*, sae: SparseAutoencoder, user) -> ActivationCache | None:
    """The SAE's training cache, when ``user`` may read it: a shared SAE never opens its owner's
    private cache to another user."""
    if sae.cache is None:
        return None
    try:
        return reach(user, sae.cache)
    except ApplicationError:
        return None


def check_cache_for(
    sae: SparseAutoencoder, cache: ActivationCache | None, *, purpose: str
) -> ActivationCache:
    """``cache`` holds completed activations at the SAE's hook and width (400 / 409 otherwise)."""
    if cache is None:
        raise ApplicationError("CACHE_REQUIRED", f"Name an activation cache to {purpose} (cache_id).")
    if cache.status != ActivationCache.Status.COMPLETED:
        raise ApplicationError("CACHE_NOT_READY", f"The cache is {cache.status}.", status=409)
    needed = [(sae.hook_name, sae.d_in)]
    if sae.hook_name_out:  # a transcoder reads its input and output hooks side by side
        needed.append((sae.hook_name_out, sae.d_out))
    for hook, width in needed:
        if hook not in cache.hooks or (cache.activation_shapes.get(hook) or [0, 0])[1] != width:
            raise ApplicationError(
                "INVALID_HOOK",
                f"The cache has no {hook!r} activations of width {width}: extract that hook first.",
                details={"hook_name": hook, "cache_hooks": cache.hooks},
            )
    return cache


def sae_evaluate_request(
    *, sae: SparseAutoencoder, actor, cache: ActivationCache | None = None, admit: bool = True
) -> SaeEvaluation:
    """Queue an evaluation on the held-out part of ``cache`` (default: the training cache, when
    ``actor`` may read it), with CE loss recovered (the job loads the model where it runs if no
    worker has it). ``admit=False``: the follow-up of a training, not counted against the caps."""
    if sae.status != SparseAutoencoder.Status.COMPLETED:
        raise ApplicationError("SAE_NOT_READY", f"The SAE is {sae.status}.", status=409)
    check_single_layer(sae, "an evaluation")
    reader = actor or OPERATOR  # None: the operator, or a system SAE's own follow-up
    cache = check_cache_for(
        sae, reach(reader, cache) if cache is not None else default_cache(sae=sae, user=reader),
        purpose="evaluate on",
    )  # fmt: skip
    if sae.model_id is None and cache.model_id is None:
        raise ApplicationError("MODEL_REQUIRED", "The SAE names no registered model.")
    with transaction.atomic():
        take_turns("sae-evaluation", sae.pk)  # two requests at once: one evaluation, one 409
        if sae.evaluations.filter(status__in=SaeEvaluation.ACTIVE).exists():
            raise ApplicationError("EVALUATION_IN_PROGRESS", "An evaluation is already queued.", status=409)
        if admit:
            jobs.job_admit(owner=actor, tokens=cache.num_tokens)
        if sae.model_id is None:
            sae.model = cache.model
            sae.save(update_fields=["model"])
        estimate = memory_budget_check(
            budgets.sae_encoding(d_in=sae.d_in, d_sae=sae.d_sae, rows=evaluation_rows(sae.d_sae)),
            what="this evaluation",
            worker_name=model_worker_name(sae.model),
        )
        evaluation = SaeEvaluation.objects.create(
            sae=sae,
            cache=cache,
            memory_estimate_bytes=estimate,
            owner=actor if getattr(actor, "is_authenticated", False) else sae.owner,
        )
        jobs.job_submit(evaluation, queue=model_job_queue(sae.model_id))
    return evaluation


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
) -> tuple[SparseAutoencoder, bool]:
    """Import an SAE from a folder under ``LOCAL_MODEL_ROOTS``: a SAELens folder (``cfg.json`` +
    ``sae_weights.safetensors``) or a Gemma Scope ``params.npz``. Returns the row and whether it is
    new: the owner's earlier import of the same files (same hook and model) is reused.

    Here, in the web process, only headers are read: every file must resolve inside the roots
    (links followed; never into miStudio's own data), its declared sizes must agree with each other
    and the file, and the SAE must fit the size limit and the memory budget. A worker then reads
    the arrays (refusing non-finite weights) and stores them as a SAELens folder, so export gives
    it back in SAELens' layout."""
    check_label_text(name, field="name")
    folder = path_inside_roots(local_path, settings.LOCAL_MODEL_ROOTS, setting="LOCAL_MODEL_ROOTS")
    if not folder.is_dir():
        raise ApplicationError("INVALID_LOCAL_PATH", "The local path is not a folder.")
    return _import_folder(
        owner=owner, folder=folder, format=format, model=model, hook=hook, name=name, shared=shared
    )


# The files of a SAELens folder a request may send (POST /api/saes/upload), by form field.
UPLOAD_FILES = {"cfg": "cfg.json", "weights": "sae_weights.safetensors", "sparsity": "sparsity.safetensors"}


def sae_upload(
    *,
    owner,
    files: dict[str, Any],
    model: LanguageModel | None = None,
    hook: str | None = None,
    name: str = "",
    shared: bool = False,
) -> tuple[SparseAutoencoder, bool]:
    """Import a SAELens folder sent in the request: ``files`` maps :data:`UPLOAD_FILES`' fields
    (``cfg`` and ``weights`` required) to uploaded files. They are written to a folder of their own
    under ``SAE_UPLOAD_DIR`` and checked and imported as :func:`sae_import` does a local folder;
    the folder goes when the import ends (or at once, when it is refused or an earlier import of
    the same files is reused)."""
    check_label_text(name, field="name")
    folder = Path(settings.SAE_UPLOAD_DIR) / new_id("upload")
    folder.mkdir(parents=True)
    try:
        for field, filename in UPLOAD_FILES.items():
            if field in files:
                with open(folder / filename, "wb") as target:
                    for chunk in files[field].chunks():
                        target.write(chunk)
        sae, created = _import_folder(
            owner=owner, folder=folder, format="saelens", model=model, hook=hook, name=name or "uploaded",
            shared=shared, uploaded=True,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if not created:
        shutil.rmtree(folder, ignore_errors=True)
    return sae, created


def _import_folder(
    *,
    owner,
    folder: Path,
    format: str,
    model: LanguageModel | None,
    hook: str | None,
    name: str,
    shared: bool,
    uploaded: bool = False,
) -> tuple[SparseAutoencoder, bool]:
    files = sae_folder_files(folder, format, uploaded=uploaded)
    hook_name = hook or files.hook_name
    if not hook_name:
        raise ApplicationError("HOOK_REQUIRED", "The folder names no hook point: give hook.")
    if not is_hook_name(hook_name):
        raise ApplicationError(
            "INVALID_HOOK",
            f"The hook name {hook_name[:80]!r} is not a hook point name (at most {MAX_HOOK_NAME_LENGTH} "
            "characters): give hook.",
            details={"fields": {"hook": ["Not a hook point name."]}},
        )
    check_sae_size(files.d_in, files.d_sae)
    if model is not None:
        check_hook_width(model, hook_name, files.d_in)
    digest = files_digest(files.files)
    owner = owner if getattr(owner, "is_authenticated", False) else None
    with transaction.atomic():
        # Identical imports take turns from here: the second one finds the first one's row.
        take_turns("sae-import", getattr(owner, "pk", None), digest)
        earlier = SparseAutoencoder.objects.filter(
            owner=owner, content_hash=digest, hook_name=hook_name, model=model, source=source_of(files),
            status__in=[*SparseAutoencoder.ACTIVE, SparseAutoencoder.Status.COMPLETED],
        ).first()  # fmt: skip
        if earlier is not None:
            return earlier, False
        jobs.job_admit(owner=owner)
        estimate = memory_budget_check(
            budgets.sae_import(tensor_bytes=files.tensor_bytes), what="this import"
        )
        sae = SparseAutoencoder.objects.create(
            name=name or folder.name,
            source=source_of(files),
            model=model,
            model_name=(model.display_identifier if model else None) or files.model_name or "",
            hook_name=hook_name,
            architecture=files.architecture,
            d_in=files.d_in,
            d_sae=files.d_sae,
            import_path=str(folder),
            content_hash=digest,
            memory_estimate_bytes=estimate,
            owner=owner,
            shared=shared,
        )
        jobs.job_submit(sae, queue=shared_queue())  # any worker: an import needs no model
    return sae, True


def transcoder_set_import(
    *, owner, local_path: str, model: LanguageModel, name: str = "", shared: bool = False
) -> tuple[list[SparseAutoencoder], bool]:
    """Import a circuit-tracer transcoder set (``layer_{i}.safetensors`` per layer, and optionally
    its ``config.yaml``) from a folder under ``LOCAL_MODEL_ROOTS`` as one transcoder row per layer
    of ``model``, each reading ``blocks.{i}.ln2.hook_normalized`` and writing
    ``blocks.{i}.hook_mlp_out`` (what an attribution graph takes). Headers only here, checked as
    :func:`sae_import` checks a folder; a worker reads each file. Returns the rows (layer 0 first)
    and whether they are new: the owner's earlier import of the same files is reused. A folder
    holding a cross-layer transcoder (``W_enc_0.safetensors``…) is imported as its one row
    (:func:`clt_import`)."""
    check_label_text(name, field="name")
    folder = path_inside_roots(local_path, settings.LOCAL_MODEL_ROOTS, setting="LOCAL_MODEL_ROOTS")
    if not folder.is_dir():
        raise ApplicationError("INVALID_LOCAL_PATH", "The local path is not a folder.")
    if (folder / "W_enc_0.safetensors").exists():
        sae, created = clt_import(owner=owner, folder=folder, model=model, name=name, shared=shared)
        return [sae], created
    layers = sae_folder_files(folder, "circuit_tracer")
    if len(layers) != (model.num_layers or 0):
        raise ApplicationError(
            "INVALID_TRANSCODERS",
            f"The folder has {len(layers)} transcoders and {model.name} has {model.num_layers} layers.",
        )
    for files in layers:
        check_sae_size(files.d_in, files.d_sae)
        hook_in, hook_out = transcoder_hooks(files.layer)
        check_hook_width(model, hook_in, files.d_in)
        check_hook_width(model, hook_out, files.d_out)
    owner = owner if getattr(owner, "is_authenticated", False) else None
    digests = [files_digest(files.files) for files in layers]
    rows = []
    with transaction.atomic():
        # Identical imports take turns from here: the second one finds the first one's rows.
        take_turns("sae-import", getattr(owner, "pk", None), *digests)
        earlier = [
            SparseAutoencoder.objects.filter(
                owner=owner, content_hash=digest, model=model, source=SparseAutoencoder.Source.CIRCUIT_TRACER,
                hook_name=transcoder_hooks(files.layer)[0],
                status__in=[*SparseAutoencoder.ACTIVE, SparseAutoencoder.Status.COMPLETED],
            ).first()
            for files, digest in zip(layers, digests, strict=True)
        ]  # fmt: skip
        if all(earlier):
            return earlier, False
        jobs.job_admit(owner=owner)
        for files, digest in zip(layers, digests, strict=True):
            estimate = memory_budget_check(
                budgets.sae_import(tensor_bytes=files.tensor_bytes), what="this import"
            )
            sae = SparseAutoencoder.objects.create(
                name=f"{name or folder.name} · layer {files.layer}",
                source=SparseAutoencoder.Source.CIRCUIT_TRACER, model=model,
                model_name=model.display_identifier, hook_name=transcoder_hooks(files.layer)[0],
                hook_name_out=transcoder_hooks(files.layer)[1], architecture=files.architecture,
                d_in=files.d_in, d_sae=files.d_sae, d_out=files.d_out, import_path=str(files.files[0]),
                content_hash=digest, memory_estimate_bytes=estimate, owner=owner, shared=shared,
            )  # fmt: skip
            jobs.job_submit(sae, queue=shared_queue())
            rows.append(sae)
    return rows, True


def clt_import(
    *, owner, folder: Path, model: LanguageModel, name: str, shared: bool
) -> tuple[SparseAutoencoder, bool]:
    """:func:`transcoder_set_import` of a cross-layer transcoder in circuit-tracer's layout
    (``W_enc_{l}`` and ``W_dec_{l}.safetensors`` per layer; ``folder`` already resolved inside the
    roots) as one row over every layer of ``model``: ``d_sae`` features per layer, reading each
    layer's MLP input (``hook_name`` is layer 0's) and writing into that layer's MLP output and every
    later one's (``hook_name_out`` is the last layer's). Headers only here; a worker reads the files.
    Returns the row and whether it is new: the owner's earlier import of the same files is reused."""
    files = sae_folder_files(folder, "clt")
    n_layers = files.layer
    if n_layers != (model.num_layers or 0):
        raise ApplicationError(
            "INVALID_TRANSCODERS",
            f"The cross-layer transcoder has {n_layers} layers and {model.name} has {model.num_layers}.",
        )
    check_sae_size(files.d_in, files.d_sae)
    hook_in, hook_out = transcoder_hooks(0)[0], transcoder_hooks(n_layers - 1)[1]
    check_hook_width(model, hook_in, files.d_in)
    check_hook_width(model, hook_out, files.d_out)
    owner = owner if getattr(owner, "is_authenticated", False) else None
    digest = files_digest(files.files)
    with transaction.atomic():
        take_turns("sae-import", getattr(owner, "pk", None), digest)
        earlier = SparseAutoencoder.objects.filter(
            owner=owner, content_hash=digest, model=model, source=SparseAutoencoder.Source.CLT,
            status__in=[*SparseAutoencoder.ACTIVE, SparseAutoencoder.Status.COMPLETED],
        ).first()  # fmt: skip
        if earlier is not None:
            return earlier, False
        jobs.job_admit(owner=owner)
        needed = budgets.sae_import(tensor_bytes=files.tensor_bytes)
        estimate = memory_budget_check(needed, what="this import")
        sae = SparseAutoencoder.objects.create(
            name=name or folder.name, source=SparseAutoencoder.Source.CLT, model=model,
            model_name=model.display_identifier, hook_name=hook_in, hook_name_out=hook_out,
            architecture=files.architecture, d_in=files.d_in, d_sae=files.d_sae, d_out=files.d_out,
            n_layers=n_layers, import_path=str(folder), content_hash=digest, memory_estimate_bytes=estimate,
            owner=owner, shared=shared,
        )  # fmt: skip
        jobs.job_submit(sae, queue=shared_queue())
    return sae, True


def check_single_layer(sae: SparseAutoencoder, what: str) -> None:
    """400 ``UNSUPPORTED_SAE`` for a cross-layer transcoder where only single-layer SAEs work yet."""
    if sae.is_cross_layer:
        raise ApplicationError(
            "UNSUPPORTED_SAE",
            f"{sae.name or sae.id} is a cross-layer transcoder: {what} works on single-layer SAEs and "
            "transcoders for now. Attribution graphs take it whole (transcoder_ids: [its id]).",
        )


def source_of(files: SaeFiles) -> str:
    if files.format == "gemma_scope":
        return SparseAutoencoder.Source.GEMMA_SCOPE
    return SparseAutoencoder.Source.SAELENS


# miStudio's own data: never importable, whatever roots an operator sets.
PRIVATE_DIRECTORIES = (
    "SAE_DIR",
    "FEATURES_DIR",
    "STEERING_DIR",
    "GRAPH_DIR",
    "BENCH_DIR",
    "ACTIVATION_CACHE_DIR",
    "DATASET_DIR",
    "SAE_UPLOAD_DIR",  # other users' uploads waiting for their import
)


def sae_folder_files(folder: Path, format: str, *, uploaded: bool = False) -> Any:
    """The SAE files of ``folder`` from their headers, each resolved (links followed) inside
    ``LOCAL_MODEL_ROOTS`` and outside miStudio's own data (400 ``UNSAFE_PATH`` / ``INVALID_SAE``):
    a :class:`SaeFiles`, or for ``circuit_tracer`` one per layer. An ``uploaded`` folder (what
    :func:`sae_upload` wrote) is confined to ``SAE_UPLOAD_DIR`` instead."""
    try:
        roots = [Path(settings.SAE_UPLOAD_DIR)] if uploaded else settings.LOCAL_MODEL_ROOTS
        entries = confined_folder_entries(folder, roots)
        private = (
            [] if uploaded else [Path(getattr(settings, name)).resolve() for name in PRIVATE_DIRECTORIES]
        )
        for entry, real in entries.items():
            if any(real.is_relative_to(directory) for directory in private):
                raise ApplicationError(
                    "UNSAFE_PATH", f"{entry!r} links into miStudio's own data.", details={"file": entry}
                )
        if format == "circuit_tracer":
            return inspect_circuit_tracer_folder(entries)
        if format == "clt":
            return inspect_clt_folder(entries)
        return inspect_sae_folder(entries, format)
    except EngineError as error:
        raise ApplicationError(error.code, error.message, details=error.details) from None


def files_digest(paths: tuple[Path, ...]) -> str:
    """xxh3-128 of the files' bytes, in order (streamed: memory stays flat)."""
    digest = xxhash.xxh3_128()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(8 << 20):
                digest.update(block)
        digest.update(b"\x00")
    return digest.hexdigest()


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
    jobs.job_update(sae, actor=actor, changes=changes)
    return sae


def sae_delete(*, sae: SparseAutoencoder, actor) -> None:
    """Delete the row; its folder follows on commit (``mistudio.jobs``). A training or import in
    flight must be cancelled first (409 ``SAE_BUSY``)."""
    check_may_change(sae, actor, what="SAE")
    if sae.status in SparseAutoencoder.ACTIVE:
        raise ApplicationError("SAE_BUSY", "The SAE is training; cancel it first.", status=409)
    sae.delete()
