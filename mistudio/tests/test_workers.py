"""The worker's lanes (``mistudio.workers.MiStudioWorker.lane_order``), with a real RQ worker in
burst mode and a real model load: a flood of interactive work that never lets the interactive
queue empty does not starve a model load."""

from __future__ import annotations

import time

import pytest
from rq.job import Job

from mistudio.access import OPERATOR
from mistudio.redis_client import get_redis
from mistudio.workers import interactive_queue, run_worker, worker_task
from models_app.models import LanguageModel
from models_app.services import model_load_request, model_register

pytestmark = pytest.mark.django_db(transaction=True)  # the burst worker in this process closes connections

WORKER = "flooded-worker"
FLOOD_SECONDS = 20  # the flood's end at the latest: what the load would wait without the turns


@worker_task(timeout=30)
def flood_item(model_id: str, until: float) -> None:
    """One interactive item (20 ms of work) that puts the next in the queue while the model is not
    loaded: the interactive queue never empties."""
    time.sleep(0.02)
    if time.time() < until and not LanguageModel.objects.filter(pk=model_id, status="ready").exists():
        interactive_queue(WORKER).enqueue(f"{__name__}.flood_item", model_id, until)


def test_a_model_load_starts_within_a_turn_under_a_continuous_interactive_flood(tiny_gpt2_folder, settings):
    settings.WORKER_INTERACTIVE_TURN_SECONDS = 0.5
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None)
    until = time.time() + FLOOD_SECONDS
    for _ in range(3):  # three in the queue at all times
        interactive_queue(WORKER).enqueue(f"{__name__}.flood_item", model.id, until)
    job_id = model_load_request(model_id=model.id, actor=OPERATOR).rq_job_id
    run_worker(name=WORKER, device="cpu", burst=True)
    load = Job.fetch(job_id, connection=get_redis())
    model.refresh_from_db()
    assert model.status == "ready"
    waited = (load.started_at - load.enqueued_at).total_seconds()
    assert waited < 3, f"the load waited {waited:.1f} s behind the interactive flood"
