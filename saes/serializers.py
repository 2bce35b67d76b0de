"""The one JSON shape of an SAE row: the API, its events and WebSocket snapshots all use it."""

from typing import Any

from saes.models import SparseAutoencoder


def iso(value) -> str | None:
    return value.isoformat() if value else None


def sae_state(sae: SparseAutoencoder, *, with_history: bool = True) -> dict[str, Any]:
    """An SAE as ``GET /api/saes/{id}``, ``sae:*`` events and snapshots show it (the list leaves
    out ``history``, the training curves)."""
    state = {
        "id": sae.id,
        "name": sae.name,
        "source": sae.source,
        "model_id": sae.model_id,
        "model_name": sae.model_name,
        "cache_id": sae.cache_id,
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
        "evaluation": sae.evaluation,
        "evaluation_status": sae.evaluation_status,
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
