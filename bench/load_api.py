"""End to end: ``POST /api/models/{id}/load`` until the row says ``ready``, against a bare load.

The issue's load benchmark, through the whole product: the web layer validates and queues, a
real worker process (``manage.py worker``) takes the job from Redis, resolves the files, makes
room, loads, places, warms up, and writes ``ready`` (publishing events on the way). Measured
from the POST until the database row reads ``ready`` (polled every 20 ms, so up to 20 ms of
the figure is the poll).

Against, in the same run: a bare ``AutoModelForCausalLM.from_pretrained`` of the same folder
(same dtype / BitsAndBytesConfig) plus one forward pass on 32 tokens, in this process.

Runs on the embedded default in a temporary data directory unless DATABASE_URL / REDIS_URL are
set. One untimed round of each path first; then ``--repeats`` alternating rounds; medians.
Goal: within 1.15x of the bare load or + 0.5 s, whichever is larger.

    .venv/bin/python bench/load_api.py [--repeats 5]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MISTUDIO_DATA_DIR", tempfile.mkdtemp(prefix="mistudio-bench-load-"))
os.environ["DJANGO_SETTINGS_MODULE"] = "mistudio.settings"
os.environ.setdefault("MAX_LOADED_MODELS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars too

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402

QUANTIZATIONS = ("none", "int8", "int4")
SEQUENCE_LENGTH = 32


def wait_for(model, statuses: set[str], timeout: float = 300.0) -> None:
    """Poll the row every 20 ms: often enough to add little, rarely enough to leave the cores alone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        model.refresh_from_db(fields=["status", "error_code", "error_message"])
        if model.status in statuses:
            return
        time.sleep(0.02)
    raise SystemExit(f"{model.name} did not reach {statuses} (status {model.status})")


def api_load(client, model) -> float:
    """Seconds from POST …/load until the row reads ``ready``; then an untimed unload."""
    from models_app.services import model_unload_request

    started = time.perf_counter()
    response = client.post(f"/api/models/{model.id}/load", {}, format="json")
    if response.status_code != 202:
        raise SystemExit(f"load refused: {response.content!r}")
    wait_for(model, {"ready", "failed"})
    elapsed = time.perf_counter() - started
    if model.status != "ready":
        raise SystemExit(f"load failed: {model.error_code} {model.error_message}")
    model_unload_request(model_id=model.id)
    wait_for(model, {"unloaded"})
    return elapsed


def bare_load(folder: Path, quantization: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.loading import quantization_config_for, release, torch_dtype_for

    started = time.perf_counter()
    kwargs = {"dtype": torch_dtype_for(quantization), "use_safetensors": True, "device_map": {"": "cpu"}}
    if (config := quantization_config_for(quantization)) is not None:
        kwargs["quantization_config"] = config
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    with torch.no_grad():
        model(torch.arange(SEQUENCE_LENGTH).unsqueeze(0))
    elapsed = time.perf_counter() - started
    holder = type("Holder", (), {})()
    holder.model, holder.tokenizer = model, None
    del model
    release(holder)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    from engine.testing.tiny_models import build_tiny_model
    from mistudio.workers import read_heartbeats
    from models_app.models import LanguageModel
    from models_app.services import model_register

    call_command("migrate", verbosity=0)
    folder = settings.LOCAL_MODEL_ROOTS[0] / "bench-gpt2-small"
    if not (folder / "config.json").exists():
        build_tiny_model("gpt2", folder, size="gpt2-small", seed=0)
    user, _ = get_user_model().objects.get_or_create(username="bench", is_superuser=True)
    client = APIClient(HTTP_HOST="127.0.0.1")
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")

    worker = subprocess.Popen(
        [sys.executable, "manage.py", "worker", "--name", "bench-worker", "--device", "cpu"],
        cwd=ROOT, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while not any(beat["name"] == "bench-worker" for beat in read_heartbeats()):
            time.sleep(0.1)
        print(f"database {settings.DATABASES['default']['ENGINE'].rsplit('.', 1)[-1]}, gpt2-small (124M)")
        print(f"medians of {args.repeats}; api: POST load -> row ready; bare: from_pretrained + forward")
        print(f"{'quant':6} {'api (s)':>8} {'bare (s)':>9} {'ratio':>6} {'limit':>6}  ok")
        for quantization in QUANTIZATIONS:
            LanguageModel.objects.filter(identifier=str(folder), quantization=quantization).delete()
            model = model_register(
                source="local", identifier=str(folder), name=f"bench-{quantization}", owner=user,
                quantization=quantization,
            )  # fmt: skip
            api_load(client, model)  # untimed: first-time costs of both paths
            bare_load(folder, quantization)
            api_times, bare_times = [], []
            for _ in range(args.repeats):
                api_times.append(api_load(client, model))
                bare_times.append(bare_load(folder, quantization))
            api, bare = statistics.median(api_times), statistics.median(bare_times)
            limit = max(1.15 * bare, bare + 0.5)
            print(
                f"{quantization:6} {api:8.3f} {bare:9.3f} {api / bare:6.2f} {limit:6.3f}  "
                + ("yes" if api <= limit else "NO")
            )
            print(f"       api runs: {', '.join(f'{t:.3f}' for t in api_times)}")
            print(f"       bare runs: {', '.join(f'{t:.3f}' for t in bare_times)}")
    finally:
        worker.terminate()
        worker.wait(timeout=60)


if __name__ == "__main__":
    main()
