"""The permission matrix: every route, method and role ({anonymous, reader, writer (the owner), admin, other
user}), against private rows the writer owns; and sharing, where a visible row is still not another
writer's to change.

``OK`` means the request got past authentication, role and ownership (any answer but 401, 403, 404
or 405: a 400 for an empty body, a 409 for a model that is not loaded are fine here). The test fails
when a route exists that the matrix does not list, so a new route cannot arrive unprotected.
"""

from __future__ import annotations

import pytest
import torch
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from circuits.models import AttributionGraph, Subgraph
from conftest import make_user
from evaluations.models import BenchRun
from features.models import Explanation, ExplanationJob, Feature, FeatureAnalysis
from generation.models import Generation
from models_app.models import LanguageModel
from models_app.services import model_register
from saes.models import SaeGroup, SparseAutoencoder
from steering.models import SteeringVector
from steering.services import vector_store

pytestmark = pytest.mark.django_db

OK = "ok"
ROLES = ("anonymous", "reader", "writer", "admin", "other", "norole")

# Outcomes per role, in ROLES order.
# A signed-in user with no role is refused everything but the health check and signing out: 403 from
# the API and the pages alike (before any lookup, so nothing is learnt about rows).
PUBLIC = (OK, OK, OK, OK, OK, OK)
ANY_READER = (401, OK, OK, OK, OK, 403)  # lists and reads that show each user only what they may see
WRITERS = (401, 403, OK, OK, OK, 403)  # creating: the result is the caller's own
OWNER_READS = (401, 404, OK, OK, 404, 403)  # reading the writer's private row
OWNER_CHANGES = (401, 403, OK, OK, 404, 403)  # changing it (readers are refused by role before the lookup)
PAGE = (302, OK, OK, OK, OK, 403)  # pages send anonymous visitors to sign in
OWNER_PAGE = (302, 404, OK, OK, 404, 403)
PAGE_WRITERS = (302, 403, OK, OK, OK, 403)  # a page's form that creates (the SAE training form)
OWNER_PAGE_CHANGES = (302, 403, OK, OK, 404, 403)  # a page's form that changes the writer's row
# The OpenAI-compatible routes: a reader may list models but not generate.
OPENAI_READ = ANY_READER
OPENAI_GENERATE = WRITERS
NO_SUCH_ROUTE = (404, 404, 404, 404, 404, 404)  # the documented 404 body, for everyone

