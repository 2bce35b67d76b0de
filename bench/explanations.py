"""Automatic interpretation of the demo SAE through this workbench's own /v1: throughput and scores.

The demo SAE: a TopK SAE (32x = 4,096 features, k 32) trained by the product on the demo model's
``blocks.2.hook_resid_post`` over the demo dataset, then analysed (``bench/demo_stack.py`` starts the
stack: a worker, Daphne, demo-gpt2 loaded). Then, with demo-gpt2 as explainer and scorer:

1. one at a time: an explanation job with ``concurrency`` 1 over ``--sequential`` features;
2. batched: the same job with ``concurrency`` ``--concurrency`` over ``--features`` features (its
   requests meet in /v1's batches: the worker decodes queued requests together);
3. a random-explanation baseline: each of those features scored again with another feature's
   explanation (a derangement), as delphi's papers compare, through the same scorer.

Reported: features per minute of both, their ratio, and the distribution of the scores (detection,
fuzzing, their mean) beside the baseline's. demo-gpt2 is a 4-layer model trained for 90 s on Python
docstrings, with a 128-token context: its explanations are poor and its scoring answers rarely
parse (unparsed answers count as failed predictions, as in delphi). The throughput is what this
measures; the scores show the arithmetic on real answers.

    .venv/bin/python bench/explanations.py [--features 1000] [--sequential 100] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_stack import HOOK, demo_stack, wait_for

# Sized to demo-gpt2's 128-token context: a prompt shrinks to fit what these leave of it.
# demo-gpt2 is no chat model: it would end its turn at once, so it answers max tokens (ignore_eos).
OPTIONS = {"explain_max_tokens": 24, "score_max_tokens": 16, "explain_examples": 6, "test_examples": 6,
           "non_activating": 6, "ignore_eos": True}  # fmt: skip


def finished(row, *, timeout: float):
    def ended():
        row.refresh_from_db()
        return row.status not in ("queued", "running")

    wait_for(ended, timeout=timeout, what=f"{row.pk}", interval=1.0)
    if row.status != "completed":
        raise SystemExit(f"{row.pk} {row.status}: {row.error_code} {row.error_message}")
    return row


def demo_sae(stack, user, expansion: int):
    """The demo SAE and its completed analysis (trained and analysed once per data directory)."""
    from activations.models import ActivationCache
    from features.models import FeatureAnalysis
    from features.services import analysis_request
    from saes.models import SparseAutoencoder
    from saes.services import sae_train_request

    name = f"demo-sae-{expansion}x"
    sae = SparseAutoencoder.objects.filter(name=name, status="completed").first()
    if sae is None:
        cache = ActivationCache.objects.get(pk=stack.cache_id)
        sae = sae_train_request(
            owner=user, cache=cache, hook=HOOK, architecture="topk", expansion_factor=expansion, k=32,
            lr=1e-3, batch_size=1024, total_tokens=5 * cache.num_tokens, name=name, shared=True,
        )  # fmt: skip
        finished(sae, timeout=3600)
    analysis = FeatureAnalysis.objects.filter(sae=sae, status="completed").first()
    if analysis is None:
        analysis = finished(analysis_request(owner=user, sae=sae, shared=True), timeout=3600)
    return sae, analysis


def run_job(user, analysis, model_id: str, indices: list[int], concurrency: int):
    from features.explanations import explanation_request

    job = explanation_request(
        owner=user, analysis=analysis, explainer_model=model_id,
        selection={"kind": "list", "indices": indices}, options={**OPTIONS, "concurrency": concurrency},
    )  # fmt: skip
    started = time.monotonic()
    finished(job, timeout=6 * 3600)
    return job, time.monotonic() - started


def random_baseline(stack, user, analysis, job, concurrency: int) -> list[dict]:
    """Each feature of ``job`` scored with another feature's explanation, through /v1."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.autointerp.chat import ChatClient
    from engine.autointerp.pipeline import Endpoints, InterpretationConfig, score_explanation
    from features.explanation_tasks import feature_examples, non_activating_examples, prompt_tokens
    from features.selectors import FeatureFile, analysis_tokenizer

    rows = [row for row in job.explanations.order_by("index") if row.text]
    texts = [row.text for row in rows]
    shuffled = texts[1:] + texts[:1]  # a derangement: nobody keeps its own
    config = InterpretationConfig(**{**OPTIONS, "concurrency": concurrency})
    data, tokenizer = FeatureFile(analysis), analysis_tokenizer(analysis.sae)
    quiet = non_activating_examples(
        analysis, [row.index for row in rows], config, tokenizer=tokenizer, device="cpu"
    )
    client = ChatClient(
        base_url=stack.base_url + "/v1", model=job.explainer_model, api_key=stack.tokens[user.username]
    )
    tokens, context = prompt_tokens(job, job.scorer_model), int(job.config["context_tokens"])

    def fits(messages) -> bool:
        return tokens(messages) + config.score_max_tokens <= context

    endpoints = Endpoints(explainer=client, scorer=client, scorer_fits=fits)

    def score(pair):
        row, text = pair
        examples = feature_examples(data, row.index, config, tokenizer, quiet[row.index])
        scores = score_explanation(examples, text, endpoints, config)
        values = {kind: scores[kind].balanced_accuracy if kind in scores else None for kind in config.scorers}
        present = [value for value in values.values() if value is not None]
        return {**values, "score": sum(present) / len(present) if present else None}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(score, zip(rows, shuffled, strict=True)))


