"""Hostile or broken input gets a clean 4xx in the documented shape, and nothing is stored half-way.

One place for the whole list (the app tests go deeper on each): hostile ``config.json`` files, an
oversize upload, malformed JSON, a wrong content type, absurd numbers, NUL bytes and unicode in
names.
"""

from __future__ import annotations

import json
import shutil

import pytest
from django.conf import settings

from activations.models import Dataset
from models_app.models import LanguageModel

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(writer, client_for):
    return client_for(writer)


def refused(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body["error"]) == {"code", "message", "details", "timestamp"}
    assert (
        "Traceback" not in response.content.decode()
        and str(settings.BASE_DIR) not in response.content.decode()
    )
    if code:
        assert body["error"]["code"] == code
    return body["error"]


def hostile_copy(source, name: str, **config_changes):
    folder = settings.LOCAL_MODEL_ROOTS[0] / name
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"auto_map": {"AutoModelForCausalLM": "evil.EvilModel"}}, "REMOTE_CODE_NOT_ALLOWED"),
        ({"n_layer": 10**9}, "INVALID_MODEL"),
        ({"n_embd": -5}, "INVALID_MODEL"),
        ({"model_type": "definitely_not_a_family"}, "UNSUPPORTED_ARCHITECTURE"),
    ],
)
def test_a_hostile_config_is_refused_and_nothing_is_registered(api, tiny_gpt2_folder, changes, code):
    folder = hostile_copy(tiny_gpt2_folder, f"hostile-{code.lower()}", **changes)
    response = api.post("/api/models", {"source": "local", "model_identifier": str(folder)}, format="json")
    refused(response, 400, code)
    assert not LanguageModel.objects.exists()


def test_an_oversize_upload_is_refused_before_anything_is_stored(api, settings):
    settings.DATASET_MAX_UPLOAD_BYTES = 1024
    from django.core.files.uploadedfile import SimpleUploadedFile

    files_before = set(settings.DATASET_DIR.glob("*")) if settings.DATASET_DIR.exists() else set()
    upload = SimpleUploadedFile("big.txt", b"a line of text\n" * 200, content_type="text/plain")
    response = api.post("/api/datasets", {"file": upload, "name": "big"}, format="multipart")
    refused(response, 413, "DATASET_TOO_LARGE")
    assert not Dataset.objects.exists()
    files_after = set(settings.DATASET_DIR.glob("*")) if settings.DATASET_DIR.exists() else set()
    assert files_after == files_before  # no partial file either


@pytest.mark.parametrize(
    ("path", "body", "content_type", "status", "code"),
    [
        ("/api/models", '{"model_identifier": ', "application/json", 400, "MALFORMED_REQUEST"),
        ("/api/models", "model_identifier=gpt2", "text/plain", 415, "UNSUPPORTED_MEDIA_TYPE"),
        ("/api/datasets", "[1, 2, 3]", "application/json", 400, None),
        ("/api/generate", '{"prompt": "hi"', "application/json", 400, "MALFORMED_REQUEST"),
        ("/api/generate", "prompt=hi", "text/plain", 415, None),
    ],
)
def test_malformed_bodies_and_wrong_content_types(api, path, body, content_type, status, code):
    refused(api.generic("POST", path, body, content_type=content_type), status, code)
    assert not LanguageModel.objects.exists() and not Dataset.objects.exists()


def test_absurd_numbers_are_named(api, tiny_gpt2_folder):
    model = api.post(
        "/api/models", {"source": "local", "model_identifier": str(tiny_gpt2_folder)}, format="json"
    ).json()
    error = refused(
        api.post(
            "/api/generate", {"model_id": model["id"], "prompt": "hi", "max_tokens": 10**12}, format="json"
        ),
        400,
    )
    assert "max_tokens" in error["details"]["fields"]
    error = refused(api.patch(f"/api/models/{model['id']}", {"keep_alive_seconds": -1}, format="json"), 400)
    assert "keep_alive_seconds" in error["details"]["fields"]
    error = refused(api.get("/api/models", {"limit": 10**9}), 400)
    assert "limit" in error["details"]["fields"]


@pytest.mark.parametrize("name", ["nul\x00inside", "\x00"])
def test_a_nul_byte_in_a_name_is_refused_and_nothing_is_stored(api, tiny_gpt2_folder, name):
    response = api.post(
        "/api/models",
        {"source": "local", "model_identifier": str(tiny_gpt2_folder), "name": name},
        format="json",
    )
    error = refused(response, 400)
    assert "name" in error["details"]["fields"]
    assert not LanguageModel.objects.exists()
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("notes.txt", b"one\ntwo\n", content_type="text/plain")
    error = refused(api.post("/api/datasets", {"file": upload, "name": name}, format="multipart"), 400)
    assert "name" in error["details"]["fields"]
    assert not Dataset.objects.exists()