MATRIX: dict[str, dict[str, tuple]] = {
    "api/": {"GET": ANY_READER},
    "api/models": {"GET": ANY_READER, "POST": WRITERS},
    "api/models/{model}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES, "DELETE": OWNER_CHANGES},
    "api/models/{model}/load": {"POST": OWNER_CHANGES},
    "api/models/{model}/unload": {"POST": OWNER_CHANGES},
    "api/models/{model}/cancel": {"POST": OWNER_CHANGES},
    "api/models/{model}/memory-estimate": {"GET": OWNER_READS},
    "api/models/{model}/hook-points": {"GET": OWNER_READS},
    "api/models/{model}/tokenize": {"POST": OWNER_READS},  # reads the model's tokenizer
    "api/models/{model}/patching": {"POST": OWNER_CHANGES},
    "api/models/{model}/logit-lens": {"POST": OWNER_CHANGES},
    "api/models/{model}/extract-activations": {"POST": OWNER_CHANGES},
    "api/models/{model}/activations/{extraction}": {"GET": OWNER_READS},
    "api/workers": {"GET": ANY_READER},
    "api/generate": {"POST": WRITERS},
    "api/generate/sweep": {"POST": WRITERS},
    "api/generate/{generation}/cancel": {"POST": OWNER_CHANGES},
    "api/generations": {"GET": ANY_READER},
    "api/generations/{generation}": {"GET": OWNER_READS},
    "api/datasets": {"GET": ANY_READER, "POST": WRITERS},
    "api/datasets/{dataset}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES, "DELETE": OWNER_CHANGES},
    "api/datasets/{dataset}/samples": {"GET": OWNER_READS},
    "api/extractions": {"GET": ANY_READER},
    "api/extractions/{extraction}": {"GET": OWNER_READS},
    "api/extractions/{extraction}/cancel": {"POST": OWNER_CHANGES},
    "api/activation-caches": {"GET": ANY_READER},
    "api/activation-caches/{cache}": {"GET": OWNER_READS, "DELETE": OWNER_CHANGES},
    "api/activation-caches/{cache}/download": {"GET": OWNER_READS},
    "api/activation-caches/{cache}/slice": {"GET": OWNER_READS},
    "api/activation-caches/{cache}/stats": {"GET": OWNER_READS},
    "api/activation-caches/{cache}/top-k": {"GET": OWNER_READS},
    "api/saes": {"GET": ANY_READER, "POST": WRITERS},
    "api/saes/import": {"POST": WRITERS},
    "api/saes/import-transcoders": {"POST": WRITERS},
    "api/saes/upload": {"POST": WRITERS},
    "api/saes/groups": {"GET": ANY_READER, "POST": WRITERS},
    "api/saes/groups/{group}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES, "DELETE": OWNER_CHANGES},
    "api/saes/groups/{group}/cancel": {"POST": OWNER_CHANGES},
    "api/saes/groups/{group}/stop": {"POST": OWNER_CHANGES},
    "api/saes/{sae}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES, "DELETE": OWNER_CHANGES},
    "api/steering-vectors": {"GET": ANY_READER, "POST": WRITERS},
    "api/steering-vectors/import": {"POST": WRITERS},
    "api/steering-vectors/{vector}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES, "DELETE": OWNER_CHANGES},
    "api/steering-vectors/{vector}/cancel": {"POST": OWNER_CHANGES},
    "api/steering-vectors/{vector}/export": {"GET": OWNER_READS},
    "api/saes/{sae}/cancel": {"POST": OWNER_CHANGES},
    "api/saes/{sae}/evaluate": {"POST": OWNER_CHANGES},
    "api/saes/{sae}/export": {"GET": OWNER_READS},
    "api/saes/{sae}/analyses": {"GET": OWNER_READS, "POST": OWNER_CHANGES},
    "api/saes/{sae}/analyses/{analysis}": {
        "GET": OWNER_READS,
        "PATCH": OWNER_CHANGES,
        "DELETE": OWNER_CHANGES,
    },
    "api/saes/{sae}/analyses/{analysis}/cancel": {"POST": OWNER_CHANGES},
    "api/saes/{sae}/features": {"GET": OWNER_READS},
    "api/saes/{sae}/features/export": {"GET": OWNER_READS},
    "api/saes/{sae}/features/{index}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES},
    "api/saes/{sae}/encode": {"POST": OWNER_CHANGES},
    "api/saes/{sae}/features/search": {"GET": OWNER_READS},
    "api/saes/{sae}/features/{index}/explanations/{explanation}/accept": {"POST": OWNER_CHANGES},
    "api/saes/{sae}/explanations": {"GET": OWNER_READS, "POST": OWNER_CHANGES},
    "api/saes/{sae}/explanations/{job}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES},
    "api/saes/{sae}/explanations/{job}/cancel": {"POST": OWNER_CHANGES},
    "api/saes/{sae}/explanations/{job}/results": {"GET": OWNER_READS},
    "api/explainers": {"GET": ANY_READER},
    "api/graphs": {"GET": ANY_READER, "POST": WRITERS},
    "api/graphs/{graph}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES, "DELETE": OWNER_CHANGES},
    "api/graphs/{graph}/cancel": {"POST": OWNER_CHANGES},
    "api/graphs/{graph}/nodes": {"GET": OWNER_READS},
    "api/graphs/{graph}/export": {"GET": OWNER_READS},
    "api/graphs/{graph}/intervene": {"POST": OWNER_CHANGES},
    "api/graphs/{graph}/subgraphs": {"GET": OWNER_READS, "POST": OWNER_CHANGES},
    "api/subgraphs/{subgraph}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES, "DELETE": OWNER_CHANGES},
    "api/subgraphs/{subgraph}/export": {"GET": OWNER_READS},
    "api/saebench": {"GET": ANY_READER, "POST": WRITERS},
    "api/saebench/compare": {"GET": ANY_READER},
    "api/saebench/{bench}": {"GET": OWNER_READS, "PATCH": OWNER_CHANGES, "DELETE": OWNER_CHANGES},
    "api/saebench/{bench}/cancel": {"POST": OWNER_CHANGES},
    "api/saebench/{bench}/results": {"GET": OWNER_READS},
    "api/saebench/{bench}/export": {"GET": OWNER_READS},
    "api/schema/": {"GET": ANY_READER},
    "api/{unmatched}": {"GET": NO_SUCH_ROUTE},
    "v1/models": {"GET": OPENAI_READ},
    "v1/models/{model}": {"GET": OWNER_READS},
    "v1/chat/completions": {"POST": OPENAI_GENERATE},
    "v1/completions": {"POST": OPENAI_GENERATE},
    "v1/": {"GET": NO_SUCH_ROUTE},
    "v1/{unmatched}": {"GET": NO_SUCH_ROUTE},
    "healthz": {"GET": PUBLIC},
    "favicon.ico": {"GET": PUBLIC},  # a redirect to the static icon
    "metrics": {"GET": (401, 403, 403, OK, 403, 403)},  # staff / model:admin, or the METRICS_TOKEN
    "docs/api/": {"GET": PAGE},
    "": {"GET": PAGE},
    "models/{model}/": {"GET": OWNER_PAGE},
    "models/{model}/patching/": {"GET": OWNER_PAGE},
    "models/{model}/logit-lens/": {"GET": OWNER_PAGE},
    "datasets/": {"GET": PAGE},
    "datasets/{dataset}/": {"GET": OWNER_PAGE},
    "activations/": {"GET": PAGE},
    "activations/{cache}/": {"GET": OWNER_PAGE},
    "saes/": {"GET": PAGE, "POST": PAGE_WRITERS},
    "saes/import/": {"POST": PAGE_WRITERS},
    "saes/groups/new/": {"GET": PAGE, "POST": PAGE_WRITERS},
    "saes/compare/": {"GET": PAGE, "POST": PAGE_WRITERS},
    "saes/groups/{group}/": {"GET": OWNER_PAGE, "POST": OWNER_PAGE_CHANGES},
    "saes/{sae}/": {"GET": OWNER_PAGE, "POST": OWNER_PAGE_CHANGES},
    "saes/{sae}/analyses/": {"POST": OWNER_PAGE_CHANGES},  # run or cancel a feature analysis
    "saes/{sae}/features/": {"GET": OWNER_PAGE},
    "saes/{sae}/features/{index}/": {"GET": OWNER_PAGE, "POST": OWNER_PAGE_CHANGES},  # POST: a label
    "saes/{sae}/encode/": {"GET": OWNER_PAGE, "POST": OWNER_PAGE_CHANGES},
    "saes/{sae}/explanations/new/": {"GET": OWNER_PAGE, "POST": OWNER_PAGE_CHANGES},
    "saes/{sae}/explanations/{job}/": {"GET": OWNER_PAGE, "POST": OWNER_PAGE_CHANGES},
    "saes/{sae}/features/{index}/explanations/{explanation}/accept/": {"POST": OWNER_PAGE_CHANGES},
    "graphs/": {"GET": PAGE, "POST": PAGE_WRITERS},
    "graphs/{graph}/": {"GET": OWNER_PAGE, "POST": OWNER_PAGE_CHANGES},
    "playground/": {"GET": PAGE},
    "workers/": {"GET": PAGE},
    "account/token/": {"GET": PAGE, "POST": PAGE},  # one's own API token: any role may have one
    "login/": {"GET": (OK, 302, 302, 302, 302, 302)},  # the signed-in are sent on to the models page
    "logout/": {"POST": (302, 302, 302, 302, 302, 302)},
}
# Django's admin and the queue dashboard under it have their own staff checks (tested in the apps'
# admin tests); the matrix covers everything else.
STAFF_ONLY_PREFIXES = ("admin/",)

