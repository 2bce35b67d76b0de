"""What a reader that has heard nothing for a while is told (``generation_check``). A row the
worker completed a moment ago is not answered from the row: the final event the worker is still
writing carries what the row does not (captured values, logprobs). Seen in CI: under load a
captured generation's answer came back without its activations."""

from datetime import timedelta

import pytest
from django.utils import timezone

from generation.models import Generation
from generation.services import (
    FINAL_EVENT_GRACE_SECONDS,
    SamplingRequest,
    generation_check,
    generation_request,
)

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_row_just_completed_is_left_to_its_stream(ready_model, writer):
    (row,) = generation_request(
        model_id=ready_model.id, owner=writer, prompts=["one"], sampling=SamplingRequest(max_tokens=5)
    )
    Generation.objects.filter(pk=row.pk).update(status="completed", finished_at=timezone.now())
    assert generation_check(row.id) is None  # the worker's final event is on its way

    long_ago = timezone.now() - timedelta(seconds=FINAL_EVENT_GRACE_SECONDS + 1)
    Generation.objects.filter(pk=row.pk).update(finished_at=long_ago)
    assert generation_check(row.id)["type"] == "done"  # its stream is gone: the row's result

    Generation.objects.filter(pk=row.pk).update(
        status="failed", error_code="WORKER_LOST", finished_at=timezone.now()
    )
    assert generation_check(row.id)["code"] == "WORKER_LOST"  # a failure carries nothing more
