"""Generation through the whole product against ``model.generate`` in one process (the limit).

The issue's generation benchmark: the kit's 124M GPT-2 (random weights), a 64-token prompt,
128 new tokens, greedy (end-of-sequence ignored on both sides, so every run makes 128 tokens).

* **End to end**: the official ``openai`` client streams ``/v1/chat/completions`` from a real
  Daphne server; a real worker process (``manage.py worker``) hosts the model. Decode tokens/s
  is (tokens - 1) / (time of the last chunk - time of the first chunk), measured in the client.
* **The limit**: ``model.generate(do_sample=False, max_new_tokens=128, min_new_tokens=128)`` on
  the same weights and the very same prompt ids in this process, timed by a streamer (first
  token and last token).
* **Time to first token**: client-side TTFT minus the bare prefill (one forward over the prompt
  plus the argmax, in this process). Goal ≤ 50 ms.
* **Capture**: the same request with three hooks captured and stored. Goal >= 0.75x.
* **4 concurrent clients**: aggregate tokens/s (all tokens / wall time) against one client.
* **Steering**: the same streamed request with no intervention, with one ``add`` of a
  d_model vector at ``blocks.6.hook_resid_post`` (goal >= 0.95x of none) and with one
  ``clamp_feature`` of an SAE with d_sae = 8 x d_in at the same hook (goal >= 0.85x), both a
  TopK SAE (k = 32; its encoder runs in full to find a feature's value) and a standard (ReLU)
  one (one encoder column). The SAEs are completed SAE rows with random weights. The conditions
  are interleaved (each round in a rotated order); the rate compared is the worker's own decode
  rate (``mistudio.timings.decode_tokens_per_second`` of the finish chunk): medians, the median
  of per-round ratios and the best of the rounds (the machine is shared: bursts of other work
  only ever slow a run down). Then the hook's own cost per decode step, in this process.
  ``--steering-only`` runs this part alone.

Runs on the embedded default in a temporary data directory unless DATABASE_URL / REDIS_URL are
set. One untimed round first; then ``--repeats`` rounds; medians.

    .venv/bin/python bench/generation.py [--repeats 5] [--steering-only]
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MISTUDIO_DATA_DIR", tempfile.mkdtemp(prefix="mistudio-bench-generation-"))
os.environ["DJANGO_SETTINGS_MODULE"] = "mistudio.settings"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402

PROMPT_TOKENS = 64
NEW_TOKENS = 128
CAPTURE = ["blocks.3.hook_resid_post", "blocks.3.mlp.hook_post", "blocks.6.hook_resid_post"]
CLIENTS = 4
STEERING_HOOK = "blocks.6.hook_resid_post"
SAE_EXPANSION = 8
SAE_TOPK = 32


ASGI = "mistudio.asgi:application"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def chat_message_of_length(tokenizer, tokens: int) -> str:
    """A user message whose chat prompt (the kit has no chat template: the fallback) is ``tokens`` long."""
    from engine.generation import render_prompt
    from engine.testing.tiny_models import local_corpus

    words = " ".join(local_corpus(20_000)).split()
    low, high = 1, len(words)
    while low < high:  # the longest prefix of words whose rendered prompt fits
        middle = (low + high + 1) // 2
        if (
            len(render_prompt(tokenizer, messages=[{"role": "user", "content": " ".join(words[:middle])}]))
            <= tokens
        ):
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])


def stream_chat(
    client,
    model_id: str,
    message: str,
    *,
    capture: list[str] | None = None,
    interventions: list | None = None,
) -> dict:
    """One streamed chat completion; client-side times of the request, first and last content
    chunk, and the worker's own decode rate (the finish chunk's ``mistudio.timings``)."""
    extra: dict = {"ignore_eos": True}
    if capture:
        extra["mistudio"] = {"capture": capture}
    if interventions:
        extra.setdefault("mistudio", {})["interventions"] = interventions
    started = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    timings = None
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": message}], max_tokens=NEW_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra,
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        extension = (chunk.model_extra or {}).get("mistudio")
        if extension and extension.get("timings"):
            timings = extension["timings"]
        # One chunk per token (its text may be empty: many ids of this random model are outside
        # the kit tokenizer's vocabulary and decode to nothing); the opening chunk carries the role.
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.role is None and delta.content is not None:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            chunks += 1
    if usage is None or usage.completion_tokens != NEW_TOKENS:
        raise SystemExit(f"expected {NEW_TOKENS} tokens, got usage {usage}")
    return {
        "ttft": first - started,
        "decode_tps": (NEW_TOKENS - 1) / (last - first),
        "wall": last - started,
        "prompt_tokens": usage.prompt_tokens,
        "chunks": chunks,
        "worker_tps": (timings or {}).get("decode_tokens_per_second"),
    }


class Timestamps:
    """A ``generate`` streamer that notes when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self):
        pass


