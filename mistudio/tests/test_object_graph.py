"""The object graph: a row a request names leads to others, and a shared row never opens its owner's
private ones.

alice shares a model and an SAE trained on her private activation cache; bob, another writer, sees
the SAE but not the cache. Every way from the SAE to the cache is checked: its JSON (API, list,
page, events), a feature analysis over it (run, listed, exported), a mean ablation taking its means
from it, and an evaluation. Steering vectors lead to datasets the same way.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from activations.models import ActivationCache
from activations.services import dataset_create_from_texts
from conftest import make_user
from features.models import FeatureAnalysis
from features.serializers import analysis_state
from features.services import analysis_request
from features.tests.conftest import completed_sae_row
from mistudio.access import AUDIENCE, linked_id, may_see, reach
from mistudio.errors import ApplicationError
from models_app.services import model_register, model_update
from saes.models import SaeEvaluation
from saes.serializers import evaluation_state, sae_event_state
from saes.tests.conftest import HOOK, write_planted_cache
from steering.models import SteeringVector
from steering.serializers import vector_event_state

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(db):
    return make_user("alice", "model:write")


@pytest.fixture
def bob(db):
    return make_user("bob", "model:write")


@pytest.fixture
def graph(alice, tiny_gpt2_folder):
    """alice's model (shared), her private planted cache on it, and a completed SAE on that cache
    (shared)."""
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="alice-gpt2", owner=alice)
    model = model_update(model_id=model.id, actor=alice, shared=True)
    cache = write_planted_cache(model, alice, samples=64)
    sae = completed_sae_row(model, cache, alice, shared=True)
    return model, cache, sae


def error_of(response) -> dict:
    return response.json()["error"]


def answer_of(response) -> dict:
    """The error a response answers, without what differs from one request to the next."""
    return {key: value for key, value in error_of(response).items() if key not in ("timestamp", "request_id")}


def export_of(response) -> dict:
    assert response.status_code == 200, response.content
    return json.loads(b"".join(response.streaming_content))


def test_the_private_cache_is_what_the_graph_is_about(graph, alice, bob):
    """The premise of the file: bob sees the model and the SAE, not the cache; alice sees all."""
    model, cache, sae = graph
    assert may_see(bob, type(model), model.pk) and may_see(bob, type(sae), sae.pk)
    assert not may_see(bob, ActivationCache, cache.pk)
    assert may_see(alice, ActivationCache, cache.pk)
    with pytest.raises(ApplicationError) as refused:
        reach(bob, cache)
    assert (refused.value.code, refused.value.status) == ("CACHE_NOT_FOUND", 404)
    assert reach(alice, cache) == cache


# --- 1. an analysis over the SAE's training cache -------------------------------------------------


def test_another_user_cannot_analyse_a_shared_sae_over_its_owners_private_cache(graph, bob, client_for):
    _, cache, sae = graph
    api = client_for(bob)
    by_default = api.post(f"/api/saes/{sae.id}/analyses", {}, format="json")
    assert by_default.status_code == 400, by_default.content
    assert error_of(by_default)["code"] == "CACHE_REQUIRED"
    assert cache.id.encode() not in by_default.content

    named = api.post(f"/api/saes/{sae.id}/analyses", {"cache_id": cache.id}, format="json")
    assert named.status_code == 404, named.content
    assert error_of(named)["code"] == "CACHE_NOT_FOUND"
    # The same answer as for a cache that does not exist.
    missing = api.post(f"/api/saes/{sae.id}/analyses", {"cache_id": "c_no_such_cache"}, format="json")
    assert missing.status_code == 404 and answer_of(missing) == answer_of(named)
    assert not FeatureAnalysis.objects.exists()

    # The service itself, asked directly, refuses the same way (not only the view).
    with pytest.raises(ApplicationError) as refused:
        analysis_request(owner=bob, sae=sae, cache=cache)
    assert refused.value.code == "CACHE_NOT_FOUND"
    with pytest.raises(ApplicationError) as refused:
        analysis_request(owner=bob, sae=sae)
    assert refused.value.code == "CACHE_REQUIRED" and cache.id not in str(refused.value.message)
    assert not FeatureAnalysis.objects.exists()


def test_the_owner_analyses_over_her_training_cache_by_default(graph, alice, client_for):
    """The other side of the guard: the default still works for whoever may read the cache."""
    _, cache, sae = graph
    response = client_for(alice).post(f"/api/saes/{sae.id}/analyses", {}, format="json")
    assert response.status_code == 202, response.content
    assert response.json()["cache_id"] == cache.id
    assert response.json()["shared"] is False  # an analysis holds the cache's text: private by default


# --- 2. the SAE's JSON and page -------------------------------------------------------------------


def test_the_sae_shows_its_cache_id_only_to_who_may_see_the_cache(graph, alice, bob, client_for):
    _, cache, sae = graph
    sae.evaluation = {"cache_id": cache.id, "mse": 0.1, "held_out_tokens": 128}
    sae.save(update_fields=["evaluation"])

    as_bob = client_for(bob).get(f"/api/saes/{sae.id}")
    assert as_bob.status_code == 200, as_bob.content
    assert as_bob.json()["cache_id"] is None
    assert as_bob.json()["evaluation"]["cache_id"] is None
    assert as_bob.json()["evaluation"]["mse"] == 0.1  # the rest of the evaluation is still shown
    assert cache.id.encode() not in as_bob.content
    listed = client_for(bob).get("/api/saes")
    (row,) = [row for row in listed.json()["saes"] if row["id"] == sae.id]
    assert row["cache_id"] is None and row["evaluation"]["cache_id"] is None
    assert cache.id.encode() not in listed.content

    as_alice = client_for(alice).get(f"/api/saes/{sae.id}").json()
    assert as_alice["cache_id"] == cache.id and as_alice["evaluation"]["cache_id"] == cache.id
    (row,) = [row for row in client_for(alice).get("/api/saes").json()["saes"] if row["id"] == sae.id]
    assert row["cache_id"] == cache.id and row["evaluation"]["cache_id"] == cache.id


def page(user, path: str):
    client = Client()
    client.force_login(user)
    response = client.get(path)
    assert response.status_code == 200, (path, response.status_code)
    return response.content.decode()


def test_the_sae_page_shows_the_cache_id_only_to_who_may_see_the_cache(graph, alice, bob):
    _, cache, sae = graph
    sae.evaluation = {"cache_id": cache.id, "mse": 0.1, "held_out_tokens": 128}
    sae.save(update_fields=["evaluation"])
    for suffix in ("", "?fragment=results", "?fragment=analyses", "?fragment=training"):
        assert cache.id not in page(bob, f"/saes/{sae.id}/{suffix}"), suffix
    assert "a cache you cannot see" in page(bob, f"/saes/{sae.id}/")
    assert cache.id not in page(bob, "/saes/")
    assert cache.id in page(alice, f"/saes/{sae.id}/")
    assert cache.id in page(alice, f"/saes/{sae.id}/?fragment=results")


# --- 3. events ------------------------------------------------------------------------------------


def test_events_of_a_shared_sae_do_not_name_its_private_cache(graph, alice):
    model, cache, sae = graph
    sae.evaluation = {"cache_id": cache.id, "mse": 0.1}
    sae.save(update_fields=["evaluation"])
    shared = sae_event_state(sae)
    assert shared["cache_id"] is None and shared["evaluation"]["cache_id"] is None

    private = completed_sae_row(model, cache, alice, shared=False)
    private.evaluation = {"cache_id": cache.id, "mse": 0.1}
    private.save(update_fields=["evaluation"])
    state = sae_event_state(private)
    assert state["cache_id"] == cache.id and state["evaluation"]["cache_id"] == cache.id

    # A system SAE (no owner) reaches every reader: never the id.
    system = completed_sae_row(model, cache, None, shared=False)
    assert sae_event_state(system)["cache_id"] is None


def test_events_of_an_analysis_name_its_cache_only_while_it_is_private(graph, alice):
    _, cache, sae = graph
    analysis = FeatureAnalysis.objects.create(sae=sae, cache=cache, status="completed", owner=alice)
    assert analysis_state(analysis)["cache_id"] == cache.id
    analysis.shared = True
    analysis.save(update_fields=["shared"])
    assert analysis_state(FeatureAnalysis.objects.get(pk=analysis.pk))["cache_id"] is None


def test_events_of_a_shared_vector_do_not_name_its_private_datasets(graph, alice):
    model, _, _ = graph
    dataset = dataset_create_from_texts(
        name="alice texts", texts=["a b", "c d"], owner=alice, source="upload"
    )
    vector = SteeringVector.objects.create(
        model=model, hook_name=HOOK, positive_dataset=dataset, negative_dataset=dataset, owner=alice
    )
    state = vector_event_state(vector)
    assert state["positive_dataset_id"] == dataset.id and state["negative_dataset_id"] == dataset.id
    vector.shared = True
    vector.save(update_fields=["shared"])
    state = vector_event_state(SteeringVector.objects.get(pk=vector.pk))
    assert state["positive_dataset_id"] is None and state["negative_dataset_id"] is None


def test_evaluation_events_of_a_shared_sae_do_not_name_its_private_cache(graph, alice):
    """An evaluation's events reach everyone who sees its SAE (``SaeEvaluation.audience_rows``): for
    a shared SAE that is every reader, so they must not name the owner's private cache."""
    _, cache, sae = graph
    evaluation = SaeEvaluation.objects.create(sae=sae, cache=cache, status="completed", owner=alice)
    assert evaluation.audience_rows() == [("sae", sae.id)]  # who receives it: whoever sees the SAE
    assert evaluation_state(evaluation)["cache_id"] is None


