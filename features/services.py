"""Feature workflows: analysis requests, enqueue, cancel, resume, labels, live encoding.

Every front door (API, pages, admin, ``manage.py`` commands) calls these. Rows change through
their ``mark_*`` methods and every change is announced by :func:`analysis_publish` (on commit).
"""

import shutil
import uuid
from typing import Any

from django.conf import settings
from django.db import transaction

from activations.models import ActivationCache
from features.models import FeatureAnalysis, FeatureLabel
from features.serializers import analysis_state
from mistudio.access import check_may_change
from mistudio.errors import ApplicationError
from mistudio.events import publish, rows_audience
from mistudio.redis_client import get_redis
from mistudio.workers import call_worker, cancel_if_queued, enqueue
from models_app.services import model_host, model_job_queue
from saes.models import SparseAutoencoder

ENCODE_WAIT_SECONDS = 60
MAX_ENCODE_CHARS = 20_000


def analysis_groups(analysis: FeatureAnalysis) -> list[str]:
    return [f"analysis.{analysis.id}", f"sae.{analysis.sae_id}"]


def analysis_publish(analysis: FeatureAnalysis, event: str, fields: list[str], **extra: Any) -> None:
    """Save ``fields`` and announce ``event`` with the analysis's state (to its SAE's page too)."""
    publish(
        event,
        {**analysis_state(analysis), **extra},
        groups=analysis_groups(analysis),
        instance=analysis,
        fields=fields,
        audience=rows_audience(("analysis", analysis.id)),
    )


# --- analyses ------------------------------------------------------------------------------------


def analysis_request(
    *, owner, sae: SparseAutoencoder, cache: ActivationCache | None = None, shared: bool | None = None
) -> FeatureAnalysis:
    """Queue a feature analysis of ``sae`` over ``cache`` (default: the cache it was trained on),
    a completed cache holding the SAE's hook at its width (read straight from disk: no model run)."""
    cache = cache or sae.cache
    if sae.status != SparseAutoencoder.Status.COMPLETED:
        raise ApplicationError("SAE_NOT_READY", f"The SAE is {sae.status}.", status=409)
    if cache is None:
        raise ApplicationError("CACHE_REQUIRED", "Name an activation cache to analyse over (cache_id).")
    if cache.status != ActivationCache.Status.COMPLETED:
        raise ApplicationError("CACHE_NOT_READY", f"The cache is {cache.status}.", status=409)
    width = (cache.activation_shapes.get(sae.hook_name) or [0, 0])[1]
    if sae.hook_name not in cache.hooks or width != sae.d_in:
        raise ApplicationError(
            "INVALID_HOOK",
            f"The cache has no {sae.hook_name!r} activations of width {sae.d_in}: extract that hook first.",
            details={"hook_name": sae.hook_name, "cache_hooks": cache.hooks},
        )
    if FeatureAnalysis.objects.filter(sae=sae, cache=cache, status__in=FeatureAnalysis.ACTIVE).exists():
        raise ApplicationError(
            "ANALYSIS_IN_PROGRESS", "An analysis of this SAE over this cache is already running.", status=409
        )
    with transaction.atomic():
        analysis = FeatureAnalysis.objects.create(
            sae=sae,
            cache=cache,
            tokens=cache.num_tokens,
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=sae.shared if shared is None else shared,
        )
        analysis.rq_job_id = f"analysis-{analysis.id}"
        analysis_publish(analysis, "analysis:queued", ["rq_job_id"])
        analysis_enqueue(analysis)
    return analysis


def analysis_enqueue(analysis: FeatureAnalysis, *, worker_name: str | None = None) -> None:
    """To the model's host when it is loaded (its unembedding gives the logit effects), else the
    shared queue (the job then reads the unembedding from the model's files)."""
    queue = model_job_queue(analysis.sae.model_id, worker_name=worker_name)
    enqueue(queue, "features.tasks.run_feature_analysis", analysis.id, job_id=analysis.rq_job_id)


