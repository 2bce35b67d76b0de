"""Read queries of explanation jobs and explanations, for the API, pages, commands and search.

An explanation is written from the analysis's examples (the cache's text): it is visible where
its job is, and a job where its analysis is and it is the reader's own or shared.
"""

from __future__ import annotations

from typing import Any

from features.models import Explanation, ExplanationJob
from features.selectors import explanation_job_list
from features.serializers import explanation_job_state
from mistudio.access import visible_row
from mistudio.errors import ApplicationError
from mistudio.events import register_group_kind
from saes.models import SparseAutoencoder


def explanation_job_get(*, user, sae: SparseAutoencoder, job_id: str) -> ExplanationJob:
    """One of the SAE's explanation jobs that the user may see (404 otherwise)."""
    return visible_row(
        explanation_job_list(user=user).filter(analysis__sae=sae),
        job_id,
        code="EXPLANATION_JOB_NOT_FOUND",
        what="explanation job of this SAE",
    )


def explanation_get(*, user, sae: SparseAutoencoder, index: int, explanation_id: int) -> Explanation:
    """One explanation of feature ``index`` of the SAE that the user may see (404 otherwise)."""
    explanation = (
        Explanation.objects.select_related("analysis__sae")
        .filter(pk=explanation_id, index=index, analysis__sae=sae, job__in=explanation_job_list(user=user))
        .first()
    )
    if explanation is None:
        raise ApplicationError("EXPLANATION_NOT_FOUND", "No such explanation of this feature.", status=404)
    return explanation


def explanation_snapshot(user, key: str | None) -> dict[str, Any] | None:
    job = explanation_job_list(user=user).filter(pk=key).first()
    return None if job is None else explanation_job_state(job, viewer=user)


def register_event_groups() -> None:
    register_group_kind(
        "explanation",
        keyed=True,
        snapshot=explanation_snapshot,
        visible=lambda user, key: explanation_job_list(user=user).filter(pk=key).exists(),
    )
