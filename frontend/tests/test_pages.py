"""Sign-in, sign-out and the top bar every page shares."""

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def test_anonymous_visitors_are_sent_to_sign_in():
    response = Client().get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_sign_in_lands_on_the_models_page_with_the_role_in_the_top_bar(reader):
    browser = Client()
    response = browser.post("/login/", {"username": "rita-reader", "password": "rita-reader-password"})
    assert response.status_code == 302 and response["Location"] == "/"
    page = browser.get("/").content.decode()
    assert 'data-testid="role">model:read<' in page and 'data-testid="username">rita-reader<' in page


def test_a_wrong_password_says_so():
    response = Client().post("/login/", {"username": "nobody", "password": "wrong"})
    assert response.status_code == 200 and "didn't match" in response.content.decode()


def test_sign_out_ends_the_session(reader):
    browser = Client()
    browser.force_login(reader)
    assert browser.get("/").status_code == 200
    assert browser.post("/logout/").status_code == 302
    assert browser.get("/").status_code == 302
