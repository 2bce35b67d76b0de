"""A worker run with ``--device auto`` and a tight ``--max-memory``: the load spills to disk instead
of failing, the row says where the model sits, and an extraction through the API equals
transformers' hidden states of the whole model."""

import numpy as np
import pytest
import torch
from django.core.management import CommandError, call_command
from transformers import AutoModelForCausalLM, AutoTokenizer

from activations.models import Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from activations.store import ActivationStore
from mistudio.workers import WorkerIdentity, heartbeat_payload, run_worker
from models_app.models import LanguageModel
from models_app.services import model_register

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "split-worker"
HOOKS = ["blocks.0.hook_resid_post", "ln_final.hook_normalized"]  # ln_final sits on disk
TEXTS = ["The function returns the value.", "Short.", "A longer sample that needs padding in its batch."]


def test_a_tight_budget_loads_the_model_split_to_disk_and_extracts_the_same_values(
    tiny_llama_folder, writer, client_for
):
    model = model_register(source="local", identifier=str(tiny_llama_folder), name="llama", owner=writer)
    budget = int(0.9 * model.memory_estimates["none"])  # less than the model: no eviction can help
    dataset = dataset_create_from_texts(name="texts", texts=TEXTS, owner=None, source=Dataset.Source.BUILTIN)
    api = client_for(writer)
    response = api.post(
        f"/api/models/{model.id}/extract-activations",
        {"dataset_id": dataset.id, "hooks": HOOKS, "batch_size": 2, "max_length": 16},
        format="json",
    )
    assert response.status_code == 202, response.content

    run_worker(name=WORKER, device="auto", max_memory={"cpu": budget}, burst=True)

    model.refresh_from_db()
    assert model.status == LanguageModel.Status.READY, (model.error_code, model.error_message)
    placed = model.memory_by_device
    assert placed["cpu"] > 0 and placed["disk"] > 0
    assert model.memory_usage_bytes == placed["cpu"] <= budget
    assert api.get(f"/api/models/{model.id}").json()["memory_by_device"] == placed

    job = ExtractionJob.objects.get(pk=response.json()["extraction_id"])
    assert job.status == "completed", (job.error_code, job.error_message)
    store = ActivationStore.open(job.cache.directory)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_folder)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_folder, use_safetensors=True).eval()
    for index, text in enumerate(TEXTS):
        ids = tokenizer(text, truncation=True, max_length=16)["input_ids"]
        with torch.no_grad():
            hidden = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert store.sample_tokens(index)[0].tolist() == ids
        np.testing.assert_allclose(store.sample(HOOKS[0], index), hidden[1][0].numpy(), atol=1e-5)
        np.testing.assert_allclose(store.sample(HOOKS[1], index), hidden[-1][0].numpy(), atol=1e-5)


def test_the_heartbeat_describes_a_split_placement():
    identity = WorkerIdentity(name=WORKER, device="auto", max_memory=(("cpu", 3 * 2**30),))
    assert identity.compute_device == "cpu"
    beat = heartbeat_payload(identity, started_at=0)
    assert beat["device"] == "auto"
    assert beat["placement"] == "auto (cpu=3GiB, rest on disk)"
    assert 0 < beat["memory_free_bytes"] <= beat["memory_total_bytes"] <= 3 * 2**30


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--device", "cpu", "--max-memory", "cpu=1GiB"], "auto only"),
        (["--device", "auto", "--max-memory", "cpu=lots"], "as a size"),
        (["--device", "tpu"], "cpu, cuda:N or auto"),
    ],
)
def test_bad_placement_options_stop_the_worker_command_with_a_message(arguments, message):
    with pytest.raises(CommandError, match=message):
        call_command("worker", "--burst", *arguments)
