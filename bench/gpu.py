"""The GPU benchmark: where extraction time goes, extraction
against its peers, decode and SAE training on one device, printed as a markdown table to paste
into docs/benchmarks.md (and written with its numbers as JSON to ``--output-dir``, default $OUT).

Model (``--model``), random weights, built in a temporary folder and loaded with
``engine.loading.load_weights`` onto ``--device`` (default cuda:0; ``cpu`` for a sanity run):

* ``gpt2-small``: the kit's GPT-2 small geometry (124M parameters), float32 by default;
* ``llama-1b``: Llama 3.2 1B's geometry (1.24B: 16 layers, width 2048, 32 query / 8 key-value
  heads, MLP 8192, vocabulary 128,256, tied embeddings), defined here (the kit's largest Llama is
  "small"), bfloat16 by default. ``--quantization`` picks none / fp16 / bf16 for either.

Rows of the table (real, non-pad tokens per second; medians of ``--repeats`` after a warm-up), on
``--samples`` texts of 16-256 tokens of the kit's corpus, batch size 16, resid_post at the first,
middle and last block, every cache stored in the model's dtype (bench/extraction_costs.py):

* **bare forward** over miStudio's batches, stopped after the deepest block: the yardstick;
* **extract(), batches dropped**: the forward pass with the hooks and the device-to-host copies;
* **extraction into a cache on tmpfs** (``--tmpfs``, default /dev/shm, or the roomiest other
  tmpfs; skipped with the reason where none has room): the extraction job's path, ``extract`` ->
  ``BackgroundWriter`` -> ``CacheWriter`` -> ``finalize``. Goal >= 0.7x the bare forward;
* **write + fsync** of 1 GiB into the cache directory (``--cache-dir``, default the data
  directory's activations/, as the worker writes), as tokens/s at the cache's bytes per token;
* **extraction into the cache directory**. Goal >= 0.85x min(bare forward, that bandwidth);
* **peers**: the same data through nnsight (``trace`` + ``save``) and TransformerLens
  (``run_with_cache``; GPT-2 only, bench/peers.py converts GPT-2 weights), keeping the real
  tokens' rows in host memory, bench/extraction.py's contenders run by ``--bench-python``
  (default: .venv-bench's, see bench/requirements-bench.txt, else this interpreter); a peer that
  interpreter cannot import is "not installed". Goal: extraction into the cache directory >= 1.5x
  the better peer;
* **decode**: ``engine.generation.generate``, greedy, end-of-sequence ignored, 128 new tokens
  after a 64-token prompt: (tokens - 1) / decode seconds; against ``model.generate`` with the
  same prompt ids and ``min_new_tokens``, timed by a streamer from its first to its last token.
  Goal >= 0.9x;
* **SAE training**: ``engine.sae.train`` on ``--device``, TopK (d_sae = 8 x width, k = 32, batch
  4096) for 2M tokens, fed as the SAE task feeds it: the deepest hook's cache read back shard by
  shard through the shuffle buffer (repeated as often as needed); the trainer's own tokens/s.
  No goal.

Progress goes to stderr with the time of day, each result as it is measured, so a run cut short
still shows how far it got; stdout is the heading line and the table.

    .venv/bin/python bench/gpu.py [--device cuda:0] [--model gpt2-small|llama-1b] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# bench/'s own modules (the script's folder is on sys.path when it runs).
from extraction import (  # noqa: E402
    DEFAULT_BENCH_PYTHON,
    build_texts,
    hook_names,
    real_token_count,
    run_contender,
)
from extraction_costs import (  # noqa: E402
    BANDWIDTH_BYTES,
    TMPFS_DEFAULT,
    default_cache_parent,
    extract_into_cache,
    measure_extraction_costs,
)
from gpu_table import Row, markdown_table, table_rows  # noqa: E402

SEED = 0
MIN_LENGTH = 16
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
    bandwidth_bytes: int


# About 70k tokens: each extraction row takes a few seconds on an H200 (measured).
FULL = Sizes(
    samples=512,
    max_length=256,
    repeats=3,
    prompt_tokens=64,
    new_tokens=128,
    sae_tokens=2_000_000,
    sae_batch_size=4096,
    bandwidth_bytes=BANDWIDTH_BYTES,
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
    bandwidth_bytes=64 * 2**20,
)


@dataclass(frozen=True)
class Options:
    device: str
    model: str
    quantization: str
    sizes: Sizes
    bench_python: Path
    peers: bool
    cache_dir: Path
    tmpfs: Path
    output_dir: Path | None


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
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="where the caches go (a temporary folder inside it); default: the data directory's "
        "activations/ (ACTIVATION_CACHE_DIR, else MISTUDIO_DATA_DIR/activations, else data/activations)",
    )
    parser.add_argument(
        "--tmpfs", type=Path, default=TMPFS_DEFAULT, help=f"the tmpfs to try first (default {TMPFS_DEFAULT})"
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=os.environ.get("OUT") or None,
        help="also write the table (.md) and its numbers (.json) here (default: $OUT when set)",
    )
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
        cache_dir=args.cache_dir or default_cache_parent(),
        tmpfs=args.tmpfs,
        output_dir=args.output_dir,
    )


def hook_layers(layers: int) -> list[int]:
    """The blocks whose resid_post is extracted: the first, the middle and the last."""
    return sorted({0, layers // 2, layers - 1})


# -- the heading -----------------------------------------------------------------------------------


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
    """A progress line on stderr, with the time of day."""
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


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
    """Each peer's seconds over ``tokenized`` (median), or why it has none."""
    from engine.hooks import hook_site

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
            outcomes[label] = "failed" if result is None else result["seconds"]
            if result is not None:
                tokens = real_token_count(tokenized)
                rate = tokens / result["seconds"]
                log(f"  {label} {result['version']}: {result['seconds']:.3f} s, {rate:,.0f} tokens/s")
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
    dtype: str,
    tokens: int,
    batch_size: int,
    directory: Path,
) -> tuple[float, str]:
    """The trainer's tokens/s on ``hook``'s cache in ``dtype`` (written first, not timed), and the
    SAE's shape."""
    from activations.store import ActivationStore
    from engine.prefetch import prefetched
    from engine.sae import TrainingConfig, shuffled_batches, train

    extract_into_cache(model, tokenized, [hook], directory, dtype=dtype)
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


