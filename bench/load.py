"""Load time and memory of the worker's load path against a bare transformers load.

Builds a randomly initialised GPT-2 small (124,439,808 parameters, the kit's "gpt2-small")
in a temporary folder once, then for each quantization, alternating the two paths:

  (a) the worker's path: ``load_weights(...)`` + ``warm_up(...)``. It includes the tokenizer
      load (the worker needs it; its share is shown), the quantization check, the footprint,
      returning freed heap to the OS, and a one-token warm-up forward pass;
  (b) a bare ``AutoModelForCausalLM.from_pretrained(folder, ...)`` with the same dtype,
      ``BitsAndBytesConfig`` and ``device_map`` as (a), plus one forward pass on 32 tokens.

Both run in this one long-lived process, like the worker; one untimed round of each first
pays the one-off costs (imports, bitsandbytes set-up, page cache), so neither path is charged
for them. Releasing a model between runs is not timed. Medians over ``--repeats`` runs.
Goals: (a) within 1.15x of (b) or (b) + 0.5 s, whichever is larger; the footprint
(``get_memory_footprint()``) of int8 at most 0.5x and of int4 at most 0.3x the fp32 one.

    .venv/bin/python bench/load.py [--repeats 3] [--device cpu]
"""

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.loading import (  # noqa: E402  (the path is set just above)
    load_weights,
    quantization_config_for,
    release,
    torch_dtype_for,
    warm_up,
)
from engine.testing.tiny_models import build_tiny_model  # noqa: E402

FOOTPRINT_GOALS = {"int8": 0.5, "int4": 0.3}
SEQUENCE_LENGTH = 32


def worker_path(folder: Path, quantization: str, device: str) -> tuple[float, int, dict[str, float]]:
    """Seconds for load_weights + warm_up, the footprint, and the seconds per stage."""
    started = time.perf_counter()
    weights = load_weights(folder, model_type="gpt2", quantization=quantization, device=device)
    warm_up(weights)
    elapsed = time.perf_counter() - started
    footprint, timings = weights.memory_usage_bytes, dict(weights.timings)
    release(weights)
    return elapsed, footprint, timings


def bare_path(folder: Path, quantization: str, device: str) -> float:
    """Seconds for a bare from_pretrained with the same settings + one 32-token forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {
        "dtype": torch_dtype_for(quantization, device),
        "device_map": {"": device},
        "use_safetensors": True,
    }
    quantization_config = quantization_config_for(quantization, device)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    input_ids = torch.arange(SEQUENCE_LENGTH, device=device).unsqueeze(0) + 10
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    with torch.no_grad():
        model(input_ids=input_ids)
    elapsed = time.perf_counter() - started
    holder = SimpleNamespace(model=model)
    del model
    release(holder)  # untimed, as for (a): both paths start from a trimmed heap
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path (at least 3)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--folder", type=Path, help="reuse a gpt2-small folder instead of building one")
    args = parser.parse_args()
    repeats = max(args.repeats, 3)

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, device {args.device}"
    )

    with tempfile.TemporaryDirectory(prefix="mistudio-bench-load-") as scratch:
        folder = args.folder
        if folder is None:
            started = time.perf_counter()
            folder = build_tiny_model("gpt2", Path(scratch) / "gpt2-small", size="gpt2-small")
            print(f"built gpt2-small in {time.perf_counter() - started:.1f} s")

        rows = []
        fp32_footprint = None
        for quantization in args.quantizations:
            worker_path(folder, quantization, args.device)  # untimed: one-off costs
            bare_path(folder, quantization, args.device)
            ours, bare, stages = [], [], []
            footprint = 0
            for repeat in range(repeats):
                # Alternate which path goes first, so neither always inherits the other's heap.
                order = ("a", "b") if repeat % 2 == 0 else ("b", "a")
                for path in order:
                    if path == "a":
                        seconds, footprint, timings = worker_path(folder, quantization, args.device)
                        ours.append(seconds)
                        stages.append(timings)
                    else:
                        bare.append(bare_path(folder, quantization, args.device))
            if quantization == "none":
                fp32_footprint = footprint
            stage_medians = {name: statistics.median(run[name] for run in stages) for name in stages[0]}
            rows.append((quantization, ours, bare, stage_medians, footprint))

    print(f"\nmedians of {repeats} runs; a: load_weights + warm_up, b: from_pretrained + 32-token forward")
    header = (
        f"{'quant':<6} {'a (s)':>7} {'b (s)':>7} {'a/b':>6} {'limit':>7} {'time ok':>8} "
        f"{'tok (s)':>8} {'MB':>8} {'x fp32':>7} {'goal':>6} {'mem ok':>7}"
    )
    print(header)
    print("-" * len(header))
    for quantization, ours, bare, stage_medians, footprint in rows:
        a, b = statistics.median(ours), statistics.median(bare)
        limit = max(1.15 * b, b + 0.5)
        share = footprint / fp32_footprint if fp32_footprint else float("nan")
        goal = FOOTPRINT_GOALS.get(quantization)
        memory_ok = "-" if goal is None else ("yes" if share <= goal else "NO")
        time_ok = "yes" if a <= limit else "NO"
        print(
            f"{quantization:<6} {a:>7.3f} {b:>7.3f} {a / b:>6.2f} {limit:>7.3f} {time_ok:>8} "
            f"{stage_medians['tokenizer']:>8.3f} {footprint / 1e6:>8.1f} {share:>7.3f} "
            f"{'-' if goal is None else f'{goal:.2f}':>6} {memory_ok:>7}"
        )
        runs_a, runs_b = (", ".join(f"{seconds:.3f}" for seconds in runs) for runs in (ours, bare))
        print(f"{'':<6} a runs: {runs_a}; b runs: {runs_b}")
        breakdown = ", ".join(f"{name} {seconds:.3f}" for name, seconds in stage_medians.items())
        print(f"{'':<6} a stages (medians; weights includes tokenizer): {breakdown}")


if __name__ == "__main__":
    main()
