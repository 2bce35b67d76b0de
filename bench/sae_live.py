"""Training from the model on the fly: one SAE against SAELens's own runner, four SAEs in
one job against four jobs and against sparsify, and memory as the token count grows.

Every run is a fresh process (its peak RSS its own), on the CPU, timed around the training call
(model forward passes, shuffling and the SAE steps all included; loading the model not).

* **one SAE**: a TopK SAE at ``blocks.6.hook_resid_post`` of a GPT-2-small-geometry model with
  random weights, trained on the same token ids by ours (``engine.sae.group.train_group`` fed by
  ``model_source``, what the group job runs) and by SAELens 6's ``LanguageModelSAETrainingRunner``
  (its ``ActivationsStore``; the model as a ``HookedTransformer`` holding the very same weights,
  converted by TransformerLens; the dataset pretokenized to the same ids). Same hyper-parameters:
  ``--expansion``, ``--k``, ``--batch-size`` tokens a step, ``--lr`` with a 5 % warm-up and a
  linear decay over the last 20 %, AuxK 1/32, decoder rows of norm 0.1, activations scaled to a
  mean norm of sqrt(d_in), a shuffle buffer of 16 batches, 32 samples of ``--context`` tokens a
  forward pass. Both SAEs are then scored by one function on held-out text (explained variance,
  L0), loaded by SAELens's ``SAE.load_from_disk``. Goal: tokens/s >= 1.2x, explained variance at
  least as good.
* **four at once**: four TopK SAEs in one group (one forward pass a batch) against four groups of
  one (each runs the model as far as its hook), and against eai-sparsify's ``Trainer`` on the same
  four hook points (module outputs), same expansion, k, tokens a step, token ids, AuxK (1/32, for
  latents silent as long as ours counts them dead). ``--four-sites spread``: the resid_post of
  blocks 2, 5, 8, 11 (four separate jobs that stop early run 30/12 of a forward pass where the group
  runs one, so 2.5x is the ceiling); ``block``: four sites of block 11 (every job runs it all).
  Goals: >= 2.5x the four jobs, >= 1.0x sparsify.
* **memory**: one SAE from the demo model's geometry (4 layers, width 128) at 1M and 10M tokens:
  peak RSS growth <= 10 %.

    .venv/bin/python bench/sae_live.py [--tokens 65536] [--group-tokens 32768] [--expansion 4]
        [--k 32] [--batch-size 1024] [--context 128] [--parts one,four,memory] [--four-sites spread]

SAELens and sparsify run in .venv-bench (bench/requirements-bench.txt); without it only ours runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
ONE_HOOK = "blocks.6.hook_resid_post"
# The four hook points of the many-at-once part: spread over the layers (four separate jobs, each
# stopping after its hook, run 30/12 of a forward pass where the group runs one: at most 2.5x), or
# the sites of the last block (each separate job runs the whole forward pass: up to 4x).
FOUR_SITES = {
    "spread": [f"blocks.{layer}.hook_resid_post" for layer in (2, 5, 8, 11)],
    "block": [
        f"blocks.11.{hook}"
        for hook in ("hook_attn_out", "ln2.hook_normalized", "hook_mlp_out", "hook_resid_post")
    ],
}
# sparsify names a module whose output it reads.
SPARSIFY_MODULES = {
    "hook_resid_post": "",
    "hook_attn_out": ".attn",
    "ln2.hook_normalized": ".ln_2",
    "hook_mlp_out": ".mlp",
}
FORWARD_SAMPLES = 32
BUFFER_BATCHES = 16
AUX_COEFFICIENT = 1 / 32
HELD_OUT_SAMPLES = 64


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def schedule(tokens: int, batch_size: int) -> tuple[int, int, int]:
    steps = -(-tokens // batch_size)
    return steps, max(1, steps // 20), max(1, steps // 5)


def build_model(folder: Path, size: str) -> None:
    from engine.demo_training import train_demo_gpt2
    from engine.testing.tiny_models import build_tiny_model

    if (folder / "config.json").exists():
        return
    if size == "demo":
        train_demo_gpt2(folder, time_budget_seconds=3.0)  # the demo's geometry and tokenizer
    else:
        build_tiny_model("gpt2", folder, size=size, seed=0)


def token_samples(folder: Path, context: int, count: int) -> list[list[int]]:
    """``count`` samples of exactly ``context`` token ids: the local corpus tokenized, joined and cut."""
    from transformers import AutoTokenizer

    from engine.testing.corpus import local_corpus

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids: list[int] = []
    texts = local_corpus()
    index = 0
    while len(ids) < context * count:
        ids += tokenizer(texts[index % len(texts)])["input_ids"]
        index += 1
    return [ids[start : start + context] for start in range(0, context * count, context)]


def train_ours(folder: str, hooks: list[str], tokens: int, args: dict, save_to: str | None) -> dict:
    import torch

    from engine.loading import load_weights
    from engine.sae import TrainingConfig
    from engine.sae.formats import save_saelens
    from engine.sae.group import GroupMember, model_source, train_group

    torch.manual_seed(0)
    weights = load_weights(Path(folder), model_type="gpt2", quantization="none", device="cpu")
    samples = token_samples(Path(folder), args["context"], args["samples"])
    width = int(weights.model.config.hidden_size)
    steps, warmup, decay = schedule(tokens, args["batch_size"])
    config = TrainingConfig(
        architecture="topk",
        d_sae=args["expansion"] * width,
        k=args["k"],
        lr=args["lr"],
        batch_size=args["batch_size"],
        total_tokens=tokens,
        warmup_steps=warmup,
        decay_fraction=decay / steps,
        dead_after_steps=max(1, steps // 10),
        aux_coefficient=AUX_COEFFICIENT,
    )
    members = [GroupMember(hook, config) for hook in hooks]

    def open_source(position):
        return model_source(
            weights.model,
            None,
            lambda start, stop: samples[start:stop],
            hooks=hooks,
            train_samples=len(samples),
            max_length=args["context"],
            batch_size=FORWARD_SAMPLES,
            window_samples=1024,
            position=position,
        )

    started = time.perf_counter()
    results = train_group(
        members,
        widths=dict.fromkeys(hooks, width),
        open_source=open_source,
        buffer_rows=BUFFER_BATCHES * args["batch_size"],
    )
    seconds = time.perf_counter() - started
    trained_tokens = results[0].tokens
    if save_to:
        for index, hook in enumerate(hooks):
            save_saelens(results[index].sae, Path(save_to) / hook, hook_name=hook, model_name="bench")
    return {
        "tokens": trained_tokens,
        "seconds": seconds,
        "tokens_per_second": trained_tokens / seconds,
        "peak_rss_mib": peak_rss_mib(),
    }


def train_saelens(folder: str, tokens: int, args: dict, save_to: str) -> dict:
    """SAELens's own on-the-fly runner over the same ids, the model converted to a HookedTransformer."""
    import torch
    from datasets import Dataset
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
        TopKTrainingSAEConfig,
    )
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel.from_pretrained(folder, use_safetensors=True).eval()
    c = hf.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer,
        d_model=c.n_embd,
        n_ctx=c.n_positions,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd,
        d_vocab=c.vocab_size,
        act_fn="gelu_new",
        normalization_type="LN",
        eps=c.layer_norm_epsilon,
        default_prepend_bos=False,
        positional_embedding_type="standard",
    )
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(
        convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False, center_unembed=False
    )
    model.eval()
    samples = token_samples(Path(folder), args["context"], args["samples"])
    dataset = Dataset.from_dict({"tokens": samples})
    width = c.n_embd
    steps, warmup, decay = schedule(tokens, args["batch_size"])
    runner_cfg = LanguageModelSAERunnerConfig(
        sae=TopKTrainingSAEConfig(
            d_in=width,
            d_sae=args["expansion"] * width,
            k=args["k"],
            aux_loss_coefficient=AUX_COEFFICIENT,
            decoder_init_norm=0.1,
            normalize_activations="expected_average_only_in",
        ),
        model_name="bench-gpt2",
        hook_name=ONE_HOOK,
        dataset_path="local",
        streaming=False,
        context_size=args["context"],
        training_tokens=tokens,
        train_batch_size_tokens=args["batch_size"],
        # Its buffer holds n_batches_in_buffer x context_size rows: 16 batches, as ours.
        n_batches_in_buffer=max(1, BUFFER_BATCHES * args["batch_size"] // args["context"]),
        # The activation scale from 8,192 rows, as ours (its default reads 1,000 batches first).
        n_batches_for_norm_estimate=max(1, 8192 // args["batch_size"]),
        store_batch_size_prompts=FORWARD_SAMPLES,
        lr=args["lr"],
        lr_warm_up_steps=warmup,
        lr_decay_steps=decay,
        dead_feature_window=max(1, steps // 10),
        feature_sampling_window=steps + 1,
        device="cpu",
        logger=LoggingConfig(log_to_wandb=False),
        checkpoint_path=None,
        output_path=save_to,
        verbose=False,
        prepend_bos=False,
    )
    runner = LanguageModelSAETrainingRunner(runner_cfg, override_model=model, override_dataset=dataset)
    started = time.perf_counter()
    runner.run()
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "peak_rss_mib": peak_rss_mib(),
    }


def train_sparsify(folder: str, hooks: list[str], tokens: int, args: dict, save_to: str) -> dict:
    """eai-sparsify's Trainer on the same ids and hook points (module outputs: the residual stream)."""
    os.environ["SPARSIFY_DISABLE_TRITON"] = "1"
    import torch
    from datasets import Dataset
    from sparsify import SaeConfig, TrainConfig, Trainer
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel.from_pretrained(folder, use_safetensors=True).eval()
    count = tokens // args["context"]
    samples = token_samples(Path(folder), args["context"], count)
    dataset = Dataset.from_dict({"input_ids": samples}).with_format("torch")
    config = TrainConfig(
        SaeConfig(expansion_factor=args["expansion"], k=args["k"]),
        batch_size=args["batch_size"] // args["context"],
        hookpoints=[sparsify_module(hook) for hook in hooks],
        # AuxK as ours: 1/32, for latents silent as long as ours counts them dead.
        auxk_alpha=AUX_COEFFICIENT,
        dead_feature_threshold=max(1, schedule(tokens, args["batch_size"])[0] // 10) * args["batch_size"],
        lr=args["lr"],
        log_to_wandb=False,
        save_dir=save_to,
        optimizer="adam",
    )
    trainer = Trainer(config, dataset, model)
    started = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - started
    trained = count * args["context"]
    return {
        "tokens": trained,
        "seconds": seconds,
        "tokens_per_second": trained / seconds,
        "peak_rss_mib": peak_rss_mib(),
    }


def sparsify_module(hook: str) -> str:
    _, layer, site = hook.split(".", 2)
    return f"h.{layer}{SPARSIFY_MODULES[site]}"


def score(folder: str, hook: str, saes: list[str], args: dict) -> list[dict]:
    """Explained variance and L0 on held-out ids (past the training ones) of each SAELens folder."""
    import torch

    from engine.extraction import extract, plan_batches
    from engine.loading import load_weights

    weights = load_weights(Path(folder), model_type="gpt2", quantization="none", device="cpu")
    everything = token_samples(Path(folder), args["context"], args["samples"] + HELD_OUT_SAMPLES)
    held_out = everything[args["samples"] :]
    batches = extract(weights.model, held_out, plan_batches([len(s) for s in held_out], 16), hooks=[hook])
    rows = torch.cat([batch.activations[hook] for batch in batches]).float()
    try:
        from sae_lens import SAE

        load = SAE.load_from_disk
    except ImportError:
        from engine.sae.formats import load_saelens

        def load(path):
            return load_saelens(path)[0]

    sys.path.insert(0, str(Path(__file__).parent))
    from sae import held_out_quality  # bench/sae.py's scorer: one function for every benchmark

    return [held_out_quality(load(path), rows) for path in saes]


def run_json(python: Path | str, *arguments: str) -> dict | list:
    command = [str(python), __file__, *arguments]
    environment = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if finished.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{finished.stderr[-4000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def child(arguments: list[str]) -> None:
    role, folder, spec = arguments[0], arguments[1], json.loads(arguments[2])
    if role == "ours":
        result = train_ours(folder, spec["hooks"], spec["tokens"], spec, spec.get("save_to"))
    elif role == "saelens":
        result = train_saelens(folder, spec["tokens"], spec, spec["save_to"])
    elif role == "sparsify":
        result = train_sparsify(folder, spec["hooks"], spec["tokens"], spec, spec["save_to"])
    else:
        result = score(folder, spec["hook"], spec["saes"], spec)
    print(json.dumps(result))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--group-tokens", type=int, default=32768)
    parser.add_argument("--expansion", type=int, default=4)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--parts", default="one,four,memory")
    parser.add_argument("--four-sites", choices=sorted(FOUR_SITES), default="spread")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    peers = BENCH_PYTHON.exists()
    base = {
        "expansion": args.expansion, "k": args.k, "batch_size": args.batch_size, "context": args.context,
        "lr": args.lr,
    }  # fmt: skip
    me = sys.executable
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        if parts & {"one", "four"}:
            folder = work / "gpt2-small"
            build_model(folder, "gpt2-small")
        if "one" in parts:
            spec = {**base, "tokens": args.tokens, "samples": args.tokens // args.context}
            ours = run_json(
                me,
                "--child",
                "ours",
                str(folder),
                json.dumps({**spec, "hooks": [ONE_HOOK], "save_to": str(work / "ours")}),
            )
            row = {"ours": ours}
            saes = [str(work / "ours" / ONE_HOOK)]
            if peers:
                row["saelens"] = run_json(
                    BENCH_PYTHON,
                    "--child",
                    "saelens",
                    str(folder),
                    json.dumps({**spec, "save_to": str(work / "saelens")}),
                )
                saes.append(str(work / "saelens"))
            scorer = BENCH_PYTHON if peers else me
            row["held_out"] = run_json(
                scorer, "--child", "score", str(folder), json.dumps({**spec, "hook": ONE_HOOK, "saes": saes})
            )
            if peers:
                row["ratio"] = ours["tokens_per_second"] / row["saelens"]["tokens_per_second"]
            print(json.dumps({"one_sae": row}, indent=1), flush=True)
        if "four" in parts:
            spec = {**base, "tokens": args.group_tokens, "samples": args.group_tokens // args.context}
            four_hooks = FOUR_SITES[args.four_sites]
            together = run_json(me, "--child", "ours", str(folder), json.dumps({**spec, "hooks": four_hooks}))
            apart = [
                run_json(me, "--child", "ours", str(folder), json.dumps({**spec, "hooks": [hook]}))
                for hook in four_hooks
            ]
            row = {
                "group": together,
                "separate_seconds": [run["seconds"] for run in apart],
                "ratio_vs_separate": sum(run["seconds"] for run in apart) / together["seconds"],
            }
            if peers:
                row["sparsify"] = run_json(
                    BENCH_PYTHON,
                    "--child",
                    "sparsify",
                    str(folder),
                    json.dumps({**spec, "hooks": four_hooks, "save_to": str(work / "sparsify")}),
                )
                row["ratio_vs_sparsify"] = (
                    together["tokens_per_second"] / row["sparsify"]["tokens_per_second"]
                )
            print(json.dumps({f"four_saes_{args.four_sites}": row}, indent=1), flush=True)
        if "memory" in parts:
            demo = work / "demo"
            build_model(demo, "demo")
            runs = {}
            for tokens in (1_000_000, 10_000_000):
                spec = {
                    **base, "expansion": 16, "k": 16, "batch_size": 4096, "tokens": tokens, "samples": 4096,
                    "hooks": ["blocks.1.hook_resid_post"],
                }  # fmt: skip
                runs[tokens] = run_json(me, "--child", "ours", str(demo), json.dumps(spec))
            growth = runs[10_000_000]["peak_rss_mib"] / runs[1_000_000]["peak_rss_mib"] - 1
            print(json.dumps({"memory": {"runs": runs, "growth": growth}}, indent=1), flush=True)


if __name__ == "__main__":
    main()
