"""The GPU benchmark (issue 17, part 4): extraction, decode and SAE training throughput on one
device, printed as one markdown table to paste into docs/benchmarks.md.

Model (``--model``), random weights, built in a temporary folder and loaded with
``engine.loading.load_weights`` onto ``--device`` (default cuda:0; ``cpu`` for a sanity run):

* ``gpt2-small``: the kit's GPT-2 small geometry (124M parameters), float32 by default;
* ``llama-1b``: Llama 3.2 1B's geometry (1.24B: 16 layers, width 2048, 32 query / 8 key-value
  heads, MLP 8192, vocabulary 128,256, tied embeddings), defined here (the kit's largest Llama is
  "small"), bfloat16 by default. ``--quantization`` picks none / fp16 / bf16 for either.

Rows of the table (real, non-pad tokens per second; medians of ``--repeats`` after a warm-up):

* **extraction**: miStudio from token ids to a finalized cache on disk (``plan_batches`` ->
  ``extract`` -> ``CacheWriter`` through its ``BackgroundWriter``: the worker task's path) of
  resid_post at the first, middle and last block, on ``--samples`` texts of 16-256 tokens of the
  kit's corpus, batch size 16; against the bare forward pass over the same batches stopped after
  the deepest block. Both are bench/extraction.py's ``run_mistudio`` and ``run_limit``. Goal
  >= 0.85x.
* **extraction vs peers**: the same data through TransformerLens (``run_with_cache``) and nnsight
  (``trace`` + ``save``), bench/extraction.py's contenders run by ``--bench-python`` (default:
  .venv-bench's, see bench/requirements-bench.txt, else this interpreter); a peer that interpreter
  cannot import is "not installed". TransformerLens runs GPT-2 only (bench/peers.py converts
  GPT-2 weights). Goal >= 2x the better peer.
* **decode**: ``engine.generation.generate``, greedy, end-of-sequence ignored, 128 new tokens
  after a 64-token prompt: (tokens - 1) / decode seconds; against ``model.generate`` with the
  same prompt ids and ``min_new_tokens``, timed by a streamer from its first to its last token.
  Goal >= 0.9x.
* **SAE training**: ``engine.sae.train`` on ``--device``, TopK (d_sae = 8 x width, k = 32, batch
  4096) for 2M tokens, fed as the SAE task feeds it: the deepest hook's cache read back shard by
  shard through the shuffle buffer (repeated as often as needed); the trainer's own tokens/s.
  No goal.

Progress goes to stderr; stdout is the heading line and the table.

    .venv/bin/python bench/gpu.py [--device cuda:0] [--model gpt2-small|llama-1b] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# bench/'s own modules (the script's folder is on sys.path when it runs).
from extraction import (  # noqa: E402
    DEFAULT_BENCH_PYTHON,
    build_texts,
    extract_to_cache,
    hook_names,
    real_token_count,
    run_contender,
    run_limit,
    run_mistudio,
)

SEED = 0
MIN_LENGTH = 16
GOAL_EXTRACTION_VS_FORWARD = 0.85
GOAL_EXTRACTION_VS_PEERS = 2.0
GOAL_DECODE_VS_GENERATE = 0.9
SAE_EXPANSION = 8
SAE_K = 32
SAE_LEARNING_RATE = 1e-3
SAE_CHUNK_ROWS = 16_384
SAE_BUFFER_BATCHES = 16
SAE_SAMPLE_ROWS = 4096
QUANTIZATIONS = ("none", "fp16", "bf16")
TORCH_DTYPES = {"none": "float32", "fp16": "float16", "bf16": "bfloat16"}
PEERS = (("transformer_lens", "TransformerLens"), ("nnsight", "nnsight"))

# Llama 3.2 1B (meta-llama/Llama-3.2-1B's config.json), with a shorter context: positions have no
# weights, so the benchmark's lengths are all it needs.
LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128_256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500_000.0,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class ModelChoice:
    family: str
    quantization: str
    description: str


MODELS: dict[str, ModelChoice] = {
    "gpt2-small": ModelChoice("gpt2", "none", "GPT-2 small geometry"),
    "llama-1b": ModelChoice("llama", "bf16", "Llama 3.2 1B geometry"),
}


@dataclass(frozen=True)
class Sizes:
    samples: int
    max_length: int
    repeats: int
    prompt_tokens: int
    new_tokens: int
    sae_tokens: int
    sae_batch_size: int


FULL = Sizes(
    samples=512,
    max_length=256,
    repeats=3,
    prompt_tokens=64,
    new_tokens=128,
    sae_tokens=2_000_000,
    sae_batch_size=4096,
)
# A sanity run (a minute or two on a laptop CPU for gpt2-small): every part runs, numbers mean little.
QUICK = Sizes(
    samples=16,
    max_length=64,
    repeats=1,
    prompt_tokens=16,
    new_tokens=16,
    sae_tokens=8192,
    sae_batch_size=1024,
)


@dataclass(frozen=True)
class Options:
    device: str
    model: str
    quantization: str
    sizes: Sizes
    bench_python: Path
    peers: bool


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` (= cuda:0) or ``cuda:N``; anything else is an argparse error."""
    if text == "cpu":
        return text
    if text == "cuda":
        return "cuda:0"
    kind, _, index = text.partition(":")
    if kind == "cuda" and index.isdigit():
        return f"cuda:{int(index)}"
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def parse_options(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", type=device_name, default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-small")
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, help="default: none for gpt2-small, bf16 for llama-1b"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a sanity run that finishes fast")
    parser.add_argument("--samples", type=int, help=f"extraction samples (default {FULL.samples})")
    parser.add_argument("--repeats", type=int, help=f"timed runs per measurement (default {FULL.repeats})")
    parser.add_argument(
        "--bench-python",
        type=Path,
        help="the interpreter the peers run in (default: .venv-bench's if present)",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip TransformerLens and nnsight")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    overrides = {
        name: getattr(args, name) for name in ("samples", "repeats") if getattr(args, name) is not None
    }
    for name, value in overrides.items():
        if value < 1:
            parser.error(f"--{name} must be at least 1")
    sizes = replace(sizes, **overrides)
    bench_python = args.bench_python
    if bench_python is None:
        bench_python = DEFAULT_BENCH_PYTHON if DEFAULT_BENCH_PYTHON.exists() else Path(sys.executable)
    return Options(
        device=args.device,
        model=args.model,
        quantization=args.quantization or MODELS[args.model].quantization,
        sizes=sizes,
        bench_python=bench_python,
        peers=not args.no_peers,
    )


