"""Attribution graphs through the API: the job (a burst worker over the tiny GPT-2) stores the graph
the engine computes on the same weights; the owner pins, groups and prunes; the nodes come labelled
only with what the viewer may see; a shared graph opens to others, its private transcoders do not;
an intervention answered by the model's worker equals the engine's; the export is the viewer's JSON;
bad input gets a 4xx and loses nothing. Views prune the graph's bounded view, never its matrix, and
equal the full graph's prune up to the node threshold the view holds; a graph made before views
gets its view from a worker."""

import io
import json
import threading
import time

import pytest
import torch
from django.core.management import call_command

from circuits.models import AttributionGraph
from circuits.services import graph_estimate
from circuits.tests.conftest import computed_graph, transcoder_rows
from circuits.view_memory import held_bytes
from conftest import make_user
from engine.attribution import AttributionConfig, attribute, attribution_tokens, prune
from engine.attribution import AttributionGraph as EngineGraph
from engine.attribution.graph import TENSORS_FILENAME
from engine.attribution.intervention import FeatureIntervention, intervene
from engine.attribution.neuronpedia import graph_json
from engine.attribution.prunable import VIEW_FILENAME
from engine.registry import LOADED_MODELS
from features.models import FeatureLabel
from mistudio.redis_client import get_redis
from mistudio.workers import WorkerIdentity, heartbeat_key, run_worker, write_heartbeat
from models_app.models import LanguageModel
from models_app.tests.burst_worker import answered, load_on_burst_worker
from models_app.tests.live_stack import wait_until
from saes.tasks import sae_module

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "graph-worker"
PROMPT = "The cat sat on the mat because it was warm"


@pytest.fixture
def loaded_model(tiny_gpt2_folder, writer):
    return load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)


