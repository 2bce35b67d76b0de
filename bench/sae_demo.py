"""SAEs on the demo model, one per layer: explained variance, L0, dead fraction, CE loss recovered.

The table: all ``blocks.{i}.hook_resid_post`` of demo-gpt2 (4 layers, width 128), a TopK
SAE on each (8x expansion, k = 32), trained on the activations of the demo dataset's samples
(the first 2,000 docstrings of the local corpus, at most 128 tokens each) and evaluated on the
last 5 % of the samples, held out: reconstruction metrics on their activations, and CE loss
recovered with the model running on their token ids (the reconstruction spliced in at the hook,
against the clean and zero-ablated runs). The same engine functions the ``saes`` app runs.

    .venv/bin/python bench/sae_demo.py [--model-dir data/local_models/demo-gpt2] [--epochs 5]

Without ``--model-dir`` (or when it holds no trained model) demo-gpt2 is trained first (90 s).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOLDOUT_FRACTION = 0.05
SAMPLES = 2000
MAX_LENGTH = 128


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=ROOT / "data" / "local_models" / "demo-gpt2")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--expansion", type=int, default=8)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--product-defaults",
        action="store_true",
        help="train as POST /api/saes does when only cache and hook are given: k = default_k(d_in), "
        "expansion = default_expansion(d_in, training tokens), "
        "lr 3e-4, batch 4096, dead_after_steps and total tokens as engine.sae's defaults",
    )
    parser.add_argument("--layers", help="comma-separated layers (default: all)")
    parser.add_argument(
        "--dead-after-steps", type=int, help="default: 1000, or the product's with --product-defaults"
    )
    arguments = parser.parse_args()
    if arguments.product_defaults:
        arguments.lr, arguments.batch_size = 3e-4, 4096
        if "--epochs" not in sys.argv:
            arguments.epochs = 1

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.demo_training import demo_corpus, train_demo_gpt2
    from engine.extraction import extract, plan_batches, tokenize_samples
    from engine.sae import (
        TrainingConfig,
        default_dead_after_steps,
        default_expansion,
        default_k,
        default_total_tokens,
        shuffled_batches,
        train,
    )
    from engine.sae.evaluation import ce_loss_recovered, evaluate_activations

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as temporary:
        folder = arguments.model_dir
        if not (folder / "training_report.json").exists():
            folder = Path(temporary) / "demo-gpt2"
            print("training demo-gpt2 (90 s)…", flush=True)
            train_demo_gpt2(folder, time_budget_seconds=90.0)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True).eval()

    layers = (
        [int(layer) for layer in arguments.layers.split(",")]
        if arguments.layers
        else range(model.config.n_layer)
    )
    hooks = [f"blocks.{layer}.hook_resid_post" for layer in layers]
    tokenized = tokenize_samples(tokenizer, demo_corpus()[:SAMPLES], MAX_LENGTH)
    first_held_out = int(len(tokenized) * (1 - HOLDOUT_FRACTION))
    rows: dict[str, dict[str, list]] = {hook: {"train": [], "held_out": []} for hook in hooks}
    started = time.perf_counter()
    for batch in extract(model, tokenized, plan_batches([len(ids) for ids in tokenized], 16), hooks=hooks):
        held = batch.sample_index >= first_held_out
        for hook in hooks:
            rows[hook]["train"].append(batch.activations[hook][~held])
            rows[hook]["held_out"].append(batch.activations[hook][held])
    sequences = [ids for ids in tokenized[first_held_out:] if len(ids) > 1][:64]
    train_tokens = sum(len(part) for part in rows[hooks[0]]["train"])
    held_out_tokens = sum(len(part) for part in rows[hooks[0]]["held_out"])
    print(
        f"extracted {len(hooks)} hooks, {len(tokenized)} samples in {time.perf_counter() - started:.1f} s: "
        f"{train_tokens:,} training tokens, {held_out_tokens:,} held out; CE over {len(sequences)} samples",
        flush=True,
    )

    results = []
    for hook in hooks:
        data = torch.cat(rows[hook]["train"]).float()
        held_out = torch.cat(rows[hook]["held_out"]).float()
        d_in = data.shape[1]
        total_tokens = arguments.epochs * len(data)
        if arguments.product_defaults and "--epochs" not in sys.argv:
            total_tokens = default_total_tokens(len(data), arguments.batch_size)
        steps = -(-total_tokens // arguments.batch_size)
        product = arguments.product_defaults
        config = TrainingConfig(
            architecture="topk",
            d_sae=(
                default_expansion(d_in, len(data))
                if product and "--expansion" not in sys.argv
                else arguments.expansion
            )
            * d_in,
            k=default_k(d_in) if product and "--k" not in sys.argv else arguments.k,
            lr=arguments.lr,
            batch_size=arguments.batch_size,
            total_tokens=total_tokens,
            warmup_steps=max(1, steps // 20),
            dead_after_steps=arguments.dead_after_steps
            or (default_dead_after_steps(steps) if product else 1000),
        )
        chunks = (
            data[start : start + 16384]
            for _ in range(-(-total_tokens // len(data)))
            for start in range(0, len(data), 16384)
        )
        started = time.perf_counter()
        trained = train(
            shuffled_batches(chunks, batch_size=config.batch_size, buffer_rows=16 * config.batch_size),
            d_in=d_in,
            config=config,
            sample=data[torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:8192]],
        )
        seconds = time.perf_counter() - started
        evaluation = evaluate_activations(trained.sae, [held_out])
        ce = ce_loss_recovered(model, sequences, hook_name=hook, sae=trained.sae)
        result = {
            "hook": hook,
            "d_in": d_in,
            "d_sae": config.d_sae,
            "steps": trained.steps,
            "k": config.k,
            "dead_after_steps": config.dead_after_steps,
            "tokens_per_second": trained.tokens / seconds,
            **evaluation.to_dict(),
            "dead_fraction": evaluation.dead_features / config.d_sae,
            **ce.to_dict(),
        }
        results.append(result)
        print(
            f"{hook:<26} k {config.k:>3}  EV {result['explained_variance']:.3f}  L0 {result['l0']:5.1f}  "
            f"dead {result['dead_fraction']:6.1%}  CE clean {ce.clean_loss:.3f} / SAE {ce.sae_loss:.3f} / "
            f"zero {ce.zero_ablation_loss:.3f}  recovered {ce.ce_loss_recovered:.3f}  "
            f"({trained.steps} steps, {result['tokens_per_second']:,.0f} tok/s)",
            flush=True,
        )
    if arguments.json:
        arguments.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
