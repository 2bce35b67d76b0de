"""Server-rendered pages: sign-in, the dashboard and its empty state."""

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def test_anonymous_visitors_are_sent_to_sign_in():
    response = Client().get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_sign_in_then_the_dashboard_shows_models_and_role(reader, tiny_gpt2_folder):
    from models_app.services import model_register

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-dash", owner=None)
    browser = Client()
    response = browser.post("/login/", {"username": "rita-reader", "password": "rita-reader-password"})
    assert response.status_code == 302 and response["Location"] == "/"
    page = browser.get("/").content.decode()
    assert "tiny-dash" in page and f'data-model-id="{model.id}"' in page
    assert "model:read" in page and "status-pending" in page


def test_a_wrong_password_says_so():
    response = Client().post("/login/", {"username": "nobody", "password": "wrong"})
    assert response.status_code == 200 and "didn't match" in response.content.decode()


def test_empty_dashboard_explains_how_to_add_a_model(reader):
    browser = Client()
    browser.force_login(reader)
    page = browser.get("/").content.decode()
    assert "No models yet" in page and "No worker is running" in page