# What a route's <converter:name> stands for.
PLACEHOLDERS = {
    "model_id": "{model}",
    "model_ref": "{model}",
    "dataset_id": "{dataset}",
    "extraction_id": "{extraction}",
    "cache_id": "{cache}",
    "generation_id": "{generation}",
    "sae_id": "{sae}",
    "group_id": "{group}",
    "analysis_id": "{analysis}",
    "index": "{index}",
    "vector_id": "{vector}",
    "job_id": "{job}",
    "explanation_id": "{explanation}",
    "graph_id": "{graph}",
    "subgraph_id": "{subgraph}",
    "run_id": "{bench}",
    "unmatched": "{unmatched}",
}


def routes() -> set[str]:
    """Every URL pattern of the project as a matrix key (``api/models/{model}/load``)."""
    import re

    found: set[str] = set()

    def walk(patterns, prefix: str) -> None:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                if not route.startswith(STAFF_ONLY_PREFIXES):
                    walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern):
                found.add(re.sub(r"<(?:\w+:)?(\w+)>", lambda match: PLACEHOLDERS[match.group(1)], route))

    walk(get_resolver().url_patterns, "")
    return found


def test_every_route_is_in_the_matrix():
    assert routes() - set(MATRIX) == set(), "add the new routes to MATRIX with who may call them"
    assert set(MATRIX) - routes() == set(), "the matrix names routes that no longer exist"