def test_a_graph_is_computed_stored_pruned_shared_intervened_and_exported(
    loaded_model, tiny_gpt2_folder, writer, client_for
):
    api = client_for(writer)
    transcoders = transcoder_rows(loaded_model, tiny_gpt2_folder, writer)
    ids = [sae.id for sae in transcoders]
    response = api.post(
        "/api/graphs",
        {
            "model_id": loaded_model.id,
            "prompt": PROMPT,
            "transcoder_ids": ids,
            "batch_size": 16,
            "name": "cats",
        },
        format="json",
    )
    assert response.status_code == 202, response.content
    state = response.json()
    assert state["status"] == "queued" and state["transcoder_ids"] == ids
    assert state["memory_estimate_bytes"] > 0
    run_worker(name=WORKER, device="cpu", burst=True)
    graph = AttributionGraph.objects.get(pk=state["id"])
    assert graph.status == "completed", (graph.error_code, graph.error_message)

    # The stored graph is the engine's on the same weights and transcoders.
    loaded = LOADED_MODELS.get(loaded_model.id)
    tokens = attribution_tokens(loaded.tokenizer, PROMPT)
    assert graph.tokens == tokens
    modules = [sae_module(sae) for sae in transcoders]
    expected = attribute(loaded.model, modules, tokens, AttributionConfig(batch_size=16))
    summary = api.get(f"/api/graphs/{graph.id}").json()["summary"]
    assert summary["active_features"] == len(expected.active_features)
    assert summary["completeness_error"] <= 1e-4
    assert [logit["token_id"] for logit in summary["logits"]] == expected.logit_tokens.tolist()

    # The page's view: the pruned graph in the Neuronpedia JSON, at other thresholds on request.
    view = api.get(f"/api/graphs/{graph.id}/nodes").json()
    pruned = prune(expected, 0.8, 0.98)
    assert len(view["nodes"]) <= int(pruned.nodes.sum())
    assert {node["feature_type"] for node in view["nodes"]} >= {"embedding", "logit"}
    wider = api.get(f"/api/graphs/{graph.id}/nodes", {"node_threshold": 0.95, "edge_threshold": 0.99}).json()
    assert len(wider["nodes"]) >= len(view["nodes"])
    assert api.get(f"/api/graphs/{graph.id}/nodes", {"node_threshold": 2}).status_code == 400

    # Labels reach the nodes; the owner pins a path and groups a supernode.
    feature_node = next(node for node in view["nodes"] if node["feature_type"] == "cross layer transcoder")
    layer, feature, _ = (int(part) for part in feature_node["node_id"].split("_"))
    FeatureLabel.objects.create(sae=transcoders[layer], index=feature, label="cats and mats", owner=writer)
    labelled = api.get(f"/api/graphs/{graph.id}/nodes").json()
    assert (
        next(n for n in labelled["nodes"] if n["node_id"] == feature_node["node_id"])["clerp"]
        == "cats and mats"
    )
    logit_node = next(node for node in view["nodes"] if node["feature_type"] == "logit")
    changes = {
        "pinned": [feature_node["node_id"], logit_node["node_id"]],
        "supernodes": [["cat words", feature_node["node_id"]]],
        "node_threshold": 0.7,
    }
    assert api.patch(f"/api/graphs/{graph.id}", changes, format="json").status_code == 200
    saved = api.get(f"/api/graphs/{graph.id}/nodes").json()
    assert saved["qParams"]["pinnedIds"] == changes["pinned"]
    assert saved["qParams"]["supernodes"] == changes["supernodes"]
    assert saved["metadata"]["node_threshold"] == 0.7
    bad = api.patch(f"/api/graphs/{graph.id}", {"pinned": ["'); drop"]}, format="json")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "INVALID_NODES"
    assert api.get(f"/api/graphs/{graph.id}").json()["pinned"] == changes["pinned"]  # nothing lost

    # An intervention, answered by the model's worker, equals the engine's.
    body = {
        "interventions": [
            {"layer": layer, "position": int(feature_node["ctx_idx"]), "feature": feature, "value": 0.0}
        ],
        "top": 5,
    }
    answer = answered(api, f"/api/graphs/{graph.id}/intervene", body, worker=WORKER)
    assert answer.status_code == 200, answer.content
    result = intervene(
        loaded.model,
        modules,
        tokens,
        [FeatureIntervention(layer, int(feature_node["ctx_idx"]), feature, 0.0)],
    )
    top = torch.softmax(result.logits_after, -1).topk(5)
    assert [row["token_id"] for row in answer.json()["after"]] == top.indices.tolist()
    assert [row["probability"] for row in answer.json()["after"]] == pytest.approx(
        top.values.tolist(), abs=1e-5
    )
    out_of_range = {"interventions": [{"layer": 99, "position": 0, "feature": 0, "value": 1}]}
    assert api.post(f"/api/graphs/{graph.id}/intervene", out_of_range, format="json").status_code == 400

    # The export: the viewer's JSON as a file.
    export = api.get(f"/api/graphs/{graph.id}/export")
    assert export.status_code == 200 and "attachment" in export["Content-Disposition"]
    exported = json.loads(export.content)
    assert exported["metadata"]["slug"] == graph.id and exported["qParams"]["pinnedIds"] == changes["pinned"]
    assert "mistudio" not in exported

    # Another user: nothing until shared; then the graph, but not the private transcoders' labels.
    other = make_user("olga-other", "model:write")
    other_api = client_for(other)
    assert other_api.get(f"/api/graphs/{graph.id}").status_code == 404
    assert other_api.get(f"/api/graphs/{graph.id}/nodes").status_code == 404
    assert other_api.patch(f"/api/graphs/{graph.id}", {"shared": True}, format="json").status_code == 404
    assert api.patch(f"/api/graphs/{graph.id}", {"shared": True}, format="json").status_code == 200
    seen = other_api.get(f"/api/graphs/{graph.id}").json()
    assert seen["prompt"] == PROMPT and seen["transcoder_ids"] == [None] * len(ids)
    their_view = other_api.get(f"/api/graphs/{graph.id}/nodes").json()
    assert all(node["clerp"] == "" for node in their_view["nodes"] if node["feature_type"] != "logit")
    assert their_view["mistudio"]["features"] == {}
    refused = other_api.post(f"/api/graphs/{graph.id}/intervene", body, format="json")
    assert refused.status_code == 404  # the model or the transcoders: out of their sight
    assert other_api.patch(f"/api/graphs/{graph.id}", {"name": "mine"}, format="json").status_code == 403
    assert other_api.delete(f"/api/graphs/{graph.id}").status_code == 403
    # Nor can they attribute through someone's private transcoders.
    LanguageModel.objects.filter(pk=loaded_model.pk).update(shared=True)  # the model they may use
    taken = other_api.post(
        "/api/graphs", {"model_id": loaded_model.id, "prompt": PROMPT, "transcoder_ids": ids}, format="json"
    )
    assert taken.status_code == 404 and taken.json()["error"]["code"] == "SAE_NOT_FOUND"

    # Deleting the graph takes its files.
    directory = graph.directory
    assert directory.exists()
    assert api.delete(f"/api/graphs/{graph.id}").status_code == 204
    assert not AttributionGraph.objects.filter(pk=graph.id).exists()