# --- 4. an analysis over the private cache, run, shared, exported ---------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_analysis_over_a_private_cache_is_private_until_shared_and_never_names_the_cache(
    graph, alice, bob, client_for
):
    from mistudio.workers import run_worker

    _, cache, sae = graph
    analysis = analysis_request(owner=alice, sae=sae, cache=cache)
    assert analysis.shared is False
    run_worker(name="graph-worker", device="cpu", burst=True)
    analysis.refresh_from_db()
    assert analysis.status == "completed", (analysis.error_code, analysis.error_message)

    as_bob, as_alice = client_for(bob), client_for(alice)
    refused = as_bob.get(f"/api/saes/{sae.id}/features/export")
    assert refused.status_code == 404, refused.content
    assert error_of(refused)["code"] == "NO_ANALYSIS"
    assert as_bob.get(f"/api/saes/{sae.id}/features").status_code == 404
    assert as_bob.get(f"/api/saes/{sae.id}/features/5").status_code == 404
    assert as_bob.get(f"/api/saes/{sae.id}/analyses").json() == {"analyses": [], "total": 0}
    direct = as_bob.get(f"/api/saes/{sae.id}/analyses/{analysis.id}")
    assert direct.status_code == 404 and error_of(direct)["code"] == "ANALYSIS_NOT_FOUND"
    assert cache.id not in page(bob, f"/saes/{sae.id}/?fragment=analyses")
    # Nor may bob share it for her.
    assert (
        as_bob.patch(
            f"/api/saes/{sae.id}/analyses/{analysis.id}", {"shared": True}, format="json"
        ).status_code
        == 404
    )

    assert export_of(as_alice.get(f"/api/saes/{sae.id}/features/export"))["cache_id"] == cache.id

    shared = as_alice.patch(f"/api/saes/{sae.id}/analyses/{analysis.id}", {"shared": True}, format="json")
    assert shared.status_code == 200, shared.content
    assert shared.json()["shared"] is True and shared.json()["cache_id"] == cache.id

    exported = export_of(as_bob.get(f"/api/saes/{sae.id}/features/export"))
    assert exported["analysis_id"] == analysis.id and exported["cache_id"] is None
    assert len(exported["features"]) == sae.d_sae
    (listed,) = as_bob.get(f"/api/saes/{sae.id}/analyses").json()["analyses"]
    assert listed["id"] == analysis.id and listed["cache_id"] is None
    assert as_bob.get(f"/api/saes/{sae.id}/analyses/{analysis.id}").json()["cache_id"] is None
    assert as_bob.get(f"/api/saes/{sae.id}/features/5").status_code == 200
    bob_page = page(bob, f"/saes/{sae.id}/?fragment=analyses")
    assert analysis.id in bob_page and cache.id not in bob_page

    assert export_of(as_alice.get(f"/api/saes/{sae.id}/features/export"))["cache_id"] == cache.id


