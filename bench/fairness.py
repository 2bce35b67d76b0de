"""Fairness on one model's worker: interactive work while a batch job runs, and batch
jobs of two users taking turns.

On the demo stack (``bench/demo_stack.py``: demo-gpt2 loaded on a real worker process, a real
Daphne server):

1. **Idle**: the time to the first token of a streamed ``/v1/chat/completions`` (the official
   ``openai`` client, 8 new tokens), ``--requests`` times.
2. **Training alone**: an SAE training (TopK, 8x, k 32, batch 4096) on the demo cache, its
   tokens/s over ``--window`` seconds with nothing else asked of the worker (from the row's
   ``tokens_seen``).
3. **Training with interactive load**: the same requests as in 1, one every ``--interval``
   seconds (a researcher at the playground; 0: back to back, a saturating load), for the next
   window, while the training goes on: their time to first token, and the training's tokens/s
   over that window.
   Goals: median time to first token <= 2x idle; training >= 0.8x its rate alone.
4. **Two users**: a long job of the operator's holds the worker while alice queues 5 short
   trainings and then bob 5; it is cancelled, and the order the 10 start in is printed.
   Goal: they alternate.

    .venv/bin/python bench/fairness.py [--requests 15] [--window 20]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

os.environ.setdefault("MAX_ACTIVE_JOBS_PER_USER", "8")  # alice queues 5 trainings at once below

from demo_stack import HOOK, demo_stack, wait_for  # after the environment: it configures Django
from demo_stack import first_token_seconds as chat_first_token

NEW_TOKENS = 8
MESSAGE = "What does sorted() return?"


def first_token_seconds(client, model_id: str) -> float:
    """Seconds from sending a streamed chat completion to its first content chunk."""
    first = chat_first_token(client, model_id, message=MESSAGE, max_tokens=NEW_TOKENS)
    if first is None:
        raise SystemExit("no content chunk came back")
    return first


def training_rate(sae, seconds: float, *, meanwhile=None) -> tuple[float, list]:
    """The training's tokens/s over ``seconds`` (``meanwhile()`` called in a loop until then), and
    what ``meanwhile`` returned."""
    sae.refresh_from_db()
    start_tokens, started = sae.tokens_seen, time.monotonic()
    results = []
    while time.monotonic() - started < seconds:
        if meanwhile is None:
            time.sleep(0.25)
        else:
            results.append(meanwhile())
    sae.refresh_from_db()
    if sae.status != "running":
        raise SystemExit(f"the training is {sae.status} ({sae.error_code} {sae.error_message})")
    return (sae.tokens_seen - start_tokens) / (time.monotonic() - started), results


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=15)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between requests under load")
    args = parser.parse_args()

    import openai
    import torch

    from activations.models import ActivationCache
    from mistudio.access import OPERATOR
    from saes import services
    from saes.models import SparseAutoencoder

    with demo_stack() as stack:
        client = openai.OpenAI(
            base_url=f"{stack.base_url}/v1", api_key=stack.tokens["bob"], max_retries=0, timeout=120
        )
        cache = ActivationCache.objects.get(pk=stack.cache_id)
        first_token_seconds(client, stack.model_id)  # untimed: first-request costs
        idle = [first_token_seconds(client, stack.model_id) for _ in range(args.requests)]

        training = services.sae_train_request(
            owner=stack.users["alice"], cache=cache, hook=HOOK, architecture="topk", k=32,
            total_tokens=10**9, name="fairness bench",
        )  # fmt: skip
        wait_for(
            lambda: SparseAutoencoder.objects.filter(pk=training.pk, status="running", step__gt=20).exists(),
            timeout=300, what="the training to run",
        )  # fmt: skip
        alone, _ = training_rate(training, args.window)

        def paced() -> float:
            started = time.monotonic()
            seconds = first_token_seconds(client, stack.model_id)
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
            return seconds

        loaded, busy = training_rate(training, args.window, meanwhile=paced)
        services.sae_cancel(sae=training, actor=OPERATOR)

        threads = torch.get_num_threads()
        print(f"demo-gpt2 on one CPU worker, torch threads {threads}; {NEW_TOKENS} new tokens a request")
        idle_median, busy_median = statistics.median(idle), statistics.median(busy)
        print(
            f"time to first token, idle          median {idle_median * 1000:7.1f} ms   "
            f"p90 {percentile(idle, 0.9) * 1000:7.1f} ms   ({len(idle)} requests)"
        )
        print(
            f"time to first token, training runs median {busy_median * 1000:7.1f} ms   "
            f"p90 {percentile(busy, 0.9) * 1000:7.1f} ms   ({len(busy)} requests, one every "
            f"{args.interval:g} s)   {busy_median / idle_median:.2f}x idle (goal <= 2x)"
        )
        print(
            f"training tokens/s alone {alone:10.0f};  with the requests {loaded:10.0f}   "
            f"{loaded / alone:.2f}x (goal >= 0.8x)"
        )

        # Two users' batch jobs: queued behind a job of the operator's, then run in turn.
        wait_for(
            lambda: SparseAutoencoder.objects.get(pk=training.pk).status == "cancelled",
            timeout=60,
            what="cancel",
        )
        blocker = services.sae_train_request(
            owner=None, cache=cache, hook=HOOK, total_tokens=10**9, name="blocker"
        )
        wait_for(
            lambda: SparseAutoencoder.objects.filter(pk=blocker.pk, status="running").exists(),
            timeout=120, what="the blocker",
        )  # fmt: skip
        short = {"cache": cache, "hook": HOOK, "d_sae": 256, "k": 8, "batch_size": 1024, "total_tokens": 2048}
        queued = [
            services.sae_train_request(owner=stack.users[name], name=f"{name} {index}", **short)
            for name in ("alice", "bob")
            for index in range(5)
        ]
        services.sae_cancel(sae=blocker, actor=OPERATOR)
        rows = SparseAutoencoder.objects.filter(pk__in=[sae.pk for sae in queued])
        wait_for(
            lambda: not rows.filter(status__in=["queued", "running"]).exists(),
            timeout=600,
            what="the ten trainings",
        )
        names = [sae.owner.username for sae in rows.order_by("started_at")]
        alternate = all(a != b for a, b in itertools.pairwise(names))
        print(f"queued: alice x5, then bob x5; started: {' '.join(names)}   alternating: {alternate}")


if __name__ == "__main__":
    main()
