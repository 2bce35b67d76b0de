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
