"""Workers stay responsive at any idle time, and a worker call that misses its deadline is a 503
that leaves nothing running.

The second review: after about two minutes idle, a worker logged "Timeout reading from socket" and
backed off for up to 60 s (a queued training waited 46 s to start), and ``/encode``, ``/logit-lens``
and ``/patching`` answered 500 at exactly 10 s — the Redis socket timeout, shorter than the worker's
blocking dequeue and the calls' own deadlines — while the abandoned call still ran later.

Here the socket timeout is 1 s and RQ's blocking dequeue 5 s (both settings), and the worker
idles past both before it is called on.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from django.conf import settings

from mistudio.errors import ApplicationError
from mistudio.redis_client import get_redis
from mistudio.workers import (
    call_waiting_key,
    call_worker,
    call_worker_key,
    interactive_queue,
    run_worker,
    worker_task,
)
from models_app.models import LanguageModel
from models_app.tests.live_stack import register_and_load, wait_until
from saes import services
from saes.models import SparseAutoencoder
from saes.tests.conftest import HOOK, write_planted_cache
from steering.services import logit_lens_request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.waits]

IDLE_SECONDS = 6.5  # longer than the 1 s socket timeout and the 5 s dequeue below


@worker_task(timeout=10)
def note_the_call(request_id: str, marker: str) -> None:
    """A worker call whose computation leaves a mark in Redis (so a test sees whether it ran)."""
    from mistudio.workers import answer_call

    answer_call(request_id, lambda: {"ran": bool(get_redis().set(marker, "1", ex=60))}, failure_code="X")


def test_an_idle_worker_answers_a_call_and_starts_a_job_at_once(
    tiny_gpt2_folder, writer, process_env, settings
):
    settings.REDIS_SOCKET_TIMEOUT_SECONDS = 1  # this process's command reads, as the web's
    name = "idle-worker"
    environment = process_env(REDIS_SOCKET_TIMEOUT_SECONDS="1", RQ_WORKER_TTL_SECONDS="20")
    with open(settings.DATA_DIR / f"{name}.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "manage.py", "worker", "--name", name],
            cwd=settings.BASE_DIR, env=environment, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        model = LanguageModel.objects.get(pk=register_and_load(tiny_gpt2_folder, name="idle-gpt2"))
        cache = write_planted_cache(model, writer, samples=32)

        time.sleep(IDLE_SECONDS)
        started = time.monotonic()
        lens = logit_lens_request(model=model, prompt="Hello there", top=3)
        answered_in = time.monotonic() - started
        assert lens["tokens"] and len(lens["top"]) == len(lens["layers"]) > 0
        assert answered_in < 2, f"the idle worker answered after {answered_in:.1f} s"

        time.sleep(IDLE_SECONDS)
        sae = services.sae_train_request(
            owner=writer, cache=cache, hook=HOOK, batch_size=256, total_tokens=256
        )
        wait_until(
            lambda: SparseAutoencoder.objects.filter(pk=sae.pk, started_at__isnull=False).exists(),
            timeout=30, what="the training to start",
        )  # fmt: skip
        sae.refresh_from_db()
        waited = (sae.started_at - sae.created_at).total_seconds()
        assert waited < 1, f"a job queued on the idle worker started after {waited:.1f} s"
        log_text = (settings.DATA_DIR / f"{name}.log").read_text(errors="replace")
        assert "Timeout reading from socket" not in log_text and "retrying in" not in log_text
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_a_call_that_misses_its_deadline_is_a_503_and_is_withdrawn(settings):
    settings.REDIS_SOCKET_TIMEOUT_SECONDS = 0.5  # shorter than the wait: the wait must not be cut by it
    marker = f"{settings.REDIS_KEY_PREFIX}:test:marker"
    started = time.monotonic()
    with pytest.raises(ApplicationError) as busy:
        call_worker("nobody-home", f"{__name__}.note_the_call", marker, wait_seconds=2)
    waited = time.monotonic() - started
    assert (busy.value.code, busy.value.status) == ("MODEL_BUSY", 503)
    assert busy.value.details["retry_after_seconds"] == 5
    assert 2 <= waited < 3, waited  # the whole deadline, not the socket timeout
    assert interactive_queue("nobody-home").count == 0  # withdrawn: nothing left to run


def test_a_worker_skips_a_call_its_caller_gave_up_on():
    marker = f"{settings.REDIS_KEY_PREFIX}:test:skipped"
    queue = interactive_queue("skip-worker")
    request_id = "given-up"
    # Queued, then the caller stopped waiting before a worker took it (its waiting key is gone).
    queue.enqueue(f"{__name__}.note_the_call", request_id, marker)
    get_redis().delete(call_waiting_key(request_id))
    run_worker(name="skip-worker", device="cpu", burst=True)
    assert not get_redis().exists(marker), "the abandoned call was computed anyway"
    assert not get_redis().exists(call_worker_key(request_id))  # and nobody was answered


def test_a_call_is_answered_by_a_worker_that_takes_it_in_time():
    marker = f"{settings.REDIS_KEY_PREFIX}:test:answered"
    answer: dict = {}

    def ask() -> None:
        answer["body"] = call_worker("answer-worker", f"{__name__}.note_the_call", marker, wait_seconds=20)

    asking = threading.Thread(target=ask)
    asking.start()
    wait_until(lambda: interactive_queue("answer-worker").count > 0, timeout=10, what="the call")
    run_worker(name="answer-worker", device="cpu", burst=True)
    asking.join(timeout=20)
    assert answer["body"] == {"ran": True} and get_redis().exists(marker)
