"""The job bodies of SAE training, import and evaluation (``mistudio.jobs``), and the SAE modules
a worker keeps loaded. They run in a miStudio worker."""

import contextlib
import logging
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from activations.models import ActivationCache
from activations.selectors import cache_store
from activations.services import DatasetReader
from activations.store import ActivationStore
from engine.configs import config_from_dict
from engine.prefetch import prefetched
from engine.registry import LOADED_MODELS
from engine.sae import TrainingCheckpoint, train
from engine.sae.evaluation import ce_loss_recovered, evaluate_activations, log_feature_density
from engine.sae.formats import (
    load_circuit_tracer_layer,
    load_gemma_scope,
    load_saelens,
    save_circuit_tracer,
    save_saelens,
)
from engine.sae_architectures import REGISTRY
from mistudio.errors import ApplicationError
from mistudio.events import ProgressThrottle
from mistudio.job_runner import JobContext, job_task
from mistudio.jobs import DAY, job_publish
from mistudio.redis_client import get_redis
from models_app.tasks import model_in_this_worker
from saes.cache_data import (
    CE_MAX_SEQUENCES,
    PREFETCH_BATCHES,
    SHUFFLE_BUFFER_BATCHES,
    cache_split,
    evaluation_rows,
    holdout_sequences,
    row_chunks,
    spread_sample,
    training_batches,
)
from saes.groups import CLT_KIND, GroupReading
from saes.models import SaeEvaluation, SaeGroup, SparseAutoencoder
from saes.selectors import CIRCUIT_TRACER_FOLDER, CLT_FOLDER, import_extras
from saes.services import (
    HOLDOUT_FRACTION,
    folder_size,
    sae_evaluate_request,
    sae_folder_files,
    sae_training_lease,
)
from saes.signals import group_completed

logger = logging.getLogger(__name__)

CURVE_POINTS = 400  # points kept per training curve (every n-th step, and the last)
LEASE_RENEW_SECONDS = 60
SAE_MODULES_KEPT = 4  # SAEs a worker keeps loaded for live encoding and steering
_SAE_MODULES: dict[str, tuple[float, Any]] = {}  # sae id -> (weights' mtime, module), oldest first


def sae_module(sae: SparseAutoencoder) -> Any:
    """The SAE's module (eval mode), loaded once per worker (again if its weights file changed);
    the last few used are kept. Callers move it to their device."""
    if sae.is_cross_layer:
        from engine.sae.clt import load_clt

        weights, load = sae.directory / CLT_FOLDER / "W_enc_0.safetensors", load_clt
    else:
        weights, load = sae.directory / "sae_weights.safetensors", lambda folder: load_saelens(folder)[0]
    stamp = weights.stat().st_mtime
    cached = _SAE_MODULES.pop(sae.id, None)
    if cached is None or cached[0] != stamp:
        module = load(weights.parent)
        cached = (stamp, module.eval())
    _SAE_MODULES[sae.id] = cached  # now the newest
    while len(_SAE_MODULES) > SAE_MODULES_KEPT:
        _SAE_MODULES.pop(next(iter(_SAE_MODULES)))
    return cached[1]


def sae_module_by_id(sae_id: str) -> Any:
    """:func:`sae_module` of a completed SAE; 404 ``SAE_NOT_FOUND`` if it is gone meanwhile."""
    sae = SparseAutoencoder.objects.filter(pk=sae_id, status=SparseAutoencoder.Status.COMPLETED).first()
    if sae is None:
        raise ApplicationError("SAE_NOT_FOUND", f"The SAE {sae_id} is gone.", status=404)
    return sae_module(sae)


# Keys of stored ``hyperparameters`` that TrainingConfig no longer has (rows written by older
# versions): named here so that any other unknown key fails rather than being dropped.
RETIRED_TRAINING_KEYS: tuple[str, ...] = ()


