"""A deleted user publishes nothing.

A row without an owner is a *system* row every reader sees, so deleting a user must never leave
their rows ownerless: every owned row (every model with an ``owner``) goes to the inactive
``deleted-users`` account, unshared, visible to admins only; their feature labels are deleted.

The test builds a row of every owned model and fails when ``owned_models()`` names a model it
did not build one for, so a new kind of owned row cannot go unchecked.
"""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Model

from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from circuits.models import AttributionGraph, Subgraph
from conftest import make_user
from evaluations.models import BenchRun
from features.models import ExplanationJob, FeatureAnalysis, FeatureLabel
from generation.models import Generation
from mistudio.access import _VISIBILITY, DELETED_USERS_ACCOUNT, may_see, owned_models
from models_app.models import LanguageModel
from saes.models import SaeEvaluation, SaeGroup, SparseAutoencoder
from steering.models import SteeringVector

pytestmark = pytest.mark.django_db

HOOK = "blocks.0.hook_resid_post"
LIST_ROUTES = {  # a reader's lists, and the key of their rows
    "/api/models": "models",
    "/api/datasets": "datasets",
    "/api/saes": "saes",
    "/api/steering-vectors": "vectors",
    "/api/activation-caches": "caches",
    "/api/extractions": "extractions",
    "/api/generations": "results",
}


def language_model(owner, *, shared: bool = False) -> LanguageModel:
    return LanguageModel.objects.create(
        name=f"{getattr(owner, 'username', 'system')}-model", model_type="gpt2", source="huggingface",
        identifier=f"test/{uuid.uuid4().hex[:12]}", owner=owner, shared=shared,
    )  # fmt: skip


def activation_cache(model, owner, dataset=None) -> ActivationCache:
    return ActivationCache.objects.create(
        key_hash=uuid.uuid4().hex, key={}, model=model, dataset=dataset, hooks=[HOOK], max_length=16,
        dtype="float32", status="completed", num_samples=2, num_tokens=2, owner=owner,
    )  # fmt: skip


def sae(model, cache, owner, *, shared: bool = False) -> SparseAutoencoder:
    return SparseAutoencoder.objects.create(
        model=model, cache=cache, hook_name=HOOK, architecture="topk", d_in=64, d_sae=256, k=8,
        status="completed", owner=owner, shared=shared,
    )  # fmt: skip


@pytest.fixture
def olga(db):
    """Another writer, whose shared model and SAE stay visible to everyone: dora's analysis, label and
    vector hang on them, so that what hides those rows after dora goes is their own owner and flag."""
    owner = make_user("olga-other", "model:write")
    model = language_model(owner, shared=True)
    cache = activation_cache(model, owner)
    return {"user": owner, "model": model, "sae": sae(model, cache, owner, shared=True)}


def rows_of(user, olga) -> dict[type[Model], list[Model]]:
    """A private row of every owned model for ``user``; the shareable ones shared (to prove that
    deleting the user unshares them)."""
    model = language_model(user, shared=True)
    dataset = dataset_create_from_texts(
        name=f"{user.username} texts", texts=["one", "two"], owner=user, source="upload", shared=True
    )
    cache = activation_cache(model, user, dataset)
    extraction = ExtractionJob.objects.create(
        model=model, dataset=dataset, cache=cache, hooks=[HOOK], status="completed", owner=user
    )
    generation = Generation.objects.create(model=model, owner=user, prompt="hi", parameters={})
    own_sae = sae(model, cache, user, shared=True)
    evaluation = SaeEvaluation.objects.create(sae=own_sae, cache=cache, status="completed", owner=user)
    analyses = [
        FeatureAnalysis.objects.create(
            sae=olga["sae"], cache=cache, status="completed", owner=user, shared=True
        ),
        FeatureAnalysis.objects.create(sae=own_sae, cache=cache, status="completed", owner=user, shared=True),
    ]
    labels = [
        FeatureLabel.objects.create(
            sae=olga["sae"], index=5, label=f"{user.username}'s", owner=user, shared=True
        ),
        FeatureLabel.objects.create(sae=own_sae, index=5, label="mine", owner=user, shared=True),
    ]
    vector = SteeringVector.objects.create(
        model=olga["model"], hook_name=HOOK, width=64, status="completed", owner=user, shared=True,
        positive_dataset=dataset, negative_dataset=dataset,
    )  # fmt: skip
    group = SaeGroup.objects.create(model=model, dataset=dataset, status="completed", owner=user, shared=True)
    explanations = ExplanationJob.objects.create(
        analysis=analyses[1], explainer_model="m_x", scorer_model="m_x", indices=[5], status="completed",
        owner=user, shared=True,
    )  # fmt: skip
    graph = AttributionGraph.objects.create(
        model=olga["model"], transcoders=[olga["sae"].id], prompt="a prompt", status="completed", owner=user,
        shared=True,
    )  # fmt: skip
    subgraph = Subgraph.objects.create(graph=graph, owner=user, name="a reading", shared=True)
    bench = BenchRun.objects.create(
        model=olga["model"],
        saes=[olga["sae"].id],
        methods=["core"],
        status="completed",
        owner=user,
        shared=True,
    )
    return {
        BenchRun: [bench],
        AttributionGraph: [graph],
        Subgraph: [subgraph],
        ExplanationJob: [explanations],
        SaeGroup: [group],
        LanguageModel: [model],
        Dataset: [dataset],
        ActivationCache: [cache],
        ExtractionJob: [extraction],
        Generation: [generation],
        SparseAutoencoder: [own_sae],
        SaeEvaluation: [evaluation],
        FeatureAnalysis: analyses,
        FeatureLabel: labels,
        SteeringVector: [vector],
    }


