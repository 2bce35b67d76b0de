"""The model commands, run as researchers run them, against a real worker process."""

import io
import json
import subprocess
import sys

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command

from models_app.models import LanguageModel

pytestmark = pytest.mark.django_db(transaction=True)


def run(*arguments: str) -> str:
    out = io.StringIO()
    call_command(*arguments, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_add_list_and_inspect_a_local_model(tiny_gpt2_folder):
    model_id = run("add_model", "--path", str(tiny_gpt2_folder), "--name", "tiny-cli", "--pin").strip()
    model = LanguageModel.objects.get(pk=model_id)
    assert model.name == "tiny-cli" and model.pinned and model.status == "pending"

    table = run("list_models")
    assert "tiny-cli" in table and model_id in table and "pending (pinned)" in table
    assert "tiny-cli" not in run("list_models", "--status", "ready")

    report = json.loads(run("inspect_model", "tiny-cli", "--json"))
    assert report["parameter_count"] == model.parameter_count and report["model_type"] == "gpt2"
    assert report["memory_estimates"] == model.memory_estimates
    text = run("inspect_model", "--path", str(tiny_gpt2_folder))
    assert "parameter_count" in text and "int8" in text


def test_add_model_explains_a_refusal():
    with pytest.raises(CommandError, match="INVALID_LOCAL_PATH"):
        run("add_model", "--path", "/etc")
    with pytest.raises(CommandError, match="INVALID_MODEL_ID"):
        run("add_model", "--hub-id", "../../etc/passwd")


@pytest.mark.slow
def test_load_waits_for_a_real_worker_then_unload(tiny_gpt2_folder, process_env):
    model_id = run("add_model", "--path", str(tiny_gpt2_folder), "--name", "tiny-load").strip()
    worker = subprocess.Popen(
        [sys.executable, "manage.py", "worker", "--name", "cli-worker"],
        cwd=settings.BASE_DIR, env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        output = run("load_model", "tiny-load", "--quantization", "bf16", "--timeout", "120")
        assert "ready on cli-worker" in output
        model = LanguageModel.objects.get(pk=model_id)
        assert model.status == "ready" and model.quantization == "bf16"
        with pytest.raises(CommandError, match="ALREADY_LOADED"):
            run("load_model", model_id)
        assert "queued on cli-worker" in run("unload_model", model_id)
        import time

        deadline = time.monotonic() + 60
        while model.status != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.2)
            model.refresh_from_db()
        assert model.status == "unloaded" and model.unload_reason == "requested"
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_load_no_wait_only_queues(tiny_gpt2_folder):
    run("add_model", "--path", str(tiny_gpt2_folder), "--name", "tiny-nowait")
    assert "queued" in run("load_model", "tiny-nowait", "--no-wait")
    assert LanguageModel.objects.get(name="tiny-nowait").status == "loading"
    with pytest.raises(CommandError, match="No model with id or name"):
        run("load_model", "no-such-model")
