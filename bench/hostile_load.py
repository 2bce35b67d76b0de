"""One hostile user beside two honest ones, on one CPU worker: what the honest users get.

On the demo stack (``bench/demo_stack.py``: demo-gpt2 loaded on a real worker process, a real Daphne
server), three users with API tokens:

* **bob** (honest) chats: a streamed ``/v1/chat/completions`` (8 new tokens) every ``--interval``
  seconds; his time to the first token, idle and under the hostile load.
* **alice** (honest) trains an SAE on the demo cache (her tokens/s, alone and under the load), and,
  ``--load-after`` seconds into the hostile phase, loads a small model of her own: how long until
  the worker starts loading it, and until it is ready.
* **mallory** (hostile), in phase 1 (``--duration`` seconds, beside alice's training and load):
  - floods ``POST /api/generate`` with ``--prompts``-prompt batches of ``--tokens`` tokens each over
    ``--connections`` connections, paced at the generation rate limit (requests per minute in older
    versions; work tokens per minute since admission counts work), abandoning the requests in
    flight when she stops;
  - opens her attribution graph's views (``/nodes``, ``/export``) on ``--graph-views``
    connections, back to back;
  and in phase 2 (``--explain-duration`` seconds; alice's training cancelled so that the job runs)
  adds an explanation job at the highest ``concurrency`` the API takes, over the features of alice's
  shared demo SAE, with demo-gpt2 as explainer (its requests go through ``/v1`` as hers).

Reported: bob's time to first token (median, worst) idle and in each phase, alice's training
tokens/s under load against alone, her load's wait, every answer's status by user (5xx and
connection errors counted), the web process's peak resident memory, and mallory's generation rows
still queued or running 10 s after everything stopped (work that outlived its requests).
Goals: 0 answers >= 500; honest median
time to first token <= 3x idle, worst <= 10 s; the honest load starts within 60 s; the training
keeps >= 0.5x its idle tokens/s; the web process within its memory budget.

    .venv/bin/python bench/hostile_load.py [--duration 60] [--connections 24] [--prompts 16]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import threading
import time

os.environ.setdefault("MAX_ACTIVE_JOBS_PER_USER", "8")

from demo_stack import HOOK, demo_stack, user_with_token, wait_for  # configures Django first
from demo_stack import first_token_seconds as chat_first_token

PROMPT = "def sorted_items(mapping):\n    "
GRAPH_PROMPT = (
    "def add(a, b):\n    return a + b\n\n\ndef multiply(a, b):\n    return a * b\n\n\n"
    "def subtract(a, b):\n    return a -"
)
CHAT_TOKENS = 8
CHAT_MESSAGE = "What does sorted() return?"
EXPLAIN_OPTIONS = {"explain_max_tokens": 24, "score_max_tokens": 16, "explain_examples": 6,
                   "test_examples": 6, "non_activating": 6, "ignore_eos": True}  # fmt: skip


class Tally:
    """Answers by user and status, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, user: str, status: int | str) -> None:
        with self.lock:
            self.counts[user][status] += 1

    def server_errors(self) -> int:
        return sum(
            count
            for counter in self.counts.values()
            for status, count in counter.items()
            if not isinstance(status, int) or status >= 500
        )


def first_token_seconds(client, model_id: str, tally: Tally) -> float | None:
    """Seconds from sending a streamed chat completion to its first content chunk (None: it failed)."""
    import openai

    try:
        first = chat_first_token(
            client, model_id, message="What does sorted() return?", max_tokens=CHAT_TOKENS
        )
    except openai.APIStatusError as error:
        tally.add("bob", error.status_code)
        return None
    except openai.APIError as error:  # timeouts, dropped connections
        tally.add("bob", type(error).__name__)
        return None
    tally.add("bob", 200 if first is not None else "no-token")
    return first