def distribution(values: list[float | None]) -> str:
    present = sorted(value for value in values if value is not None)
    if not present:
        return "no score (no answer parsed)"
    quartiles = statistics.quantiles(present, n=4) if len(present) > 1 else [present[0]] * 3
    return (
        f"n={len(present)}, mean {statistics.fmean(present):.3f}, "
        f"quartiles {quartiles[0]:.3f} / {quartiles[1]:.3f} / {quartiles[2]:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--features", type=int, default=1000)
    parser.add_argument("--sequential", type=int, default=100, help="features of the one-at-a-time run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--expansion", type=int, default=32, help="the demo SAE's width over 128")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--threads", help="OMP_NUM_THREADS of the stack's processes (default: torch's)")
    parser.add_argument("--max-batch", help="GENERATION_MAX_BATCH of the stack (default: the product's, 8)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the random-explanation baseline")
    arguments = parser.parse_args()

    from features.models import Feature

    environment = {
        "RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE": "0",
        **({"OMP_NUM_THREADS": arguments.threads} if arguments.threads else {}),
        **({"GENERATION_MAX_BATCH": arguments.max_batch} if arguments.max_batch else {}),
    }
    with demo_stack(environment=environment) as stack:
        user = stack.users["alice"]
        sae, analysis = demo_sae(stack, user, arguments.expansion)
        live = list(
            Feature.objects.filter(analysis=analysis, density__gt=0)
            .order_by("-density")
            .values_list("index", flat=True)
        )
        chosen = live[: arguments.features]
        print(
            f"demo SAE {sae.id}: {sae.d_sae} features, {len(live)} live; explaining {len(chosen)}", flush=True
        )
        sequential, sequential_seconds = run_job(
            user, analysis, stack.model_id, chosen[: arguments.sequential], 1
        )
        print(f"one at a time: {sequential.features_per_minute:.1f} features/min", flush=True)
        batched, batched_seconds = run_job(user, analysis, stack.model_id, chosen, arguments.concurrency)
        print(
            f"concurrency {arguments.concurrency}: {batched.features_per_minute:.1f} features/min", flush=True
        )
        baseline = (
            []
            if arguments.no_baseline
            else random_baseline(stack, user, analysis, batched, arguments.concurrency)
        )

    rows = list(batched.explanations.all())
    kinds = ("detection", "fuzzing", "score")

    def run_entry(job, seconds: float) -> dict:
        return {
            "features": len(job.indices), "seconds": round(seconds, 1), "requests": job.requests_sent,
            "features_per_minute": job.features_per_minute, "failures": job.summary.get("failures"),
        }  # fmt: skip

    result = {
        "features": len(chosen),
        "sequential": run_entry(sequential, sequential_seconds),
        "batched": {**run_entry(batched, batched_seconds), "concurrency": arguments.concurrency},
        "speedup": round(batched.features_per_minute / sequential.features_per_minute, 2),
        "scores": {name: distribution([getattr(row, name) for row in rows]) for name in kinds},
        "random_baseline": {name: distribution([entry[name] for entry in baseline]) for name in kinds},
    }
    print(json.dumps(result, indent=1))
    print("\n| run | features | features/min | requests |\n|---|---:|---:|---:|")
    for name in ("sequential", "batched"):
        entry = result[name]
        print(f"| {name} | {entry['features']} | {entry['features_per_minute']:.1f} | {entry['requests']} |")
    print(f"\nspeed-up: {result['speedup']}x\n")
    print("| score | demo-gpt2's explanations | random explanations |\n|---|---|---|")
    for name in ("detection", "fuzzing", "score"):
        print(f"| {name} | {result['scores'][name]} | {result['random_baseline'][name]} |")
    if arguments.json:
        arguments.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
