"""Where a queued job stands (``mistudio.job_queue``): its place in the scheduler's fair line, what
runs and waits ahead of it (another user's rows by their kind alone), when it may start; in its
row's GET, which the pages and the client read. Before, a job said "Queued 0 %" and nothing more."""

import pytest

from conftest import make_user
from features.models import FeatureAnalysis
from mistudio.job_queue import queue_position
from mistudio.workers import worker_queue
from saes.models import SparseAutoencoder

pytestmark = pytest.mark.django_db
WORKER = "queue-worker"


@pytest.fixture
def sae(writer):
    return SparseAutoencoder.objects.create(
        hook_name="blocks.0.hook_resid_post", architecture="topk", d_in=8, d_sae=16, status="completed",
        owner=writer, shared=True,
    )  # fmt: skip


def analysis(sae, owner, *, status="queued", **fields) -> FeatureAnalysis:
    return FeatureAnalysis.objects.create(
        sae=sae, owner=owner, status=status, queue_name=worker_queue(WORKER).name, **fields
    )


def test_a_queued_job_says_its_place_what_is_ahead_and_when_it_may_start(sae, writer, client_for):
    olga = make_user("olga-other", "model:write")
    running = analysis(sae, writer, status="running", host_worker=WORKER, eta_seconds=120.0)
    theirs = analysis(sae, olga)  # the oldest waiting
    first = analysis(sae, writer)
    mine = analysis(sae, writer)

    place = queue_position(mine, viewer=writer)
    # Fair between owners: olga's oldest, then walt's oldest, then this one.
    assert place["position"] == 3 and place["workers"] == 1
    assert place["ahead"] == [
        {"kind": "analysis", "id": None, "owner": "another user", "status": "queued", "eta_seconds": None},
        {"kind": "analysis", "id": first.pk, "owner": "you", "status": "queued", "eta_seconds": None},
    ]
    assert place["running"] == [
        {"kind": "analysis", "id": running.pk, "owner": "you", "status": "running", "eta_seconds": 120.0}
    ]
    assert place["starts_in_seconds"] is None  # the rows ahead have no ETA yet
    assert theirs.pk not in str(place)  # another user's private row: its kind alone

    # Next in line behind a job with an ETA: it may start when that one ends.
    FeatureAnalysis.objects.filter(pk__in=[theirs.pk, first.pk]).update(status="cancelled")
    assert queue_position(mine, viewer=writer) | {"ahead": []} == {
        "position": 1, "ahead": [], "running": place["running"], "workers": 1, "starts_in_seconds": 120.0,
    }  # fmt: skip

    # In the row's GET (what the pages and the client read); null once it runs.
    body = client_for(writer).get(f"/api/saes/{sae.id}/analyses/{mine.id}").json()
    assert body["queue"]["position"] == 1 and body["queue"]["starts_in_seconds"] == 120.0
    assert client_for(writer).get(f"/api/saes/{sae.id}/analyses/{running.id}").json()["queue"] is None


def test_the_pages_say_where_a_queued_job_or_model_load_stands(sae, writer, tiny_gpt2_folder):
    import time

    from django.test import Client

    from mistudio.workers import WorkerIdentity, write_heartbeat
    from models_app.models import LanguageModel
    from models_app.services import model_register

    olga = make_user("olga-other", "model:write")
    analysis(sae, writer, status="running", host_worker=WORKER, eta_seconds=120.0)
    analysis(sae, olga)
    analysis(sae, writer)
    browser = Client()
    browser.force_login(writer)
    listed = browser.get(f"/saes/{sae.id}/?fragment=analyses").content.decode()
    assert (
        "Queued · <strong>#2</strong> in line, behind your analysis (running, about 120 s left), "
        "another user's analysis · its start is unknown" in listed
    )

    # A model load waits for what the workers run (they yield to it at their next checkpoint).
    write_heartbeat(WorkerIdentity(name=WORKER, device="cpu"), time.time())
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    LanguageModel.objects.filter(pk=model.pk).update(status="loading", progress=0, status_message="Queued")
    card = browser.get("/").content.decode().split(f'data-model-id="{model.id}"')[1]
    assert "Waiting for a worker, behind your analysis (running, about 120 s left)." in card
