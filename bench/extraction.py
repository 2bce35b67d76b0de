"""Extraction throughput of miStudio's engine against a bare forward, TransformerLens and nnsight.

Model: a randomly initialised GPT-2 small (124M parameters, the kit's "gpt2-small"), built once
in a temporary folder. Data: ``--samples`` slices of realistic text (the kit's local corpus),
lengths drawn uniformly from 16..256 tokens with a fixed seed, decoded to text and tokenized once
with ``tokenize_samples``; every contender starts from those token ids (tokenization is shared
and timed separately). Request: resid_post of ``--layers`` (default 0, 6, 11), batch size 16.

Contenders, in real (non-pad) tokens per second:

  (L) the limit: for the batches miStudio plans (``plan_batches``), the padded input ids and
      attention mask (built before the clock starts) through ``model.transformer`` under
      ``torch.inference_mode``, stopped by a hook right after the deepest requested block; no
      hooks on other blocks, nothing stored.
  (M) miStudio end to end from the token ids: ``plan_batches`` -> ``extract`` -> ``CacheWriter``
      (``add_batch`` per batch, ``finalize``) into a temporary directory, exactly the worker
      task's path (activations/tasks.py), disk writes, fsyncs and sha256 of every file included.
  (T) TransformerLens: ``HookedTransformer`` built from the same weights (``convert_gpt2_weights``;
      ``from_pretrained`` needs the Hub even with ``hf_model=``), ``run_with_cache`` with
      ``names_filter`` and ``stop_at_layer``, under ``torch.inference_mode``.
  (N) nnsight: ``TransformersModel`` wrapping the same model, ``trace`` + ``nnsight.save`` of the
      blocks' outputs and ``tracer.stop()`` after the deepest one, under ``torch.no_grad``.

T and N take the samples in dataset order, 16 at a time, right-padded with an attention mask, and
keep each batch's real-token rows on the CPU (``activations[mask]``), as a user collecting
activations would. They run in a separate virtual environment (``--bench-python``, see
bench/requirements-bench.txt) as subprocesses; without it they are skipped.

Each contender is warmed up once (its first ``WARM_UP_BATCHES`` batches), then timed over
``--repeats`` full passes; medians are reported. Also measured: peak RSS of M in a fresh
subprocess for ``--samples`` and 4x as many samples; layers [0, 1] alone (M against the bare
forward through block 1); and 1000 samples x 128 tokens for the three layers (the "1000 samples
within 5 minutes" target), end to end from the texts, tokenization included.

Goals: M >= 0.90 L; M >= 1.5 max(T, N); peak RSS grows <= 10 % for a 4x larger dataset;
for layers [0, 1], M >= 0.90 of the bare forward through block 1.

    .venv/bin/python bench/extraction.py [--quick] [--repeats 2] [--samples 512]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peers import load_transformer_lens  # noqa: E402  (bench/, the script's own folder)

BATCH_SIZE = 16
MIN_LENGTH, MAX_LENGTH = 16, 256
SEED = 0
WARM_UP_BATCHES = 1
DEFAULT_BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
GOAL_LIMIT_RATIO = 0.90
GOAL_COMPETITOR_RATIO = 1.5
GOAL_RSS_GROWTH = 0.10
GOAL_PIPELINE_RATIO = 1.1  # pipelined extraction with a slow disk <= 1.1 x max(compute, write)


def hook_names(layers: list[int]) -> list[str]:
    return [f"blocks.{layer}.hook_resid_post" for layer in layers]


def real_token_count(tokenized: list[list[int]]) -> int:
    return sum(len(ids) for ids in tokenized)


def dataset_batches(count: int) -> list[list[int]]:
    """Batches of ``BATCH_SIZE`` consecutive samples in dataset order (how T and N are used)."""
    return [list(range(start, min(start + BATCH_SIZE, count))) for start in range(0, count, BATCH_SIZE)]


def padded_batch(tokenized: list[list[int]], batch: list[int], pad_token_id: int):
    """Right-padded input ids and attention mask of one batch."""
    import torch

    rows = [tokenized[index] for index in batch]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for number, row in enumerate(rows):
        input_ids[number, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[number, : len(row)] = 1
    return input_ids, attention_mask


def timed(run, *, repeats: int) -> dict:
    """Warm up once on a few batches (``run(warm_up=True)``), then the median of full passes."""
    run(warm_up=True)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(warm_up=False)
        seconds.append(time.perf_counter() - started)
    return {"seconds": statistics.median(seconds), "runs": seconds}


# -- data --------------------------------------------------------------------------------------------


def build_texts(tokenizer, count: int, *, lengths: tuple[int, int], seed: int) -> list[str]:
    """``count`` slices of the local corpus with token lengths drawn from ``lengths``, as text."""
    from engine.testing.tiny_models import local_corpus

    stream: list[int] = []
    for ids in tokenizer(local_corpus(), add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        length = rng.randint(*lengths)
        start = rng.randrange(len(stream) - length)
        texts.append(tokenizer.decode(stream[start : start + length]))
    return texts


def prepare(folder: Path, count: int, *, lengths: tuple[int, int] = (MIN_LENGTH, MAX_LENGTH)):
    """The loaded model, its tokenizer, the texts and their token ids (truncated to the longest)."""
    from engine.extraction import tokenize_samples
    from engine.loading import load_weights

    weights = load_weights(folder, model_type="gpt2", quantization="none", device="cpu")
    texts = build_texts(weights.tokenizer, count, lengths=lengths, seed=SEED)
    started = time.perf_counter()
    tokenized = tokenize_samples(weights.tokenizer, texts, lengths[1])
    tokenize_seconds = time.perf_counter() - started
    return weights.model, weights.tokenizer, texts, tokenized, tokenize_seconds


# -- L and M (main environment) --------------------------------------------------------------------------


class _Stop(Exception):
    pass


def run_limit(model, tokenized: list[list[int]], deepest: int, *, repeats: int) -> dict:
    """(L): a bare forward over the planned batches, through block ``deepest`` only.

    Any family, on the model's device (bench/gpu.py): the inputs are put there before the clock
    starts, and a pass on a GPU ends when the device has finished its work."""
    import torch

    from engine.extraction import plan_batches
    from engine.hooks import hook_site
    from engine.runtime import pad_token_id, smallest_runner

    plan = plan_batches([len(ids) for ids in tokenized], BATCH_SIZE)
    device = model.get_input_embeddings().weight.device
    pad = pad_token_id(model)
    inputs = [tuple(tensor.to(device) for tensor in padded_batch(tokenized, batch, pad)) for batch in plan]
    site = hook_site(model, f"blocks.{deepest}.hook_resid_post")
    block = model.get_submodule(site.module_path)
    base = smallest_runner(model, [site])

    def stop(module, args, output):
        raise _Stop

    def run(*, warm_up: bool) -> None:
        handle = block.register_forward_hook(stop)
        try:
            with torch.inference_mode():
                for input_ids, attention_mask in inputs[:WARM_UP_BATCHES] if warm_up else inputs:
                    with contextlib.suppress(_Stop):
                        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            handle.remove()

    return timed(run, repeats=repeats)


def cache_writer(
    model,
    hooks: list[str],
    directory: Path,
    *,
    shard_max_tokens: int | None,
    write_delay: float = 0.0,
    dtype: str = "float32",
):
    """A CacheWriter for ``hooks`` in ``directory``, storing ``dtype``: 64 MiB shards as the worker
    task writes unless ``shard_max_tokens`` asks for more shards, ``write_delay`` seconds added to
    each."""
    from activations.store import CacheWriter, shard_tokens_for

    widths = dict.fromkeys(hooks, model.config.hidden_size)
    writer = CacheWriter.create_or_resume(
        directory,
        key={"bench": "extraction", "hooks": hooks},
        provenance={"batch_size": BATCH_SIZE},
        hooks=widths,
        dtype=dtype,
        shard_max_tokens=shard_max_tokens or shard_tokens_for(widths, dtype),
    )
    writer.write_delay_seconds = write_delay
    return writer


def extract_to_cache(
    model,
    tokenized: list[list[int]],
    hooks: list[str],
    directory: Path,
    *,
    pipelined: bool = True,
    shard_max_tokens: int | None = None,
    write_delay: float = 0.0,
) -> dict:
    """(M): the worker task's path from the token ids to a finalized cache in ``directory``: the
    batches written by a ``BackgroundWriter`` thread (``pipelined=False``: inline, as before
    the pipelined writer). ``write_delay`` seconds are added to every shard write (a slow disk)."""
    from activations.store import BackgroundWriter
    from engine.extraction import extract, plan_batches

    plan = plan_batches([len(ids) for ids in tokenized], BATCH_SIZE)
    writer = cache_writer(model, hooks, directory, shard_max_tokens=shard_max_tokens, write_delay=write_delay)
    batches = extract(model, tokenized, plan, hooks=hooks, dtype="float32", start_batch=writer.next_batch)
    if pipelined:
        with BackgroundWriter(writer) as background:
            for batch in batches:
                background.add_extracted(batch)
    else:
        for batch in batches:
            writer.add_extracted(batch)
    manifest = writer.finalize(num_samples=len(tokenized))
    writer.close()
    return manifest


def run_pipeline(model, tokenized: list[list[int]], hooks: list[str], *, shards: int = 16) -> dict:
    """The pipelined writer's proof on a CPU: the forward pass alone (compute), the cache writes alone with a
    fixed delay per shard chosen so that writing takes about as long as computing (write), and
    the whole extraction inline (≈ compute + write) and pipelined (≈ max(compute, write))."""
    from engine.extraction import extract, plan_batches

    plan = plan_batches([len(ids) for ids in tokenized], BATCH_SIZE)
    tokens = real_token_count(tokenized)
    shard_tokens = max(1, tokens // shards)
    started = time.perf_counter()
    collected = list(extract(model, tokenized, plan, hooks=hooks, dtype="float32"))
    compute = time.perf_counter() - started
    # The shards the writer will make (it writes once it holds shard_tokens or more, and at the end).
    expected, held = 0, 0
    for batch in collected:
        held += int(batch.token_ids.numel())
        if held >= shard_tokens:
            expected, held = expected + 1, 0
    expected += held > 0
    delay = compute / expected  # the disk as slow as the model: the case that gains the most

    def write_only(directory: Path) -> float:
        writer = cache_writer(model, hooks, directory, shard_max_tokens=shard_tokens, write_delay=delay)
        began = time.perf_counter()
        for batch in collected:
            writer.add_extracted(batch)
        writer.finalize(num_samples=len(tokenized))
        writer.close()
        return time.perf_counter() - began

    results = {"compute": compute, "delay": delay, "tokens": tokens}
    directory = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    try:
        results["write"] = write_only(directory / "write-only")
        for name, pipelined in (("inline", False), ("pipelined", True)):
            began = time.perf_counter()
            manifest = extract_to_cache(
                model, tokenized, hooks, directory / name, pipelined=pipelined, shard_max_tokens=shard_tokens,
                write_delay=delay,
            )  # fmt: skip
            results[name] = time.perf_counter() - began
            results["shards"] = len(manifest["shards"])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return results


def run_mistudio(model, tokenized: list[list[int]], hooks: list[str], *, repeats: int) -> dict:
    """(M) timed: each pass writes a fresh cache; removing it afterwards is not timed."""
    first_batches = dataset_batches(len(tokenized))[:WARM_UP_BATCHES]
    warm_up_samples = [index for batch in first_batches for index in batch]

    def run(*, warm_up: bool) -> None:
        directory = Path(tempfile.mkdtemp(prefix="bench-extraction-"))
        try:
            samples = [tokenized[index] for index in warm_up_samples] if warm_up else tokenized
            manifest = extract_to_cache(model, samples, hooks, directory / "cache")
            assert manifest["num_tokens"] == real_token_count(samples)
        finally:
            if not warm_up:
                run.bytes = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
            shutil.rmtree(directory, ignore_errors=True)

    result = timed(run, repeats=repeats)
    result["cache_bytes"] = run.bytes
    return result


# -- T and N (benchmark environment, subprocess) --------------------------------------------------------


def _on_device(batch, device: str):
    return tuple(tensor.to(device) for tensor in batch)


def run_transformer_lens(
    folder: Path,
    tokenized: list[list[int]],
    layers: list[int],
    *,
    repeats: int,
    device: str = "cpu",
    dtype: str = "float32",
):
    """(T) on ``device`` in ``dtype`` (GPT-2 only: bench/peers.py converts GPT-2 weights)."""
    import torch
    from transformers import AutoConfig

    model = load_transformer_lens(folder).to(device).to(getattr(torch, dtype))
    config = AutoConfig.from_pretrained(folder)
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    names = hook_names(layers)
    stop_at_layer = max(layers) + 1
    batches = [
        _on_device(padded_batch(tokenized, batch, pad), device) for batch in dataset_batches(len(tokenized))
    ]

    def run(*, warm_up: bool) -> None:
        kept = []
        with torch.inference_mode():
            for input_ids, attention_mask in batches[:WARM_UP_BATCHES] if warm_up else batches:
                _, cache = model.run_with_cache(
                    input_ids, attention_mask=attention_mask, names_filter=names, stop_at_layer=stop_at_layer
                )
                real = attention_mask.bool()
                kept.append({name: cache[name][real].cpu() for name in names})
        run.count = sum(part[names[0]].shape[0] for part in kept)

    result = timed(run, repeats=repeats)
    assert run.count == real_token_count(tokenized)
    return result


def run_nnsight(
    folder: Path,
    tokenized: list[list[int]],
    layers: list[int],
    *,
    repeats: int,
    device: str = "cpu",
    dtype: str = "float32",
    blocks: str = "transformer.h",
):
    """(N) on ``device`` in ``dtype``; ``blocks`` is the path of the model's block list."""
    import nnsight
    import torch
    from nnsight import TransformersModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    model = TransformersModel(hf_model, tokenizer=AutoTokenizer.from_pretrained(folder))
    config = hf_model.config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    batches = [
        _on_device(padded_batch(tokenized, batch, pad), device) for batch in dataset_batches(len(tokenized))
    ]

    def block_list():
        envoy = model
        for part in blocks.split("."):
            envoy = getattr(envoy, part)
        return envoy

    def run(*, warm_up: bool) -> None:
        kept = []
        for input_ids, attention_mask in batches[:WARM_UP_BATCHES] if warm_up else batches:
            inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
            with torch.no_grad(), model.trace(inputs) as tracer:
                # Only objects passed to save() leave the trace; a plain list would not.
                outputs = nnsight.save([block_list()[layer].output for layer in layers])
                tracer.stop()
            real = attention_mask.bool()
            kept.append([output[real].cpu() for output in outputs])
        run.count = sum(part[0].shape[0] for part in kept)

    result = timed(run, repeats=repeats)
    assert run.count == real_token_count(tokenized)
    return result


