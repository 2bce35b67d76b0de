"""The one JSON shape of each row: the API, events and WebSocket snapshots use these."""

from typing import Any

from activations.models import ActivationCache
from features.models import Feature, FeatureAnalysis, FeatureLabel
from mistudio.access import AUDIENCE, linked_id


def iso(value) -> str | None:
    return value.isoformat() if value else None


def analysis_state(analysis: FeatureAnalysis, *, viewer=AUDIENCE) -> dict[str, Any]:
    """An analysis as ``GET /api/saes/{id}/analyses/{aid}``, ``analysis:*`` events and snapshots show
    it to ``viewer`` (an event's: everyone it reaches): the id of the cache it read only if they may
    see that cache."""
    return {
        "id": analysis.id,
        "sae_id": analysis.sae_id,
        "cache_id": linked_id(viewer, analysis, ActivationCache, analysis.cache_id),
        "config": analysis.config,
        "status": analysis.status,
        "phase": analysis.phase,
        "progress": analysis.progress,
        "tokens": analysis.tokens,
        "tokens_per_second": analysis.tokens_per_second,
        "eta_seconds": analysis.eta_seconds,
        "summary": analysis.summary,
        "file_size_bytes": analysis.file_size_bytes,
        "memory_estimate_bytes": analysis.memory_estimate_bytes,
        "host_worker": analysis.host_worker,
        "error_code": analysis.error_code,
        "error_message": analysis.error_message,
        "owner": analysis.owner.username if analysis.owner_id else None,
        "shared": analysis.shared,
        "created_at": iso(analysis.created_at),
        "started_at": iso(analysis.started_at),
        "finished_at": iso(analysis.finished_at),
    }


def label_state(label: FeatureLabel | None) -> dict[str, Any] | None:
    if label is None:
        return None
    return {
        "label": label.label,
        "notes": label.notes,
        "owner": label.owner.username if label.owner_id else None,
        "shared": label.shared,
        "updated_at": iso(label.updated_at),
    }


def feature_summary(feature: Feature, label: FeatureLabel | None = None) -> dict[str, Any]:
    """A feature as the feature list shows it."""
    return {
        "index": feature.index,
        "density": feature.density,
        "max_activation": feature.max_activation,
        "mean_activation": feature.mean_activation,
        "dead": feature.dead,
        "auto_label": feature.auto_label,
        "label": label_state(label),
    }