def demo_transcoders(stack, owner):
    """One random MLP transcoder per layer of demo-gpt2 (a graph needs one per layer; its views'
    cost is what is measured here, not its meaning)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from engine.sae.formats import save_saelens
    from engine.testing.tiny_saes import random_transcoders
    from models_app.models import LanguageModel
    from saes.models import SparseAutoencoder
    from saes.services import folder_size

    model = LanguageModel.objects.get(pk=stack.model_id)
    rows = list(SparseAutoencoder.objects.filter(name__startswith="bench transcoder ", model=model))
    if rows:
        return sorted(rows, key=lambda row: row.hook_name)
    config = AutoConfig.from_pretrained(model.identifier)
    modules = random_transcoders(SimpleNamespace(config=config), "jumprelu", skip=True, seed=3)
    for layer, module in enumerate(modules):
        hook, hook_out = f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.hook_mlp_out"
        sae = SparseAutoencoder(
            name=f"bench transcoder {layer}", model=model, model_name=model.display_identifier,
            hook_name=hook, hook_name_out=hook_out, architecture="jumprelu", d_in=module.shape.d_in,
            d_sae=module.shape.d_sae, d_out=module.shape.d_out, status="completed", progress=100,
            owner=owner,
        )  # fmt: skip
        save_saelens(module, sae.directory, hook_name=hook, model_name=sae.model_name, hook_name_out=hook_out)
        sae.file_size_bytes = folder_size(sae.directory)
        sae.save()
        rows.append(sae)
    return rows


def tiny_model_for(owner):
    """A small GPT-2 of alice's in a local model folder, registered and unloaded (hers to load)."""
    from django.conf import settings

    from engine.testing.tiny_models import build_tiny_model
    from models_app.models import LanguageModel
    from models_app.services import model_register

    folder = settings.LOCAL_MODEL_ROOTS[0] / "bench-hostile-gpt2"
    if not (folder / "config.json").exists():
        build_tiny_model("gpt2", folder, size="small")
    existing = LanguageModel.objects.filter(name="bench-hostile-gpt2").first()
    if existing is not None:
        LanguageModel.objects.filter(pk=existing.pk).update(status="unloaded", host_worker="")
        return existing
    return model_register(source="local", identifier=str(folder), owner=owner, name="bench-hostile-gpt2")


