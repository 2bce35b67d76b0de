"""`manage.py bootstrap_demo`: a trained demo model and dataset, registered once."""

import json

import pytest
from django.conf import settings
from django.core.management import call_command
from transformers import AutoModelForCausalLM

from activations.models import Dataset
from models_app.models import LanguageModel

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


def test_bootstrap_demo_trains_registers_and_reuses():
    call_command("bootstrap_demo", training_seconds=6)
    model = LanguageModel.objects.get(name="demo-gpt2")
    dataset = Dataset.objects.get(name="demo-docstrings")
    folder = settings.LOCAL_MODEL_ROOTS[0] / "demo-gpt2"
    report = json.loads((folder / "training_report.json").read_text())
    assert report["final_loss"] < report["initial_loss"]
    weights = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True)
    assert model.model_type == "gpt2" and model.parameter_count == weights.num_parameters()
    assert dataset.sample_count > 100
    assert dataset.storage_path.read_text().count("\n") == dataset.sample_count
    topics = Dataset.objects.get(name="demo-docstring-topics")  # sparse probing's
    assert topics.label_field == "topic"
    assert topics.classes == {
        "networking": 250,
        "concurrency": 250,
        "files": 250,
        "text": 250,
        "numbers": 250,
    }

    call_command("bootstrap_demo", training_seconds=6)
    assert LanguageModel.objects.filter(name="demo-gpt2").count() == 1
    assert Dataset.objects.filter(name="demo-docstrings").count() == 1
    assert Dataset.objects.filter(name="demo-docstring-topics").count() == 1
    assert json.loads((folder / "training_report.json").read_text()) == report  # not retrained
