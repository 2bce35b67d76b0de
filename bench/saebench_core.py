"""SAEBench's core suite on one SAE: miStudio's (engine.saebench.core) against sae-bench
0.6.0's own ``run_evals``, on the same SAE, model, token batches and CPU.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv-bench/bin/python bench/saebench_core.py [--size gpt2-small]
        [--reconstruction-batches 10] [--sparsity-batches 1] [--repeats 2]

The model is a GPT-2 of ``--size`` (``gpt2-small``: GPT-2 small's exact geometry, 124 M parameters
with its 50,257-token vocabulary, random weights; ``small``: 4 layers, 256 wide), transformers here
and TransformerLens there (bench/peers.py, ``from_pretrained_no_processing``'s weights); the SAE
a random TopK with 16 x d_model features at the middle layer's resid_post, read by sae-bench
through its SAELens folder. Batches are SAEBench's defaults (16 prompts of 128 tokens, every
metric on), cut from local English text. Each contender runs ``--repeats`` times (the best is
reported), after one warm-up; the largest relative difference between the two results is printed
beside the times, so a faster wrong answer shows. ``--saes N`` judges N SAEs at the hook together
(one stacked pass a batch for all) against N runs of sae-bench (its time for the first, times N).
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
sys.path.insert(0, str(ROOT / "bench"))

WORK = Path(os.environ.get("BENCH_WORK") or Path(tempfile.gettempdir()) / "mistudio-bench-saebench")


def main() -> None:
    import peers
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.sae.formats import save_saelens
    from engine.saebench.core import CoreConfig, context_batches, core_metrics_many
    from engine.testing.corpus import local_corpus
    from engine.testing.tiny_models import build_tiny_model
    from engine.testing.tiny_saes import random_sae

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="gpt2-small", choices=["small", "gpt2-small"])
    parser.add_argument("--reconstruction-batches", type=int, default=10)
    parser.add_argument("--sparsity-batches", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--saes", type=int, default=1,
        help="SAEs at the hook in one run (ours: together; sae-bench: its time for one, times this)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))

    import sae_lens
    from sae_bench.evals.core import main as saebench
    from sae_bench.evals.core.eval_config import CoreEvalConfig
    from sae_bench.sae_bench_utils import general_utils

    folder = WORK / args.size
    if not (folder / "config.json").exists():
        build_tiny_model("gpt2", folder, size=args.size, seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    theirs_model = peers.load_transformer_lens(folder)
    d_model, layers = model.config.n_embd, model.config.n_layer
    hook = f"blocks.{layers // 2}.hook_resid_post"
    saes = [random_sae(d_model, "topk", k=32, expansion=16, seed=3 + index) for index in range(args.saes)]
    sae = saes[0]
    sae_folder = save_saelens(sae, WORK / f"sae-{args.size}", hook_name=hook, model_name=f"bench-{args.size}")
    config = CoreConfig(
        n_eval_reconstruction_batches=args.reconstruction_batches,
        n_eval_sparsity_variance_batches=args.sparsity_batches,
    )
    batches = context_batches(
        (tokenizer(text)["input_ids"] for text in local_corpus() * 50),
        context_size=config.context_size,
        batch_size=config.batch_size_prompts,
        batches=config.batches,
        bos_token_id=tokenizer.bos_token_id,
    )
    ignore = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}
    _, their_sae, _ = general_utils.load_and_format_sae(
        "bench", sae_lens.SAE.load_from_disk(sae_folder), "cpu"
    )
    their_config = CoreEvalConfig(
        model_name=f"bench-{args.size}",
        **{key: value for key, value in config.to_dict().items() if key != "context_size"},
        context_size=config.context_size,
    )

    class SameBatches:
        context_size = config.context_size
        store_batch_size_prompts = config.batch_size_prompts
        position = 0

        def get_batch_tokens(self, prompts):
            self.position += 1
            return batches[self.position - 1]

        def reset_input_dataset(self):
            self.position = 0

    def ours():
        return core_metrics_many(model, saes, batches, hook_name=hook, ignore_tokens=ignore, config=config)[0]

    def theirs():
        metrics, features = saebench.run_evals(
            their_sae, SameBatches(), theirs_model, their_config, ignore_tokens=ignore
        )
        metrics["misc_metrics"] = saebench.calculate_misc_metrics(features)
        return metrics

    def timed(run):
        run()  # warm-up
        best, result = float("inf"), None
        for _ in range(args.repeats):
            started = time.perf_counter()
            result = run()
            best = min(best, time.perf_counter() - started)
        return best, result

    our_seconds, our_result = timed(ours)
    their_seconds, their_result = timed(theirs)
    worst = max(
        abs(our_result.metrics[group][name] - value) / max(abs(value), 1e-6)
        for group, values in their_result.items()
        for name, value in values.items()
    )
    tokens = config.batches * config.batch_size_prompts * config.context_size
    print(
        f"model: GPT-2 {args.size} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters), "
        f"SAE {d_model} x {sae.shape.d_sae} TopK at {hook}"
    )
    print(
        f"batches: {config.n_eval_reconstruction_batches} reconstruction, "
        f"{config.n_eval_sparsity_variance_batches} sparsity/variance, "
        f"{config.batch_size_prompts} x {config.context_size} tokens ({tokens:,} tokens)"
    )
    their_seconds *= args.saes  # sae-bench judges one SAE a run
    print(f"SAEs       {args.saes}{' (sae-bench: its time for one, times that)' if args.saes > 1 else ''}")
    print(f"miStudio   {our_seconds:7.2f} s")
    print(f"sae-bench  {their_seconds:7.2f} s")
    print(
        f"speed-up   {their_seconds / our_seconds:7.2f} x   "
        f"(largest relative difference of a metric: {worst:.1e})"
    )
    print(
        f"ours: L0 {our_result.metrics['sparsity']['l0']:.2f}, "
        f"CE score {our_result.metrics['model_performance_preservation']['ce_loss_score']:.4f}, "
        f"KL score {our_result.metrics['model_behavior_preservation']['kl_div_score']:.4f}"
    )


if __name__ == "__main__":
    main()
