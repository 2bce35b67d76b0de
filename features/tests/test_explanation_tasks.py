"""What an explanation job stores of an endpoint's words (``features.explanation_tasks``): an
endpoint's error text goes into a feature's ``error_message``, and the job's own when the endpoint
is wrong, only with the configured keys and anything shaped like a key taken out."""

from __future__ import annotations

import pytest

from engine.autointerp.pipeline import FeatureResult
from engine.autointerp.scoring import Score, scorer_names
from features.explanation_tasks import EndpointWatch, store_result
from features.models import Explanation, ExplanationJob, FeatureAnalysis
from mistudio.errors import ApplicationError
from mistudio.jobs import job_fail

pytestmark = pytest.mark.django_db

KEY = "paid-explainer-key-9d8c7b6a5f"


@pytest.fixture
def job(sae_row, planted_cache, writer, settings, monkeypatch):
    """A running job on an administrator's endpoint whose key is ``KEY``."""
    monkeypatch.setenv("PAID_EXPLAINER_KEY", KEY)
    settings.EXPLAINER_ENDPOINTS = {
        "paid": {"url": "https://example.invalid/v1", "key_env": "PAID_EXPLAINER_KEY", "context_tokens": 4096}
    }
    analysis = FeatureAnalysis.objects.create(
        sae=sae_row, cache=planted_cache, status="completed", owner=writer
    )
    return ExplanationJob.objects.create(
        analysis=analysis, endpoint="paid", explainer_model="gpt", scorer_model="gpt", indices=[1, 2],
        status="running", owner=writer,
    )  # fmt: skip


ECHOED = f"The endpoint answered 401: bad key {KEY} (also tried sk-live-0123456789abcdefghij)"


def test_an_endpoints_error_text_is_stored_redacted(job):
    stored = store_result(job, FeatureResult(index=1, error_code="ENDPOINT_ERROR", error_message=ECHOED))
    stored.refresh_from_db()
    assert KEY not in stored.error_message and "sk-live-0123456789abcdefghij" not in stored.error_message
    assert stored.error_message.startswith("The endpoint answered 401: bad key [redacted]")


def test_a_job_failed_by_its_endpoint_stores_its_message_redacted(job):
    watch = EndpointWatch(2, local=False)
    watch.check(FeatureResult(index=1, error_code="ENDPOINT_ERROR", error_message=ECHOED))
    with pytest.raises(ApplicationError) as failed:
        watch.check(FeatureResult(index=2, error_code="ENDPOINT_ERROR", error_message=ECHOED))
    assert KEY in failed.value.message  # (what the wrapper gets; it stores it through job_fail)
    job_fail(job, code=failed.value.code, message=failed.value.message)
    job.refresh_from_db()
    assert job.status == "failed" and job.error_code == "ENDPOINT_ERROR"
    assert KEY not in job.error_message and "[redacted]" in job.error_message


def test_each_scorer_with_a_column_stores_its_score_there(job):
    """Every scorer with a column of its own (Explanation.SCORE_COLUMNS) is a registered one, and
    a result's scores land in those columns; a scorer that gave none leaves its column empty."""
    assert set(Explanation.SCORE_COLUMNS) <= set(scorer_names())
    score = Score(balanced_accuracy=0.75, true_positives=3, true_negatives=3, false_positives=1,
                  false_negatives=1, failed=0, total=8, value=0.75)  # fmt: skip
    row = store_result(job, FeatureResult(index=1, explanation="ships", scores={"detection": score}))
    assert (row.detection, row.fuzzing, row.score) == (0.75, None, 0.75)
    assert row.scoring == {"detection": score.as_dict()}
