"""SAEBench's sparse probing of N SAEs at one hook point: judged one at a time (one pass of the
model and the model's own probes per SAE, as runs did before) against judged together (one pass,
the model's probes once), on the demo's labelled dataset and this CPU.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python bench/saebench_probing.py [--saes 8]
        [--size small] [--per-class 250] [--context 128]

The model is a tiny GPT-2 of ``--size`` (``small``: 4 layers, 256 wide; ``gpt2-small``: GPT-2
small's geometry, 124 M parameters, random weights); the SAEs random TopK (k 8 .. 64) with
8 x d_model features at the middle layer's resid_post; the texts the demo's topics (five classes,
``--per-class`` each) with the run's defaults (80 % to train, k in 1, 2, 5, seed 42). Prints each
way's seconds and whether every SAE's result is the same both ways.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORK = Path(os.environ.get("BENCH_WORK") or Path(tempfile.gettempdir()) / "mistudio-bench-probing")


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.demo_training import demo_topics
    from engine.saebench.sparse_probing import sparse_probing, split_by_class
    from engine.testing.tiny_models import build_tiny_model
    from engine.testing.tiny_saes import random_sae

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--saes", type=int, default=8)
    parser.add_argument("--size", default="small", choices=["small", "gpt2-small"])
    parser.add_argument("--per-class", type=int, default=250)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()

    folder = WORK / f"gpt2-{args.size}"
    if not (folder / "config.json").exists():
        build_tiny_model("gpt2", folder, size=args.size, seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    width = model.config.hidden_size
    hook = f"blocks.{model.config.num_hidden_layers // 2}.hook_resid_post"
    saes = [
        random_sae(width, "topk", k=8 * 2 ** (index % 4), expansion=8, seed=index)
        for index in range(args.saes)
    ]
    split = split_by_class(
        demo_topics(args.per_class), train_fraction=0.8, max_per_class=args.per_class, seed=42
    )
    options = {"hook_name": hook, "k_values": [1, 2, 5], "context_length": args.context, "seed": 42}

    started = time.perf_counter()
    alone = [sparse_probing(model, tokenizer, [sae], split, **options)[0] for sae in saes]
    one_at_a_time = time.perf_counter() - started
    started = time.perf_counter()
    together = sparse_probing(model, tokenizer, saes, split, **options)
    at_once = time.perf_counter() - started

    texts = sum(len(texts) for side in (split.train, split.test) for texts in side.values())
    print(f"{args.saes} SAEs at {hook} of gpt2 {args.size}; {texts} texts of up to {args.context} tokens")
    print(
        f"one at a time: {one_at_a_time:.1f} s   together: {at_once:.1f} s   ({one_at_a_time / at_once:.2f}x)"
    )
    print("results identical:", alone == together)


if __name__ == "__main__":
    main()