# --- 5. mean ablation ---------------------------------------------------------------------------


def generate(user, body: dict):
    client = Client()
    return client.post(
        "/api/generate",
        json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Token {user.auth_token.key}",
    )


def mean_ablation(model_id: str, cache_id: str) -> dict:
    intervention = {"type": "ablate", "hook": HOOK, "neurons": [0], "mean_from": cache_id}
    return {
        "model_id": model_id,
        "prompt": "Hi",
        "max_tokens": 2,
        "mistudio": {"interventions": [intervention]},
    }


def test_a_mean_ablation_cannot_take_its_means_from_another_users_private_cache(graph, alice, bob):
    model, cache, _ = graph
    refused = generate(bob, mean_ablation(model.id, cache.id))
    assert refused.status_code == 400, refused.content
    error = error_of(refused)
    assert error["code"] == "INVALID_INTERVENTION"
    assert "no such" in error["message"].lower()
    assert "interventions[0].mean_from" in error["details"]["fields"]
    for secret in (alice.username, HOOK + " activations", str(cache.num_tokens), "owner", "private"):
        assert secret not in refused.content.decode(), secret
    # Word for word what a cache that does not exist answers (but for its id).
    missing = generate(bob, mean_ablation(model.id, "c_no_such_cache"))
    assert missing.status_code == 400
    assert json.loads(json.dumps(answer_of(refused)).replace(cache.id, "ID")) == json.loads(
        json.dumps(answer_of(missing)).replace("c_no_such_cache", "ID")
    )

    allowed = generate(alice, mean_ablation(model.id, cache.id))
    assert allowed.status_code == 409, allowed.content
    assert error_of(allowed)["code"] == "MODEL_NOT_LOADED"