def contender_main(args) -> None:
    """Entry point inside the benchmark environment: one contender, JSON on stdout."""
    import importlib.metadata

    import torch

    torch.manual_seed(SEED)
    data = json.loads(Path(args.data).read_text())
    runner, package = {
        "transformer_lens": (run_transformer_lens, "transformer-lens"),
        "nnsight": (run_nnsight, "nnsight"),
    }[args.contender]
    # bench/gpu.py adds where and how to run (device, dtype) and, for nnsight, the block list's path.
    keys = ("device", "dtype", "blocks") if args.contender == "nnsight" else ("device", "dtype")
    placement = {key: data[key] for key in keys if key in data}
    result = runner(
        Path(args.model_dir), data["tokenized"], data["layers"], repeats=args.repeats, **placement
    )
    result["version"] = importlib.metadata.version(package)
    result["torch"] = torch.__version__
    result["transformers"] = importlib.metadata.version("transformers")
    print("RESULT " + json.dumps(result))


def run_contender(name: str, bench_python: Path, folder: Path, data_file: Path, repeats: int) -> dict | None:
    command = [
        str(bench_python),
        str(Path(__file__).resolve()),
        "--contender",
        name,
        "--model-dir",
        str(folder),
        "--data",
        str(data_file),
        "--repeats",
        str(repeats),
    ]
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    environment = {**os.environ, **offline}
    completed = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT)
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"  {name} failed (exit {completed.returncode}):\n{completed.stderr[-3000:]}", file=sys.stderr)
    return None