def measure_live_training(
    model, tokenized: list[list[int]], hooks: list[str], *, device: str, dtype: str, tokens: int,
    batch_size: int,
) -> list[tuple[str, float]]:  # fmt: skip
    """Training from the model on the fly (``engine.sae.group``, what the group job runs): tokens/s
    of one SAE at the deepest hook, then of one SAE at each hook from one forward pass a batch,
    forward passes included, the shuffle buffer on ``device`` in ``dtype``."""
    from engine.hooks import list_hook_points
    from engine.sae import TrainingConfig
    from engine.sae.group import GroupMember, model_source, train_group

    widths = {info.name: info.width for info in list_hook_points(model)}
    steps = math.ceil(tokens / batch_size)
    rates = []
    for label, chosen in (("1 SAE", hooks[-1:]), (f"{len(hooks)} SAEs, one forward pass", hooks)):
        config = TrainingConfig(
            architecture="topk", d_sae=SAE_EXPANSION * widths[chosen[0]], k=SAE_K, lr=SAE_LEARNING_RATE,
            batch_size=batch_size, total_tokens=tokens, warmup_steps=max(1, steps // 20),
        )  # fmt: skip

        def open_source(position, chosen=chosen):
            return model_source(
                model, None, lambda start, stop: tokenized[start:stop], hooks=chosen,
                train_samples=len(tokenized), max_length=max(map(len, tokenized)), batch_size=32,
                position=position, dtype=dtype, device=device,
            )  # fmt: skip

        started = time.perf_counter()
        results = train_group(
            [GroupMember(hook, config) for hook in chosen], widths=widths, open_source=open_source,
            buffer_rows=SAE_BUFFER_BATCHES * batch_size, device=device,
        )  # fmt: skip
        if device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(device)
        rates.append((label, results[0].tokens / (time.perf_counter() - started)))
    return rates


# The attribution row: random TopK transcoders (k per token) of this width per layer, a prompt of
# this many tokens, the most feature nodes kept and the targets per backward pass.
ATTRIBUTION_EXPANSION = 8
ATTRIBUTION_K = 32
ATTRIBUTION_TOKENS = 128
ATTRIBUTION_FEATURES = 4096
ATTRIBUTION_BATCH = 256


def measure_attribution(model, tokenizer, *, tokens: int) -> tuple[float, str]:
    """Seconds of one attribution graph (``engine.attribution.attribute``, what the graph job runs)
    through one random TopK transcoder per layer in the model's dtype, and what the graph held."""
    import torch

    from engine.attribution import AttributionConfig, attribute
    from engine.sae import SaeShape, SparseAutoencoder

    parameter = next(model.parameters())
    width = int(model.config.hidden_size)
    transcoders = []
    generator = torch.Generator(device=parameter.device).manual_seed(SEED)
    for _ in range(int(model.config.num_hidden_layers)):
        d_sae = ATTRIBUTION_EXPANSION * width
        shape = SaeShape("topk", width, d_sae, ATTRIBUTION_K, apply_b_dec_to_input=False, d_out=width)
        transcoder = SparseAutoencoder(shape).to(device=parameter.device, dtype=parameter.dtype)
        with torch.no_grad():
            for tensor in (transcoder.W_enc, transcoder.W_dec):
                tensor.copy_(
                    torch.randn(tensor.shape, generator=generator, device=parameter.device) / width**0.5
                )
        transcoders.append(transcoder)
    ids = [tokenizer.bos_token_id or 0, *prompt_ids(tokenizer, tokens - 1)]
    config = AttributionConfig(batch_size=ATTRIBUTION_BATCH, max_feature_nodes=ATTRIBUTION_FEATURES)
    attribute(model, transcoders, ids[:16], config)  # warm-up
    if parameter.device.type == "cuda":
        torch.cuda.synchronize(parameter.device)
    started = time.perf_counter()
    graph = attribute(model, transcoders, ids, config)
    if parameter.device.type == "cuda":
        torch.cuda.synchronize(parameter.device)
    seconds = time.perf_counter() - started
    return seconds, (
        f"{len(ids)} tokens, {graph.info['active_features']:,} active features, {graph.n_features:,} kept, "
        f"completeness error {graph.completeness_error():.1e}"
    )


# -- main ------------------------------------------------------------------------------------------


def attempt(label: str, measure):
    """``measure()``, or None when it fails (logged): one failed part leaves the others' rows."""
    try:
        return measure()
    except Exception:  # any failure of a diagnostic part; the traceback is logged
        log(f"{label} failed:\n{traceback.format_exc()}")
        return None


def write_outputs(folder: Path, model: str, table: str, numbers: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"bench-gpu-{model}.md").write_text(table + "\n")
    (folder / f"bench-gpu-{model}.json").write_text(json.dumps(numbers, indent=2) + "\n")


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
    dtype = TORCH_DTYPES[options.quantization]
    workdir = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    try:
        log(f"building {options.model} ({dtype}) on {options.device} ...")
        folder = build_model(
            options.model, workdir / "model", device=options.device, quantization=options.quantization
        )
        log("loading it ...")
        weights = load_weights(
            folder, model_type=choice.family, quantization=options.quantization, device=options.device
        )
        model, tokenizer = weights.model, weights.tokenizer
        texts = build_texts(tokenizer, sizes.samples, lengths=(MIN_LENGTH, sizes.max_length), seed=SEED)
        tokenized = tokenize_samples(tokenizer, texts, sizes.max_length)
        tokens = real_token_count(tokenized)
        layers = hook_layers(num_layers(model))
        hooks = hook_names(layers)

        log(f"where extraction time goes, {tokens:,} tokens, {len(hooks)} hooks, cache in {dtype} ...")
        costs = measure_extraction_costs(
            model, tokenized, hooks, max(layers), dtype=dtype, repeats=sizes.repeats,
            cache_parent=options.cache_dir, tmpfs=options.tmpfs, bandwidth_bytes=sizes.bandwidth_bytes,
            log=log,
        )  # fmt: skip
        log("the peers ...")
        peers = run_peers(options, model, folder, tokenized, layers, workdir)
        log("decode ...")
        decoded = attempt(
            "decode",
            lambda: measure_decode(
                model, tokenizer, prompt_tokens=sizes.prompt_tokens, new_tokens=sizes.new_tokens,
                repeats=sizes.repeats,
            ),
        )  # fmt: skip
        decode, reference = decoded if decoded is not None else (None, None)
        if decoded is not None:
            log(f"  decode {decode:,.0f} tokens/s, model.generate {reference:,.0f}")
        log("SAE training ...")
        trained = attempt(
            "SAE training",
            lambda: measure_sae_training(
                model, tokenized, hooks[-1], device=options.device, dtype=dtype, tokens=sizes.sae_tokens,
                batch_size=sizes.sae_batch_size, directory=workdir / "sae-cache",
            ),
        )  # fmt: skip
        sae, sae_shape = trained if trained is not None else (None, f"batch {sizes.sae_batch_size}")
        if trained is not None:
            log(f"  SAE training {sae:,.0f} tokens/s")
        log("SAE training from the model ...")
        live = attempt(
            "SAE training from the model",
            lambda: measure_live_training(
                model, tokenized, hooks, device=options.device, dtype=dtype, tokens=sizes.sae_tokens,
                batch_size=sizes.sae_batch_size,
            ),
        )  # fmt: skip

        log("an attribution graph ...")
        graph = attempt(
            "attribution", lambda: measure_attribution(model, tokenizer, tokens=ATTRIBUTION_TOKENS)
        )
        if graph is not None:
            log(f"  attribution graph {graph[0]:.2f} s ({graph[1]})")

        lengths = [len(ids) for ids in tokenized]
        detail = (
            f"{len(tokenized)} samples, {tokens:,} tokens ({min(lengths)}..{max(lengths)} each), hooks "
            f"{', '.join(hooks)}, cache in {dtype} ({costs.bytes_per_token * tokens / 1e6:,.0f} MB); decode "
            f"{sizes.new_tokens} tokens after {sizes.prompt_tokens}; median of {sizes.repeats}"
        )
        title = heading(
            device=options.device, device_label=describe_device(options.device), model=options.model,
            parameters=weights.parameter_count, quantization=options.quantization, detail=detail,
        )  # fmt: skip
        rows = table_rows(
            costs, deepest=max(layers), hooks=len(hooks), peers=peers, decode=decode, generate=reference,
            sae=sae, sae_shape=sae_shape,
        )  # fmt: skip
        for label, rate in live or []:
            rows.append(Row(f"SAE training from the model, {label}, forwards in", rate=rate, against="-"))
        if live is None:
            rows.append(Row("SAE training from the model", rate=None, against="failed"))
        if graph is not None:
            rows.append(Row(f"Attribution graph ({graph[1]})", seconds=graph[0], against="-"))
        else:
            rows.append(Row("Attribution graph", against="failed"))
        table = f"{title}\n\n{markdown_table(rows)}"
        print(table, flush=True)
        if options.output_dir is not None:
            numbers = {
                "heading": title,
                "model": options.model,
                "device": options.device,
                "dtype": dtype,
                "costs": {**dataclasses.asdict(costs), "disk_bound": costs.disk_bound, "bound": costs.bound},
                "peers_seconds": peers,
                "decode": decode,
                "generate": reference,
                "sae": sae,
                "sae_from_the_model": dict(live or []),
                "attribution": None if graph is None else {"seconds": graph[0], "graph": graph[1]},
                "rows": [dataclasses.asdict(row) for row in rows],
            }
            write_outputs(options.output_dir, options.model, table, numbers)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
