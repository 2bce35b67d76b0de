"""Schemathesis against ``/api/schema/``: every operation, with a reader's and a writer's token,
bounded examples. No answer may be a server error, every answer's status must be one the schema
documents (the operation's own 2xx, or a 4xx / 503 error), and every body must match the schema:
a 2xx its output serializer, an error the one error body (``mistudio.openapi``).

Generated values are mostly nonsense by design (random ids, out-of-range numbers, odd strings):
what this proves is that bad input gets a clean 4xx in the documented shape, never a 500.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, given, reject, settings
from rest_framework.test import APIClient
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

from conftest import make_user

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

EXAMPLES_PER_OPERATION = 12


@pytest.fixture
def tokens(db):
    return {role: make_user(f"fuzz-{role}", f"model:{role}").auth_token.key for role in ("read", "write")}


@pytest.fixture
def online_hub(tmp_path, monkeypatch, settings):
    """A reachable hub (the stand-in on 127.0.0.1), as a deployed server has: fuzzed hub ids get the
    hub's real answer (no such repository) instead of the offline refusal."""
    from huggingface_hub import constants as hub_constants

    from engine.testing.hub_standin import LocalHub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    settings.MODEL_CACHE_DIR = tmp_path / "model-cache"
    with LocalHub(tmp_path / "hub") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


@pytest.fixture
def api_schema(tokens, online_hub):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {tokens['read']}")
    raw = client.get("/api/schema/").json()
    schema = schemathesis.openapi.from_dict(raw)
    schema.app = get_wsgi_application()
    return schema


BOUNDED = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same examples on every run: a failure is reproducible
    database=None,
)


def route_words(schema) -> set[str]:
    """The literal segments of the API's paths (``groups`` of ``/api/saes/groups``)."""
    paths = schema.raw_schema["paths"]
    return {part for path in paths for part in path.split("/") if part and "{" not in part}


def fuzz_every_operation(schema, token: str) -> list[str]:
    """Bounded examples of every operation in the schema, sent with ``token``; the failures found.

    (Schemathesis's pytest plugin does not run under pytest 9, so the operations are driven here
    with Hypothesis directly: the same strategies and the same checks.)
    """
    failures = []
    # A path parameter spelled as another route's segment reaches that route, not this operation
    # (``/api/saes/{sae_id}`` with ``groups`` is the list of groups): such an example tests nothing.
    words = route_words(schema)
    for result in schema.get_all_operations():
        operation = result.ok()

        @BOUNDED
        @given(case=operation.as_strategy())
        def examples(case):
            if words & {str(value) for value in (case.path_parameters or {}).values()}:
                reject()
            case.call_and_validate(
                headers={"Authorization": f"Token {token}", "Host": "localhost"},
                checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
            )

        try:
            examples()
        except (Exception, BaseExceptionGroup) as error:  # one operation's failure must not hide the others'
            failures.append(f"{operation.method.upper()} {operation.path}: {str(error)[:1500]}")
    return failures


@pytest.mark.parametrize("role", ["read", "write"])
def test_no_operation_answers_a_server_error_or_breaks_its_schema(api_schema, tokens, role):
    assert len(list(api_schema.get_all_operations())) >= 25  # the whole API was read
    failures = fuzz_every_operation(api_schema, tokens[role])
    assert not failures, "\n\n".join(failures)
