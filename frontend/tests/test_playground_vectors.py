"""The playground's Steering panel with saved steering vectors (server side): completed vectors the
user can see are offered, each naming its model and hook; ``?vector=`` presets one."""

import re

import pytest
from django.test import Client

from conftest import make_user
from models_app.models import LanguageModel
from steering.models import SteeringVector

WORKER = "playground-worker"


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


def ready_model(folder) -> LanguageModel:
    return LanguageModel.objects.create(
        name="vector-gpt2", source="local", identifier=f"{folder}/vector-gpt2", model_type="gpt2",
        status=LanguageModel.Status.READY, host_worker=WORKER, num_layers=2,
    )  # fmt: skip


def vector_row(model, owner, name: str, *, status: str = "completed", shared: bool = False) -> SteeringVector:
    return SteeringVector.objects.create(
        name=name, model=model, hook_name="blocks.1.hook_resid_pre", width=64, norm=3.25,
        status=status, owner=owner, shared=shared,
    )  # fmt: skip


def steer_panel(page: str) -> str:
    return re.search(r'id="steer-card".*?</section>', page, re.S).group(0)


@pytest.mark.django_db
def test_the_panel_offers_completed_visible_vectors_preset_by_the_query(writer, tiny_gpt2_folder):
    model = ready_model(tiny_gpt2_folder)
    mine = vector_row(model, writer, "mine")
    theirs = vector_row(model, make_user("sam-sharer", "model:write"), "shared one", shared=True)
    vector_row(model, writer, "still computing", status="running")
    vector_row(model, make_user("olga-other", "model:write"), "not shared")
    browser = signed_in(writer)

    query = {"model": model.id, "vector": mine.id, "coefficient": "4", "positions": "generated"}
    panel = steer_panel(browser.get("/playground/", query).content.decode())
    assert '<input type="checkbox" id="steer" checked>' in panel and re.search(
        r'id="steer-fields"\s*>', panel
    )
    assert re.search(r'value="vector" checked>', panel)  # the vector source is chosen
    assert re.search(r'id="steer-feature-fields" hidden', panel) and re.search(
        r'id="steer-vector-fields"\s*>', panel
    )
    assert '<label for="steer-vector">Steering vector</label>' in panel
    options = dict(re.findall(r'<option value="(sv_[^"]+)"([^>]*)>', panel))
    assert sorted(options) == sorted([mine.id, theirs.id])  # completed and visible only
    assert (
        f'data-model="{model.id}"' in options[mine.id]
        and 'data-hook="blocks.1.hook_resid_pre"' in options[mine.id]
    )
    assert 'data-width="64"' in options[mine.id] and 'data-norm="3.250"' in options[mine.id]
    assert "selected" in options[mine.id] and "selected" not in options[theirs.id]
    assert 'id="steer-amount" step="0.5" value="4.0"' in panel
    assert re.search(r'<option value="generated" selected>', panel)
    assert "Times the vector, added to the activation at its hook point" in panel
    # No SAE is completed: the feature source is offered but switched off, and says why.
    assert re.search(r'value="feature"\s+disabled>', panel) and 'id="steer-no-saes"' in panel


@pytest.mark.django_db
def test_an_unknown_vector_is_named_and_no_vector_says_how_to_make_one(writer, tiny_gpt2_folder):
    model = ready_model(tiny_gpt2_folder)
    browser = signed_in(writer)
    panel = steer_panel(
        browser.get("/playground/", {"model": model.id, "vector": "sv_nope"}).content.decode()
    )
    assert 'id="steer-missing-vector"' in panel and "<code>sv_nope</code>" in panel
    assert '<input type="checkbox" id="steer" >' in panel  # nothing to steer with: off
    # Nothing to steer with yet: the panel offers to compute a vector, open.
    assert "No completed steering vector yet: compute one below." in panel
    assert re.search(r'<details class="new-vector" id="new-vector" open>', panel)

    vector_row(model, writer, "mine", status="failed")
    panel = steer_panel(browser.get("/playground/", {"model": model.id}).content.decode())
    assert 'id="steer-vector"' not in panel