# -- peak RSS (subprocess per dataset size) ---------------------------------------------------------------


def rss_main(args) -> None:
    """Entry point of the RSS child: load, tokenize, run M once; report this process's peak RSS."""
    model, _tokenizer, _texts, tokenized, _seconds = prepare(Path(args.model_dir), args.rss_child)
    layers = [int(layer) for layer in args.layers.split(",")]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    directory = Path(tempfile.mkdtemp(prefix="bench-extraction-rss-"))
    try:
        started = time.perf_counter()
        extract_to_cache(model, tokenized, hook_names(layers), directory / "cache")
        seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "samples": args.rss_child,
        "tokens": real_token_count(tokenized),
        "seconds": seconds,
        "peak_before_kib": before,
        "peak_kib": peak,
    }
    print("RESULT " + json.dumps(result))


def measure_rss(folder: Path, samples: int, layers: list[int]) -> dict | None:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--rss-child",
        str(samples),
        "--model-dir",
        str(folder),
        "--layers",
        ",".join(map(str, layers)),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"  RSS child failed (exit {completed.returncode}):\n{completed.stderr[-3000:]}", file=sys.stderr)
    return None


# -- report -------------------------------------------------------------------------------------------------


def rate(result: dict | None, tokens: int) -> float | None:
    return None if result is None else tokens / result["seconds"]