def test_unicode_names_are_kept_exactly(api, tiny_gpt2_folder):
    name = "模型 ✨ مدل — Ünïcödé \U0001f9e0"
    response = api.post(
        "/api/models",
        {"source": "local", "model_identifier": str(tiny_gpt2_folder), "name": name},
        format="json",
    )
    assert response.status_code == 201 and response.json()["name"] == name
    assert LanguageModel.objects.get().name == name


# --- Hostile JSON and numbers, on every route that takes them -------------------

DEEP = "[" * 5000 + "]" * 5000  # Python's json recurses per level: RecursionError, not ValueError
JUST_TOO_DEEP = '{"a": ' * 40 + "1" + "}" * 40
BODILESS_ACTIONS = ("/unload", "/cancel")
NOT_JSON_CONSTANTS = ['{"temperature": NaN}', '{"name": Infinity}', '{"name": -Infinity}']


def json_routes(rows: dict[str, str]) -> list[tuple[str, str]]:
    """(method, path) of every route that reads a JSON body, the writer's rows filled in (not the
    multipart-only upload of an SAE's files: JSON is a 415 there)."""
    from django.urls import resolve

    from mistudio.tests.test_permissions import MATRIX

    found = []
    for route, methods in MATRIX.items():
        for method in methods:
            if method in ("POST", "PATCH") and route.startswith(("api/", "v1/")):
                path = "/" + route
                for placeholder, value in rows.items():
                    path = path.replace(placeholder, value)
                parsers = getattr(getattr(resolve(path).func, "view_class", None), "parser_classes", None)
                if parsers is None or any("json" in parser.media_type for parser in parsers):
                    found.append((method, path))
    return found


def malformed(response) -> str:
    """The error code of a refused hostile body, in the shape of the route (OpenAI's on /v1)."""
    assert response.status_code == 400, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json")
    body = response.json()["error"]
    assert "Traceback" not in response.content.decode()
    return body["code"]


def test_deeply_nested_or_non_standard_json_is_a_400_on_every_json_route(
    writer, client_for, tiny_gpt2_folder
):
    from mistudio.tests.test_permissions import owned_rows

    api = client_for(writer)
    routes = json_routes(owned_rows(writer, tiny_gpt2_folder))
    assert len(routes) >= 12
    for method, path in routes:
        for body in [DEEP, JUST_TOO_DEEP, *NOT_JSON_CONSTANTS]:
            response = api.generic(method, path, body, content_type="application/json")
            if path.endswith(BODILESS_ACTIONS):  # they read no body: any JSON answer but a 5xx
                assert response.status_code < 500 and response["Content-Type"] == "application/json"
                continue
            assert malformed(response) == "MALFORMED_REQUEST", (method, path, body[:20])


