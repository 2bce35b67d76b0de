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
    assert 'data-testid="role">model:read<' in page
    assert 'data-testid="username" title="Your API token">rita-reader<' in page


def test_a_wrong_password_says_so():
    response = Client().post("/login/", {"username": "nobody", "password": "wrong"})
    assert response.status_code == 200 and "didn't match" in response.content.decode()


def test_sign_out_ends_the_session(reader):
    browser = Client()
    browser.force_login(reader)
    assert browser.get("/").status_code == 200
    assert browser.post("/logout/").status_code == 302
    assert browser.get("/").status_code == 302


def test_every_page_carries_a_strict_content_security_policy_and_no_inline_code(writer, tiny_gpt2_folder):
    """The policy refuses inline scripts and styles; so no page may contain any (the browser tests
    also fail on any refusal Chromium reports while they drive the pages)."""
    import re

    from mistudio.tests.test_permissions import MATRIX, owned_rows

    rows = owned_rows(writer, tiny_gpt2_folder)
    browser = Client()
    browser.force_login(writer)
    pages = [
        route
        for route, methods in MATRIX.items()
        if "GET" in methods and not route.startswith(("api/", "v1/"))
    ]
    checked = 0
    for route in pages:
        path = "/" + route
        for placeholder, value in rows.items():
            path = path.replace(placeholder, value)
        response = browser.get(path)
        policy = response.get("Content-Security-Policy", "")
        assert "default-src 'self'" in policy and "unsafe-inline" not in policy, (path, policy)
        assert "frame-ancestors 'none'" in policy
        if response.status_code != 200 or not response["Content-Type"].startswith("text/html"):
            continue
        html = response.content.decode()
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), (path, "inline script")
        assert "<style" not in html and not re.search(r"\sstyle=", html), (path, "inline style")
        assert not re.search(r"\son[a-z]+=", html), (path, "inline event handler")
        checked += 1
    assert checked >= 9


def test_pages_have_an_icon_and_favicon_ico_is_not_a_404(reader):
    """Before: every page logged a 404 for /favicon.ico."""
    answer = Client().get("/favicon.ico")
    assert answer.status_code == 301 and answer["Location"].endswith("/frontend/favicon.svg")
    browser = Client()
    browser.force_login(reader)
    page = browser.get("/").content.decode()
    assert '<link rel="icon" href="/static/frontend/favicon.svg" type="image/svg+xml">' in page
