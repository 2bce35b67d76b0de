"""The one way jobs are queued (``mistudio.workers.enqueue``), on the real Redis: after the
caller's transaction commits, never for a request that rolled back, with the task's timeout."""

import pytest
from django.db import transaction

from mistudio.workers import TASK_TIMEOUT_SECONDS, enqueue, worker_queue

pytestmark = pytest.mark.django_db(transaction=True)
TASK = "models_app.tasks.unload_model"


def test_a_job_is_queued_when_its_transaction_commits_and_never_after_a_rollback():
    queue = worker_queue("enqueue-test")
    queue.empty()
    with transaction.atomic():
        enqueue(queue, TASK, "m_committed", reason="test")
        assert queue.count == 0  # the worker would not find the rows yet
    assert queue.count == 1
    job = queue.jobs[0]
    assert job.args == ("m_committed",) and job.kwargs == {"reason": "test"}
    assert job.timeout == TASK_TIMEOUT_SECONDS[TASK]

    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue(queue, TASK, "m_rolled_back", reason="test")
        raise RuntimeError("the request failed")
    assert [job.args for job in queue.jobs] == [("m_committed",)]

    enqueue(queue, TASK, "m_outside", reason="test")  # no transaction: at once
    assert queue.count == 2
    queue.empty()