def row(label: str, result: dict | None, tokens: int, note: str = "") -> str:
    if result is None:
        return f"  {label:<44} {'skipped':>12}  {note}"
    runs = ", ".join(f"{seconds:.2f}" for seconds in result["runs"])
    median = result["seconds"]
    return f"  {label:<44} {tokens / median:>10,.0f}/s  median {median:.2f} s ({runs}) {note}"


def verdict(value: float | None, goal: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f} (goal >= {goal:.2f}: {'met' if value >= goal else 'MISSED'})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 16 samples of 16..64 tokens, 1 run, no RSS/1000x128"
    )
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", default="0,6,11")
    parser.add_argument("--bench-python", type=Path, default=DEFAULT_BENCH_PYTHON)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: T,N,rss,layers01,target")
    parser.add_argument(
        "--pipeline-only", action="store_true", help="only the slow-disk experiment (inline vs pipelined)"
    )
    # Internal: the subprocess entry points.
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        contender_main(args)
        return
    if args.rss_child:
        rss_main(args)
        return

    import torch

    from engine.testing.tiny_models import build_tiny_model

    torch.manual_seed(SEED)
    max_length = MAX_LENGTH
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    if args.quick:
        args.samples, args.repeats, max_length = 16, 1, 64
        skip |= {"rss", "target"}
    layers = [int(layer) for layer in args.layers.split(",")]
    hooks = hook_names(layers)
    workdir = Path(tempfile.mkdtemp(prefix="bench-extraction-model-"))
    try:
        folder = build_tiny_model("gpt2", workdir / "gpt2-small", size="gpt2-small", seed=SEED)
        model, tokenizer, _texts, tokenized, tokenize_seconds = prepare(
            folder, args.samples, lengths=(MIN_LENGTH, max_length)
        )
        tokens = real_token_count(tokenized)
        lengths = [len(ids) for ids in tokenized]
        print(
            f"GPT-2 small (random weights, {model.num_parameters():,} parameters); {len(tokenized)} samples, "
            f"{tokens:,} real tokens (lengths {min(lengths)}..{max(lengths)}); hooks {', '.join(hooks)}; "
            f"batch size {BATCH_SIZE}; torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        print(f"  tokenization (shared, not in any rate): {tokenize_seconds:.2f} s")

        print("running the slow-disk experiment (inline vs pipelined cache writes) ...", flush=True)
        # Samples of one length (128 tokens), so that every shard costs the model the same time and
        # the fixed delay per shard write can match it; with the lengths above sorted longest
        # first, the late shards compute fast and their writes queue up whatever the pipeline.
        from engine.extraction import tokenize_samples

        even = tokenize_samples(
            tokenizer, build_texts(tokenizer, args.samples, lengths=(128, 128), seed=SEED), 128
        )
        pipeline = run_pipeline(model, even, hooks)
        report_pipeline(pipeline)
        if args.pipeline_only:
            return

        results: dict[str, dict | None] = {}
        print("running L ...", flush=True)
        results["L"] = run_limit(model, tokenized, max(layers), repeats=args.repeats)
        print("running M ...", flush=True)
        results["M"] = run_mistudio(model, tokenized, hooks, repeats=args.repeats)

        data_file = workdir / "data.json"
        data_file.write_text(json.dumps({"tokenized": tokenized, "layers": layers}))
        for key, name in (("T", "transformer_lens"), ("N", "nnsight")):
            results[key] = None
            if key in skip:
                continue
            if not args.bench_python.exists():
                print(f"  {name}: skipped, {args.bench_python} not found (see bench/requirements-bench.txt)")
                continue
            print(f"running {key} ({name}) ...", flush=True)
            results[key] = run_contender(name, args.bench_python, folder, data_file, args.repeats)

        layers01 = {}
        if "layers01" not in skip:
            print("running layers [0, 1] ...", flush=True)
            layers01["L"] = run_limit(model, tokenized, 1, repeats=args.repeats)
            layers01["M"] = run_mistudio(model, tokenized, hook_names([0, 1]), repeats=args.repeats)

        rss = {}
        if "rss" not in skip:
            for count in (args.samples, 4 * args.samples):
                print(f"measuring peak RSS of M for {count} samples ...", flush=True)
                rss[count] = measure_rss(folder, count, layers)

        target = None
        if "target" not in skip:
            print("running 1000 samples x 128 tokens ...", flush=True)
            from engine.extraction import tokenize_samples

            texts = build_texts(tokenizer, 1000, lengths=(128, 128), seed=SEED)
            directory = Path(tempfile.mkdtemp(prefix="bench-extraction-target-"))
            try:
                started = time.perf_counter()
                target_tokenized = tokenize_samples(tokenizer, texts, 128)
                extract_to_cache(model, target_tokenized, hooks, directory / "cache")
                seconds = time.perf_counter() - started
                target = {"seconds": seconds, "tokens": real_token_count(target_tokenized)}
            finally:
                shutil.rmtree(directory, ignore_errors=True)

        print()
        print(f"Real tokens per second ({tokens:,} tokens, median of {args.repeats}, warm-up excluded):")
        print(row(f"L  bare forward to block {max(layers)} (miStudio's batches)", results["L"], tokens))
        mb = results["M"]["cache_bytes"] / 2**20
        print(row("M  miStudio extract + CacheWriter (disk)", results["M"], tokens, f"cache {mb:.0f} MiB"))
        for key, label in (("T", "T  TransformerLens run_with_cache"), ("N", "N  nnsight trace + save")):
            result = results[key]
            note = f"v{result['version']}" if result else ""
            print(row(label, result, tokens, note))
        limit, mistudio = rate(results["L"], tokens), rate(results["M"], tokens)
        others = [value for value in (rate(results["T"], tokens), rate(results["N"], tokens)) if value]
        print()
        print(f"  M / L:             {verdict(mistudio / limit, GOAL_LIMIT_RATIO)}")
        best_other = mistudio / max(others) if others else None
        print(f"  M / max(T, N):     {verdict(best_other, GOAL_COMPETITOR_RATIO)}")
        if layers01:
            print(row("L  bare forward to block 1 (layers [0, 1])", layers01["L"], tokens))
            print(row("M  miStudio, layers [0, 1]", layers01["M"], tokens))
            ratio = rate(layers01["M"], tokens) / rate(layers01["L"], tokens)
            print(f"  M / L, layers [0, 1]: {verdict(ratio, GOAL_LIMIT_RATIO)}")
        if rss and all(rss.values()):
            small, large = (rss[count] for count in sorted(rss))
            growth = large["peak_kib"] / small["peak_kib"] - 1
            for entry in (small, large):
                print(
                    f"  peak RSS of M, {entry['samples']} samples ({entry['tokens']:,} tokens): "
                    f"{entry['peak_kib'] / 1024:,.0f} MiB (after load+tokenize "
                    f"{entry['peak_before_kib'] / 1024:,.0f} MiB; "
                    f"{entry['tokens'] / entry['seconds']:,.0f} tok/s)"
                )
            verdict_text = "met" if growth <= GOAL_RSS_GROWTH else "MISSED"
            print(f"  peak RSS growth at 4x: {growth:+.1%} (goal <= {GOAL_RSS_GROWTH:.0%}: {verdict_text})")
        if target:
            print(
                f"  1000 samples x 128 tokens, {len(layers)} layers, tokenize + extract + cache: "
                f"{target['seconds']:.1f} s ({target['tokens'] / target['seconds']:,.0f} tok/s; "
                f"target 300 s: "
                f"{'met' if target['seconds'] <= 300 else 'MISSED'})"
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def report_pipeline(result: dict) -> None:
    compute, write = result["compute"], result["write"]
    bound = max(compute, write)
    ratio = result["pipelined"] / bound
    print(
        f"  slow disk ({result['shards']} shards, {result['delay'] * 1000:.0f} ms added to each write): "
        f"compute alone {compute:.2f} s, writes alone {write:.2f} s; inline {result['inline']:.2f} s "
        f"({result['inline'] / (compute + write):.2f} x the sum), pipelined {result['pipelined']:.2f} s = "
        f"{ratio:.2f} x max(compute, write) (goal <= {GOAL_PIPELINE_RATIO}: "
        f"{'met' if ratio <= GOAL_PIPELINE_RATIO else 'MISSED'})",
        flush=True,
    )


if __name__ == "__main__":
    main()
