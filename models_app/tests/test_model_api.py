"""The models REST API: every status code and error body, on real tiny models."""

import json

import pytest
from django.conf import settings

from mistudio.workers import shared_queue, worker_queue
from models_app.models import LanguageModel

pytestmark = pytest.mark.django_db


def error_code(response) -> str:
    body = response.json()
    assert set(body["error"]) == {"code", "message", "details", "timestamp"}
    return body["error"]["code"]


@pytest.fixture
def writer_api(writer, client_for):
    return client_for(writer)


@pytest.fixture
def reader_api(reader, client_for):
    return client_for(reader)


@pytest.fixture
def registered(writer_api, tiny_gpt2_folder):
    response = writer_api.post(
        "/api/models",
        # Shared, so that the reader in these tests sees it (ownership: mistudio/tests/test_permissions.py).
        {"source": "local", "model_identifier": str(tiny_gpt2_folder), "name": "tiny", "shared": True},
        format="json",
    )
    assert response.status_code == 201, response.content
    return response.json()


def local_folder(name: str, config: dict, files: dict[str, bytes]):
    folder = settings.LOCAL_MODEL_ROOTS[0] / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for file_name, content in files.items():
        (folder / file_name).write_bytes(content)
    return folder


def test_register_a_local_model(registered, tiny_gpt2_folder):
    assert registered["id"].startswith("m_") and registered["status"] == "pending"
    assert registered["model_type"] == "gpt2" and registered["source"] == "local"
    assert registered["parameter_count"] > 0 and registered["num_layers"] >= 1
    assert set(registered["memory_estimates"]) >= {"none", "fp16", "bf16"}
    assert registered["memory_estimates"]["fp16"] < registered["memory_estimates"]["none"]


def test_registering_the_same_model_twice_is_409(writer_api, registered, tiny_gpt2_folder):
    response = writer_api.post(
        "/api/models", {"source": "local", "model_identifier": str(tiny_gpt2_folder)}, format="json"
    )
    assert response.status_code == 409 and error_code(response) == "MODEL_ALREADY_REGISTERED"
    assert response.json()["error"]["details"]["model_id"] == registered["id"]


@pytest.mark.parametrize(
    "identifier",
    [
        "relative/path",
        "/etc",
        "{root}/../../..",
        "{root}/%2e%2e/%2e%2e/etc",
        "{root}/tiny-gpt2\x00",
        "{root}/does-not-exist",
        "file://{root}/tiny-gpt2",
    ],
)
def test_local_paths_outside_the_roots_are_400(writer_api, identifier, tiny_gpt2_folder):
    identifier = identifier.format(root=settings.LOCAL_MODEL_ROOTS[0])
    response = writer_api.post(
        "/api/models", {"source": "local", "model_identifier": identifier}, format="json"
    )
    assert response.status_code == 400
    assert error_code(response) in {
        "INVALID_LOCAL_PATH",
        "VALIDATION_ERROR",
    }  # NUL is refused by the serializer
    assert str(settings.LOCAL_MODEL_ROOTS[0]) not in response.content.decode()  # no server path echoed


def test_a_symlink_out_of_the_roots_is_400(writer_api, tmp_path, tiny_gpt2_folder):
    import shutil

    outside = tmp_path / "outside"
    shutil.copytree(tiny_gpt2_folder, outside)
    link = settings.LOCAL_MODEL_ROOTS[0] / "link-out"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    response = writer_api.post(
        "/api/models", {"source": "local", "model_identifier": str(link)}, format="json"
    )
    link.unlink()
    assert response.status_code == 400 and error_code(response) == "INVALID_LOCAL_PATH"


@pytest.mark.parametrize(
    "linked",
    ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors", "generation_config.json"],
)
def test_a_file_linked_out_of_the_roots_is_400_at_registration(writer_api, model_copy, linked, tmp_path):
    folder = model_copy("linked-out", {linked: "outside"})
    response = writer_api.post(
        "/api/models", {"source": "local", "model_identifier": str(folder)}, format="json"
    )
    assert response.status_code == 400 and error_code(response) == "UNSAFE_PATH", response.content
    assert response.json()["error"]["details"] == {"file": linked}
    assert linked in response.json()["error"]["message"]
    assert (
        str(folder.parent) not in response.content.decode() and str(tmp_path) not in response.content.decode()
    )
    assert not LanguageModel.objects.exists()


def test_files_linked_inside_the_root_are_fine(writer_api, model_copy):
    folder = model_copy("linked-in", {"config.json": "inside", "model.safetensors": "inside"})
    response = writer_api.post(
        "/api/models", {"source": "local", "model_identifier": str(folder)}, format="json"
    )
    assert response.status_code == 201, response.content
    assert response.json()["model_type"] == "gpt2" and response.json()["parameter_count"] > 0