@pytest.fixture
def users(db):
    return {
        "anonymous": AnonymousUser(),
        "reader": make_user("rita-reader", "model:read"),
        "writer": make_user("walt-writer", "model:write"),
        "admin": make_user("ada-admin", "model:admin"),
        "other": make_user("olga-other", "model:write"),
        "norole": make_user("nora-norole", None),
    }


def owned_rows(owner, folder) -> dict[str, str]:
    """A fresh private model, dataset, extraction, cache, generation and SAE of ``owner``: their ids."""
    LanguageModel.objects.all().delete()
    Dataset.objects.all().delete()
    model = model_register(source="local", identifier=str(folder), name="private-gpt2", owner=owner)
    dataset = dataset_create_from_texts(
        name="private texts", texts=["one", "two"], owner=owner, source="upload"
    )
    cache = ActivationCache.objects.create(
        key_hash="p" * 64, key={}, model=model, dataset=dataset, hooks=["blocks.0.hook_resid_post"],
        max_length=16, dtype="float32", status="completed", num_samples=2, num_tokens=2, owner=owner,
    )  # fmt: skip
    job = ExtractionJob.objects.create(
        model=model, dataset=dataset, cache=cache, hooks=cache.hooks, status="completed", owner=owner
    )
    generation = Generation.objects.create(model=model, owner=owner, prompt="hi", parameters={})
    sae = SparseAutoencoder.objects.create(
        model=model, cache=cache, hook_name="blocks.0.hook_resid_post", architecture="topk", d_in=64,
        d_sae=256, k=8, status="completed", owner=owner,
    )  # fmt: skip
    group = SaeGroup.objects.create(model=model, dataset=dataset, status="completed", owner=owner)
    analysis = FeatureAnalysis.objects.create(sae=sae, cache=cache, status="completed", owner=owner)
    Feature.objects.create(analysis=analysis, index=5, density=0.1, max_activation=1, mean_activation=0.5)
    explanation_job = ExplanationJob.objects.create(
        analysis=analysis, explainer_model="m", scorer_model="m", indices=[5], status="completed", owner=owner
    )
    explanation = Explanation.objects.create(
        job=explanation_job, analysis=analysis, index=5, text="fives", explainer_model="m", scorer_model="m"
    )
    vector = SteeringVector.objects.create(
        model=model, hook_name="blocks.0.hook_resid_post", width=64, status="completed", owner=owner
    )
    vector_store(vector, torch.ones(64))
    graph = AttributionGraph.objects.create(
        model=model, transcoders=[sae.id], prompt="a private prompt", status="completed", owner=owner
    )
    subgraph = Subgraph.objects.create(graph=graph, owner=owner, name="a private reading")
    bench = BenchRun.objects.create(
        model=model, saes=[sae.id], methods=["core"], status="completed", owner=owner
    )
    return {
        "{bench}": bench.id,
        "{graph}": graph.id,
        "{subgraph}": subgraph.id,
        "{vector}": vector.id,
        "{job}": explanation_job.id,
        "{explanation}": str(explanation.pk),
        "{analysis}": analysis.id,
        "{index}": "5",
        "{model}": model.id,
        "{dataset}": dataset.id,
        "{extraction}": job.id,
        "{cache}": cache.id,
        "{generation}": generation.id,
        "{sae}": sae.id,
        "{group}": group.id,
        "{unmatched}": "no/such/endpoint",
    }