def test_absurdly_large_numbers_in_queries_and_bodies_are_400s_naming_the_field(
    writer, client_for, tiny_gpt2_folder
):
    from mistudio.tests.test_permissions import owned_rows

    rows = owned_rows(writer, tiny_gpt2_folder)
    api = client_for(writer)
    huge = 10**20
    cases = [
        (api.get("/api/models", {"offset": huge}), "offset"),
        (api.get(f"/api/datasets/{rows['{dataset}']}/samples", {"offset": huge}), "offset"),
        (api.get(f"/api/activation-caches/{rows['{cache}']}/slice", {"start": huge}), "start"),
        (api.get(f"/api/activation-caches/{rows['{cache}']}/top-k", {"neuron": huge}), "neuron"),
        (
            api.post(
                f"/api/models/{rows['{model}']}/extract-activations",
                {"dataset_id": rows["{dataset}"], "layers": [0], "sample_count": huge},
                format="json",
            ),
            "sample_count",
        ),
    ]
    for response, field in cases:
        error = refused(response, 400)
        assert field in error["details"]["fields"], (field, error)
    response = api.post(
        "/v1/completions", {"model": rows["{model}"], "prompt": "hi", "best_of": huge}, format="json"
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"


def input_serializers():
    """Every request serializer of the project (output ``ModelSerializer``s and ``OutputSerializer``s
    excluded)."""
    import importlib

    from rest_framework import serializers

    from mistudio.serializers import OutputSerializer

    for module in ("models_app.apis", "activations.apis", "generation.openai_api"):
        importlib.import_module(module)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    project = {"mistudio", "models_app", "activations", "generation", "frontend"}
    for cls in set(subclasses(serializers.Serializer)):
        answers = issubclass(cls, serializers.ModelSerializer | OutputSerializer)  # they describe answers
        if cls.__module__.split(".")[0] in project and not answers:
            yield cls


def test_every_number_string_and_list_a_client_sends_is_bounded():
    """The class behind ``?offset=10**20`` → 500: an unbounded field lets a value through that the
    database or numpy cannot hold. JSON fields are checked by their own validators (and the depth
    limit of every JSON body)."""
    from rest_framework import serializers

    unbounded = []
    checked = 0
    for cls in input_serializers():
        for name, field in cls().fields.items():
            if field.read_only:
                continue
            checked += 1
            where = f"{cls.__module__}.{cls.__qualname__}.{name}"
            if isinstance(field, serializers.IntegerField | serializers.FloatField):
                bounded = field.min_value is not None and field.max_value is not None
            elif isinstance(field, serializers.CharField | serializers.ListField):
                bounded = field.max_length is not None
            else:
                bounded = True  # choices, booleans, JSON (validated by their own code)
            if not bounded:
                unbounded.append(where)
    assert checked > 50
    assert not unbounded, unbounded


def test_an_unexpected_error_in_an_api_or_openai_view_is_json_never_an_html_page(rf, caplog):
    from mistudio.error_middleware import ErrorResponseMiddleware

    middleware = ErrorResponseMiddleware(lambda request: None)
    failure = ZeroDivisionError("secret detail /srv/path")
    api = middleware.process_exception(rf.post("/api/generate"), failure)
    assert api.status_code == 500 and api["Content-Type"] == "application/json"
    assert json.loads(api.content)["error"]["code"] == "INTERNAL_ERROR"
    openai = middleware.process_exception(rf.post("/v1/chat/completions"), failure)
    body = json.loads(openai.content)["error"]
    assert openai.status_code == 500 and body["type"] == "server_error" and body["code"] == "INTERNAL_ERROR"
    for response in (api, openai):
        assert b"secret detail" not in response.content and b"/srv/path" not in response.content
    assert "secret detail" in caplog.text  # the operator still gets the traceback
    assert middleware.process_exception(rf.get("/models/"), failure) is None  # pages: Django's own


# --- the second review's class 8: each answered with a 4xx, nothing stored -------------


@pytest.fixture
def sae_with_features(writer, tiny_gpt2_folder):
    from features.tests.conftest import completed_sae_row
    from models_app.services import model_register
    from saes.tests.conftest import write_planted_cache

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    return completed_sae_row(model, write_planted_cache(model, writer, samples=8), writer)


def test_a_page_number_past_any_database_is_a_400(api, sae_with_features):
    response = api.get(f"/api/saes/{sae_with_features.id}/features", {"page": 10**30})
    assert refused(response, 400, "VALIDATION_ERROR")["details"]["fields"]["page"]


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("safe\u202eexe.txt", "U+202E"),
        ("a\u2066b", "U+2066"),
        ("bell\x07", "U+0007"),
        ("esc\x1b[31m", "U+001B"),
    ],
)
def test_control_and_direction_characters_in_a_label_are_refused(api, sae_with_features, text, shown):
    from features.models import FeatureLabel

    response = api.patch(f"/api/saes/{sae_with_features.id}/features/0", {"label": text}, format="json")
    assert shown in refused(response, 400, "INVALID_TEXT")["message"]
    assert not FeatureLabel.objects.exists()
    # Line breaks stay fine in notes, and a plain label goes through.
    ok = api.patch(
        f"/api/saes/{sae_with_features.id}/features/0", {"label": "fine", "notes": "a\nb"}, format="json"
    )
    assert ok.status_code == 200, ok.content


def test_an_intervention_of_absurd_magnitude_is_a_400_before_any_worker(api, tiny_gpt2_folder):
    from models_app.services import model_register

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None)
    hook = "blocks.0.hook_resid_post"
    for intervention in (
        {"type": "add", "hook": hook, "vector": [1e300] + [0.0] * 63},
        {"type": "add", "hook": hook, "vector": [1.0] * 64, "coefficient": 1e300},
        {"type": "replace", "hook": hook, "vector": [3e38] * 64},  # finite in JSON, infinite in float32
    ):
        body = {
            "model_id": model.id,
            "prompt": "Hi",
            "max_tokens": 2,
            "mistudio": {"interventions": [intervention]},
        }
        response = api.post("/api/generate", body, format="json")
        assert refused(response, 400, "INVALID_INTERVENTION")["details"]["intervention"] == 0


def test_an_unmatched_api_path_is_a_json_404_for_any_method_even_signed_in_by_session(writer):
    from django.test import Client

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(writer)
    for method in ("post", "put", "patch", "delete", "get"):
        for path in ("/api/no-such-thing", "/v1/no-such-thing"):
            response = getattr(browser, method)(path)
            assert response.status_code == 404, (method, path, response.content[:100])
            assert response["Content-Type"].startswith("application/json"), (method, path)