def bare_runs(model, prompt_ids: list[int]) -> dict:
    import torch

    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        started = time.perf_counter()
        logits = model(input_ids).logits
        int(logits[0, -1].argmax())
        prefill = time.perf_counter() - started
        # The least a prefill can cost: logits for the last position only (what our engine does).
        started = time.perf_counter()
        int(model(input_ids, logits_to_keep=1).logits[0, -1].argmax())
        prefill_last = time.perf_counter() - started
        streamer = Timestamps()
        model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, streamer=streamer, pad_token_id=0,
        )  # fmt: skip
    times = streamer.times
    return {
        "prefill": prefill,
        "prefill_last": prefill_last,
        "decode_tps": (len(times) - 1) / (times[-1] - times[0]),
    }


def concurrent(client, model_id: str, messages: list[str]) -> float:
    """Aggregate decode tokens/s of ``len(messages)`` clients streaming at once."""
    results: list[dict] = []

    def one(message):
        results.append(stream_chat(client, model_id, message))

    threads = [threading.Thread(target=one, args=(message,)) for message in messages]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(messages) * NEW_TOKENS / (time.perf_counter() - started)


def steering_sae_row(model, owner, architecture: str, d_in: int, *, seed: int):
    """A completed SAE row at :data:`STEERING_HOOK` (d_sae = 8 x d_in) with random weights, saved
    in SAELens' layout in the row's directory (what training would leave)."""
    import torch

    from engine.sae import SaeShape, SparseAutoencoder
    from engine.sae.formats import save_saelens
    from saes.models import SparseAutoencoder as SaeRow
    from saes.services import folder_size

    k = SAE_TOPK if architecture == "topk" else None
    module = SparseAutoencoder(SaeShape(architecture, d_in, SAE_EXPANSION * d_in, k=k))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("W_enc", "W_dec"):
            parameter = getattr(module, name)
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / d_in**0.5)
    sae = SaeRow(
        name=f"bench-steering-{architecture}", model=model, model_name=model.display_identifier,
        hook_name=STEERING_HOOK, architecture=architecture, d_in=d_in, d_sae=SAE_EXPANSION * d_in, k=k,
        status=SaeRow.Status.COMPLETED, progress=100, owner=owner,
    )  # fmt: skip
    save_saelens(module, sae.directory, hook_name=STEERING_HOOK, model_name=sae.model_name)
    sae.file_size_bytes = folder_size(sae.directory)
    sae.save()
    return sae


def steering(client, model, owner, message: str, d_model: int, repeats: int) -> None:
    """Decode with no intervention, one ``add``, one ``clamp_feature`` (TopK and standard SAE),
    interleaved in rotated order each round; medians and ratios against no intervention."""
    import random

    saes = {
        arch: steering_sae_row(model, owner, arch, d_model, seed=i)
        for i, arch in enumerate(("topk", "standard"))
    }
    rng = random.Random(0)
    vector = [rng.gauss(0, 1) for _ in range(d_model)]
    conditions = {
        "none": None,
        "add": [{"type": "add", "hook": STEERING_HOOK, "vector": vector, "coefficient": 1.0}],
        "clamp_feature (topk)": [
            {"type": "clamp_feature", "sae": saes["topk"].id, "feature": 7, "value": 4.0}
        ],
        "clamp_feature (standard)": [
            {"type": "clamp_feature", "sae": saes["standard"].id, "feature": 7, "value": 4.0}
        ],
    }
    goals = {"add": 0.95, "clamp_feature (topk)": 0.85, "clamp_feature (standard)": 0.85}
    names = list(conditions)
    for name in names:  # untimed: the worker loads each SAE once (then cached)
        stream_chat(client, model.id, message, interventions=conditions[name])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(stream_chat(client, model.id, message, interventions=conditions[name]))

    def median(name, key):
        return statistics.median(row[key] for row in runs[name])

    def best(name):
        return max(row["worker_tps"] for row in runs[name])

    base, base_best = median("none", "worker_tps"), best("none")
    print()
    print(
        f"Steering at {STEERING_HOOK} (d_model {d_model}; SAEs d_sae {SAE_EXPANSION * d_model}, "
        f"TopK k={SAE_TOPK}); {NEW_TOKENS} new tokens, greedy, ignore_eos; {repeats} rounds, rotated order"
    )
    print("worker decode tok/s: median, ratio of medians, median of per-round ratios, best, ratio of bests")
    print(f"{'condition':26} {'median':>7} {'ratio':>6} {'paired':>7} {'best':>6} {'ratio':>6}  goal")
    for name in names:
        worker = median(name, "worker_tps")
        # Each round's rate over the same round's no-intervention rate (drift cancels out).
        paired = statistics.median(
            row["worker_tps"] / none["worker_tps"] for row, none in zip(runs[name], runs["none"], strict=True)
        )
        goal = goals.get(name)
        verdict = (
            ""
            if goal is None
            else f">= {goal:.2f}x  paired {'met' if paired >= goal else 'MISSED'}, "
            f"best {'met' if best(name) / base_best >= goal else 'MISSED'}"
        )
        print(
            f"{name:26} {worker:7.1f} {worker / base:5.2f}x {paired:6.2f}x "
            f"{best(name):6.1f} {best(name) / base_best:5.2f}x  {verdict}"
        )
    for name in names:
        worker_runs = ", ".join(f"{row['worker_tps']:.1f}" for row in runs[name])
        client_runs = ", ".join(f"{row['decode_tps']:.1f}" for row in runs[name])
        print(f"  runs {name}: worker {worker_runs}; client {client_runs}")
    hook_costs(saes, vector, step_seconds=1 / base_best)