def analysis_cancel_key(analysis_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:cancel:analysis:{analysis_id}"


def analysis_cancel_requested(analysis_id: str) -> bool:
    return bool(get_redis().exists(analysis_cancel_key(analysis_id)))


def analysis_cancel(*, analysis: FeatureAnalysis, actor) -> FeatureAnalysis:
    """A queued analysis is cancelled at once; a running one stops after its current chunk."""
    check_may_change(analysis, actor, what="analysis")
    with transaction.atomic():
        analysis = FeatureAnalysis.objects.select_for_update().get(pk=analysis.pk)
        if analysis.status not in FeatureAnalysis.ACTIVE:
            raise ApplicationError("NOT_RUNNING", "The analysis is not queued or running.", status=409)
        get_redis().set(analysis_cancel_key(analysis.id), "1", ex=7 * 24 * 3600)
        if cancel_if_queued(analysis.rq_job_id):
            analysis_discard(analysis)
    return analysis


def analysis_discard(analysis: FeatureAnalysis) -> None:
    analysis_publish(analysis, "analysis:cancelled", analysis.mark_cancelled())
    files_removed_on_commit(analysis)


def analysis_failed(analysis: FeatureAnalysis, *, code: str, message: str) -> None:
    """``failed`` with its code; partial files go (no half-written dashboards stay)."""
    fields = analysis.mark_failed(code=code, message=message)
    analysis_publish(analysis, "analysis:failed", fields, code=code, message=message)
    files_removed_on_commit(analysis)


def analysis_resume_on_worker_start(identity) -> None:
    """The worker hook: a starting worker re-queues, on its own queue, the analyses it was running
    when it died; they continue from their saved state."""
    for analysis in FeatureAnalysis.objects.select_related("sae").filter(
        host_worker=identity.name, status=FeatureAnalysis.Status.RUNNING
    ):
        analysis.rq_job_id = f"analysis-{analysis.id}-{uuid.uuid4().hex[:6]}"
        analysis.save(update_fields=["rq_job_id"])
        analysis_enqueue(analysis, worker_name=identity.name)


def analysis_update(*, analysis: FeatureAnalysis, actor, shared: bool) -> FeatureAnalysis:
    check_may_change(analysis, actor, what="analysis")
    analysis.shared = shared
    analysis_publish(analysis, "analysis:updated", ["shared"])
    return analysis


def analysis_delete(*, analysis: FeatureAnalysis, actor) -> None:
    check_may_change(analysis, actor, what="analysis")
    if analysis.status in FeatureAnalysis.ACTIVE:
        raise ApplicationError("ANALYSIS_BUSY", "The analysis is running; cancel it first.", status=409)
    analysis.delete()


def analysis_files_follow_row(sender, instance: FeatureAnalysis, **kwargs) -> None:
    """pre_delete of an analysis row (also when its SAE goes): its folder goes on commit."""
    files_removed_on_commit(instance)


def files_removed_on_commit(analysis: FeatureAnalysis) -> None:
    directory = analysis.directory
    transaction.on_commit(lambda: shutil.rmtree(directory, ignore_errors=True))


# --- labels --------------------------------------------------------------------------------------


def feature_label_set(
    *, sae: SparseAutoencoder, index: int, actor, label: str | None = None, notes: str | None = None,
    shared: bool | None = None,
) -> FeatureLabel:  # fmt: skip
    """The actor's own label / notes on feature ``index`` (created on first use); an empty label
    and notes remove it. Readers who may write label any SAE they can see."""
    if not 0 <= index < sae.d_sae:
        raise ApplicationError("FEATURE_NOT_FOUND", f"The SAE has features 0 to {sae.d_sae - 1}.", status=404)
    owner = actor if getattr(actor, "is_authenticated", False) else None
    row, _ = FeatureLabel.objects.get_or_create(sae=sae, index=index, owner=owner)
    for name, value in (("label", label), ("notes", notes), ("shared", shared)):
        if value is not None:
            setattr(row, name, value.strip() if isinstance(value, str) else value)
    if not row.label and not row.notes:
        row.delete()
        row.pk = None
        return row
    row.save()
    return row


# --- live encoding -------------------------------------------------------------------------------


def feature_encode(*, sae: SparseAutoencoder, text: str, top: int = 10) -> dict[str, Any]:
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
    return call_worker(
        host,
        "features.tasks.run_feature_encode",
        sae.id,
        text,
        top,
        wait_seconds=ENCODE_WAIT_SECONDS,
    )