def training_config(sae: SparseAutoencoder):
    """The SAE's stored ``hyperparameters`` as the engine's TrainingConfig, or a cross-layer
    transcoder's as its CltTrainingConfig (unknown keys refused)."""
    from engine.sae import TrainingConfig

    if sae.hyperparameters.get("kind") == CLT_KIND:
        from engine.sae.clt_training import CltTrainingConfig

        values = {key: value for key, value in sae.hyperparameters.items() if key != "kind"}
        return config_from_dict(CltTrainingConfig, values)
    return config_from_dict(TrainingConfig, sae.hyperparameters, retired=RETIRED_TRAINING_KEYS)


def curve_point(metrics: dict[str, Any]) -> dict[str, Any]:
    """One point of the training curves, from a step's metrics (``StepMetrics`` as a dict)."""
    return {
        "step": metrics["step"],
        "tokens": metrics["tokens"],
        "mse": round(metrics["mse"], 6),
        "sparsity_loss": round(metrics["sparsity_loss"], 6),
        "aux_loss": round(metrics["aux_loss"], 6),
        "l0": round(metrics["l0"], 3),
        "explained_variance": round(metrics["explained_variance"], 5),
        "dead": metrics["dead"],
        "lr": metrics["lr"],
    }


def on_curve(step: int, total_steps: int) -> bool:
    """Whether a step is a point of the curves: every n-th, so at most ~CURVE_POINTS, and the last."""
    return step % max(1, total_steps // CURVE_POINTS) == 0 or step >= total_steps


def curves_until(checkpoint: TrainingCheckpoint, total_steps: int) -> list[dict[str, Any]]:
    """The curve points of a checkpoint's history: a resumed training's curves as far as it."""
    return [curve_point(metrics) for metrics in checkpoint.history if on_curve(metrics["step"], total_steps)]


class ProgressPublisher:
    """A training SAE's ``progress`` events from its steps' metrics: every curve point kept, an
    event at most twice a second (time only: a step takes milliseconds, and an event per percent
    would cost a short training more than its steps), carrying the points since the last one."""

    def __init__(self, sae: SparseAutoencoder) -> None:
        self.sae = sae
        self.throttle = ProgressThrottle(min_step=101.0, min_interval=0.5)
        self.points: list[dict[str, Any]] = []

    def __call__(self, metrics) -> bool:
        """Take one step's metrics; True when an event went out."""
        sae, values = self.sae, asdict(metrics)
        if on_curve(metrics.step, sae.total_steps):
            self.points.append(curve_point(values))
        final = metrics.step >= sae.total_steps
        if not self.throttle.ready(100 * metrics.step / sae.total_steps, final=final):
            return False
        fields = sae.mark_progress(
            step=metrics.step, tokens_seen=metrics.tokens, tokens_per_second=metrics.tokens_per_second,
            metrics=curve_point(values), points=self.points,
        )  # fmt: skip
        job_publish(sae, "progress", fields, points=list(self.points))
        self.points.clear()
        return True


def open_cache(cache: ActivationCache | None, hook: str) -> ActivationStore:
    """The store of a completed cache holding ``hook`` (``CACHE_CORRUPT`` / ``INVALID_HOOK`` else)."""
    if cache is None or cache.status != ActivationCache.Status.COMPLETED:
        raise ApplicationError("CACHE_NOT_READY", "The activation cache is gone or not complete.")
    return cache_store(cache, hook)


@job_task(SparseAutoencoder, timeout=7 * DAY)
def run_sae_training(sae: SparseAutoencoder, job: JobContext) -> None:
    """Train the SAE on its cache, streamed and shuffled from disk, with progress events and a
    checkpoint every ``SAE_CHECKPOINT_EVERY_STEPS`` steps (and when its time slice ends); then save
    it in SAELens' layout and evaluate it on the held-out part. A retried or resumed job continues
    from the last checkpoint, its stream opened at the checkpoint's position (one from before
    positions replays the stream to its step)."""
    store = open_cache(sae.cache, sae.hook_name)
    split = cache_split(store, HOLDOUT_FRACTION)
    config = training_config(sae)
    epochs = -(-config.total_tokens // split.train_stop)
    checkpoint = TrainingCheckpoint.load(sae.checkpoint_directory)
    sae.total_steps, sae.total_tokens = config.total_steps, config.total_tokens
    fields = ["total_steps", "total_tokens"]
    if checkpoint is not None:  # the curves as far as the checkpoint; the steps after it run again
        sae.history = curves_until(checkpoint, config.total_steps)
        fields.append("history")
    job_publish(sae, "progress", fields, resumed_from_step=checkpoint.step if checkpoint else None)
    sae_training_lease(sae)
    publish = ProgressPublisher(sae)
    last_lease = time.monotonic()

    def on_step(metrics) -> None:
        nonlocal last_lease
        if publish(metrics) and time.monotonic() - last_lease > LEASE_RENEW_SECONDS:
            sae_training_lease(sae)
            last_lease = time.monotonic()

    def on_checkpoint(state) -> None:
        state.save(sae.checkpoint_directory)
        job.checkpoint_saved()  # its time slice may end here

    device = job.worker.compute_device  # the worker's: a GPU worker trains on its GPU
    # Batches are read and shuffled on a thread while the step runs (page-locked for a GPU).
    batches = prefetched(
        training_batches(
            store, sae.hook_name, split.train_stop, batch_size=config.batch_size, seed=config.seed,
            epochs=epochs, start=checkpoint.stream if checkpoint is not None else None,
        ),
        depth=PREFETCH_BATCHES,
        pin_memory=device.startswith("cuda"),
    )  # fmt: skip
    with contextlib.closing(batches):
        trained = train(
            batches,
            d_in=sae.d_in,
            config=config,
            sample=spread_sample(store, sae.hook_name, split.train_stop),
            on_step=on_step,
            should_cancel=job.should_cancel,
            resume=checkpoint,
            checkpoint_every_steps=settings.SAE_CHECKPOINT_EVERY_STEPS,
            on_checkpoint=on_checkpoint,
            checkpoint_due=job.should_yield,
            device=device,
        )
    job.check_cancel()
    loaded = LOADED_MODELS.get(sae.model_id) if sae.model_id else None
    evaluation = held_out_evaluation(
        sae, trained.sae, store, split, loaded=loaded, cache_id=sae.cache_id, should_cancel=job.should_cancel
    )
    save_files(sae, trained.sae, evaluation.pop("feature_density"), prepend_bos=starts_with_bos(store, sae))
    fields = sae.mark_completed(
        evaluation=evaluation,
        file_size_bytes=folder_size(sae.directory),
        scaling_factor=trained.scaling_factor,
    )
    job_publish(sae, "completed", fields)
    if evaluation.get("ce_loss_recovered") is None and sae.model_id and sae.cache_id:
        # Where the model is (or gets) loaded; a follow-up, not counted against the caps. The
        # training is done whatever becomes of it.
        try:
            sae_evaluate_request(sae=sae, actor=sae.owner, cache=sae.cache, admit=False)
        except ApplicationError as error:
            logger.warning("no evaluation follows SAE %s: %s %s", sae.id, error.code, error.message)


@job_task(SparseAutoencoder, timeout=3600, failure_code="IMPORT_FAILED")
def run_sae_import(sae: SparseAutoencoder, job: JobContext) -> None:
    """Read an imported SAE's arrays (its folder checked again: it may have changed since the
    request), refuse non-finite weights, and store it as a SAELens folder."""
    if sae.source == sae.Source.CLT:
        import_clt(sae, job)
        return
    if sae.source == sae.Source.CIRCUIT_TRACER:  # one layer's file of a transcoder set
        path = Path(sae.import_path)
        folder = path.parent
        layers = {files.files[0].name: files for files in sae_folder_files(folder, "circuit_tracer")}
        files = layers.get(path.name)
        if files is None or (files.d_in, files.d_sae) != (sae.d_in, sae.d_sae):
            raise ApplicationError("INVALID_SAE", "The folder changed since the import was requested.")
        module = load_circuit_tracer_layer(files.files[0])
    else:
        folder = Path(sae.import_path)
        files = sae_folder_files(
            folder,
            "gemma_scope" if sae.source == sae.Source.GEMMA_SCOPE else "saelens",
            uploaded=sae.uploaded_folder is not None,
        )
        if (files.d_in, files.d_sae) != (sae.d_in, sae.d_sae):
            raise ApplicationError("INVALID_SAE", "The folder changed since the import was requested.")
        # Read through the folder whose entries were just checked to resolve inside the roots.
        module = load_gemma_scope(folder) if files.format == "gemma_scope" else load_saelens(folder)[0]
    job.check_cancel()
    save_saelens(
        module, sae.directory, hook_name=sae.hook_name, model_name=sae.model_name,
        metadata={"mistudio_sae_id": sae.id}, hook_name_out=sae.hook_name_out or None,
    )  # fmt: skip
    save_circuit_tracer_file(sae, module)
    size = folder_size(sae.directory)
    job_publish(
        sae, "completed", sae.mark_completed(evaluation={}, file_size_bytes=size, scaling_factor=None)
    )
    for imported in import_extras():  # after the SAE is complete: what fails here fails nothing else
        try:
            imported(sae, folder)
        except Exception:
            logger.exception("reading the extras of the imported SAE %s failed", sae.id)
    if sae.uploaded_folder is not None:  # its files are in the SAE's own folder now
        shutil.rmtree(sae.uploaded_folder, ignore_errors=True)


def import_clt(sae: SparseAutoencoder, job: JobContext) -> None:
    """A cross-layer transcoder's import: its folder checked again, its files read (non-finite
    weights refused) and stored in circuit-tracer's layout in the row's folder."""
    from engine.sae.clt import load_clt, save_clt

    folder = Path(sae.import_path)
    files = sae_folder_files(folder, "clt")
    if (files.d_in, files.d_sae, files.layer) != (sae.d_in, sae.d_sae, sae.n_layers):
        raise ApplicationError("INVALID_SAE", "The folder changed since the import was requested.")
    module = load_clt(folder)
    job.check_cancel()
    save_clt(module, sae.directory / CLT_FOLDER)
    job_publish(
        sae, "completed",
        sae.mark_completed(evaluation={}, file_size_bytes=folder_size(sae.directory), scaling_factor=None),
    )  # fmt: skip


def held_out_evaluation(
    sae: SparseAutoencoder, module, store: ActivationStore, split, *, loaded, cache_id: str,
    should_cancel=None,
) -> dict[str, Any]:  # fmt: skip
    """Metrics on the held-out rows of a cache, and CE loss recovered when ``loaded`` (the model in
    this worker) is given; without it ``ce_loss_recovered`` is None (an evaluation job follows
    where the model is)."""
    chunks = row_chunks(store, sae.hook_name, split.holdout_start, split.num_tokens)
    if sae.hook_name_out:  # a transcoder: its inputs beside the outputs it predicts
        outputs = row_chunks(store, sae.hook_name_out, split.holdout_start, split.num_tokens)
        chunks = zip(chunks, outputs, strict=True)
    return sae_evaluation(
        sae, module, chunks, model=loaded.model if loaded is not None else None,
        sequences=holdout_sequences(store, split) if loaded is not None else [],
        should_cancel=should_cancel, cache_id=cache_id,
    )  # fmt: skip


def sae_evaluation(
    sae: SparseAutoencoder, module, chunks, *, model, sequences, should_cancel=None, **facts: Any
) -> dict[str, Any]:
    """``module``'s held-out metrics on ``chunks`` (a transcoder's: input and output pairs) and,
    with ``model``, CE loss recovered on ``sequences`` with it spliced in at its feature hook
    (reading its input hook for a transcoder); ``facts`` are added as they are.
    ``feature_density`` is a tensor, for sparsity.safetensors."""
    result = evaluate_activations(
        module, chunks, rows_per_step=evaluation_rows(sae.d_sae), should_cancel=should_cancel
    )
    evaluation = {
        **result.to_dict(),
        "feature_density": result.feature_density,
        "held_out_tokens": result.tokens,
        **facts,
        "ce_loss_recovered": None,
    }
    if model is None:
        return evaluation
    if not sequences:
        return {**evaluation, "ce_note": "No whole held-out sample to run the model on."}
    ce = ce_loss_recovered(
        model, sequences, hook_name=sae.feature_hook, sae=module,
        input_hook=sae.hook_name if sae.hook_name_out else None, should_cancel=should_cancel,
    )  # fmt: skip
    return {**evaluation, **ce.to_dict(), "ce_tokens": ce.tokens}


def starts_with_bos(store: ActivationStore, sae: SparseAutoencoder) -> bool:
    """Whether the cache's samples begin with the model's BOS token (Llama's tokenizer adds one,
    GPT-2's does not): what SAELens' ``prepend_bos`` says about the activations trained on."""
    bos = (sae.model.config or {}).get("bos_token_id") if sae.model_id else None
    if bos is None or not store.num_samples:
        return False
    ids, positions = store.sample_tokens(0)
    return len(ids) > 0 and positions[0] == 0 and int(ids[0]) == bos


def save_files(sae: SparseAutoencoder, module, feature_density, *, prepend_bos: bool) -> None:
    """The SAELens folder (cfg.json, sae_weights.safetensors, sparsity.safetensors); the checkpoint goes."""
    save_saelens(
        module,
        sae.directory,
        hook_name=sae.hook_name,
        model_name=sae.model_name,
        metadata={"mistudio_sae_id": sae.id, "training": sae.hyperparameters, "prepend_bos": prepend_bos},
        log_feature_density=log_feature_density(feature_density),
        hook_name_out=sae.hook_name_out or None,
    )
    save_circuit_tracer_file(sae, module)
    shutil.rmtree(sae.checkpoint_directory, ignore_errors=True)


def save_circuit_tracer_file(sae: SparseAutoencoder, module) -> None:
    """A transcoder's file in circuit-tracer's layout beside its SAELens folder (exported with it),
    for the architectures circuit-tracer reads."""
    layer = re.match(r"blocks\.(\d+)\.", sae.hook_name_out or "")
    if layer is not None and REGISTRY[sae.architecture].circuit_tracer_form:
        save_circuit_tracer(module, sae.directory / CIRCUIT_TRACER_FOLDER, layer=int(layer[1]))


@job_task(SaeEvaluation, timeout=6 * 3600)
def run_sae_evaluation(evaluation: SaeEvaluation, job: JobContext) -> None:
    """Evaluate a completed SAE on the held-out part of a cache, with CE loss recovered (the model
    is loaded here if no worker has it; followed to its host if another worker has it); the
    results are merged into the SAE's ``evaluation``."""
    sae = evaluation.sae
    loaded = model_in_this_worker(sae.model_id, evaluation, purpose="an SAE evaluation")
    store = open_cache(evaluation.cache, sae.hook_name)
    split = cache_split(store, HOLDOUT_FRACTION)
    module, _ = load_saelens(sae.directory)
    results = held_out_evaluation(
        sae,
        module,
        store,
        split,
        loaded=loaded,
        cache_id=evaluation.cache_id,
        should_cancel=job.should_cancel,
    )
    results.pop("feature_density")
    evaluation.results = results
    sae.evaluation = {**sae.evaluation, **results, "error": None}
    sae.save(update_fields=["evaluation", "updated_at"])
    job_publish(evaluation, "completed", [*evaluation.mark_completed(), "results"])


# --- training from the model: a group ------------------------------------------------------------

# Held-out rows kept for a group's evaluation (every hook side by side) and CE-loss sequences.
GROUP_EVALUATION_ROWS = 16384


def group_member_configs(group: SaeGroup) -> tuple[list[SparseAutoencoder], list]:
    """The group's member rows in order, and each as the engine's :class:`GroupMember`."""
    from engine.sae.group import GroupMember

    members = list(group.members.order_by("group_index"))
    return members, [
        GroupMember(
            hook_in=sae.hook_name,
            hook_out=sae.hook_name_out or None,
            config=training_config(sae),
            n_layers=sae.n_layers,
        )
        for sae in members
    ]


@job_task(SaeGroup, timeout=14 * DAY)
def run_sae_group_training(group: SaeGroup, job: JobContext) -> None:
    """Train the group's members from the model over its dataset: one forward pass a batch feeds
    them all through a shuffle buffer on the worker's device (nothing written to disk but the
    checkpoints, every ``SAE_CHECKPOINT_EVERY_STEPS`` steps, from which a retried job continues);
    then evaluate each on the held-out samples (explained variance, CE loss recovered with it
    spliced in) and save it in SAELens' layout."""
    import torch

    from engine.hooks import list_hook_points
    from engine.sae.group import group_hooks, latest_checkpoint, model_source, train_group

    loaded = model_in_this_worker(group.model_id, group, purpose="training SAEs from the model")
    if group.dataset is None:
        raise ApplicationError("DATASET_NOT_FOUND", "The group's dataset is gone.")
    members, specs = group_member_configs(group)
    reading = config_from_dict(GroupReading, group.settings)
    total_steps = max(spec.config.total_steps for spec in specs)
    group.total_steps = total_steps
    newest = latest_checkpoint(group.checkpoint_directory)
    for index, sae in enumerate(members):
        member_fields = sae.mark_running(
            host_worker=job.worker.name,
            total_steps=specs[index].config.total_steps,
            total_tokens=specs[index].config.total_tokens,
        )
        if newest is not None:  # the curves as far as the checkpoint; the steps after it run again
            checkpoint = TrainingCheckpoint.load(newest / f"member-{index}")
            sae.history = curves_until(checkpoint, sae.total_steps)
            member_fields.append("history")
        job_publish(sae, "started", member_fields)
    job_publish(group, "progress", ["total_steps", "total_tokens"], resumed=newest is not None)

    hooks = group_hooks(specs)
    widths = {info.name: info.width for info in list_hook_points(loaded.model)}
    device = job.worker.compute_device
    publishers = [ProgressPublisher(sae) for sae in members]

    def on_step(index: int, metrics) -> None:
        if publishers[index](metrics) and index == 0:  # the group's progress is its first member's
            group_fields = group.mark_step(
                step=metrics.step, tokens_seen=metrics.tokens, tokens_per_second=metrics.tokens_per_second
            )
            job_publish(group, "progress", group_fields)

    reader = DatasetReader(group.dataset)

    def stop_asked() -> bool:  # stop and keep (saes.groups.sae_group_stop): the loop ends, nothing is lost
        return bool(get_redis().exists(group.stop_key))

    def open_source(position):
        return model_source(
            loaded.model,
            loaded.tokenizer,
            reader,
            hooks=hooks,
            train_samples=reading.train_samples,
            max_length=reading.max_length,
            batch_size=reading.forward_batch_size,
            window_samples=reading.window_samples,
            position=position,
            dtype=reading.dtype,
            device=device,
        )

    with reader:
        results = train_group(
            specs,
            widths=widths,
            open_source=open_source,
            buffer_rows=SHUFFLE_BUFFER_BATCHES * specs[0].config.batch_size,
            device=device,
            on_step=on_step,
            should_cancel=lambda: job.should_cancel() or stop_asked(),
            checkpoint_folder=group.checkpoint_directory,
            checkpoint_every_steps=settings.SAE_CHECKPOINT_EVERY_STEPS,
            checkpoint_due=job.should_yield,
            on_checkpoint=lambda step: job.checkpoint_saved(),  # its time slice may end here
            rows_dtype=getattr(torch, reading.dtype),
        )
        if not stop_asked():
            job.check_cancel()
        held_out = reader(reading.train_samples, group.dataset.sample_count)
    evaluations = group_evaluation(loaded, members, results, held_out, hooks=hooks, reading=reading, job=job)
    for index, sae in enumerate(members):
        trained = results[index]
        evaluation = evaluations[index]
        if sae.is_cross_layer:
            from engine.sae.clt import save_clt

            save_clt(trained.sae, sae.directory / CLT_FOLDER)
        else:
            save_files(sae, trained.sae, evaluation.pop("feature_density"), prepend_bos=prepends_bos(loaded))
        fields = sae.mark_completed(
            evaluation=evaluation,
            file_size_bytes=folder_size(sae.directory),
            scaling_factor=trained.scaling_factor,
        )
        job_publish(sae, "completed", fields)
    shutil.rmtree(group.checkpoint_directory, ignore_errors=True)
    get_redis().delete(group.stop_key)
    job_publish(group, "completed", group.mark_completed())
    transaction.on_commit(lambda: group_completed.send(sender=SaeGroup, group=group))


def clt_evaluation(model, clt, columns: dict[str, Any], sequences: list[list[int]], *, job) -> dict[str, Any]:
    """A cross-layer transcoder judged as the CLT papers do, on the held-out tokens: explained
    variance per layer (and their mean), features per token over all layers, and next-token loss
    with every MLP replaced at once by it (``ce_loss_recovered``: against all MLPs zeroed)."""
    import torch

    from engine.hooks import every_transcoder_hook
    from engine.sae.clt_training import ce_loss_recovered_all_mlps, clt_explained_variance, clt_l0

    hooks = every_transcoder_hook(clt.n_layers)
    inputs = torch.stack([columns[name] for name in hooks[0::2]], 1).float()
    outputs = torch.stack([columns[name] for name in hooks[1::2]], 1).float()
    explained = clt_explained_variance(clt, inputs, outputs)
    l0 = sum(clt_l0(clt, inputs))
    device = next(model.parameters()).device
    batches = [torch.tensor([ids], device=device) for ids in sequences]
    ce = ce_loss_recovered_all_mlps(model, batches, clt.to(device), should_cancel=job.should_cancel)
    clt.cpu()
    return {
        "explained_variance": round(sum(explained) / len(explained), 5),
        "explained_variance_per_layer": explained,
        "l0": round(l0, 3),
        "held_out_tokens": len(inputs),
        "ce_loss_clean": round(ce["clean"], 5),
        "ce_loss_with_sae": round(ce["replaced"], 5),
        "ce_loss_zero_ablation": round(ce["zero"], 5),
        "ce_loss_recovered": round(ce["recovered"], 5),
        "ce_note": "every MLP replaced at once by the cross-layer transcoder; zero ablation: every MLP "
        "zeroed",
    }


def prepends_bos(loaded) -> bool:
    """Whether the tokenizer starts each sample with BOS (what SAELens' ``prepend_bos`` says)."""
    ids = loaded.tokenizer("a")["input_ids"]
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    return bool(ids) and bos is not None and ids[0] == bos


def group_evaluation(
    loaded, members, results, held_out: list[str], *, hooks, reading: GroupReading, job
) -> list[dict]:
    """Each member's metrics on the held-out samples (at most ``GROUP_EVALUATION_ROWS`` tokens of
    them, every hook read in one pass) and CE loss recovered with it spliced into the model."""
    import torch

    from engine.extraction import extract, plan_batches, tokenize_samples

    tokenized = [ids for ids in tokenize_samples(loaded.tokenizer, held_out, reading.max_length) if ids]
    kept, rows = [], 0
    for ids in tokenized:
        if rows + len(ids) > GROUP_EVALUATION_ROWS and kept:
            break
        kept.append(ids)
        rows += len(ids)
    if not kept:
        raise ApplicationError("NO_HELD_OUT_TOKENS", "The held-out samples hold no token.")
    batches = extract(
        loaded.model,
        kept,
        plan_batches([len(ids) for ids in kept], reading.forward_batch_size),
        hooks=hooks,
        dtype="float32",
        should_cancel=job.should_cancel,
    )
    activations: dict[str, list] = {name: [] for name in hooks}
    for batch in batches:
        for name in hooks:
            activations[name].append(batch.activations[name])
    columns = {name: torch.cat(parts) for name, parts in activations.items()}
    sequences = [ids for ids in kept if len(ids) >= 2][:CE_MAX_SEQUENCES]
    evaluations = []
    for index, sae in enumerate(members):
        job.check_cancel()
        if sae.is_cross_layer:
            evaluations.append(clt_evaluation(loaded.model, results[index].sae, columns, sequences, job=job))
            continue
        inputs = columns[sae.hook_name]
        chunk = (inputs, columns[sae.hook_name_out]) if sae.hook_name_out else inputs
        evaluations.append(
            sae_evaluation(
                sae,
                results[index].sae,
                [chunk],
                model=loaded.model,
                sequences=sequences,
                should_cancel=job.should_cancel,
                held_out_samples=len(kept),
            )
        )
    return evaluations
