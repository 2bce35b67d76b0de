"""GGUF models: registered from their header, converted once by the worker, loaded as safetensors.

The files are tiny Q8_0 Llamas written here with the ``gguf`` package; the references are
transformers' own ``from_pretrained(gguf_file=...)`` of the same file.
"""

import io
import json

import pytest
import torch
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.management import call_command
from transformers import AutoModelForCausalLM, AutoTokenizer

from activations.selectors import model_folder
from engine.gguf import CONVERSION_MARKER, converted_folder_name, file_sha256
from engine.registry import LOADED_MODELS
from engine.testing.tiny_gguf import TOKENS, write_tiny_gguf
from mistudio.tests.websocket import events_socket, token_header
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.services import model_load_request, model_register, model_unload_request

WORKER = "pytest-gguf-worker"


def error_code(response) -> str:
    return response.json()["error"]["code"]


@pytest.fixture
def gguf_root():
    return settings.LOCAL_MODEL_ROOTS[0] / "gguf-tests"


@pytest.fixture
def tiny_gguf(gguf_root):
    path = gguf_root / "tiny" / "tiny-llama.gguf"
    if not path.exists():
        write_tiny_gguf(path, seed=0)
    return path


def transformers_gguf_model(path):
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.mark.django_db
def test_a_gguf_folder_registers_from_its_header(client_for, writer, tiny_gguf):
    api = client_for(writer)
    # The folder holds exactly one .gguf: the file is the model.
    response = api.post(
        "/api/models", {"source": "local", "model_identifier": str(tiny_gguf.parent)}, format="json"
    )
    assert response.status_code == 201, response.content
    row = LanguageModel.objects.get(pk=response.json()["id"])
    reference, _ = transformers_gguf_model(tiny_gguf)
    assert row.identifier == str(tiny_gguf.resolve())
    assert row.model_type == "llama" and row.architecture == "LlamaForCausalLM"
    assert (row.hidden_size, row.num_layers, row.vocab_size, row.context_length) == (64, 2, len(TOKENS), 128)
    assert row.parameter_count == reference.num_parameters()
    assert row.config["gguf"] == {"architecture": "llama", "file_type": "Q8_0", "tensor_count": 21}
    assert row.config["num_key_value_heads"] == reference.config.num_key_value_heads == 2
    # The float32 copy's size, as the safetensors path would estimate it.
    assert row.memory_estimates["none"] >= 4 * reference.num_parameters()


@pytest.mark.django_db
def test_gguf_registration_errors(client_for, writer, gguf_root, tiny_gguf, tmp_path):
    api = client_for(writer)

    def register(path):
        return api.post("/api/models", {"source": "local", "model_identifier": str(path)}, format="json")

    unsupported = write_tiny_gguf(gguf_root / "rwkv" / "model.gguf", architecture="rwkv6")
    response = register(unsupported)
    assert response.status_code == 400 and error_code(response) == "UNSUPPORTED_ARCHITECTURE"
    assert "rwkv6" in response.json()["error"]["message"]

    not_gguf = gguf_root / "fake" / "model.gguf"
    not_gguf.parent.mkdir(parents=True, exist_ok=True)
    not_gguf.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    response = register(not_gguf)
    assert response.status_code == 400 and error_code(response) == "INVALID_MODEL"

    truncated = gguf_root / "truncated" / "model.gguf"
    truncated.parent.mkdir(parents=True, exist_ok=True)
    truncated.write_bytes(tiny_gguf.read_bytes()[:2000])
    response = register(truncated)
    assert response.status_code == 400 and error_code(response) == "INVALID_MODEL"

    two = gguf_root / "two"
    two.mkdir(parents=True, exist_ok=True)
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(tiny_gguf.read_bytes())
    response = register(two)
    assert response.status_code == 400 and error_code(response) == "INVALID_MODEL"

    outside = tmp_path / "outside.gguf"
    outside.write_bytes(tiny_gguf.read_bytes())
    link = gguf_root / "link.gguf"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    response = register(link)
    assert response.status_code == 400 and error_code(response) == "INVALID_LOCAL_PATH"

    text_file = gguf_root / "notes.txt"
    text_file.write_text("not a model")
    response = register(text_file)
    assert response.status_code == 400 and error_code(response) == "INVALID_LOCAL_PATH"


def run_burst_worker() -> None:
    run_worker(name=WORKER, device="cpu", burst=True)


def load_and_wait(model, actor):
    model_load_request(model_id=model.id, actor=actor)
    run_burst_worker()
    model.refresh_from_db()
    return model