def call(user, method: str, path: str):
    if isinstance(user, AnonymousUser):
        client = Client()
    elif path.startswith("/api/") or path.startswith("/v1/"):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {user.auth_token.key}")
    else:
        client = Client()
        client.force_login(user)
    send = getattr(client, method.lower())
    if method in ("POST", "PATCH"):
        return send(path, data="{}", content_type="application/json")
    return send(path)


def outcome(status: int):
    return status if status in (302, 401, 403, 404, 405) else OK


def test_every_route_answers_each_role_as_the_matrix_says(users, tiny_gpt2_folder):
    """Also: no answer shows a server path (the data directory, where the local model lives, or the
    code's)."""
    rows = owned_rows(users["writer"], tiny_gpt2_folder)
    server_paths = [str(settings.DATA_DIR).encode(), str(settings.BASE_DIR).encode()]
    mismatches = []
    changed = False
    for route, methods in MATRIX.items():
        for method, expected in methods.items():
            for role, wanted in zip(ROLES, expected, strict=True):
                if changed:  # a change that went through may have used up the rows: fresh ones
                    rows = owned_rows(users["writer"], tiny_gpt2_folder)
                path = "/" + route
                for placeholder, value in rows.items():
                    path = path.replace(placeholder, value)
                response = call(users[role], method, path)
                changed = method != "GET" and response.status_code < 400
                got = outcome(response.status_code)
                if got != wanted:
                    mismatches.append(
                        f"{method} /{route} as {role}: {response.status_code}, expected {wanted}"
                    )
                if response.status_code >= 500:
                    mismatches.append(f"{method} /{route} as {role}: server error {response.status_code}")
                body = b"".join(response.streaming_content) if response.streaming else response.content
                for place in server_paths:
                    if place in body:
                        mismatches.append(f"{method} /{route} as {role}: shows the server path {place!r}")
    assert not mismatches, "\n".join(mismatches)


def test_a_shared_model_is_visible_to_all_and_still_changed_only_by_its_owner(
    users, client_for, tiny_gpt2_folder
):
    owner, other, reader = users["writer"], users["other"], users["reader"]
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="team-gpt2", owner=owner)
    assert client_for(other).get(f"/api/models/{model.id}").status_code == 404
    assert client_for(other).get("/api/models").json()["total"] == 0

    shared = client_for(owner).patch(f"/api/models/{model.id}", {"shared": True}, format="json")
    assert (
        shared.status_code == 200
        and shared.json()["shared"] is True
        and shared.json()["owner"] == owner.username
    )
    for user in (other, reader):
        listing = client_for(user).get("/api/models").json()
        assert [entry["id"] for entry in listing["models"]] == [model.id]
    # Using it is open to any writer; changing it is not.
    assert client_for(other).post(f"/api/models/{model.id}/load", {}, format="json").status_code not in (
        403,
        404,
    )
    for method, suffix, body in [
        ("patch", "", {"name": "mine-now"}),
        ("delete", "", None),
        ("post", "/unload", None),
        ("post", "/cancel", None),
    ]:
        response = getattr(client_for(other), method)(f"/api/models/{model.id}{suffix}", body, format="json")
        assert response.status_code == 403, (method, suffix, response.content)
        assert response.json()["error"]["code"] == "NOT_OWNER"
    model.refresh_from_db()
    assert model.name == "team-gpt2"
    # The owner can take it back: it is gone for the others again.
    client_for(owner).patch(f"/api/models/{model.id}", {"shared": False}, format="json")
    assert client_for(other).get(f"/api/models/{model.id}").status_code == 404
    # A second registration of the same folder by another user does not reveal the private row's id.
    again = client_for(other).post(
        "/api/models", {"source": "local", "model_identifier": str(tiny_gpt2_folder)}, format="json"
    )
    assert again.status_code == 409 and again.json()["error"]["details"]["model_id"] is None


