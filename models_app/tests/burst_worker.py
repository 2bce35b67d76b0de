"""Interactive work answered by a burst worker in this process: a model loaded on it, and a request
that waits for the worker (the way the web waits for the model's host) answered by running it."""

from __future__ import annotations

import threading

from models_app.tests.live_stack import wait_until


def load_on_burst_worker(folder, owner, *, worker: str, name: str = "tiny"):
    """A model of ``folder`` registered for ``owner`` and loaded by the burst worker ``worker``."""
    from mistudio.access import OPERATOR
    from mistudio.workers import run_worker
    from models_app.services import model_load_request, model_register

    model = model_register(source="local", identifier=str(folder), name=name, owner=owner)
    model_load_request(model_id=model.id, actor=OPERATOR)
    run_worker(name=worker, device="cpu", burst=True)
    model.refresh_from_db()
    assert model.status == "ready"
    return model


def answered(api, path: str, body: dict | None = None, *, worker: str):
    """POST ``body`` (GET without one) in a thread, answer its call with the burst worker
    ``worker``, return the response."""
    from mistudio.workers import interactive_queue, run_worker

    answer = {}

    def ask():
        answer["response"] = api.get(path) if body is None else api.post(path, body, format="json")

    asking = threading.Thread(target=ask)
    asking.start()
    wait_until(
        lambda: interactive_queue(worker).count > 0 or not asking.is_alive(), timeout=30, what="the call"
    )
    run_worker(name=worker, device="cpu", burst=True)
    asking.join(timeout=60)
    return answer["response"]