def hook_layers(layers: int) -> list[int]:
    """The blocks whose resid_post is extracted: the first, the middle and the last."""
    return sorted({0, layers // 2, layers - 1})


# -- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    measurement: str
    # Tokens per second; None when it did not run.
    rate: float | None
    # What it is compared with, in words (with that side's rate).
    against: str = "-"
    ratio: float | None = None
    # The least ratio that meets the goal; None for a row without one.
    goal: float | None = None


def rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:,.0f}"


def verdict(ratio: float | None, goal: float | None) -> str:
    if goal is None:
        return "-"
    if ratio is None:
        return f"≥ {goal:.2f}: n/a"
    return f"≥ {goal:.2f}: {'met' if ratio >= goal else 'MISSED'}"


def markdown_table(rows: Sequence[Row]) -> str:
    lines = [
        "| measurement | tokens/s | against | ratio | goal |",
        "|---|---:|---|---:|---|",
    ]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        cells = (row.measurement, rate_text(row.rate), row.against, ratio, verdict(row.ratio, row.goal))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_of(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def peer_text(label: str, outcome: float | str) -> str:
    """A peer in the "against" column: its rate, or why it has none ("not installed", ...)."""
    return f"{label} {outcome}" if isinstance(outcome, str) else f"{label} {outcome:,.0f}"


def table_rows(
    *,
    deepest: int,
    hooks: int,
    limit: float,
    extraction: float,
    peers: dict[str, float | str],
    decode: float,
    generate: float,
    sae: float,
    sae_shape: str,
) -> list[Row]:
    """The table's rows from the measured rates (tokens/s). ``peers`` maps a peer's label to its
    rate or to why it has none."""
    rates = [outcome for outcome in peers.values() if not isinstance(outcome, str)]
    best_peer = max(rates) if rates else None
    extraction_label = f"extraction, {hooks} hooks to disk"
    return [
        Row(
            extraction_label,
            extraction,
            f"bare forward to block {deepest}: {limit:,.0f}",
            ratio_of(extraction, limit),
            GOAL_EXTRACTION_VS_FORWARD,
        ),
        Row(
            extraction_label,
            extraction,
            "better of " + ", ".join(peer_text(label, outcome) for label, outcome in peers.items()),
            ratio_of(extraction, best_peer),
            GOAL_EXTRACTION_VS_PEERS,
        ),
        Row(
            "decode, greedy",
            decode,
            f"model.generate: {generate:,.0f}",
            ratio_of(decode, generate),
            GOAL_DECODE_VS_GENERATE,
        ),
        Row(f"SAE training, {sae_shape}", sae),
    ]


def heading(
    *, device: str, device_label: str, model: str, parameters: int, quantization: str, detail: str
) -> str:
    import torch
    import transformers

    return (
        f"**{device_label}** ({device}): {MODELS[model].description}, random weights, {parameters:,} "
        f"parameters, {TORCH_DTYPES[quantization]}; {detail}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


# -- the model -------------------------------------------------------------------------------------


def build_model(model: str, folder: Path, *, device: str, quantization: str) -> Path:
    """The model's folder: the kit's GPT-2 small, or the Llama 1B geometry made on ``device`` in
    the benchmark's dtype (1.2B float32 parameters built on a CPU first would need 5 GB)."""
    import torch
    import transformers

    from engine.testing.tiny_models import build_tiny_model, default_tokenizer

    if model == "gpt2-small":
        return build_tiny_model("gpt2", folder, size="gpt2-small", seed=SEED)
    tokenizer = default_tokenizer("llama", "small")
    config = transformers.LlamaConfig(
        **LLAMA_1B,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(SEED)
    with torch.device(device):
        built = transformers.LlamaForCausalLM._from_config(
            config, dtype=getattr(torch, TORCH_DTYPES[quantization])
        )
    built.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del built
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder


def describe_device(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- peers -----------------------------------------------------------------------------------------


def importable(python: Path, module: str) -> bool:
    """Whether ``python`` can import ``module`` (without importing it)."""
    if not Path(python).exists():
        return False
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0


def run_peers(
    options: Options, model, folder: Path, tokenized: list[list[int]], layers: list[int], workdir: Path
):
    """Each peer's tokens/s, or why it has none."""
    from engine.hooks import hook_site

    tokens = real_token_count(tokenized)
    # The path of the block list in the Hugging Face model (transformer.h, model.layers).
    blocks = hook_site(model, "blocks.0.hook_resid_post").module_path.rsplit(".", 1)[0]
    data_file = workdir / "peer-data.json"
    data = {
        "tokenized": tokenized,
        "layers": layers,
        "device": options.device,
        "dtype": TORCH_DTYPES[options.quantization],
        "blocks": blocks,
    }
    data_file.write_text(json.dumps(data))
    outcomes: dict[str, float | str] = {}
    for module, label in PEERS:
        if not options.peers:
            outcomes[label] = "skipped"
        elif module == "transformer_lens" and options.model != "gpt2-small":
            outcomes[label] = "n/a (GPT-2 only here)"
        elif not importable(options.bench_python, module):
            outcomes[label] = "not installed"
        else:
            log(f"running {label} in {options.bench_python} ...")
            result = run_contender(module, options.bench_python, folder, data_file, options.sizes.repeats)
            outcomes[label] = "failed" if result is None else tokens / result["seconds"]
    return outcomes


# -- decode ----------------------------------------------------------------------------------------


class TokenTimes:
    """A ``generate`` streamer noting when each new token arrives (its first put is the prompt).
    bench/generation.py has the same one, but importing it sets Django up."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def prompt_ids(tokenizer, length: int) -> list[int]:
    """``length`` token ids of the kit's corpus."""
    from engine.testing.tiny_models import local_corpus

    ids: list[int] = []
    for paragraph in local_corpus(20_000):
        ids.extend(tokenizer(paragraph, add_special_tokens=False).input_ids)
        if len(ids) >= length:
            return ids[:length]
    raise RuntimeError("the corpus is shorter than the prompt")


def measure_decode(
    model, tokenizer, *, prompt_tokens: int, new_tokens: int, repeats: int
) -> tuple[float, float]:
    """Decode tokens/s of ``generate`` and of ``model.generate``, interleaved rounds, medians."""
    import torch

    from engine.generation import SamplingParams, generate
    from engine.runtime import pad_token_id

    ids = prompt_ids(tokenizer, prompt_tokens)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    device = model.get_input_embeddings().weight.device
    input_ids = torch.tensor([ids], device=device)

    def ours() -> float:
        (result,) = generate(model, tokenizer, [ids], [params])
        return (len(result.token_ids) - 1) / result.decode_seconds

    def theirs() -> float:
        streamer = TokenTimes()
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                streamer=streamer,
                pad_token_id=pad_token_id(model),
            )
        return (len(streamer.times) - 1) / (streamer.times[-1] - streamer.times[0])

    ours(), theirs()  # warm-up
    rates: dict[str, list[float]] = {"ours": [], "theirs": []}
    for round_number in range(repeats):
        order = (("ours", ours), ("theirs", theirs))
        for name, run in order if round_number % 2 == 0 else order[::-1]:
            rates[name].append(run())
    return statistics.median(rates["ours"]), statistics.median(rates["theirs"])


# -- SAE training ----------------------------------------------------------------------------------


def measure_sae_training(
    model,
    tokenized: list[list[int]],
    hook: str,
    *,
    device: str,
    tokens: int,
    batch_size: int,
    directory: Path,
) -> tuple[float, str]:
    """The trainer's tokens/s on ``hook``'s cache (written first, not timed), and the SAE's shape."""
    from activations.store import ActivationStore
    from engine.prefetch import prefetched
    from engine.sae import TrainingConfig, shuffled_batches, train

    extract_to_cache(model, tokenized, [hook], directory)
    store = ActivationStore.open(directory)
    rows, width = store.shape(hook)
    epochs = math.ceil(tokens / rows)

    def chunks():
        for _ in range(epochs):
            for start in range(0, rows, SAE_CHUNK_ROWS):
                yield store.get(hook, start, min(start + SAE_CHUNK_ROWS, rows), as_torch=True).float()

    steps = math.ceil(tokens / batch_size)
    config = TrainingConfig(
        architecture="topk",
        d_sae=SAE_EXPANSION * width,
        k=SAE_K,
        lr=SAE_LEARNING_RATE,
        batch_size=batch_size,
        total_tokens=tokens,
        warmup_steps=max(1, steps // 20),
    )
    batches = shuffled_batches(chunks(), batch_size=batch_size, buffer_rows=SAE_BUFFER_BATCHES * batch_size)
    # Read ahead on a thread and page-locked for a GPU, as the SAE training job does.
    batches = prefetched(batches, depth=4, pin_memory=device.startswith("cuda"))
    sample = store.get(hook, 0, min(rows, SAE_SAMPLE_ROWS), as_torch=True).float()
    with contextlib.closing(batches):
        trained = train(batches, d_in=width, config=config, sample=sample, device=device)
    shape = f"TopK {SAE_EXPANSION} x {width}, k {SAE_K}, batch {batch_size}, {trained.tokens:,} tokens"
    return trained.history[-1].tokens_per_second, shape


# -- main ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    import torch

    from engine.extraction import tokenize_samples
    from engine.hooks import num_layers
    from engine.loading import load_weights

    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"bench/gpu.py: no CUDA device visible (torch {torch.__version__}); try --device cpu"
        )
    torch.manual_seed(SEED)
    sizes = options.sizes
    choice = MODELS[options.model]
    workdir = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    try:
        log(f"building {options.model} ...")
        folder = build_model(
            options.model, workdir / "model", device=options.device, quantization=options.quantization
        )
        weights = load_weights(
            folder, model_type=choice.family, quantization=options.quantization, device=options.device
        )
        model, tokenizer = weights.model, weights.tokenizer
        texts = build_texts(tokenizer, sizes.samples, lengths=(MIN_LENGTH, sizes.max_length), seed=SEED)
        tokenized = tokenize_samples(tokenizer, texts, sizes.max_length)
        tokens = real_token_count(tokenized)
        layers = hook_layers(num_layers(model))
        hooks = hook_names(layers)

        log(f"running the bare forward and extraction over {tokens:,} tokens ...")
        limit = tokens / run_limit(model, tokenized, max(layers), repeats=sizes.repeats)["seconds"]
        extraction = tokens / run_mistudio(model, tokenized, hooks, repeats=sizes.repeats)["seconds"]
        peers = run_peers(options, model, folder, tokenized, layers, workdir)
        log("running decode ...")
        decode, reference = measure_decode(
            model,
            tokenizer,
            prompt_tokens=sizes.prompt_tokens,
            new_tokens=sizes.new_tokens,
            repeats=sizes.repeats,
        )
        log("running SAE training ...")
        sae, sae_shape = measure_sae_training(
            model, tokenized, hooks[-1], device=options.device, tokens=sizes.sae_tokens,
            batch_size=sizes.sae_batch_size, directory=workdir / "sae-cache",
        )  # fmt: skip
        parameters = weights.parameter_count

        lengths = [len(ids) for ids in tokenized]
        detail = (
            f"{len(tokenized)} samples, {tokens:,} tokens ({min(lengths)}..{max(lengths)} each), hooks "
            f"{', '.join(hooks)}; decode {sizes.new_tokens} tokens after {sizes.prompt_tokens}; median of "
            f"{sizes.repeats}"
        )
        print(
            heading(
                device=options.device, device_label=describe_device(options.device), model=options.model,
                parameters=parameters, quantization=options.quantization, detail=detail,
            )
        )  # fmt: skip
        print()
        rows = table_rows(
            deepest=max(layers), hooks=len(hooks), limit=limit, extraction=extraction, peers=peers,
            decode=decode, generate=reference, sae=sae, sae_shape=sae_shape,
        )  # fmt: skip
        print(markdown_table(rows))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