def test_a_shared_dataset_can_be_used_but_not_changed_by_another_writer(users, client_for):
    owner, other = users["writer"], users["other"]
    dataset = dataset_create_from_texts(
        name="team texts", texts=["a", "b"], owner=owner, source="upload", shared=True
    )
    assert client_for(other).get(f"/api/datasets/{dataset.id}/samples").status_code == 200
    refused = client_for(other).delete(f"/api/datasets/{dataset.id}")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "NOT_OWNER"
    assert Dataset.objects.filter(pk=dataset.pk).exists()
    assert (
        client_for(owner).patch(f"/api/datasets/{dataset.id}", {"shared": False}, format="json").status_code
        == 200
    )
    assert client_for(other).get(f"/api/datasets/{dataset.id}").status_code == 404
    assert client_for(owner).delete(f"/api/datasets/{dataset.id}").status_code == 204


def test_read_only_fields_cannot_be_written(users, client_for, tiny_gpt2_folder):
    owner = users["writer"]
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="guarded", owner=owner)
    for field, value in [
        ("status", "ready"),
        ("owner", users["other"].pk),
        ("host_worker", "evil"),
        ("memory_usage_bytes", 1),
        ("identifier", "/etc"),
        ("error_code", "X"),
    ]:
        response = client_for(owner).patch(f"/api/models/{model.id}", {field: value}, format="json")
        assert response.status_code == 400, (field, response.content)
        assert field in response.json()["error"]["details"]["fields"]
    created = client_for(owner).post(
        "/api/models",
        {"source": "local", "model_identifier": str(tiny_gpt2_folder), "status": "ready", "owner": 99},
        format="json",
    )
    assert created.status_code == 400
    assert set(created.json()["error"]["details"]["fields"]) == {"status", "owner"}
    model.refresh_from_db()
    assert (model.status, model.owner_id, model.host_worker) == ("pending", owner.pk, "")


ALL_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def test_every_method_a_route_does_not_serve_is_a_405(users, tiny_gpt2_folder):
    """The other half of "every route and method": what the matrix does not list is refused (asked
    by an admin, so that no role or ownership check answers first)."""
    rows = owned_rows(users["writer"], tiny_gpt2_folder)
    wrong = []
    for route, methods in MATRIX.items():
        if route in ("api/{unmatched}", "v1/", "v1/{unmatched}", "login/", "logout/"):
            continue  # no such endpoint whatever the method (404); Django's own sign-in views
        path = "/" + route
        for placeholder, value in rows.items():
            path = path.replace(placeholder, value)
        for method in ALL_METHODS:
            if method in methods:
                continue
            response = call(users["admin"], method, path)
            if response.status_code != 405:
                wrong.append(f"{method} /{route}: {response.status_code}")
    assert not wrong, "\n".join(wrong)


