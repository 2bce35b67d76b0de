"""Steering vectors: computed by the real job (a burst worker over the tiny GPT-2), checked against
transformers' ``output_hidden_states``; exported, imported, used by an ``add`` intervention."""

import io
import json

import pytest
import torch
from safetensors.torch import load, save
from transformers import AutoModelForCausalLM, AutoTokenizer

from activations.services import dataset_create_from_texts
from conftest import make_user
from generation.interventions import interventions_request, resolved_interventions
from generation.services import hook_widths
from mistudio.workers import run_worker
from models_app.services import model_register
from steering.models import SteeringVector
from steering.services import MAX_PROMPT_BYTES, MAX_PROMPT_CHARACTERS, MAX_PROMPTS

pytestmark = pytest.mark.django_db(transaction=True)

HOOK = "blocks.0.hook_resid_post"
POSITIVE = ["I love this, it is wonderful", "What a great and happy day", "Joy and delight everywhere"]
NEGATIVE = ["I hate this, it is awful", "What a terrible and sad day"]


@pytest.fixture
def tiny_model(tiny_gpt2_folder, writer):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)


def reference(folder, prompts, *, last_only: bool) -> torch.Tensor:
    """Mean of block 0's output over the prompts' tokens (or last tokens), by transformers."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=True).input_ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
        rows.append(hidden[-1:] if last_only else hidden)
    return torch.cat(rows).double().mean(dim=0).float()


def test_contrastive_vectors_equal_the_difference_of_means(tiny_model, tiny_gpt2_folder, writer, client_for):
    api = client_for(writer)
    made = {}
    for reduction in ("mean", "last"):
        body = {
            "model_id": tiny_model.id, "hook_name": HOOK, "positive": POSITIVE, "negative": NEGATIVE,
            "reduction": reduction, "name": f"joy ({reduction})",
        }  # fmt: skip
        response = api.post("/api/steering-vectors", body, format="json")
        assert response.status_code == 202, response.content
        assert response.json()["status"] == "queued"
        made[reduction] = response.json()["id"]
    # The same prompts given as two datasets.
    positive, negative = (
        dataset_create_from_texts(name=name, texts=texts, owner=writer, source="upload")
        for name, texts in (("joy", POSITIVE), ("gloom", NEGATIVE))
    )
    body = {
        "model_id": tiny_model.id, "hook_name": HOOK, "positive_dataset_id": positive.id,
        "negative_dataset_id": negative.id,
    }  # fmt: skip
    response = api.post("/api/steering-vectors", body, format="json")
    assert response.status_code == 202, response.content
    from_datasets = response.json()["id"]
    both = api.post("/api/steering-vectors", {**body, "positive": POSITIVE}, format="json")
    assert both.status_code == 400 and both.json()["error"]["code"] == "INVALID_PROMPTS"
    run_worker(name="steering-worker", device="cpu", burst=True)

    for reduction, vector_id in made.items():
        detail = api.get(f"/api/steering-vectors/{vector_id}").json()
        assert detail["status"] == "completed", detail
        exported = api.get(f"/api/steering-vectors/{vector_id}/export")
        assert exported.status_code == 200
        values = load(exported.content)["vector"]
        last_only = reduction == "last"
        expected = reference(tiny_gpt2_folder, POSITIVE, last_only=last_only) - reference(
            tiny_gpt2_folder, NEGATIVE, last_only=last_only
        )
        torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
        assert detail["width"] == 64 and detail["norm"] == pytest.approx(float(expected.norm()), rel=1e-5)
    assert api.get("/api/steering-vectors").json()["total"] == 3
    same = [
        load(api.get(f"/api/steering-vectors/{key}/export").content)["vector"]
        for key in (made["mean"], from_datasets)
    ]
    torch.testing.assert_close(same[0], same[1], atol=1e-6, rtol=0)

    # An add intervention names the vector by id: its hook and values come from the row.
    raw = [{"type": "add", "steering_vector": made["mean"], "coefficient": 2.0}]
    spec = interventions_request(raw, widths=hook_widths(tiny_model, raw), user=writer)
    assert spec[0]["hook"] == HOOK and spec[0]["steering_vector"] == made["mean"]
    (intervention,) = resolved_interventions(spec)
    stored = load(api.get(f"/api/steering-vectors/{made['mean']}/export").content)["vector"]
    assert torch.equal(intervention.vector, stored) and intervention.coefficient == 2.0


def test_import_export_and_refusals(tiny_model, writer, reader, client_for):
    api = client_for(writer)

    def upload(tensors: dict, hook=HOOK):
        file = io.BytesIO(save(tensors))
        file.name = "vector.safetensors"
        return api.post(
            "/api/steering-vectors/import",
            {"file": file, "model_id": tiny_model.id, "hook_name": hook, "name": "imported"},
            format="multipart",
        )

    values = torch.linspace(-1, 1, 64)
    response = upload({"vector": values})
    assert response.status_code == 201, response.content
    vector = SteeringVector.objects.get(pk=response.json()["id"])
    assert vector.source == "imported" and vector.width == 64
    assert torch.equal(load(api.get(f"/api/steering-vectors/{vector.id}/export").content)["vector"], values)

    for tensors in (
        {"vector": torch.ones(63)},
        {"vector": torch.full((64,), float("nan"))},
        {"a": torch.ones(64), "b": torch.ones(64)},
    ):
        refused = upload(tensors)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "INVALID_VECTOR"
    assert upload({"vector": values}, hook="blocks.9.hook_nothing").status_code == 400
    not_safetensors = io.BytesIO(b"\x80\x04pickle")
    not_safetensors.name = "vector.pt"
    refused = api.post(
        "/api/steering-vectors/import",
        {"file": not_safetensors, "model_id": tiny_model.id, "hook_name": HOOK},
        format="multipart",
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "INVALID_VECTOR"
    assert SteeringVector.objects.count() == 1

    # Private to its owner: another user's request cannot name it.
    other = client_for(reader)
    assert other.get(f"/api/steering-vectors/{vector.id}").status_code == 404
    body = {
        "model_id": tiny_model.id, "prompt": "x",
        "mistudio": {"interventions": [{"type": "add", "steering_vector": "sv_nope"}]},
    }  # fmt: skip
    response = api.post("/api/generate", json.dumps(body), content_type="application/json")
    assert response.status_code == 404 and response.json()["error"]["code"] == "STEERING_VECTOR_NOT_FOUND"

    # Rename, share, delete: the file goes with the row.
    assert api.patch(f"/api/steering-vectors/{vector.id}", {"shared": True}, format="json").status_code == 200
    assert other.get(f"/api/steering-vectors/{vector.id}").status_code == 200
    path = vector.path
    assert api.delete(f"/api/steering-vectors/{vector.id}").status_code == 204
    assert not path.exists() and not SteeringVector.objects.exists()


def test_the_steering_vector_command(tiny_model, tmp_path):
    import threading

    from django.core.management import call_command

    from models_app.tests.live_stack import wait_until

    out = io.StringIO()
    prompts = tmp_path / "negative.txt"
    prompts.write_text("\n".join(NEGATIVE) + "\n\n")
    command = threading.Thread(
        target=call_command,
        args=("steering_vector", "create", tiny_model.name, HOOK, "--positive", POSITIVE[0]),
        kwargs={
            "negative": [f"@{prompts}"],
            "name": "cli",
            "stdout": out,
            "stderr": (status := io.StringIO()),
        },
    )
    command.start()
    wait_until(lambda: SteeringVector.objects.exists(), timeout=30, what="the queued vector")
    run_worker(name="steering-cli-worker", device="cpu", burst=True)
    command.join(timeout=60)
    vector = SteeringVector.objects.get()
    assert vector.status == "completed" and vector.negative == NEGATIVE and vector.positive == POSITIVE[:1]
    assert out.getvalue().startswith(f"{vector.id}  cli  {HOOK} [64]  norm ")
    assert out.getvalue().count("\n") == 1 and vector.id not in status.getvalue()  # its line, once

    target = tmp_path / "out.safetensors"
    call_command("steering_vector", "export", vector.id, str(target), stdout=io.StringIO())
    imported = io.StringIO()
    call_command(
        "steering_vector", "import", tiny_model.id, HOOK, str(target), "--name", "again", stdout=imported
    )
    listing = io.StringIO()
    call_command("steering_vector", "list", stdout=listing)
    assert listing.getvalue().count(f"{HOOK} [64]") == 2 and "again" in listing.getvalue()
    again = SteeringVector.objects.get(name="again")
    assert torch.equal(load(again.path.read_bytes())["vector"], load(target.read_bytes())["vector"])


# --- bounded rows: prompts by the byte, datasets by reference, cancel -----------------------------


def vector_body(model, **sides) -> dict:
    return {"model_id": model.id, "hook_name": HOOK, **sides}


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"code", "message", "details", "timestamp"} and error["code"] == code, error
    return error


def test_prompts_over_the_byte_limit_are_refused(tiny_model, writer, client_for):
    # 40 prompts of 4,000 two-byte characters: within the count and length limits, and 160,000
    # characters in all (under 256 Ki), but 320,000 bytes of UTF-8: over MAX_PROMPT_BYTES.
    positive = ["é" * MAX_PROMPT_CHARACTERS] * 40
    assert len(positive) <= MAX_PROMPTS and sum(map(len, positive)) < MAX_PROMPT_BYTES
    assert sum(len(prompt.encode()) for prompt in positive) > MAX_PROMPT_BYTES
    response = client_for(writer).post(
        "/api/steering-vectors", vector_body(tiny_model, positive=positive, negative=NEGATIVE), format="json"
    )
    error = assert_error(response, 400, "INVALID_PROMPTS")
    assert "positive" in error["details"]["fields"]
    assert not SteeringVector.objects.exists()


def test_a_vector_from_datasets_stores_no_prompts_in_its_row(tiny_model, writer, client_for):
    long_texts = [f"{index} " + "joy " * 990 for index in range(8)]  # ~4,000 characters each
    positive, negative = (
        dataset_create_from_texts(name=name, texts=texts, owner=writer, source="upload")
        for name, texts in (("joy", long_texts), ("gloom", NEGATIVE))
    )
    api = client_for(writer)
    body = vector_body(tiny_model, positive_dataset_id=positive.id, negative_dataset_id=negative.id)
    response = api.post("/api/steering-vectors", body, format="json")
    assert response.status_code == 202, response.content
    vector = SteeringVector.objects.get(pk=response.json()["id"])
    assert vector.positive == [] and vector.negative == []  # referenced, not copied into the row
    assert (vector.positive_dataset_id, vector.negative_dataset_id) == (positive.id, negative.id)

    detail = api.get(f"/api/steering-vectors/{vector.id}").json()
    assert detail["positive_dataset_id"] == positive.id and detail["negative_dataset_id"] == negative.id
    listing = api.get("/api/steering-vectors").json()
    assert listing["total"] == 1
    (row,) = listing["vectors"]
    assert row["id"] == vector.id and "positive" not in row and "negative" not in row

    # Another user's private dataset cannot be named.
    other = make_user("otto-other", "model:write")
    private = dataset_create_from_texts(name="private", texts=POSITIVE, owner=other, source="upload")
    response = api.post(
        "/api/steering-vectors",
        vector_body(tiny_model, positive_dataset_id=private.id, negative=NEGATIVE),
        format="json",
    )
    assert_error(response, 404, "DATASET_NOT_FOUND")
    assert SteeringVector.objects.count() == 1


def test_cancel_a_queued_vector(tiny_model, writer, client_for):
    api = client_for(writer)
    response = api.post(
        "/api/steering-vectors", vector_body(tiny_model, positive=POSITIVE, negative=NEGATIVE), format="json"
    )
    assert response.status_code == 202, response.content
    vector_id = response.json()["id"]
    cancelled = api.post(f"/api/steering-vectors/{vector_id}/cancel")
    assert cancelled.status_code == 202, cancelled.content
    assert cancelled.json()["status"] == "cancelled"
    assert SteeringVector.objects.get(pk=vector_id).status == "cancelled"
    assert_error(api.post(f"/api/steering-vectors/{vector_id}/cancel"), 409, "NOT_RUNNING")
    run_worker(name="steering-worker", device="cpu", burst=True)  # its token runs nothing
    assert SteeringVector.objects.get(pk=vector_id).status == "cancelled"