@pytest.mark.django_db(transaction=True)
def test_a_gguf_loads_through_one_conversion_and_matches_transformers(writer, tiny_gguf):
    model = model_register(source="local", identifier=str(tiny_gguf), owner=writer)
    assert model_folder(model) is None  # not converted yet
    try:
        model = load_and_wait(model, writer)
        assert model.status == "ready", (model.error_code, model.error_message)
        store = settings.MODEL_STORE_DIR / converted_folder_name(file_sha256(tiny_gguf))
        assert json.loads((store / CONVERSION_MARKER).read_text())["sha256"] == file_sha256(tiny_gguf)
        config = json.loads((store / "config.json").read_text())
        assert "quantization_config" not in config and config["model_type"] == "llama"
        assert not [entry for entry in settings.MODEL_STORE_DIR.iterdir() if entry.name.startswith(".")]
        weights_written = (store / "model.safetensors").stat().st_mtime_ns
        # The web process finds the copy (for the tokenizer) without hashing the file.
        assert model_folder(model) == store

        reference, reference_tokenizer = transformers_gguf_model(tiny_gguf)
        loaded = LOADED_MODELS.get(model.id)
        text = "w1 w7 abc w3"
        ids = reference_tokenizer(text, return_tensors="pt").input_ids
        assert torch.equal(loaded.tokenizer(text, return_tensors="pt").input_ids, ids)
        with torch.no_grad():
            expected = reference(ids).logits
            assert torch.equal(loaded.model(ids).logits, expected)

        model_unload_request(model_id=model.id)
        run_burst_worker()
        model = load_and_wait(model, writer)
        assert model.status == "ready"
        # Read from the converted copy: not written again.
        assert (store / "model.safetensors").stat().st_mtime_ns == weights_written
        with torch.no_grad():
            assert torch.equal(LOADED_MODELS.get(model.id).model(ids).logits, expected)
    finally:
        LOADED_MODELS.remove(model.id)


@pytest.mark.django_db(transaction=True)
def test_a_gguf_transformers_cannot_convert_fails_the_load_with_a_code(writer, gguf_root):
    # No tokenizer in the file: the header inspects fine, the conversion cannot build the model.
    path = write_tiny_gguf(gguf_root / "no-tokenizer" / "model.gguf", with_tokenizer=False)
    model = model_register(source="local", identifier=str(path), owner=writer, name="no-tokenizer")
    model = load_and_wait(model, writer)
    assert model.status == "failed" and model.error_code == "GGUF_CONVERSION_FAILED"
    assert not (settings.MODEL_STORE_DIR / converted_folder_name(file_sha256(path))).exists()
    assert not [entry for entry in settings.MODEL_STORE_DIR.iterdir() if entry.name.startswith(".")]


async def loading_stages(communicator) -> list[tuple[str, float]]:
    stages = []
    while True:
        message = await communicator.receive_json_from(timeout=60)
        if message["type"] != "event":
            continue
        if message["event"] == "model:loading":
            stages.append((message["data"]["stage"], message["data"]["progress"]))
        if message["event"] in {"model:ready", "model:failed"}:
            assert message["event"] == "model:ready", message
            return stages


@pytest.mark.django_db(transaction=True)
async def test_the_conversion_is_a_load_stage_with_progress_on_the_first_load_only(writer, gguf_root):
    path = gguf_root / "staged" / "model.gguf"
    await sync_to_async(write_tiny_gguf)(path, seed=3)
    model = await sync_to_async(model_register)(source="local", identifier=str(path), owner=writer)
    communicator = events_socket(token_header(writer))
    assert (await communicator.connect())[0]
    await communicator.send_json_to({"action": "subscribe", "groups": [f"model.{model.id}"]})
    await communicator.receive_json_from(timeout=5)  # the snapshot
    try:
        await sync_to_async(model_load_request)(model_id=model.id, actor=writer)
        await sync_to_async(run_burst_worker, thread_sensitive=False)()
        first = await loading_stages(communicator)
        converting = [progress for stage, progress in first if stage == "convert"]
        assert converting == sorted(converting) and len(converting) >= 3
        assert converting[0] == 5 and converting[-1] == 55
        assert [progress for _, progress in first] == sorted(progress for _, progress in first)

        await sync_to_async(model_unload_request)(model_id=model.id)
        await sync_to_async(run_burst_worker, thread_sensitive=False)()
        await sync_to_async(model_load_request)(model_id=model.id, actor=writer)
        await sync_to_async(run_burst_worker, thread_sensitive=False)()
        second = await loading_stages(communicator)
        assert "convert" not in {stage for stage, _ in second} and "weights" in {stage for stage, _ in second}
    finally:
        LOADED_MODELS.remove(model.id)
        await communicator.disconnect()


@pytest.mark.django_db
def test_add_model_registers_a_gguf_file(tiny_gguf):
    out = io.StringIO()
    call_command("add_model", "--path", str(tiny_gguf), stdout=out, stderr=io.StringIO())
    model = LanguageModel.objects.get(pk=out.getvalue().strip())
    assert model.identifier == str(tiny_gguf.resolve()) and model.config["gguf"]["file_type"] == "Q8_0"


@pytest.mark.django_db(transaction=True)
def test_the_converted_copy_loads_with_the_safetensors_quantization_options(writer, tiny_gguf):
    model = model_register(source="local", identifier=str(tiny_gguf), owner=writer, quantization="bf16")
    try:
        model = load_and_wait(model, writer)
        assert model.status == "ready", (model.error_code, model.error_message)
        reference = AutoModelForCausalLM.from_pretrained(
            str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.bfloat16
        ).eval()
        loaded = LOADED_MODELS.get(model.id).model
        assert next(loaded.parameters()).dtype == torch.bfloat16
        ids = torch.tensor([[1, 64, 70, 5, 9]])
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, reference(ids).logits)
    finally:
        LOADED_MODELS.remove(model.id)