def ownerless() -> dict[type[Model], set]:
    """The pks of the rows without an owner (system rows), of every owned model."""
    return {
        model: set(model._default_manager.filter(owner__isnull=True).values_list("pk", flat=True))
        for model in owned_models()
    }


def has_shared(model: type[Model]) -> bool:
    return any(field.name == "shared" for field in model._meta.fields)


def deletes_rows(model: type[Model]) -> bool:
    return getattr(model, "OWNER_DELETED", "withhold") == "delete"


def test_every_owned_model_is_built_here(olga):
    """The check that keeps this file honest: a new model with an ``owner`` needs a row above."""
    user = make_user("dora", "model:write")
    built = rows_of(user, olga)
    missing = set(owned_models()) - set(built)
    assert not missing, f"build a row of {sorted(m._meta.label for m in missing)} in rows_of()"
    assert set(built) == set(owned_models())
    for model, rows in built.items():
        assert rows and all(row.owner_id == user.pk for row in rows), model
    # Every kind with a visibility rule is among them.
    assert set(_VISIBILITY) <= set(built)


@pytest.mark.parametrize("how", ["instance", "queryset"])
def test_a_deleted_users_rows_go_to_the_deleted_users_account_unshared(
    olga, reader, writer, model_admin, client_for, how
):
    dora = make_user("dora", "model:write")
    built = rows_of(dora, olga)
    assert set(owned_models()) <= set(built), "build a row of every owned model (see the test above)"
    system = dataset_create_from_texts(name="system texts", texts=["s"], owner=None, source="builtin")
    # What makes the check below mean something: shared, they were visible to the others.
    for model, rows in built.items():
        if model in _VISIBILITY and has_shared(model):
            for row in rows:
                assert may_see(reader, model, row.pk) and may_see(writer, model, row.pk), (model, row.pk)
    listed_before = {path: client_for(reader).get(path).json()[key] for path, key in LIST_ROUTES.items()}
    assert any(entry["id"] == built[LanguageModel][0].pk for entry in listed_before["/api/models"])
    before = ownerless()
    assert system.pk in before[Dataset]

    if how == "instance":
        dora.delete()
    else:
        get_user_model().objects.filter(username="dora").delete()
    assert not get_user_model().objects.filter(username="dora").exists()

    account = get_user_model().objects.get(username=DELETED_USERS_ACCOUNT)
    assert not account.is_active and not account.has_usable_password()
    assert not account.groups.exists() and not account.user_permissions.exists()
    for model, rows in built.items():
        for row in rows:
            stored = model._default_manager.filter(pk=row.pk).select_related("owner").first()
            if deletes_rows(model):
                assert stored is None, f"{model.__name__} {row.pk} of a deleted user is kept"
                continue
            assert stored is not None, f"{model.__name__} {row.pk} was deleted with its owner"
            assert stored.owner is not None and stored.owner.username == DELETED_USERS_ACCOUNT, (
                model,
                row.pk,
            )
            if has_shared(model):
                assert stored.shared is False, (model, row.pk)
    assert not FeatureLabel.objects.filter(pk__in=[label.pk for label in built[FeatureLabel]]).exists()

    for model in _VISIBILITY:
        for row in built[model]:
            assert not may_see(reader, model, row.pk), f"a reader sees {model.__name__} {row.pk}"
            assert not may_see(writer, model, row.pk), f"another writer sees {model.__name__} {row.pk}"
            assert not may_see(olga["user"], model, row.pk), f"olga sees {model.__name__} {row.pk}"
            assert may_see(model_admin, model, row.pk), f"the admin no longer sees {model.__name__} {row.pk}"

    after = ownerless()
    assert after == before, "rows lost their owner: they are now system rows every reader sees"

    dora_ids = {row.pk for rows in built.values() for row in rows}
    for user in (reader, writer):
        for path, key in LIST_ROUTES.items():
            response = client_for(user).get(path)
            assert response.status_code == 200, (path, response.content)
            shown = {entry["id"] for entry in response.json()[key]}
            assert not shown & dora_ids, f"{user.username}'s {path} lists a deleted user's rows"
    # olga's SAE lists no analysis or label of dora's; the admin still finds dora's model.
    analyses = client_for(reader).get(f"/api/saes/{olga['sae'].id}/analyses")
    assert analyses.status_code == 200 and analyses.json()["total"] == 0
    admin_models = client_for(model_admin).get("/api/models").json()["models"]
    (held,) = [entry for entry in admin_models if entry["id"] == built[LanguageModel][0].pk]
    assert held["owner"] == DELETED_USERS_ACCOUNT and held["shared"] is False


