"""Feature workflows: analysis requests, cancel, labels, live encoding.

Every front door (API, pages, admin, ``manage.py`` commands) calls these. An analysis is a job
(``mistudio.jobs``); rows change through their ``mark_*`` methods and every change is announced.
"""

import json
import logging
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from activations.models import ActivationCache, Dataset
from activations.services.extractions import default_max_length, storage_dtype_for
from engine import budgets
from engine.features.analysis import AnalysisConfig
from features.models import FeatureAnalysis, FeatureLabel
from features.search import search_indexes_request
from mistudio import jobs
from mistudio.access import OPERATOR, check_may_change, reach
from mistudio.budgets import memory_budget_check
from mistudio.errors import ApplicationError
from mistudio.local_paths import path_inside_roots
from mistudio.text import check_label_text
from mistudio.transaction_locks import take_turns
from mistudio.workers import call_worker
from models_app.services import model_host, model_job_queue, model_worker_name
from saes.groups import DEFAULT_GROUP_MAX_LENGTH, FORWARD_TOKENS
from saes.models import SaeGroup, SparseAutoencoder
from saes.services import check_cache_for, check_single_layer, default_cache

logger = logging.getLogger(__name__)

ENCODE_WAIT_SECONDS = 60
MAX_ENCODE_CHARS = 20_000
ENCODE_MAX_TOKENS = 1024
UNEMBEDDING_VOCABULARY = 262_144  # the largest vocabulary a logit-effects block is sized for
# An analysis straight from the model reads this many tokens of its dataset unless told otherwise:
# enough for every feature above a density of ~1e-4 to show its top examples, minutes on a CPU.
MODEL_ANALYSIS_TOKENS = 1 << 18


# --- analyses ------------------------------------------------------------------------------------


def analysis_memory(sae: SparseAutoencoder, tokens: int) -> budgets.MemoryEstimate:
    vocabulary = (sae.model.vocab_size if sae.model is not None else None) or UNEMBEDDING_VOCABULARY
    return budgets.feature_analysis(
        d_in=sae.d_in, d_sae=sae.d_sae, tokens=tokens, chunk_rows=AnalysisConfig().chunk_rows,
        vocabulary=vocabulary,
    )  # fmt: skip


