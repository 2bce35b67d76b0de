"""The one way jobs are queued (``mistudio.workers.enqueue``), on the real Redis: after the
caller's transaction commits, never for a request that rolled back; and the timeout a task
declares beside its body (``worker_task``) is the one a real worker applies."""

import time

import pytest
from django.db import transaction
from rq.job import Job

from mistudio.workers import enqueue, run_worker, worker_queue, worker_task

pytestmark = pytest.mark.django_db(transaction=True)
TASK = "models_app.tasks.unload_model"


@worker_task(timeout=1)
def sleep_past_its_limit(seconds: float) -> str:
    time.sleep(seconds)
    return "woke up"


def test_a_job_is_queued_when_its_transaction_commits_and_never_after_a_rollback():
    queue = worker_queue("enqueue-test")
    queue.empty()
    with transaction.atomic():
        enqueue(queue, TASK, "m_committed", reason="test")
        assert queue.count == 0  # the worker would not find the rows yet
    assert queue.count == 1
    job = queue.jobs[0]
    assert job.args == ("m_committed",) and job.kwargs == {"reason": "test"}

    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue(queue, TASK, "m_rolled_back", reason="test")
        raise RuntimeError("the request failed")
    assert [job.args for job in queue.jobs] == [("m_committed",)]

    enqueue(queue, TASK, "m_outside", reason="test")  # no transaction: at once
    assert queue.count == 2
    queue.empty()


def test_a_worker_applies_the_timeout_a_task_declares_whatever_it_was_queued_with():
    queue = worker_queue("timeout-test")
    queue.empty()
    job = queue.enqueue(f"{__name__}.sleep_past_its_limit", 3, job_timeout=600)
    started = time.monotonic()
    run_worker(name="timeout-test", device="cpu", burst=True)
    job = Job.fetch(job.id, connection=queue.connection)
    assert job.get_status() == "failed" and "JobTimeoutException" in (job.latest_result().exc_string or "")
    assert time.monotonic() - started < 3  # stopped after its declared second, not its queued 600
