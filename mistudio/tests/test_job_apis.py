"""The one HTTP edge of every kind of job (``mistudio.job_apis``): each registered kind's detail and
cancel are routed from its registration, ``GET /api/`` lists the kinds with their id prefixes and
paths, and the runner announces ``<kind>:started`` once, before the task body runs."""

from __future__ import annotations

import pytest
from django.urls import resolve, reverse

from mistudio import jobs
from mistudio.job_apis import job_kinds_index
from mistudio.workers import run_worker
from models_app.services import model_register
from steering.models import SteeringVector

pytestmark = pytest.mark.django_db(transaction=True)  # the burst worker closes connections

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture
def tiny_model(tiny_gpt2_folder, writer):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)


def test_every_kind_with_an_edge_is_routed_from_its_registration():
    index = job_kinds_index()
    assert set(index) == {
        "extraction",
        "sae",
        "sae_group",
        "analysis",
        "explanation",
        "graph",
        "vector",
        "bench",
    }
    for kind in jobs.job_kinds():
        if kind.api is None:
            continue
        entry = index[kind.model.kind]
        assert kind.model._meta.pk.default().startswith(entry["id_prefix"] + "_")
        values = {name: f"x_{name}" for name in ("sae_id", entry["id_parameter"])}
        detail = "/api/" + entry["path"].format(**values)
        assert resolve(detail).url_name == f"{kind.api.name}-detail"
        assert resolve("/api/" + entry["cancel_path"].format(**values)).url_name == f"{kind.api.name}-cancel"
    assert index["analysis"] == {
        "id_prefix": "fa",
        "path": "saes/{sae_id}/analyses/{analysis_id}",
        "cancel_path": "saes/{sae_id}/analyses/{analysis_id}/cancel",
        "id_parameter": "analysis_id",
    }


def test_the_api_root_lists_the_kinds_of_job(writer, client_for):
    root = client_for(writer).get(reverse("api-root")).json()
    assert root["jobs"] == job_kinds_index()
    assert root["jobs"]["vector"]["id_prefix"] == "sv"


def test_detail_change_cancel_and_delete_through_the_generic_views(tiny_model, writer, client_for):
    api = client_for(writer)
    body = {"model_id": tiny_model.id, "hook_name": HOOK, "positive": ["joy"], "negative": ["gloom"]}
    vector_id = api.post("/api/steering-vectors", body, format="json").json()["id"]
    url = f"/api/steering-vectors/{vector_id}"
    assert api.get(url).json()["status"] == "queued"
    changed = api.patch(url, {"name": "joy", "shared": True}, format="json")
    assert changed.status_code == 200 and changed.json()["name"] == "joy" and changed.json()["shared"]
    unknown = api.patch(url, {"colour": "red"}, format="json")
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["details"]["fields"]
    busy = api.delete(url)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "STEERING_VECTOR_BUSY"
    cancelled = api.post(f"{url}/cancel")
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    assert api.post(f"{url}/cancel").json()["error"]["code"] == "NOT_RUNNING"
    assert api.put(url, {}, format="json").status_code == 405
    assert api.delete(url).status_code == 204
    assert api.get(url).status_code == 404


def test_the_runner_announces_started_once_before_the_body(tiny_model, writer, client_for, monkeypatch):
    """The body no longer announces its own start: one ``vector:started``, then the result."""
    verbs: list[str] = []
    publish = jobs.publish

    def spy(event, *args, **kwargs):
        verbs.append(event)
        publish(event, *args, **kwargs)

    monkeypatch.setattr(jobs, "publish", spy)
    body = {"model_id": tiny_model.id, "hook_name": HOOK, "positive": ["joy"], "negative": ["gloom"]}
    response = client_for(writer).post("/api/steering-vectors", body, format="json")
    assert response.status_code == 202, response.content
    run_worker(name="edge-worker", device="cpu", burst=True)
    vector = SteeringVector.objects.get(pk=response.json()["id"])
    assert vector.status == "completed" and vector.started_at is not None
    assert [verb for verb in verbs if verb.startswith("vector:")] == [
        "vector:queued",
        "vector:started",
        "vector:completed",
    ]