def test_a_hub_id_that_matches_a_local_folder_is_still_a_hub_id(writer_api, tiny_gpt2_folder, monkeypatch):
    monkeypatch.chdir(settings.LOCAL_MODEL_ROOTS[0])  # "tiny-gpt2" now also names a local folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    response = writer_api.post("/api/models", {"model_identifier": "tiny-gpt2"}, format="json")
    assert response.status_code == 503 and error_code(response) == "HUB_OFFLINE"


@pytest.mark.parametrize("identifier", ["../x", "a/b/c", "a b", "/abs/path", "x" * 200])
def test_invalid_hub_ids_are_400(writer_api, identifier):
    response = writer_api.post("/api/models", {"model_identifier": identifier}, format="json")
    assert response.status_code == 400 and error_code(response) == "INVALID_MODEL_ID"


def test_pickle_only_weights_are_refused(writer_api):
    folder = local_folder("pickle-only", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
                          {"pytorch_model.bin": b"\x80\x04never unpickled"})  # fmt: skip
    response = writer_api.post(
        "/api/models", {"source": "local", "model_identifier": str(folder)}, format="json"
    )
    assert response.status_code == 400 and error_code(response) == "UNSAFE_WEIGHTS"


def test_custom_code_configs_are_refused(writer_api, tiny_gpt2_folder):
    config = json.loads((tiny_gpt2_folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    folder = local_folder("custom-code", config, {
        "model.safetensors": (tiny_gpt2_folder / "model.safetensors").read_bytes(),
        "modeling_evil.py": b"raise SystemExit('never imported')",
    })  # fmt: skip
    response = writer_api.post(
        "/api/models", {"source": "local", "model_identifier": str(folder)}, format="json"
    )
    assert response.status_code == 400 and error_code(response) == "REMOTE_CODE_NOT_ALLOWED"


def test_unsupported_architectures_are_refused_with_the_supported_list(writer_api, tiny_gpt2_folder):
    config = json.loads((tiny_gpt2_folder / "config.json").read_text())
    config.update(model_type="t5", architectures=["T5ForConditionalGeneration"])
    folder = local_folder("t5-like", config, {
        "model.safetensors": (tiny_gpt2_folder / "model.safetensors").read_bytes()
    })  # fmt: skip
    response = writer_api.post(
        "/api/models", {"source": "local", "model_identifier": str(folder)}, format="json"
    )
    assert response.status_code == 400 and error_code(response) == "UNSUPPORTED_ARCHITECTURE"
    assert {"gpt2", "llama", "bert"} <= set(response.json()["error"]["details"]["supported"])


def test_model_type_must_match_the_config(writer_api, tiny_gpt2_folder):
    response = writer_api.post(
        "/api/models",
        {"source": "local", "model_identifier": str(tiny_gpt2_folder), "model_type": "llama"},
        format="json",
    )
    assert response.status_code == 400 and error_code(response) == "VALIDATION_ERROR"
    assert "model_type" in response.json()["error"]["details"]["fields"]


def test_bad_fields_are_named(writer_api):
    bad = {"model_identifier": "", "quantization": "int3", "keep_alive_seconds": -1, "status": "ready"}
    response = writer_api.post("/api/models", bad, format="json")
    assert response.status_code == 400 and error_code(response) == "VALIDATION_ERROR"
    assert {"model_identifier", "quantization", "keep_alive_seconds"} <= set(
        response.json()["error"]["details"]["fields"]
    )


def test_read_only_fields_cannot_be_written(writer_api, registered):
    response = writer_api.patch(
        f"/api/models/{registered['id']}", {"status": "ready", "host_worker": "x"}, format="json"
    )
    assert response.status_code == 400 and error_code(response) == "VALIDATION_ERROR"
    assert LanguageModel.objects.get(pk=registered["id"]).status == "pending"


def test_list_filters_search_and_pagination(writer_api, registered, reader_api):
    assert reader_api.get("/api/models").json()["total"] == 1
    assert reader_api.get("/api/models", {"status": "ready"}).json()["total"] == 0
    assert reader_api.get("/api/models", {"model_type": "gpt2", "source": "local"}).json()["total"] == 1
    assert reader_api.get("/api/models", {"search": "TINY"}).json()["models"][0]["id"] == registered["id"]
    assert reader_api.get("/api/models", {"search": "nothing-like-it"}).json()["total"] == 0
    page = reader_api.get("/api/models", {"limit": 1, "offset": 1}).json()
    assert page == {"models": [], "total": 1, "limit": 1, "offset": 1}
    response = reader_api.get("/api/models", {"limit": 501})
    assert response.status_code == 400 and "limit" in response.json()["error"]["details"]["fields"]


def test_patch_name_pin_and_keep_alive(writer_api, registered):
    response = writer_api.patch(
        f"/api/models/{registered['id']}",
        {"name": "renamed", "pinned": True, "keep_alive_seconds": 600},
        format="json",
    )
    assert response.status_code == 200
    assert (response.json()["name"], response.json()["pinned"], response.json()["keep_alive_seconds"]) == (
        "renamed", True, 600,
    )  # fmt: skip


def test_quantization_cannot_change_while_loading(writer_api, registered):
    writer_api.post(f"/api/models/{registered['id']}/load", {}, format="json")
    response = writer_api.patch(f"/api/models/{registered['id']}", {"quantization": "bf16"}, format="json")
    assert response.status_code == 409 and error_code(response) == "MODEL_BUSY"


def test_load_is_202_with_a_job_id_and_a_second_load_is_409(
    writer_api, registered, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        response = writer_api.post(
            f"/api/models/{registered['id']}/load", {"quantization": "bf16"}, format="json"
        )
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "loading" and body["job_id"].startswith(f"load-{registered['id']}")
    assert body["quantization"] == "bf16"
    assert body["job_id"] in shared_queue().job_ids
    again = writer_api.post(f"/api/models/{registered['id']}/load", {}, format="json")
    assert again.status_code == 409 and error_code(again) == "ALREADY_LOADING"


def test_cancelling_a_queued_load_fails_it_at_once(
    writer_api, registered, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        job_id = writer_api.post(f"/api/models/{registered['id']}/load", {}, format="json").json()["job_id"]
    response = writer_api.post(f"/api/models/{registered['id']}/cancel", {}, format="json")
    assert response.status_code == 202
    model = LanguageModel.objects.get(pk=registered["id"])
    assert model.status == "failed" and model.error_code == "LOAD_CANCELLED"
    assert job_id not in shared_queue().job_ids
    again = writer_api.post(f"/api/models/{registered['id']}/cancel", {}, format="json")
    assert again.status_code == 409 and error_code(again) == "NOT_LOADING"


def test_unload_of_a_model_that_is_not_loaded_is_409(writer_api, registered):
    response = writer_api.post(f"/api/models/{registered['id']}/unload", {}, format="json")
    assert response.status_code == 409 and error_code(response) == "MODEL_NOT_LOADED"


def test_delete_is_204_and_a_loaded_model_is_unloaded_on_its_host(
    writer_api, registered, django_capture_on_commit_callbacks
):
    model = LanguageModel.objects.get(pk=registered["id"])
    model.save(
        update_fields=model.mark_ready(host_worker="host-a", memory_usage_bytes=1, load_time_seconds=1)
    )
    with django_capture_on_commit_callbacks(execute=True):
        response = writer_api.delete(f"/api/models/{model.id}")
    assert response.status_code == 204
    assert not LanguageModel.objects.filter(pk=model.id).exists()
    queue = worker_queue("host-a")
    job = queue.jobs[-1]
    assert job.func_name == "models_app.tasks.unload_model" and job.args == (model.id,)
    assert job.kwargs == {"reason": "deleted"}
    queue.empty()
    assert writer_api.get(f"/api/models/{model.id}").status_code == 404


def test_memory_estimate(reader_api, registered):
    response = reader_api.get(f"/api/models/{registered['id']}/memory-estimate")
    assert response.status_code == 200
    body = response.json()
    assert body["estimates"]["none"]["bytes"] == registered["memory_estimates"]["none"]
    assert body["parameter_count"] == registered["parameter_count"]


@pytest.mark.parametrize(
    ("method", "suffix"),
    [("post", ""), ("patch", "/{id}"), ("delete", "/{id}"), ("post", "/{id}/load"), ("post", "/{id}/cancel")],
)
def test_readers_cannot_change_anything(reader_api, registered, method, suffix):
    response = getattr(reader_api, method)(
        "/api/models" + suffix.format(id=registered["id"]), {}, format="json"
    )
    assert response.status_code == 403 and error_code(response) == "PERMISSION_DENIED"


def test_unknown_model_is_404_on_every_route(writer_api):
    for method, path in [("get", ""), ("patch", ""), ("delete", ""), ("post", "/load"), ("post", "/unload"),
                         ("post", "/cancel"), ("get", "/memory-estimate")]:  # fmt: skip
        response = getattr(writer_api, method)(f"/api/models/m_nosuchmodel{path}", {}, format="json")
        assert response.status_code == 404 and error_code(response) == "MODEL_NOT_FOUND", (method, path)


def test_swagger_ui_is_served_without_a_cdn(writer, client):
    client.force_login(writer)
    page = client.get("/docs/api/").content.decode()
    assert "swagger-ui" in page and "cdn" not in page.lower()
