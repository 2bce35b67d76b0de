"""What splitting a model costs: GPT-2 small whole on the CPU against the same
weights under ``--device auto`` with a CPU budget below the model, the rest offloaded to disk.

For each placement: what sits where (``bytes_by_device``), extraction to a cache (3 hooks, the
same samples and writer as bench/extraction.py) and greedy decode tokens/s (``engine.generate``,
64 new tokens after a 32-token prompt). The split runs read the offloaded layers' weights from
the model's safetensors file on every forward pass (the page cache keeps them warm here, as it
would on any machine whose RAM holds the file; the budget is what the *process* may hold).

    .venv/bin/python bench/offload.py [--samples 64] [--budgets 0.75,0.5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extraction import SEED, build_texts, hook_names, real_token_count, run_mistudio

PROMPT_TOKENS = 32
NEW_TOKENS = 64


def decode_rate(weights, prompt: list[int], *, repeats: int) -> float:
    from engine.generation import SamplingParams, generate

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    generate(weights.model, weights.tokenizer, [prompt], [SamplingParams(max_new_tokens=2, temperature=0)])
    rates = []
    for _ in range(repeats):
        (result,) = generate(weights.model, weights.tokenizer, [prompt], [params])
        rates.append((len(result.token_ids) - 1) / result.decode_seconds)
    return statistics.median(rates)


def mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--budgets", default="0.75,0.5", help="CPU budgets as fractions of the model")
    parser.add_argument("--repeats", type=int, default=5, help="rounds over all placements")
    args = parser.parse_args()

    import torch

    from engine.extraction import tokenize_samples
    from engine.loading import load_weights, release, warm_up
    from engine.placement import DISK, Placement
    from engine.testing.tiny_models import build_tiny_model

    hooks = hook_names([0, 6, 11])
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as workdir:
        folder = build_tiny_model("gpt2", Path(workdir) / "gpt2-small", size="gpt2-small", seed=SEED)
        whole = load_weights(folder, model_type="gpt2", quantization="none", device="cpu")
        texts = build_texts(whole.tokenizer, args.samples, lengths=(32, 128), seed=SEED)
        tokenized = tokenize_samples(whole.tokenizer, texts, 128)
        prompt = tokenized[0][:PROMPT_TOKENS]
        tokens = real_token_count(tokenized)
        size = whole.memory_usage_bytes
        print(
            f"GPT-2 small (random weights, fp32, {mib(size)}); extraction of {args.samples} samples "
            f"({tokens:,} tokens, hooks {', '.join(hooks)}); decode {NEW_TOKENS} tokens after {len(prompt)}; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats} rounds\n"
        )
        placements = {"whole, cpu": whole}
        for fraction in (float(part) for part in args.budgets.split(",")):
            budget = {"cpu": int(fraction * size)}
            placement = Placement(device="auto", max_memory=budget, offload_folder=str(Path(workdir) / "o"))
            split = load_weights(folder, model_type="gpt2", quantization="none", device=placement)
            placements[f"auto, cpu={fraction:.0%} of the model"] = split
        for weights in placements.values():
            warm_up(weights)
        # Rounds over every placement, so a busy spell of the shared CPU hits them all.
        extraction_seconds: dict[str, list[float]] = {label: [] for label in placements}
        decode_rates: dict[str, list[float]] = {label: [] for label in placements}
        for round_number in range(args.repeats):
            for label, weights in placements.items():
                extraction_seconds[label].append(
                    run_mistudio(weights.model, tokenized, hooks, repeats=1)["seconds"]
                )
                decode_rates[label].append(decode_rate(weights, prompt, repeats=1))
            print(f"  round {round_number + 1} done", file=sys.stderr)
        rows = [
            {
                "label": label,
                "placed": weights.bytes_by_device,
                "extraction": tokens / statistics.median(extraction_seconds[label]),
                "decode": statistics.median(decode_rates[label]),
            }
            for label, weights in placements.items()
        ]
        for weights in placements.values():
            release(weights)

        base = rows[0]
        print("| placement | in memory | on disk | extraction tok/s | x whole | decode tok/s | x whole |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            in_memory = sum(value for name, value in row["placed"].items() if name != DISK)
            print(
                f"| {row['label']} | {mib(in_memory)} | {mib(row['placed'].get(DISK, 0))} "
                f"| {row['extraction']:,.0f} | {row['extraction'] / base['extraction']:.2f} "
                f"| {row['decode']:.1f} | {row['decode'] / base['decode']:.2f} |"
            )


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)