def test_bad_requests_get_a_clear_4xx_and_write_nothing(loaded_model, tiny_gpt2_folder, writer, client_for):
    api = client_for(writer)
    transcoders = transcoder_rows(loaded_model, tiny_gpt2_folder, writer)
    ids = [sae.id for sae in transcoders]
    body = {"model_id": loaded_model.id, "prompt": PROMPT, "transcoder_ids": ids}
    for changes, code in (
        ({"transcoder_ids": ids[:1]}, "INVALID_TRANSCODERS"),
        ({"transcoder_ids": ids[::-1]}, "INVALID_TRANSCODERS"),
        ({"transcoder_ids": None}, "TRANSCODERS_REQUIRED"),
        ({"prompt": "word " * 400}, "PROMPT_TOO_LONG"),
        ({"prompt": "   "}, "INVALID_PROMPT"),
        ({"target_tokens": ["The cat sat"]}, "INVALID_TARGET"),  # three tokens, not one
        ({"target_tokens": [" cat"], "target_difference": [" cat", " dog"]}, "INVALID_TARGET"),
    ):
        request = {key: value for key, value in {**body, **changes}.items() if value is not None}
        response = api.post("/api/graphs", request, format="json")
        assert response.status_code == 400, (changes, response.content)
        assert response.json()["error"]["code"] == code, changes
    assert (
        api.post("/api/graphs", {**body, "transcoder_ids": ["sae_nonexistent"]}, format="json").status_code
        == 404
    )
    assert not AttributionGraph.objects.exists()


def test_a_logit_difference_target_is_one_node_the_difference_of_two_logits(
    loaded_model, tiny_gpt2_folder, writer, client_for
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_folder)
    single = [text for text in (" cat", " dog", " mat", " warm", " the", " it")
              if len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1][:2]  # fmt: skip
    assert len(single) == 2
    api = client_for(writer)
    transcoders = transcoder_rows(loaded_model, tiny_gpt2_folder, writer)
    response = api.post("/api/graphs", {"model_id": loaded_model.id, "prompt": PROMPT, "batch_size": 16,
                                        "transcoder_ids": [sae.id for sae in transcoders],
                                        "target_difference": single}, format="json")  # fmt: skip
    assert response.status_code == 202, response.content
    run_worker(name=WORKER, device="cpu", burst=True)
    graph = api.get(f"/api/graphs/{response.json()['id']}").json()
    assert graph["status"] == "completed", graph
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"][0] for text in single]
    assert graph["summary"]["target"] == {"kind": "difference", "tokens": ids, "token_strings": single}
    assert len(graph["summary"]["logits"]) == 1 and graph["summary"]["completeness_error"] <= 1e-4
    nodes = json.loads(api.get(f"/api/graphs/{graph['id']}/nodes").content)["nodes"]
    [logit] = [node for node in nodes if node["feature_type"] == "logit"]
    assert logit["clerp"] == f'Output "{single[0]}" minus "{single[1]}"'