def flood(stack, tally: Tally, stop: threading.Event, args) -> None:
    """mallory's generation flood: ``--connections`` at once, paced at the rate limit."""
    import httpx
    from django.conf import settings

    body = {
        "model_id": stack.model_id, "prompt": [f"{PROMPT}# {index}" for index in range(args.prompts)],
        "max_tokens": args.tokens, "ignore_eos": True, "temperature": 1.0,
    }  # fmt: skip
    # Requests per minute the rate limit allows: counted in requests in older versions, in work tokens
    # (each row's prompt characters / 4 + max_tokens) since admission counts work.
    if hasattr(settings, "RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE"):
        cost = sum(-(-len(prompt) // 4) + args.tokens for prompt in body["prompt"])
        per_minute = settings.RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE / cost
    else:
        per_minute = settings.RATE_LIMIT_GENERATIONS_PER_MINUTE
    gap = 60.0 / (per_minute or 10**6)

    async def run() -> None:
        next_send = time.monotonic()
        lock = asyncio.Lock()
        async with httpx.AsyncClient(
            base_url=stack.base_url,
            headers=stack.headers("mallory"),
            timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=args.connections),
        ) as client:

            async def connection() -> None:
                nonlocal next_send
                while not stop.is_set():
                    async with lock:
                        wait = next_send - time.monotonic()
                        next_send = max(next_send, time.monotonic()) + gap
                    if wait > 0:
                        await asyncio.sleep(wait)
                    try:
                        answer = await client.post("/api/generate", json=body)
                        tally.add("mallory", answer.status_code)
                    except httpx.HTTPError as error:
                        tally.add("mallory", type(error).__name__)

            workers = [asyncio.create_task(connection()) for _ in range(args.connections)]
            while not stop.is_set():
                await asyncio.sleep(0.2)
            for task in workers:
                task.cancel()  # requests in flight are abandoned: the client went away
            await asyncio.gather(*workers, return_exceptions=True)

    asyncio.run(run())


def graph_views(stack, graph_id: str, tally: Tally, stop: threading.Event) -> None:
    import httpx

    paths = [f"/api/graphs/{graph_id}/nodes", f"/api/graphs/{graph_id}/export"]
    with httpx.Client(base_url=stack.base_url, headers=stack.headers("mallory"), timeout=600.0) as client:
        index = 0
        while not stop.is_set():
            try:
                tally.add("mallory-graphs", client.get(paths[index % len(paths)]).status_code)
            except httpx.HTTPError as error:
                tally.add("mallory-graphs", type(error).__name__)
            index += 1


def peak_memory(pid: int, stop: threading.Event, peak: list[int]) -> None:
    import psutil

    process = psutil.Process(pid)
    while not stop.is_set():
        try:
            peak[0] = max(peak[0], process.memory_info().rss)
        except psutil.Error:
            return
        time.sleep(0.1)


def ms(values: list[float], *, worst: bool = False) -> str:
    if not values:
        return "    n/a"
    return f"{(max(values) if worst else statistics.median(values)) * 1000:7.0f}"


def chat_while(client, stack, tally: Tally, args, until: float, meanwhile=None) -> list[float]:
    """bob's paced chats until ``until`` (monotonic); ``meanwhile()`` is called between them."""
    seconds: list[float] = []
    while time.monotonic() < until:
        asked = time.monotonic()
        if meanwhile is not None:
            meanwhile()
        value = first_token_seconds(client, stack.model_id, tally)
        if value is not None:
            seconds.append(value)
        time.sleep(max(0.0, args.interval - (time.monotonic() - asked)))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--explain-duration", type=float, default=30.0)
    parser.add_argument("--connections", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--graph-views", type=int, default=4)
    parser.add_argument("--idle-requests", type=int, default=10)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between bob's requests")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of training measured alone")
    parser.add_argument("--load-after", type=float, default=10.0)
    args = parser.parse_args()

    import openai
    from django.conf import settings
    from explanations import demo_sae

    from activations.models import ActivationCache
    from circuits.models import AttributionGraph
    from circuits.services import graph_request
    from features.explanations import explanation_cancel, explanation_request
    from features.models import ExplanationJob
    from generation.models import Generation
    from mistudio.access import OPERATOR
    from models_app.models import LanguageModel
    from models_app.services import model_load_request
    from saes import services
    from saes.models import SparseAutoencoder

    with demo_stack() as stack:
        mallory, token = user_with_token("mallory")
        stack.tokens["mallory"], stack.users["mallory"] = token, mallory
        alice = stack.users["alice"]
        model = LanguageModel.objects.get(pk=stack.model_id)
        tally = Tally()

        print(
            "setting up: alice's SAE and analysis (shared), mallory's transcoders and graph, "
            "alice's small model"
        )
        _, analysis = demo_sae(stack, alice, expansion=8)
        transcoders = demo_transcoders(stack, mallory)
        graph = graph_request(
            owner=mallory, model=model, transcoders=transcoders, prompt=GRAPH_PROMPT, max_feature_nodes=2048
        )
        wait_for(
            lambda: AttributionGraph.objects.get(pk=graph.pk).status in ("completed", "failed"),
            timeout=1200, what="the graph", interval=1.0,
        )  # fmt: skip
        graph.refresh_from_db()
        if graph.status != "completed":
            raise SystemExit(f"graph {graph.status}: {graph.error_code} {graph.error_message}")
        small = tiny_model_for(alice)

        client = openai.OpenAI(
            base_url=f"{stack.base_url}/v1", api_key=stack.tokens["bob"], max_retries=0, timeout=600
        )
        first_token_seconds(client, stack.model_id, Tally())  # untimed: first-request costs
        idle = [first_token_seconds(client, stack.model_id, tally) for _ in range(args.idle_requests)]
        idle = [value for value in idle if value is not None]

        cache = ActivationCache.objects.get(pk=stack.cache_id)
        training = services.sae_train_request(
            owner=alice, cache=cache, hook=HOOK, architecture="topk", k=32, total_tokens=10**9,
            name="hostile bench",
        )  # fmt: skip
        wait_for(
            lambda: SparseAutoencoder.objects.filter(pk=training.pk, status="running", step__gt=20).exists(),
            timeout=600, what="alice's training to run",
        )  # fmt: skip

        def tokens_seen() -> int:
            return SparseAutoencoder.objects.get(pk=training.pk).tokens_seen

        seen, started = tokens_seen(), time.monotonic()
        time.sleep(args.window)
        alone = (tokens_seen() - seen) / (time.monotonic() - started)

        # --- phase 1: the flood and the graph views, beside alice's training and her load ---------
        stop = threading.Event()
        peak = [0]
        threads = [threading.Thread(target=peak_memory, args=(stack.processes["web"].pid, stop, peak))]
        threads.append(threading.Thread(target=flood, args=(stack, tally, stop, args)))
        threads += [
            threading.Thread(target=graph_views, args=(stack, graph.pk, tally, stop))
            for _ in range(args.graph_views)
        ]
        for thread in threads:
            thread.start()
        phase_started = time.monotonic()
        seen = tokens_seen()
        load: dict[str, float] = {}

        def watch_load() -> None:
            elapsed = time.monotonic() - phase_started
            if "requested" not in load and elapsed >= args.load_after:
                model_load_request(model_id=small.id, actor=alice)
                load["requested"] = time.monotonic()
            if "requested" in load:
                row = LanguageModel.objects.get(pk=small.pk)
                if "started" not in load and (row.status != "loading" or row.status_message != "Queued"):
                    load["started"] = time.monotonic() - load["requested"]
                if "ready" not in load and row.status == "ready":
                    load["ready"] = time.monotonic() - load["requested"]

        busy = chat_while(client, stack, tally, args, phase_started + args.duration, meanwhile=watch_load)
        under_load = (tokens_seen() - seen) / (time.monotonic() - phase_started)
        while "requested" in load and "ready" not in load and time.monotonic() - load["requested"] < 300:
            watch_load()  # a load still waiting: how long it waited in the end
            time.sleep(0.5)

        # --- phase 2: mallory's explanation job at its highest concurrency, beside the flood ------
        services.sae_cancel(sae=training, actor=OPERATOR)
        concurrency = getattr(settings, "EXPLAINER_MAX_CONCURRENCY", 32)
        explanation = explanation_request(
            owner=mallory, analysis=analysis, explainer_model=stack.model_id,
            selection={"kind": "list", "indices": list(range(min(analysis.sae.d_sae, 400)))},
            options={**EXPLAIN_OPTIONS, "concurrency": concurrency},
        )  # fmt: skip
        wait_for(
            lambda: ExplanationJob.objects.get(pk=explanation.pk).status != "queued",
            timeout=300, what="the explanation job to start",
        )  # fmt: skip
        explaining = chat_while(client, stack, tally, args, time.monotonic() + args.explain_duration)
        explanation.refresh_from_db()
        explained = explanation.explanations.count()
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
        if ExplanationJob.objects.filter(pk=explanation.pk, status__in=["queued", "running"]).exists():
            explanation_cancel(job=explanation, actor=OPERATOR)
        time.sleep(10)
        leftover = Generation.objects.filter(owner=mallory, status__in=["queued", "running"]).count()

        print(f"\nphase 1, {args.duration:g} s: mallory floods with {args.connections} connections of "
              f"{args.prompts} prompts x {args.tokens} tokens and opens her graph on {args.graph_views} "
              "connections; alice trains, then loads a model")  # fmt: skip
        print(
            f"bob's time to first token, idle     median {ms(idle)} ms  worst {ms(idle, worst=True)} ms "
            f"({len(idle)})"
        )
        ratio = statistics.median(busy) / statistics.median(idle) if busy and idle else float("nan")
        print(f"bob's time to first token, phase 1  median {ms(busy)} ms  worst {ms(busy, worst=True)} ms "
              f"({len(busy)} answered)  {ratio:.2f}x idle (goal <= 3x, worst <= 10 s)")  # fmt: skip
        print(f"alice's training tokens/s alone {alone:,.0f}; under the load {under_load:,.0f}  "
              f"{under_load / alone:.2f}x (goal >= 0.5x)")  # fmt: skip
        started_text = f"{load['started']:.1f} s" if "started" in load else "not started"
        ready_text = f"{load['ready']:.1f} s" if "ready" in load else "not ready"
        print(
            f"alice's model load: started after {started_text}, ready after {ready_text} "
            "(goal: start <= 60 s)"
        )
        print(f"\nphase 2, {args.explain_duration:g} s: mallory's explanation job at concurrency "
              f"{concurrency} beside her flood: {explained} features explained")  # fmt: skip
        ratio = (
            statistics.median(explaining) / statistics.median(idle) if explaining and idle else float("nan")
        )
        print(f"bob's time to first token, phase 2  median {ms(explaining)} ms  worst "
              f"{ms(explaining, worst=True)} ms ({len(explaining)} answered)  {ratio:.2f}x idle")  # fmt: skip
        print(f"\nweb process peak resident memory {peak[0] / 2**20:,.0f} MiB")
        for user, counter in sorted(tally.counts.items()):
            statuses = sorted(counter.items(), key=str)
            print(f"  {user:15s} " + ", ".join(f"{status}: {count}" for status, count in statuses))
        print(f"answers >= 500 (or no answer): {tally.server_errors()} (goal 0)")
        print(f"mallory's generation rows still queued or running 10 s after it all stopped: {leftover}")


if __name__ == "__main__":
    main()
