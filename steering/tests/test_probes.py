"""Activation patching and the logit lens through the API, answered by a real worker holding the
model (the request waits in a thread while a burst worker answers); the numbers equal the engine's
functions run here on the same weights (those are checked against transformers in engine/tests)."""

import pytest
import torch

from engine.patching import logit_lens, patching_grid
from engine.registry import LOADED_MODELS
from models_app.services import model_register
from models_app.tests.burst_worker import answered as answered_by
from models_app.tests.burst_worker import load_on_burst_worker
from steering.tasks import PATCHING_MIN_SPREAD

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "probe-worker"


@pytest.fixture
def loaded_model(tiny_gpt2_folder, writer):
    return load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)


def answered(api, path: str, body: dict):
    return answered_by(api, path, body, worker=WORKER)


def test_patching_and_logit_lens_through_the_api(loaded_model, writer, client_for):
    api = client_for(writer)
    loaded = LOADED_MODELS.get(loaded_model.id)
    tokenizer = loaded.tokenizer
    clean, corrupted = "The cat sat on the mat", "The dog sat on the mat"
    clean_ids = tokenizer(clean).input_ids
    corrupted_ids = tokenizer(corrupted).input_ids
    assert len(clean_ids) == len(corrupted_ids)
    answer, wrong = tokenizer.decode([clean_ids[1]]), tokenizer.decode([corrupted_ids[1]])
    body = {"clean": clean, "corrupted": corrupted, "answer": answer, "wrong_answer": wrong}

    response = answered(api, f"/api/models/{loaded_model.id}/patching", body)
    assert response.status_code == 200, response.content
    result = response.json()
    hooks = [f"blocks.{layer}.hook_resid_pre" for layer in range(loaded_model.num_layers)]
    reference = patching_grid(
        loaded.model, clean_ids, corrupted_ids, answer_id=clean_ids[1], wrong_id=corrupted_ids[1], hooks=hooks
    )
    assert result["hooks"] == hooks and len(result["tokens"]) == len(clean_ids)
    assert result["clean_metric"] == pytest.approx(reference.clean_metric, abs=1e-5)
    assert torch.allclose(torch.tensor(result["grid"]), torch.tensor(reference.grid), atol=1e-5)
    spread = reference.clean_metric - reference.corrupted_metric
    expected = (reference.grid[0][1] - reference.corrupted_metric) / spread
    assert result["normalized"][0][1] == pytest.approx(expected, abs=1e-4)
    # A warning when clean and corrupted barely differ (before, 1.972 was shown with none).
    assert (result["warning"] is None) == (abs(spread) >= PATCHING_MIN_SPREAD)
    same = answered(api, f"/api/models/{loaded_model.id}/patching", {**body, "corrupted": clean}).json()
    assert same["clean_metric"] == same["corrupted_metric"] and "barely changes the answer" in same["warning"]

    # Refusals come back from the worker with their codes.
    for changes, code in [
        ({"corrupted": clean + " and more"}, "PROMPT_LENGTHS_DIFFER"),
        ({"answer": answer + " and more words"}, "ANSWER_NOT_ONE_TOKEN"),
    ]:
        refused = answered(api, f"/api/models/{loaded_model.id}/patching", {**body, **changes})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == code, refused.content
    refused = api.post(
        f"/api/models/{loaded_model.id}/patching", {**body, "hooks": ["blocks.9.nope"]}, format="json"
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "INVALID_HOOK"

    response = answered(api, f"/api/models/{loaded_model.id}/logit-lens", {"prompt": clean, "top": 3})
    assert response.status_code == 200, response.content
    lens = response.json()
    expected = logit_lens(loaded.model, clean_ids, top=3)
    assert lens["layers"] == expected.layers and len(lens["tokens"]) == len(clean_ids)
    for layer, rows in zip(expected.top, lens["top"], strict=True):
        for want, got in zip(layer, rows, strict=True):
            assert [entry["token_id"] for entry in got] == [token for token, _ in want]
            assert [entry["probability"] for entry in got] == pytest.approx([p for _, p in want], abs=1e-5)


def test_a_model_that_is_not_loaded_is_a_409(tiny_gpt2_folder, writer, client_for):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="cold", owner=writer)
    response = client_for(writer).post(f"/api/models/{model.id}/logit-lens", {"prompt": "x"}, format="json")
    assert response.status_code == 409 and response.json()["error"]["code"] == "MODEL_NOT_LOADED"