def test_two_deleted_users_with_labels_on_the_same_feature(olga, reader):
    dora, erin = make_user("dora", "model:write"), make_user("erin", "model:write")
    dora_rows, erin_rows = rows_of(dora, olga), rows_of(erin, olga)
    # Both labelled feature 5 of olga's SAE (one label per owner and feature).
    assert FeatureLabel.objects.filter(sae=olga["sae"], index=5).count() == 2
    dora.delete()
    erin.delete()
    assert get_user_model().objects.filter(username=DELETED_USERS_ACCOUNT).count() == 1
    assert not FeatureLabel.objects.filter(sae=olga["sae"]).exists()
    for built in (dora_rows, erin_rows):
        for model, rows in built.items():
            if deletes_rows(model):
                continue
            for row in rows:
                stored = model._default_manager.select_related("owner").get(pk=row.pk)
                assert stored.owner.username == DELETED_USERS_ACCOUNT, (model, row.pk)
                if model in _VISIBILITY:
                    assert not may_see(reader, model, row.pk), (model, row.pk)
    # A third, after them, still works (the account is reused).
    frank = make_user("frank", "model:write")
    model = language_model(frank, shared=True)
    frank.delete()
    model.refresh_from_db()
    assert model.owner.username == DELETED_USERS_ACCOUNT and model.shared is False


def test_a_user_deleted_after_the_account_itself_was_deleted(olga, reader):
    """Deleting an empty ``deleted-users`` account is harmless: the next deletion makes a new one."""
    dora = make_user("dora", "model:write")
    dora.delete()  # makes the account, holding nothing
    account = get_user_model().objects.get(username=DELETED_USERS_ACCOUNT)
    account.delete()
    erin = make_user("erin", "model:write")
    built = rows_of(erin, olga)
    erin.delete()
    fresh = get_user_model().objects.get(username=DELETED_USERS_ACCOUNT)
    assert not fresh.is_active and fresh.pk != account.pk
    for model in _VISIBILITY:
        for row in built[model]:
            assert model._default_manager.get(pk=row.pk).owner_id == fresh.pk
            assert not may_see(reader, model, row.pk), (model, row.pk)


def test_deleting_the_deleted_users_account_publishes_nothing(olga, reader, writer):
    """The account holds every deleted user's rows: deleting it (an admin tidying up users) must
    either be refused or leave those rows out of sight, never make them system rows."""
    dora = make_user("dora", "model:write")
    built = rows_of(dora, olga)
    dora.delete()
    account = get_user_model().objects.get(username=DELETED_USERS_ACCOUNT)
    before = ownerless()
    with pytest.raises(PermissionDenied, match="holds deleted users' rows"), transaction.atomic():
        account.delete()  # refused while it holds rows
    assert get_user_model().objects.filter(pk=account.pk).exists()
    for model in _VISIBILITY:
        for row in built[model]:
            assert not may_see(reader, model, row.pk), f"a reader sees {model.__name__} {row.pk}"
            assert not may_see(writer, model, row.pk), f"a writer sees {model.__name__} {row.pk}"
    assert ownerless() == before, "the account's rows lost their owner: they are now system rows"