# --- 6. steering vectors and their datasets ----------------------------------------------------------


def test_a_steering_vector_reaches_only_datasets_its_caller_may_see(graph, alice, bob, client_for):
    model, _, _ = graph
    positive = dataset_create_from_texts(
        name="alice positive", texts=["love", "joy"], owner=alice, source="upload"
    )
    negative = dataset_create_from_texts(
        name="alice negative", texts=["hate", "grief"], owner=alice, source="upload"
    )
    body = {"model_id": model.id, "hook_name": HOOK, "positive_dataset_id": positive.id, "negative": ["x"]}
    refused = client_for(bob).post("/api/steering-vectors", body, format="json")
    assert refused.status_code == 404, refused.content
    assert error_of(refused)["code"] == "DATASET_NOT_FOUND"
    other_side = {
        "model_id": model.id,
        "hook_name": HOOK,
        "positive": ["x"],
        "negative_dataset_id": negative.id,
    }
    refused = client_for(bob).post("/api/steering-vectors", other_side, format="json")
    assert refused.status_code == 404 and error_of(refused)["code"] == "DATASET_NOT_FOUND"
    assert not SteeringVector.objects.exists()

    created = client_for(alice).post(
        "/api/steering-vectors",
        {
            "model_id": model.id,
            "hook_name": HOOK,
            "positive_dataset_id": positive.id,
            "negative_dataset_id": negative.id,
        },
        format="json",
    )
    assert created.status_code == 202, created.content
    vector_id = created.json()["id"]
    assert client_for(bob).get(f"/api/steering-vectors/{vector_id}").status_code == 404
    shared = client_for(alice).patch(f"/api/steering-vectors/{vector_id}", {"shared": True}, format="json")
    assert shared.status_code == 200, shared.content

    as_bob = client_for(bob).get(f"/api/steering-vectors/{vector_id}")
    assert as_bob.status_code == 200, as_bob.content
    assert as_bob.json()["positive_dataset_id"] is None and as_bob.json()["negative_dataset_id"] is None
    (listed,) = client_for(bob).get("/api/steering-vectors").json()["vectors"]
    assert listed["positive_dataset_id"] is None and listed["negative_dataset_id"] is None
    for body_text in (as_bob.content, client_for(bob).get("/api/steering-vectors").content):
        assert positive.id.encode() not in body_text and negative.id.encode() not in body_text

    as_alice = client_for(alice).get(f"/api/steering-vectors/{vector_id}").json()
    assert (as_alice["positive_dataset_id"], as_alice["negative_dataset_id"]) == (positive.id, negative.id)

    # Once alice shares a dataset, bob is shown that one (and only that one).
    positive.shared = True
    positive.save(update_fields=["shared"])
    as_bob = client_for(bob).get(f"/api/steering-vectors/{vector_id}").json()
    assert (as_bob["positive_dataset_id"], as_bob["negative_dataset_id"]) == (positive.id, None)


# --- 7. evaluation --------------------------------------------------------------------------------


def test_another_user_cannot_evaluate_a_shared_sae(graph, bob, client_for):
    _, cache, sae = graph
    for body in ({}, {"cache_id": cache.id}):
        response = client_for(bob).post(f"/api/saes/{sae.id}/evaluate", body, format="json")
        assert response.status_code == 403, (body, response.content)
        assert error_of(response)["code"] == "NOT_OWNER"
        assert cache.id.encode() not in response.content
    assert not SaeEvaluation.objects.exists()


def test_linked_id_follows_the_viewer(graph, alice, bob, model_admin):
    """The rule the serializers share, for each kind of viewer."""
    _, cache, sae = graph
    assert linked_id(bob, sae, ActivationCache, cache.id) is None
    assert linked_id(alice, sae, ActivationCache, cache.id) == cache.id
    assert linked_id(model_admin, sae, ActivationCache, cache.id) == cache.id
    assert linked_id(AUDIENCE, sae, ActivationCache, cache.id) is None  # shared: its events reach bob
    assert linked_id(alice, sae, ActivationCache, None) is None