def test_the_estimate_grows_with_the_prompt_and_the_feature_cap(loaded_model, tiny_gpt2_folder, writer):
    transcoders = transcoder_rows(loaded_model, tiny_gpt2_folder, writer)
    short = graph_estimate(loaded_model, transcoders, 16, AttributionConfig(max_feature_nodes=100))
    long = graph_estimate(loaded_model, transcoders, 64, AttributionConfig(max_feature_nodes=100))
    more = graph_estimate(loaded_model, transcoders, 64, AttributionConfig(max_feature_nodes=1000))
    assert short.total < long.total < more.total


def test_the_command_attributes_follows_and_exports(loaded_model, tiny_gpt2_folder, writer, tmp_path):
    transcoders = transcoder_rows(loaded_model, tiny_gpt2_folder, writer)
    out, path = io.StringIO(), tmp_path / "graph.json"
    arguments = [loaded_model.name, PROMPT, "--transcoders", *[sae.id for sae in transcoders], "--owner",
                 writer.username, "--batch-size", "16", "--export", str(path)]  # fmt: skip
    command = threading.Thread(target=lambda: call_command("attribute_prompt", *arguments, stdout=out))
    command.start()
    wait_until(lambda: AttributionGraph.objects.exists(), timeout=30, what="the graph row")
    run_worker(name=WORKER, device="cpu", burst=True)
    command.join(timeout=60)
    graph = AttributionGraph.objects.get()
    assert graph.status == "completed" and graph.owner == writer
    printed = out.getvalue()
    assert f"Attribution graph {graph.id} completed" in printed
    assert graph.summary["logits"][0]["token"] in printed
    exported = json.loads(path.read_text())
    assert exported["metadata"]["slug"] == graph.id and exported["nodes"]


def _links(view: dict) -> list[tuple[str, str, float]]:
    return [(link["source"], link["target"], link["weight"]) for link in view["links"]]


def _full_graph_view(graph, node_threshold: float, edge_threshold: float) -> dict:
    """What the full matrix gives (the engine's prune of the whole graph, as before views were)."""
    return graph_json(
        EngineGraph.load(graph.directory), slug=graph.id, scan="", prompt=graph.prompt, decode=str,
        node_threshold=node_threshold, edge_threshold=edge_threshold,
    )  # fmt: skip


def test_views_prune_the_bounded_view_as_the_full_graph_never_reading_it(
    loaded_model, tiny_gpt2_folder, writer, client_for
):
    api = client_for(writer)
    transcoders = transcoder_rows(loaded_model, tiny_gpt2_folder, writer)
    graph = computed_graph(api, loaded_model, transcoders, worker=WORKER, prompt=PROMPT)
    view_file = graph.directory / VIEW_FILENAME
    assert view_file.stat().st_size < (graph.directory / TENSORS_FILENAME).stat().st_size
    widest = graph.summary["view"]["max_node_threshold"]
    # The most influential nodes, up to GRAPH_VIEW_MAX_NODES (2,000): here every node of some influence.
    assert graph.summary["nodes"] > graph.summary["view"]["stored_nodes"]
    assert 0.999 < widest <= 1.0
    expected = {pair: _full_graph_view(graph, *pair) for pair in ((0.8, 0.98), (0.6, 0.9), (widest, 0.99))}

    # The full graph's files gone: the views read only the view.
    (graph.directory / TENSORS_FILENAME).unlink()
    view = api.get(f"/api/graphs/{graph.id}/nodes").json()
    assert [node["node_id"] for node in view["nodes"]] == [
        node["node_id"] for node in expected[0.8, 0.98]["nodes"]
    ]
    assert _links(view) == _links(expected[0.8, 0.98]) and view["links"]
    assert view["mistudio"]["max_node_threshold"] == widest
    for (node_threshold, edge_threshold), full in expected.items():
        query = {"node_threshold": node_threshold, "edge_threshold": edge_threshold}
        exported = json.loads(api.get(f"/api/graphs/{graph.id}/export", query).content)
        assert [node["node_id"] for node in exported["nodes"]] == [node["node_id"] for node in full["nodes"]]
        assert [node["influence"] for node in exported["nodes"]] == [
            node["influence"] for node in full["nodes"]
        ]
        assert _links(exported) == _links(full)
    assert held_bytes() == 0  # every view gave its memory back