def model_reading(
    sae: SparseAutoencoder,
    dataset: Dataset,
    *,
    sample_count: int | None = None,
    max_length: int | None = None,
) -> dict[str, Any]:
    """How an analysis straight from the model reads ``dataset``: a group member's tokens a
    sample and samples a forward pass are its group's; the samples, enough for
    :data:`MODEL_ANALYSIS_TOKENS` tokens at most; the dtype, the one an extraction would cache."""
    for name, value in (("sample_count", sample_count), ("max_length", max_length)):
        if value is not None and (type(value) is not int or value < 1):
            raise ApplicationError("INVALID_READING", f"{name} must be a positive integer.")
    group_reading = sae.group.settings if sae.group_id else {}
    wanted_length = max_length or group_reading.get("max_length") or DEFAULT_GROUP_MAX_LENGTH
    max_length = default_max_length(sae.model, wanted_length)
    wanted = sample_count or max(1, -(-MODEL_ANALYSIS_TOKENS // max_length))
    return {
        "sample_count": min(wanted, dataset.sample_count),
        "max_length": max_length,
        "batch_size": max(1, FORWARD_TOKENS // max_length),
        "dtype": storage_dtype_for(sae.model),
    }


def analysis_request(
    *,
    owner,
    sae: SparseAutoencoder,
    cache: ActivationCache | None = None,
    dataset: Dataset | None = None,
    sample_count: int | None = None,
    max_length: int | None = None,
    shared: bool = False,
    admit: bool = True,
) -> FeatureAnalysis:
    """Queue a feature analysis of ``sae``, over ``cache`` (read straight from disk: no model run)
    or over ``dataset`` read through the SAE's model (no cache written; ``sample_count`` samples of
    ``max_length`` tokens, defaults from :func:`model_reading`). With neither: the cache it was
    trained on, when ``owner`` may read it, else the dataset it was trained on, through the model.
    The analysis holds examples of that text: it is the requester's, and shown to others only once
    they share it (``shared``). ``admit=False``: the follow-up of a group, not counted against the
    caps (as a training's evaluation)."""
    if sae.status != SparseAutoencoder.Status.COMPLETED:
        raise ApplicationError("SAE_NOT_READY", f"The SAE is {sae.status}.", status=409)
    check_single_layer(sae, "a feature analysis")
    reader = owner or OPERATOR  # None: the operator (``manage.py analyze_sae``)
    if cache is not None and dataset is not None:
        raise ApplicationError("INVALID_SOURCE", "Name a cache or a dataset to analyse over, not both.")
    if cache is None and dataset is None:
        cache = default_cache(sae=sae, user=reader)
        if cache is None and sae.dataset is not None and sae.model_id:
            dataset = reach(reader, sae.dataset)
    reading: dict[str, Any] = {}
    if dataset is not None:
        dataset = reach(reader, dataset)
        if not sae.model_id:
            raise ApplicationError(
                "MODEL_REQUIRED",
                "The SAE names no model to read the dataset through: analyse it over a cache.",
            )
        reach(reader, sae.model)
        reading = model_reading(sae, dataset, sample_count=sample_count, max_length=max_length)
        tokens = reading["sample_count"] * reading["max_length"]  # at most: samples are cut there
    else:
        cache = reach(reader, cache) if cache is not None else None
        cache = check_cache_for(sae, cache, purpose="analyse over")
        tokens = cache.num_tokens
    with transaction.atomic():
        # Two requests at once: one analysis, one 409.
        take_turns("feature-analysis", sae.pk, cache.pk if cache is not None else f"dataset:{dataset.pk}")
        running = FeatureAnalysis.objects.filter(sae=sae, status__in=FeatureAnalysis.ACTIVE)
        if running.filter(cache=cache, dataset=dataset).exists():
            raise ApplicationError(
                "ANALYSIS_IN_PROGRESS",
                f"An analysis of this SAE over this {'cache' if cache else 'dataset'} is already running.",
                status=409,
            )
        if admit:
            jobs.job_admit(owner=owner, tokens=tokens)
        estimate = memory_budget_check(
            analysis_memory(sae, tokens), what="this analysis", worker_name=model_worker_name(sae.model)
        )
        analysis = FeatureAnalysis.objects.create(
            sae=sae,
            cache=cache,
            dataset=dataset,
            reading=reading,
            tokens=tokens,
            memory_estimate_bytes=estimate,
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=shared,
        )
        # To the model's host when it is loaded (its unembedding gives the logit effects; from the
        # model, it runs the model), else the shared queue (the worker that takes it loads the
        # model to read through it, or reads the unembedding from the model's files).
        jobs.job_submit(analysis, queue=model_job_queue(sae.model_id))
    return analysis


def group_members_analyze(sender, *, group: SaeGroup, **kwargs) -> list[FeatureAnalysis]:
    """A completed group that asks for it (``analyze_members``) has each completed member analysed
    over the group's dataset through the model, as the group's owner (``saes.signals.group_completed``):
    its dashboards, labels and graph nodes' names need no cache. A member the budgets refuse is
    logged and left for a request of its own."""
    if not group.analyze_members or group.dataset_id is None:
        return []
    analyses = []
    completed = group.members.filter(status=SparseAutoencoder.Status.COMPLETED, n_layers__isnull=True)
    for member in completed.order_by("group_index"):  # (a cross-layer transcoder has no analysis yet)
        try:
            analyses.append(
                analysis_request(owner=group.owner, sae=member, dataset=group.dataset, admit=False)
            )
        except ApplicationError as error:
            logger.warning("member %s of %s is not analysed: %s", member.id, group.id, error.message)
    return analyses


def analysis_cancel(*, analysis: FeatureAnalysis, actor) -> FeatureAnalysis:
    """A queued analysis is cancelled at once; a running one stops after its current chunk."""
    return jobs.job_cancel(analysis, actor=actor)


def analysis_update(*, analysis: FeatureAnalysis, actor, shared: bool) -> FeatureAnalysis:
    check_may_change(analysis, actor, what="analysis")
    analysis.shared = shared
    jobs.job_publish(analysis, "updated", ["shared"])
    return analysis


def analysis_delete(*, analysis: FeatureAnalysis, actor) -> None:
    check_may_change(analysis, actor, what="analysis")
    if analysis.status in FeatureAnalysis.ACTIVE:
        raise ApplicationError("ANALYSIS_BUSY", "The analysis is running; cancel it first.", status=409)
    analysis.delete()


# --- labels --------------------------------------------------------------------------------------


def feature_label_set(
    *, sae: SparseAutoencoder, index: int, actor, label: str | None = None, notes: str | None = None,
    shared: bool | None = None,
) -> FeatureLabel:  # fmt: skip
    """The actor's own label / notes on feature ``index`` (created on first use); an empty label
    and notes remove it. Readers who may write label any SAE they can see."""
    if not 0 <= index < sae.d_sae:
        raise ApplicationError("FEATURE_NOT_FOUND", f"The SAE has features 0 to {sae.d_sae - 1}.", status=404)
    for field, value in (("label", label), ("notes", notes)):
        if value is not None:
            check_label_text(value, field=field, multiline=field == "notes")
    owner = actor if getattr(actor, "is_authenticated", False) else None
    row, _ = FeatureLabel.objects.get_or_create(sae=sae, index=index, owner=owner)
    for name, value in (("label", label), ("notes", notes), ("shared", shared)):
        if value is not None:
            setattr(row, name, value.strip() if isinstance(value, str) else value)
    if not row.label and not row.notes:
        row.delete()
        row.pk = None
    else:
        row.save()
    search_indexes_request(sae)  # searched by meaning: a worker rebuilds the index (debounced)
    return row


# Labels travel with an SAE: its export carries labels.json, and an import reads it back.
LABELS_FILE = "labels.json"
LABELS_SCHEMA = "mistudio.labels/1"
MAX_LABELS_BYTES = 8 * 1024 * 1024


def labels_export(user, sae: SparseAutoencoder) -> tuple[str, bytes] | None:
    """``labels.json``: the label and notes ``user`` sees on each labelled feature (their own, else
    the newest shared one); None when there are none."""
    from features.selectors import label_for, visible_labels

    by_index: dict[int, list[FeatureLabel]] = {}
    for label in visible_labels(user=user, sae=sae):
        by_index.setdefault(label.index, []).append(label)
    labels = [
        {"index": index, "label": chosen.label, "notes": chosen.notes}
        for index, found in sorted(by_index.items())
        if (chosen := label_for(found, user)) is not None
    ]
    if not labels:
        return None
    return LABELS_FILE, json.dumps({"schema": LABELS_SCHEMA, "labels": labels}, indent=1).encode()


def labels_import(sae: SparseAutoencoder, folder: Path) -> int:
    """The labels of an imported folder's ``labels.json`` (if any), as the importer's own; entries
    out of range or with text a label may not hold are skipped. Returns how many were kept."""
    path = folder / LABELS_FILE
    if not path.is_file():
        return 0
    path = path_inside_roots(str(path), settings.LOCAL_MODEL_ROOTS, setting="LOCAL_MODEL_ROOTS")
    if path.stat().st_size > MAX_LABELS_BYTES:
        logger.warning("%s is over %s bytes: its labels are not imported", path, MAX_LABELS_BYTES)
        return 0
    try:
        entries = json.loads(path.read_bytes()).get("labels", [])
    except (ValueError, AttributeError):
        logger.warning("%s is not a labels file: its labels are not imported", path)
        return 0
    kept = 0
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        index, label, notes = entry.get("index"), entry.get("label", ""), entry.get("notes", "")
        if type(index) is not int or not isinstance(label, str) or not isinstance(notes, str):
            continue
        try:
            feature_label_set(sae=sae, index=index, actor=sae.owner, label=label, notes=notes)
        except ApplicationError:
            continue
        kept += 1
    return kept


# --- live encoding -------------------------------------------------------------------------------


def feature_encode(*, sae: SparseAutoencoder, text: str, top: int = 10, actor=None) -> dict[str, Any]:
    """Which features fire on ``text``: the worker holding the SAE's model runs it up to the hook,
    the SAE encodes; this waits for its JSON reply (``ENCODE_WAIT_SECONDS`` at most)."""
    if sae.status != SparseAutoencoder.Status.COMPLETED:
        raise ApplicationError("SAE_NOT_READY", f"The SAE is {sae.status}.", status=409)
    if not text.strip():
        raise ApplicationError("INVALID_TEXT", "Give a non-empty text.")
    if len(text) > MAX_ENCODE_CHARS:
        raise ApplicationError("INVALID_TEXT", f"The text is over {MAX_ENCODE_CHARS:,} characters.")
    model = sae.model
    host = model_host(model, needed_for="live encoding runs it up to the SAE's hook")
    memory_budget_check(
        budgets.sae_encoding(d_in=sae.d_in, d_sae=sae.d_sae, rows=ENCODE_MAX_TOKENS),
        what="encoding a text with this SAE",
        worker_name=host,
    )
    return call_worker(
        host,
        "features.tasks.run_feature_encode",
        sae.id,
        text,
        top,
        wait_seconds=ENCODE_WAIT_SECONDS,
        owner=actor,
    )