def hook_costs(saes: dict, vector: list[float], *, step_seconds: float) -> None:
    """The interventions' own cost at one decode step (``Interventions.apply`` on one new token's
    [1, 1, d_model] activations, what the worker's hook runs per step), in this process: the
    least of several timed loops, against a decode step of the run above."""
    import torch

    from engine.interventions import Add, ClampFeature, Interventions
    from engine.sae.formats import load_saelens

    modules = {arch: load_saelens(row.directory)[0].eval() for arch, row in saes.items()}
    items = {
        "add": Add(hook=STEERING_HOOK, vector=torch.tensor(vector)),
        "clamp_feature (topk)": ClampFeature(
            hook=STEERING_HOOK, sae=modules["topk"], features=(7,), value=4.0
        ),
        "clamp_feature (standard)": ClampFeature(
            hook=STEERING_HOOK, sae=modules["standard"], features=(7,), value=4.0
        ),
    }
    x = torch.randn(1, 1, len(vector))
    print(f"per-step cost of the hook (in-process, 1 token, torch threads {torch.get_num_threads()}):")
    for name, item in items.items():
        interventions = Interventions([[item]], [PROMPT_TOKENS])
        interventions.begin_pass(torch.tensor([[PROMPT_TOKENS + 10]]))
        loops = 500
        timings = []
        with torch.inference_mode():
            for _ in range(7):
                started = time.perf_counter()
                for _ in range(loops):
                    interventions.apply(STEERING_HOOK, x)
                timings.append((time.perf_counter() - started) / loops)
        cost = min(timings)
        print(
            f"  {name:26} {cost * 1e6:8.1f} us  "
            f"({cost / step_seconds * 100:.2f}% of a {step_seconds * 1000:.1f} ms step)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steering-only", action="store_true", help="only the steering comparison")
    args = parser.parse_args()

    import openai
    import torch
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from engine.loading import load_weights
    from engine.testing.tiny_models import build_tiny_model
    from generation.models import Generation
    from mistudio.access import OPERATOR
    from mistudio.workers import read_heartbeats
    from models_app.models import LanguageModel
    from models_app.services import model_load_request, model_register

    call_command("migrate", verbosity=0)
    folder = settings.LOCAL_MODEL_ROOTS[0] / "bench-gpt2-small"
    if not (folder / "config.json").exists():
        build_tiny_model("gpt2", folder, size="gpt2-small", seed=0)
    user, _ = get_user_model().objects.get_or_create(username="bench", is_superuser=True)
    token = Token.objects.get_or_create(user=user)[0].key
    port = free_port()
    environment = {**os.environ, "GENERATION_MAX_BATCH": os.environ.get("GENERATION_MAX_BATCH", "8")}
    # The worker's log beside the data (a worker that dies mid-run shows why there).
    worker_log = open(Path(os.environ["MISTUDIO_DATA_DIR"]) / "bench-worker.log", "ab")  # noqa: SIM115
    print(f"worker log: {worker_log.name}")
    processes = [
        subprocess.Popen(
            [sys.executable, "manage.py", "worker", "--name", "bench-worker", "--device", "cpu"],
            cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=worker_log,
        ),
        subprocess.Popen(
            [sys.executable, "-m", "mistudio.web_server", "-b", "127.0.0.1", "-p", str(port), ASGI],
            cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ),
    ]  # fmt: skip
    try:
        while not any(beat["name"] == "bench-worker" for beat in read_heartbeats()):
            if processes[0].poll() is not None:
                raise SystemExit(f"the worker exited ({processes[0].returncode}); see {worker_log.name}")
            time.sleep(0.1)
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        LanguageModel.objects.filter(identifier=str(folder)).delete()
        model = model_register(source="local", identifier=str(folder), name="bench-gpt2-small", owner=user)
        model_load_request(model_id=model.id, actor=OPERATOR)
        while model.status != "ready":
            time.sleep(0.1)
            model.refresh_from_db()
            if model.status == "failed":
                raise SystemExit(f"load failed: {model.error_code} {model.error_message}")

        weights = load_weights(folder, model_type="gpt2", quantization="none", device="cpu")
        bare_model, tokenizer = weights.model, weights.tokenizer
        message = chat_message_of_length(tokenizer, PROMPT_TOKENS)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0, timeout=300
        )
        warm = stream_chat(client, model.id, message)  # untimed: first-request costs on both sides
        database = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        print(f"gpt2-small (124M, fp32, random weights), {database}, torch threads {torch.get_num_threads()}")
        print(f"prompt {warm['prompt_tokens']} tokens, {NEW_TOKENS} new, greedy; medians of {args.repeats}")
        if not args.steering_only:
            prompt_ids = Generation.objects.filter(model=model).latest("created_at").input_token_ids
            bare_runs(bare_model, prompt_ids)
            torch.set_num_threads(torch.get_num_threads())

            api, captured, bare = [], [], []
            for _ in range(args.repeats):
                api.append(stream_chat(client, model.id, message))
                captured.append(stream_chat(client, model.id, message, capture=CAPTURE))
                bare.append(bare_runs(bare_model, prompt_ids))
            single = [concurrent(client, model.id, [message]) for _ in range(args.repeats)]
            messages = [f"Client {index}: {message}" for index in range(CLIENTS)]
            together = [concurrent(client, model.id, messages) for _ in range(args.repeats)]

            def median(rows, key):
                return statistics.median(row[key] for row in rows)

            limit_tps, api_tps, capture_tps = (
                median(bare, "decode_tps"),
                median(api, "decode_tps"),
                median(captured, "decode_tps"),
            )
            prefill, ttft = median(bare, "prefill"), median(api, "ttft")
            prefill_last = median(bare, "prefill_last")
            print(f"model.generate decode          {limit_tps:8.1f} tokens/s   (the limit)")
            ratio = api_tps / limit_tps
            print(f"/v1/chat/completions streaming {api_tps:8.1f} tokens/s   {ratio:.2f}x  (goal >= 0.85x)")
            print(
                f"  capturing {len(CAPTURE)} hooks          {capture_tps:8.1f} tokens/s   "
                f"{capture_tps / limit_tps:.2f}x  (goal >= 0.75x)"
            )
            print(
                f"time to first token {ttft * 1000:.1f} ms - bare prefill {prefill * 1000:.1f} ms = "
                f"{(ttft - prefill) * 1000:.1f} ms  (goal <= 50 ms)"
            )
            print(
                f"  against a last-position-only prefill ({prefill_last * 1000:.1f} ms): "
                f"{(ttft - prefill_last) * 1000:.1f} ms of API overhead"
            )
            one, four = statistics.median(single), statistics.median(together)
            print(f"1 client  aggregate {one:8.1f} tokens/s")
            print(f"{CLIENTS} clients aggregate {four:8.1f} tokens/s   {four / one:.2f}x one client")
            print("runs: api " + ", ".join(f"{row['decode_tps']:.1f}" for row in api))
            print("      capture " + ", ".join(f"{row['decode_tps']:.1f}" for row in captured))
            print("      bare " + ", ".join(f"{row['decode_tps']:.1f}" for row in bare))
            print("      ttft ms " + ", ".join(f"{row['ttft'] * 1000:.1f}" for row in api))
            print("      prefill ms " + ", ".join(f"{row['prefill'] * 1000:.1f}" for row in bare))
            last_position = ", ".join(f"{row['prefill_last'] * 1000:.1f}" for row in bare)
            print(f"      last-position prefill ms {last_position}")
        d_model = bare_model.config.hidden_size
        del bare_model, weights  # from here on the model lives in the worker only
        steering(client, model, user, message, d_model, args.repeats)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
        worker_log.close()
        if settings.EMBEDDED_REDIS:  # the server this run started for itself
            from mistudio import embedded_redis

            embedded_redis.stop(settings.EMBEDDED_REDIS_SOCKET)


if __name__ == "__main__":
    main()
