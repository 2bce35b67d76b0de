"""The feature analysis job's body (``mistudio.jobs``) and live encoding. They run in a miStudio worker."""

import logging
import shutil
import time
from typing import Any

from django.conf import settings
from django.db import close_old_connections, transaction

from activations.selectors import model_folder, tokenizer_for
from activations.services import cache_touch
from engine.configs import config_from_dict
from engine.features.analysis import (
    AnalysisConfig,
    AnalysisState,
    analysis_summary,
    analyze,
    feature_arrays,
)
from engine.features.decoder import decoder_neighbours, logit_effects, unembedding
from engine.features.inference import auto_label, features_of_text
from engine.registry import LOADED_MODELS
from engine.sae.formats import load_saelens
from features.models import Feature, FeatureAnalysis
from features.rows import analysis_rows, token_table
from features.search import (
    LOCK_TIMEOUT_SECONDS,
    rebuild_pending_key,
    search_index_refresh,
    search_index_request,
)
from features.services import ENCODE_MAX_TOKENS
from mistudio.errors import ApplicationError
from mistudio.events import ProgressThrottle
from mistudio.job_runner import JobContext, job_task
from mistudio.jobs import DAY, job_publish
from mistudio.redis_client import get_redis
from mistudio.workers import answer_call, worker_task
from models_app.tasks import model_in_this_worker
from saes.services import folder_size
from saes.tasks import sae_module

logger = logging.getLogger(__name__)

LEASE_SECONDS = 900


@job_task(FeatureAnalysis, timeout=2 * DAY)
def run_feature_analysis(analysis: FeatureAnalysis, job: JobContext) -> None:
    """Sweep the SAE over the cache (three streamed passes, resumable from its saved state), add
    logit effects and neighbours, write ``features.safetensors`` and one ``Feature`` row per
    feature."""
    sae = analysis.sae
    # The model, where there is one: the unembedding (logit effects), the tokenizer, and from the
    # model, the rows themselves.
    store = analysis_rows(
        analysis, job_row=analysis, should_cancel=job.should_cancel
    )  # a bad cache fails first
    loaded = (
        model_in_this_worker(sae.model_id, analysis, purpose="a feature analysis") if sae.model_id else None
    )
    tokens = token_table(store)
    config = config_from_dict(AnalysisConfig, analysis.config or {})
    module, _ = load_saelens(sae.directory)
    device = job.worker.compute_device
    module.to(device)
    resume = AnalysisState.load(analysis.state_directory)
    # Read now: the sweep carries the resumed state forward in place.
    resumed_from = None if resume is None else {"phase": resume.phase, "row": resume.next_row}
    analysis.tokens = len(tokens)
    analysis.config = config.__dict__ if not analysis.config else analysis.config
    job_publish(analysis, "progress", ["tokens", "config"], resumed_from=resumed_from)
    throttle = ProgressThrottle(min_step=101.0, min_interval=0.5)
    if analysis.cache is not None:
        cache_touch(analysis.cache, lease_seconds=LEASE_SECONDS)  # eviction leaves a cache being read
    last_lease = time.monotonic()

    def on_progress(progress) -> None:
        nonlocal last_lease
        if analysis.cache is not None and time.monotonic() - last_lease > LEASE_SECONDS / 10:
            cache_touch(analysis.cache, lease_seconds=LEASE_SECONDS)
            last_lease = time.monotonic()
        if throttle.ready(100 * progress.fraction):
            fields = analysis.mark_progress(
                phase=progress.phase,
                fraction=progress.fraction,
                tokens_per_second=progress.rows_per_second,
            )
            job_publish(analysis, "progress", fields)

    def on_checkpoint(state: AnalysisState) -> None:
        state.save(analysis.state_directory)
        job.checkpoint_saved()  # its time slice may end here

    state = analyze(
        lambda rows: module.encode(rows.to(device)).float().cpu(),
        lambda start, stop: store.get(sae.hook_name, start, stop, as_torch=True).float(),
        tokens,
        d_sae=sae.d_sae,
        config=config,
        resume=resume,
        on_progress=on_progress,
        should_cancel=job.should_cancel,
        on_checkpoint=on_checkpoint,
        checkpoint_seconds=settings.FEATURE_ANALYSIS_CHECKPOINT_SECONDS,
        checkpoint_due=job.should_yield,
    )
    arrays = feature_arrays(state, tokens, config)
    summary = analysis_summary(state, config)
    if resumed_from is not None:
        summary["resumed_from"] = resumed_from
    if analysis.source == "model":
        summary["forward_passes"] = store.forward_passes
    arrays.update(decoder_neighbours(module.W_dec))
    weights = unembedding(loaded.model) if loaded is not None else None
    if weights is not None and weights[0].shape[0] == sae.d_in:
        arrays.update(logit_effects(module.W_dec, *weights))
    else:
        summary["logit_note"] = (
            "No logit effects: the SAE names no loaded model with an unembedding"
            if weights is None
            else f"No logit effects: the hook's width ({sae.d_in}) is not the residual stream's."
        )
    tokenizer = loaded.tokenizer if loaded is not None else None
    write_results(analysis, arrays, tokenizer=tokenizer, config=config)
    job.check_cancel()
    shutil.rmtree(analysis.state_directory, ignore_errors=True)
    fields = analysis.mark_completed(summary=summary, file_size_bytes=folder_size(analysis.directory))
    job_publish(analysis, "completed", fields)
    # Its features' automatic labels are searched by meaning: a worker indexes them now, before
    # anyone asks.
    search_index_request(analysis)