def test_a_graph_made_before_views_has_its_view_made_by_a_worker(
    loaded_model, tiny_gpt2_folder, writer, client_for
):
    api = client_for(writer)
    transcoders = transcoder_rows(loaded_model, tiny_gpt2_folder, writer)
    graph = computed_graph(api, loaded_model, transcoders, worker=WORKER, prompt=PROMPT)
    expected = _full_graph_view(graph, 0.8, 0.98)
    (graph.directory / VIEW_FILENAME).unlink()  # as a graph computed before views were

    write_heartbeat(WorkerIdentity(name=WORKER, device="cpu"), time.time())  # a worker is running
    response = answered(api, f"/api/graphs/{graph.id}/nodes", worker=WORKER)
    assert response.status_code == 200, response.content
    assert (graph.directory / VIEW_FILENAME).is_file()
    assert _links(response.json()) == _links(expected)

    # No worker alive to make it: a 503 that says so, and nothing is lost.
    (graph.directory / VIEW_FILENAME).unlink()
    get_redis().delete(heartbeat_key(WORKER))
    refused = api.get(f"/api/graphs/{graph.id}/nodes")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "NO_WORKER"
    assert refused["Retry-After"] == "30"
    assert (graph.directory / TENSORS_FILENAME).is_file()


def test_the_node_threshold_reaches_what_the_view_holds(
    loaded_model, tiny_gpt2_folder, writer, client_for, settings
):
    settings.GRAPH_VIEW_MAX_NODES = 20  # a view of the 20 most influential nodes besides tokens and logits
    api = client_for(writer)
    transcoders = transcoder_rows(loaded_model, tiny_gpt2_folder, writer)
    graph = computed_graph(api, loaded_model, transcoders, worker=WORKER, prompt=PROMPT, name="small view")
    widest = graph.summary["view"]["max_node_threshold"]
    assert 0.1 < widest < 0.8
    assert graph.summary["view"]["stored_nodes"] <= 20 + len(graph.tokens) * 2 + len(graph.summary["logits"])

    # Up to the widest threshold the view holds, the full graph's prune; past it, a 400 that says how far.
    view = api.get(f"/api/graphs/{graph.id}/nodes", {"node_threshold": widest, "edge_threshold": 0.95}).json()
    assert _links(view) == _links(_full_graph_view(graph, widest, 0.95))
    assert view["mistudio"]["max_node_threshold"] == widest
    past = api.get(f"/api/graphs/{graph.id}/nodes", {"node_threshold": min(1.0, widest + 0.05)})
    assert past.status_code == 400 and past.json()["error"]["code"] == "INVALID_THRESHOLD"
    assert past.json()["error"]["details"]["max_node_threshold"] == widest
    # The row's own threshold (0.8 by default) is taken down to it.
    own = api.get(f"/api/graphs/{graph.id}/nodes").json()
    assert own["metadata"]["node_threshold"] == widest
    assert _links(own) == _links(_full_graph_view(graph, widest, graph.edge_threshold))
