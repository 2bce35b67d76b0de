"""The static-files middleware: a second middleware chain in the same process reuses what the
finders found (the tests build one per client), and still serves every file."""

from django.contrib.staticfiles import finders
from django.test import Client

from mistudio.static_files import StaticFilesMiddleware


def test_a_second_chain_reuses_what_the_finders_found(monkeypatch):
    first = StaticFilesMiddleware(lambda request: None)
    looked = []
    original = finders.get_finders
    monkeypatch.setattr(finders, "get_finders", lambda: looked.append(1) or original())

    second = StaticFilesMiddleware(lambda request: None)

    assert (
        not looked
        and second.files.keys() == first.files.keys()
        and "/static/frontend/activations.css" in second.files
    )


def test_static_files_are_served(db):
    response = Client().get("/static/frontend/activations.css")
    assert response.status_code == 200 and b"".join(response.streaming_content)
