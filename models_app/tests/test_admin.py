"""The admin's model actions go through the same services as the API."""

import pytest

from mistudio.workers import shared_queue
from models_app.models import LanguageModel
from models_app.services import model_register

pytestmark = pytest.mark.django_db


@pytest.fixture
def model(tiny_gpt2_folder):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-admin", owner=None)


def test_list_has_filters_and_search(admin_client, model):
    page = admin_client.get(
        "/admin/models_app/languagemodel/", {"q": "tiny-admin", "status__exact": "pending"}
    )
    assert page.status_code == 200 and model.id in page.content.decode()
    assert (
        "/admin/models_app/languagemodel/add/" not in page.content.decode()
    )  # registration inspects: API/CLI


def test_load_action_queues_a_load(admin_client, model, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(
            "/admin/models_app/languagemodel/", {"action": "load_models", "_selected_action": [model.id]}
        )
    model.refresh_from_db()
    assert model.status == "loading" and model.rq_job_id in shared_queue().job_ids


def test_unload_action_reports_a_model_that_is_not_loaded(admin_client, model):
    response = admin_client.post(
        "/admin/models_app/languagemodel/",
        {"action": "unload_models", "_selected_action": [model.id]},
        follow=True,
    )
    assert "The model is not loaded." in response.content.decode()


def test_delete_action_and_edit_page_use_the_services(admin_client, model):
    response = admin_client.post(
        f"/admin/models_app/languagemodel/{model.id}/change/",
        {"name": "renamed-in-admin", "pinned": "on", "keep_alive_seconds": "60"},
    )
    assert response.status_code == 302
    model.refresh_from_db()
    assert (model.name, model.pinned, model.keep_alive_seconds) == ("renamed-in-admin", True, 60)
    admin_client.post(
        "/admin/models_app/languagemodel/", {"action": "delete_models", "_selected_action": [model.id]}
    )
    assert not LanguageModel.objects.filter(pk=model.id).exists()
