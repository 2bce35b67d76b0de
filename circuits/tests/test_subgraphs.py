"""Saved subgraphs: a reading of a graph (pins, supernodes, thresholds, notes, per-node notes) saved
by whoever may see the graph, read back through the graph's nodes (its pins kept whatever the
thresholds, its notes as the nodes' names), shared with the graph's other readers only when its
owner says so, changed only by its owner, and exported in Neuronpedia's subgraph form."""

import json

import pytest

from circuits.models import Subgraph
from circuits.tests.conftest import computed_graph, transcoder_rows
from conftest import make_user
from models_app.tests.burst_worker import load_on_burst_worker

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "subgraph-worker"


def test_a_subgraph_is_saved_read_shared_changed_by_its_owner_and_exported(
    tiny_gpt2_folder, writer, client_for
):
    model = load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)
    api = client_for(writer)
    transcoders = transcoder_rows(model, tiny_gpt2_folder, writer)
    graph = computed_graph(
        api, model, transcoders, worker=WORKER, prompt="The cat sat on the mat because it was"
    )
    api.patch(f"/api/graphs/{graph.id}", {"shared": True}, format="json")
    full = json.loads(api.get(f"/api/graphs/{graph.id}/nodes?node_threshold=0.95").content)
    features = [node["node_id"] for node in full["nodes"] if node["feature_type"] == "cross layer transcoder"]
    weakest = min(
        (node for node in full["nodes"] if node["feature_type"] == "cross layer transcoder"),
        key=lambda node: -node["influence"],
    )["node_id"]  # the last feature a prune drops
    body = {"name": "the cat path", "notes": "why the cat", "pinned": [weakest, features[0]],
            "supernodes": [["cats", *features[:2]]], "node_threshold": 0.3, "edge_threshold": 0.9,
            "annotations": {weakest: "a weak one I care about"}}  # fmt: skip
    created = api.post(f"/api/graphs/{graph.id}/subgraphs", body, format="json")
    assert created.status_code == 201, created.content
    subgraph = created.json()
    assert (subgraph["name"], subgraph["shared"], subgraph["owner"]) == (
        "the cat path",
        False,
        writer.username,
    )

    # Read through the graph's nodes: its thresholds, its pins (kept at 0.3), its notes as names.
    read = json.loads(api.get(f"/api/graphs/{graph.id}/nodes?subgraph={subgraph['id']}").content)
    assert read["metadata"]["node_threshold"] == 0.3 and read["mistudio"]["edge_threshold"] == 0.9
    assert read["qParams"]["pinnedIds"] == [weakest, features[0]]
    nodes = {node["node_id"]: node for node in read["nodes"]}
    assert weakest in nodes and nodes[weakest]["clerp"] == "a weak one I care about"
    plain = json.loads(api.get(f"/api/graphs/{graph.id}/nodes?node_threshold=0.3&edge_threshold=0.9").content)
    assert weakest not in {node["node_id"] for node in plain["nodes"]}  # the graph row's own reading drops it

    # Another reader of the (shared) graph sees it only once shared; only its owner changes it.
    other = client_for(make_user("olga-other", "model:write"))
    assert other.get(f"/api/subgraphs/{subgraph['id']}").status_code == 404
    assert other.get(f"/api/graphs/{graph.id}/subgraphs").json()["subgraphs"] == []
    assert api.patch(f"/api/subgraphs/{subgraph['id']}", {"shared": True}, format="json").status_code == 200
    assert [row["id"] for row in other.get(f"/api/graphs/{graph.id}/subgraphs").json()["subgraphs"]] == [
        subgraph["id"]
    ]
    seen = json.loads(other.get(f"/api/graphs/{graph.id}/nodes?subgraph={subgraph['id']}").content)
    assert seen["qParams"]["pinnedIds"] == [weakest, features[0]]
    refused = other.patch(f"/api/subgraphs/{subgraph['id']}", {"name": "mine now"}, format="json")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "NOT_OWNER"
    assert other.delete(f"/api/subgraphs/{subgraph['id']}").status_code == 403

    # Neuronpedia's subgraph form.
    exported = api.get(f"/api/subgraphs/{subgraph['id']}/export").json()
    assert exported == {
        "modelId": model.name, "slug": graph.id, "displayName": "the cat path",
        "pinnedIds": [weakest, features[0]], "supernodes": [["cats", *features[:2]]],
        "clerps": [[weakest, "a weak one I care about"]], "pruningThreshold": 0.3, "densityThreshold": None,
    }  # fmt: skip

    # Bad input: a clear 400 and nothing written.
    for bad, code in (
        ({"name": "x", "pinned": ["not a node"]}, "INVALID_NODES"),
        ({"name": "x", "node_threshold": 2}, "VALIDATION_ERROR"),
        ({"name": "x", "annotations": {"bad id": "text"}}, "INVALID_NODES"),
        ({"name": "   "}, "VALIDATION_ERROR"),
    ):
        response = api.post(f"/api/graphs/{graph.id}/subgraphs", bad, format="json")
        assert response.status_code == 400 and response.json()["error"]["code"] == code, (
            bad,
            response.content,
        )
    assert Subgraph.objects.count() == 1
    assert api.delete(f"/api/subgraphs/{subgraph['id']}").status_code == 204
    assert not Subgraph.objects.exists()