def write_results(analysis: FeatureAnalysis, arrays: dict, *, tokenizer, config: AnalysisConfig) -> None:
    """``features.safetensors`` (written whole, then renamed) and the ``Feature`` rows, replaced
    together in one transaction (a retried job leaves no duplicates)."""
    from safetensors.numpy import save_file

    analysis.directory.mkdir(parents=True, exist_ok=True)
    temporary = analysis.data_path.with_suffix(".tmp")
    save_file({name: value for name, value in arrays.items()}, str(temporary))
    temporary.replace(analysis.data_path)

    if tokenizer is None and analysis.sae.model is not None:
        folder = model_folder(analysis.sae.model)
        try:
            tokenizer = tokenizer_for(str(folder)) if folder is not None else None
        except (OSError, ValueError):
            tokenizer = None
    decoded: dict[int, str] = {}

    def decode(token_id: int) -> str:
        if token_id not in decoded:
            text = tokenizer.decode([token_id]) if tokenizer is not None else f"#{token_id}"
            decoded[token_id] = text.replace("\x00", "")  # PostgreSQL text holds no NUL
        return decoded[token_id]

    center = config.context_before
    activating = arrays["top_context_tokens"][:, :, center]  # [d_sae, top_k], -1 when empty
    rows = []
    for index in range(len(arrays["density"])):
        ids = [int(token) for token in activating[index] if token >= 0]
        distinct = sorted({decode(token).strip().lower() for token in ids} - {""})
        rows.append(
            Feature(
                analysis=analysis,
                index=index,
                density=float(arrays["density"][index]),
                max_activation=float(arrays["max"][index]),
                mean_activation=float(arrays["mean"][index]),
                auto_label=auto_label(ids, decode)[:200],
                top_tokens=f"|{'|'.join(token.replace('|', '¦') for token in distinct)}|" if distinct else "",
            )
        )
    with transaction.atomic():
        Feature.objects.filter(analysis=analysis).delete()
        Feature.objects.bulk_create(rows, batch_size=2000)


@worker_task(timeout=120)
def run_feature_encode(request_id: str, sae_id: str, text: str, top: int) -> None:
    """Live encoding for ``features.services.feature_encode`` (answered through ``answer_call``)."""
    from saes.models import SparseAutoencoder

    close_old_connections()

    def encode() -> dict[str, Any]:
        sae = SparseAutoencoder.objects.get(pk=sae_id)
        loaded = LOADED_MODELS.get(sae.model_id) if sae.model_id else None
        if loaded is None:
            raise ApplicationError(
                "MODEL_NOT_LOADED", "The SAE's model is not loaded in this worker.", status=409
            )
        module = sae_module(sae)
        limit = getattr(loaded.model.config, "max_position_embeddings", None) or ENCODE_MAX_TOKENS
        result = features_of_text(
            loaded.model, loaded.tokenizer, module, hook_name=sae.hook_name, text=text,
            max_length=min(ENCODE_MAX_TOKENS, int(limit)),
        )  # fmt: skip
        return {
            "token_ids": result.token_ids,
            "tokens": [loaded.tokenizer.decode([token]) for token in result.token_ids],
            "per_token": [
                [{"index": index, "value": round(value, 6)} for index, value in row]
                for row in result.per_token(top)
            ],
            "overall": result.overall(top),
        }

    answer_call(request_id, encode, failure_code="ENCODE_FAILED")


@worker_task(timeout=LOCK_TIMEOUT_SECONDS + 300)
def rebuild_search_index(analysis_id: str) -> None:
    """Bring an analysis's search index up to date (``features.search.search_index_request``): the
    rebuild a query asks for, never done inside a request. The flag that debounces the requests is
    cleared first, so that rows changed while this runs get one more rebuild."""
    close_old_connections()
    get_redis().delete(rebuild_pending_key(analysis_id))
    analysis = FeatureAnalysis.objects.filter(pk=analysis_id).first()
    if analysis is None:
        return
    try:
        count = search_index_refresh(analysis)
    except ApplicationError as error:  # no embedding model, or another process held the lock too long
        logger.warning("the search index of %s was not rebuilt: %s", analysis_id, error.message)
        return
    logger.info("the search index of %s holds %d texts", analysis_id, count)
