"""Browser tests: Debian's chromium driven by Playwright against a live Daphne and a real worker.

Fixtures (exposed by ``frontend/tests/conftest.py``):

- ``chromium``: one headless browser per session (``/usr/bin/chromium``, no downloaded build);
- ``site``: the module's live Daphne + worker (``live_processes``) with a signed-up model:write
  user ``ada`` (password ``ada-password``), rows made per test;
- ``page``: a fresh browser context signed in as ``ada`` through the real sign-in form.

``screenshot(page, name)`` saves ``docs/screenshots/<name>-light.png`` and ``-dark.png``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from django.conf import settings

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(settings.BASE_DIR) / "docs" / "screenshots"
VIEWPORT = {"width": 1360, "height": 860}
USERNAME, PASSWORD = "ada", "ada-password"
# Long enough for a tiny model's load or extraction on two busy cores; failures say what they waited for.
LIVE_TIMEOUT_MS = 90_000


@dataclass
class Site:
    base_url: str
    worker_name: str

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"


@pytest.fixture(scope="module")
def chromium(monkeypatch_module):
    """One headless browser per test module.

    Playwright's sync API runs an event loop in this thread for as long as it is started, which
    breaks every later ``async_to_sync`` in the process (event publishing, Channels tests); a
    module scope stops it, and restores the thread, before the next module runs.
    """
    from playwright.sync_api import sync_playwright

    # The test's own ORM calls are still plain synchronous code while that loop runs, so Django's
    # async-safety check must not refuse them.
    monkeypatch_module.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture
def site(transactional_db, live_processes) -> Site:

    base_url, worker_name, _processes = live_processes
    browser_user(USERNAME, "model:write")
    return Site(base_url=base_url, worker_name=worker_name)


def browser_user(username: str, role: str):
    """A user who can sign in on the live server (with :data:`PASSWORD`)."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import PBKDF2PasswordHasher
    from django.contrib.auth.models import Group

    # The live server runs the production settings, which do not accept the test settings' fast
    # hasher; a PBKDF2 hash with few iterations is accepted (and upgraded) at sign-in.
    password = PBKDF2PasswordHasher().encode(PASSWORD, "browser-test-salt", iterations=1000)
    user = get_user_model().objects.create(username=username, password=password)
    user.groups.add(Group.objects.get(name=role))
    return user


def sign_in(page, site: Site, username: str = USERNAME) -> None:
    page.goto(site.url("/login/"))
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(site.url("/"))


def _context(browser):
    """A browser context as the tests use it: 20 s for an element, 60 s for a page to load (a page
    served while CI's other groups load both cores took over 20 s)."""
    context = browser.new_context(viewport=VIEWPORT, color_scheme="light")
    context.set_default_timeout(20_000)
    context.set_default_navigation_timeout(60_000)
    return context


def page_of(page, site: Site, username: str):
    """A second tab, in its own browser context, signed in as ``username``."""
    other = _context(page.context.browser).new_page()
    sign_in(other, site, username)
    return other


@pytest.fixture
def page(chromium, site):
    context = _context(chromium)
    browser_page = context.new_page()
    errors: list[str] = []
    refused: list[str] = []
    browser_page.on("pageerror", lambda error: errors.append(str(error)))
    # Chromium reports what the Content-Security-Policy refused (an inline script or style, a
    # foreign origin) as a console error: every page any browser test visits must cause none.
    browser_page.on(
        "console",
        lambda message: "Content Security Policy" in message.text and refused.append(message.text),
    )
    sign_in(browser_page, site)
    yield browser_page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
    assert not refused, f"refused by the Content-Security-Policy: {refused}"


def screenshot(page, name: str) -> None:
    """Save the page as it is now, in the light and the dark theme, for docs/screenshots/."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        page.wait_for_timeout(150)  # let transitions settle
        page.screenshot(path=str(SCREENSHOTS / f"{name}-{scheme}.png"), full_page=True)
    page.emulate_media(color_scheme="light")