def test_a_cache_another_users_extraction_reused_is_visible_to_them_read_only(
    users, client_for, tiny_gpt2_folder
):
    rows = owned_rows(users["writer"], tiny_gpt2_folder)
    other = users["other"]
    cache_path = f"/api/activation-caches/{rows['{cache}']}"
    assert client_for(other).get(cache_path).status_code == 404
    cache = ActivationCache.objects.get(pk=rows["{cache}"])
    ExtractionJob.objects.create(  # what a request answered from the cache leaves behind
        model=cache.model, dataset=cache.dataset, cache=cache, hooks=cache.hooks, status="completed",
        cached=True, owner=other,
    )  # fmt: skip
    assert client_for(other).get(cache_path).status_code == 200
    assert [entry["id"] for entry in client_for(other).get("/api/activation-caches").json()["caches"]] == [
        cache.id
    ]
    refused = client_for(other).delete(cache_path)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "NOT_OWNER"
    assert client_for(users["reader"]).get(cache_path).status_code == 404


def owner_field_routes() -> list[tuple[str, str, str, str]]:
    """(kind, method, route, field) for every API route on an existing model or dataset whose request
    body can name one of the row's ``OWNER_FIELDS``, found from the views' own serializers."""
    from django.urls import resolve
    from rest_framework import serializers

    owner_fields = {"{model}": LanguageModel.OWNER_FIELDS, "{dataset}": Dataset.OWNER_FIELDS}
    found = []
    for route, methods in MATRIX.items():
        kind = next((placeholder for placeholder in owner_fields if placeholder in route), None)
        if kind is None or not route.startswith("api/"):
            continue
        view = resolve("/" + route.replace(kind, "x_id")).func
        view_class = getattr(view, "view_class", None) or getattr(view, "cls", None)
        bodies = [
            value
            for value in vars(view_class).values()
            if isinstance(value, type) and issubclass(value, serializers.Serializer)
        ]
        for method in methods:
            if method in ("POST", "PATCH") and hasattr(view_class, method.lower()):
                for field in sorted(
                    {name for body in bodies for name in body().fields} & set(owner_fields[kind])
                ):
                    found.append((kind, method, route, field))
    return found


def test_every_owner_field_any_route_can_change_is_the_owners_alone(users, client_for, tiny_gpt2_folder):
    """As a class: ``POST …/load {"quantization"}`` changed a shared model for a
    non-owner while PATCH said 403. Every (route, field) pair that can change a row's owner field is
    found from the views, and each must refuse another writer (403 ``NOT_OWNER``, nothing changed)
    and work for the owner (so the pair is real)."""
    owner, other = users["writer"], users["other"]
    routes = owner_field_routes()
    assert {(method, route, field) for _, method, route, field in routes} >= {
        ("PATCH", "api/models/{model}", "quantization"),
        ("POST", "api/models/{model}/load", "quantization"),
        ("PATCH", "api/datasets/{dataset}", "shared"),
    }
    failures = []
    for kind, method, route, field in routes:
        for actor, wanted in ((other, 403), (owner, None)):
            LanguageModel.objects.all().delete()
            model = model_register(
                source="local", identifier=str(tiny_gpt2_folder), name="team", owner=owner, shared=True
            )
            dataset = dataset_create_from_texts(
                name="team texts", texts=["a"], owner=owner, source="upload", shared=True
            )
            row = model if kind == "{model}" else dataset
            before = {name: getattr(row, name) for name in row.OWNER_FIELDS}
            value = {
                "name": "renamed",
                "pinned": True,
                "shared": False,
                "keep_alive_seconds": 60,
                "quantization": next(q for q in model.memory_estimates if q != model.quantization),
            }[field]
            path = "/" + route.replace("{model}", model.id).replace("{dataset}", dataset.id)
            response = getattr(client_for(actor), method.lower())(path, {field: value}, format="json")
            row.refresh_from_db()
            after = {name: getattr(row, name) for name in row.OWNER_FIELDS}
            if wanted == 403:
                code = response.json().get("error", {}).get("code") if response.status_code == 403 else None
                if code != "NOT_OWNER" or after != before:
                    failures.append(f"{method} /{route} {field} by another writer: {response.status_code}")
            elif response.status_code >= 400 or after[field] != value:
                failures.append(f"{method} /{route} {field} by the owner: {response.status_code} {after}")
    assert not failures, "\n".join(failures)
