"""The API token page: a signed-in user makes, replaces and revokes their own token (before, only
``manage.py create_user`` gave one), and the key works for the API until it is revoked."""

import pytest
from django.test import Client
from rest_framework.authtoken.models import Token

pytestmark = pytest.mark.django_db


def api_status(key: str) -> int:
    return Client().get("/api/models", HTTP_AUTHORIZATION=f"Bearer {key}").status_code


def test_make_replace_and_revoke_ones_own_api_token(reader):
    Token.objects.filter(user=reader).delete()
    browser = Client()
    browser.force_login(reader)
    page = browser.get("/account/token/").content.decode()
    assert 'data-testid="token-state">You have no token.' in page and 'id="create-token">Create token' in page

    made = browser.post("/account/token/", {"action": "create"}).content.decode()
    key = Token.objects.get(user=reader).key
    assert f'data-testid="new-token">{key}<' in made and "it is not shown again" in made
    assert api_status(key) == 200
    shown_later = browser.get("/account/token/").content.decode()
    assert key not in shown_later and f"it starts <code>{key[:4]}…</code>" in shown_later

    browser.post("/account/token/", {"action": "create"})  # replace: the old key stops working
    replaced = Token.objects.get(user=reader).key
    assert replaced != key and api_status(key) == 401 and api_status(replaced) == 200

    revoked = browser.post("/account/token/", {"action": "revoke"})
    assert revoked.status_code == 302 and not Token.objects.filter(user=reader).exists()
    assert api_status(replaced) == 401
    assert browser.post("/account/token/", {"action": "other"}).status_code == 400


def test_the_page_needs_a_signed_in_user():
    assert Client().get("/account/token/").status_code == 302  # to the sign-in page


def test_several_named_tokens_each_revoked_alone(reader):
    """Before: a user held one token, and making a new one revoked the one a notebook used."""
    from mistudio.models import ApiToken

    browser = Client()
    browser.force_login(reader)
    default = Token.objects.get(user=reader).key
    laptop = browser.post("/account/token/", {"action": "create_named", "name": "laptop notebook"})
    ci = browser.post("/account/token/", {"action": "create_named", "name": "CI"})
    keys = {row.name: row.key for row in ApiToken.objects.filter(user=reader)}
    assert f'data-testid="new-token">{keys["laptop notebook"]}<' in laptop.content.decode()
    assert f'data-testid="new-token">{keys["CI"]}<' in ci.content.decode()
    assert all(api_status(key) == 200 for key in [default, *keys.values()])  # side by side
    ok = Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {keys['CI']}")
    assert ok.status_code == 200  # the OpenAI-compatible routes too
    assert ApiToken.objects.get(user=reader, name="CI").last_used_at is not None

    page = browser.get("/account/token/").content.decode()
    assert "laptop notebook" in page and keys["CI"] not in page  # names, never keys
    again = browser.post("/account/token/", {"action": "create_named", "name": "CI"})
    assert again.status_code == 400 and "already have a token named" in again.content.decode()

    laptop_id = ApiToken.objects.get(user=reader, name="laptop notebook").pk
    browser.post("/account/token/", {"action": "revoke", "token": str(laptop_id)})
    assert api_status(keys["laptop notebook"]) == 401
    assert api_status(keys["CI"]) == 200 and api_status(default) == 200  # the others keep working
