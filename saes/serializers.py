"""The one JSON shape of an SAE row and of an evaluation: the API, events and snapshots use them."""

from typing import Any

from activations.models import ActivationCache
from mistudio.access import AUDIENCE, linked_id
from saes.models import SaeEvaluation, SparseAutoencoder


def iso(value) -> str | None:
    return value.isoformat() if value else None


def sae_state(sae: SparseAutoencoder, *, viewer=AUDIENCE, with_history: bool = True) -> dict[str, Any]:
    """An SAE as ``GET /api/saes/{id}``, ``sae:*`` events and snapshots show it to ``viewer`` (an
    event's: everyone it reaches): the id of the cache it was trained or evaluated on only if they
    may see that cache. The list leaves out the bulky fields (``with_history=False``: the training
    curves)."""
    evaluation = dict(sae.evaluation)
    if "cache_id" in evaluation:
        evaluation["cache_id"] = linked_id(viewer, sae, ActivationCache, evaluation["cache_id"])
    state = {
        "id": sae.id,
        "name": sae.name,
        "source": sae.source,
        "model_id": sae.model_id,
        "model_name": sae.model_name,
        "cache_id": linked_id(viewer, sae, ActivationCache, sae.cache_id),
        "hook_name": sae.hook_name,
        "architecture": sae.architecture,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "k": sae.k,
        "hyperparameters": sae.hyperparameters,
        "scaling_factor": sae.scaling_factor,
        "status": sae.status,
        "progress": sae.progress,
        "step": sae.step,
        "total_steps": sae.total_steps,
        "tokens_seen": sae.tokens_seen,
        "total_tokens": sae.total_tokens,
        "tokens_per_second": sae.tokens_per_second,
        "eta_seconds": sae.eta_seconds,
        "metrics": sae.metrics,
        "evaluation": evaluation,
        "evaluation_status": sae.evaluation_status,
        "warnings": sae.warnings,
        "memory_estimate_bytes": sae.memory_estimate_bytes,
        "file_size_bytes": sae.file_size_bytes,
        "host_worker": sae.host_worker,
        "error_code": sae.error_code,
        "error_message": sae.error_message,
        "owner": sae.owner.username if sae.owner_id else None,
        "shared": sae.shared,
        "created_at": iso(sae.created_at),
        "started_at": iso(sae.started_at),
        "finished_at": iso(sae.finished_at),
        "training_time_seconds": sae.training_time_seconds,
    }
    if with_history:
        state["history"] = sae.history
    return state


def sae_event_state(sae: SparseAutoencoder) -> dict[str, Any]:
    """What ``sae:*`` events carry: the state without the curves (events carry new ``points``)."""
    return sae_state(sae, with_history=False)


def evaluation_state(evaluation: SaeEvaluation, *, viewer=AUDIENCE) -> dict[str, Any]:
    """An evaluation as its ``evaluation:*`` events (on its SAE's group) show it."""
    return {
        "evaluation_id": evaluation.id,
        "sae_id": evaluation.sae_id,
        # Its events reach everyone who sees the SAE: the SAE decides who may see the cache's id.
        "cache_id": linked_id(viewer, evaluation.sae, ActivationCache, evaluation.cache_id),
        "status": evaluation.status,
        "progress": evaluation.progress,
        "results": evaluation.results,
        "memory_estimate_bytes": evaluation.memory_estimate_bytes,
        "host_worker": evaluation.host_worker,
        "error_code": evaluation.error_code,
        "error_message": evaluation.error_message,
        "created_at": iso(evaluation.created_at),
        "finished_at": iso(evaluation.finished_at),
    }
