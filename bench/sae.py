"""SAE training throughput and memory, streamed from an activation cache on disk (issue 14, part).

Writes two caches of planted sparse activations with the store's own writer (``--rows`` rows and
four times as many, width ``--d-in``), then trains a TopK SAE on each in a fresh process: the
cache is read shard by shard (``ActivationStore.get``) through the engine's shuffle buffer into
``engine.sae.train``. Reports tokens/s, explained variance, L0, dead features and the peak RSS of
each run; the goal is that the peak stays flat (<= 10 % growth) when the cache is 4x larger.

Not yet here (see the issue): the comparison with ``sae-lens``'s trainer on the same activations,
and the demo model's per-layer table with CE loss recovered.

    .venv/bin/python bench/sae.py [--rows 100000] [--d-in 256] [--expansion 8] [--k 32]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOOK = "blocks.0.hook_resid_post"


def write_cache(directory: Path, *, rows: int, d_in: int, seed: int) -> None:
    """A cache of ``rows`` sparse combinations of 4 * d_in unit atoms, 8 active per row."""
    import torch

    from activations.store import CacheWriter

    generator = torch.Generator().manual_seed(seed)
    atoms = torch.randn(4 * d_in, d_in, generator=torch.Generator().manual_seed(0))
    atoms /= atoms.norm(dim=1, keepdim=True)
    writer = CacheWriter.create_or_resume(
        directory, key={"bench": "sae", "rows": rows}, provenance={}, hooks={HOOK: d_in}, dtype="float32"
    )
    with writer:
        chunk = 8192
        for batch, start in enumerate(range(0, rows, chunk)):
            count = min(chunk, rows - start)
            chosen = torch.rand(count, len(atoms), generator=generator).argsort(dim=1)[:, :8]
            codes = torch.zeros(count, len(atoms)).scatter(
                1, chosen, torch.rand(count, 8, generator=generator) + 0.5
            )
            writer.add_batch(
                batch,
                token_ids=torch.zeros(count, dtype=torch.long),
                sample_index=torch.arange(start, start + count),
                positions=torch.zeros(count, dtype=torch.long),
                activations={HOOK: codes @ atoms},
            )
        writer.finalize(num_samples=rows)


def train_run(directory: str, expansion: int, k: int, batch_size: int) -> dict:
    """One training run over the whole cache, in this process (called in a fresh one)."""
    from activations.store import ActivationStore
    from engine.sae import TrainingConfig, shuffled_batches, train

    store = ActivationStore.open(Path(directory))
    rows, d_in = store.shape(HOOK)

    def chunks(step: int = 16384):
        for start in range(0, rows, step):
            yield store.get(HOOK, start, min(start + step, rows), as_torch=True).float()

    steps = max(1, rows // batch_size)
    config = TrainingConfig(
        architecture="topk",
        d_sae=expansion * d_in,
        k=k,
        lr=1e-3,
        batch_size=batch_size,
        total_tokens=rows,
        warmup_steps=max(1, steps // 20),
    )
    started = time.perf_counter()
    trained = train(
        shuffled_batches(chunks(), batch_size=batch_size, buffer_rows=16 * batch_size),
        d_in=d_in,
        config=config,
        sample=store.get(HOOK, 0, min(rows, 4096), as_torch=True).float(),
    )
    seconds = time.perf_counter() - started
    last = trained.history[-1]
    return {
        "rows": rows,
        "tokens_per_second": trained.tokens / seconds,
        "explained_variance": last.explained_variance,
        "l0": last.l0,
        "dead": last.dead,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--expansion", type=int, default=8)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--train", help=argparse.SUPPRESS)  # internal: one run in this process
    arguments = parser.parse_args()
    if arguments.train:
        print(json.dumps(train_run(arguments.train, arguments.expansion, arguments.k, arguments.batch_size)))
        return
    results = []
    with tempfile.TemporaryDirectory() as temporary:
        for factor in (1, 4):
            directory = Path(temporary) / f"cache-{factor}x"
            write_cache(directory, rows=factor * arguments.rows, d_in=arguments.d_in, seed=factor)
            command = [
                sys.executable, __file__, "--train", str(directory), "--expansion", str(arguments.expansion),
                "--k", str(arguments.k), "--batch-size", str(arguments.batch_size),
            ]  # fmt: skip
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(output.strip().splitlines()[-1]))
    for result in results:
        print(
            f"{result['rows']:>9,} rows  {result['tokens_per_second']:>9,.0f} tok/s  "
            f"explained variance {result['explained_variance']:.3f}  L0 {result['l0']:.1f}  "
            f"dead {result['dead']}  peak RSS {result['peak_rss_mib']:,.0f} MiB"
        )
    growth = results[1]["peak_rss_mib"] / results[0]["peak_rss_mib"] - 1
    print(f"peak RSS growth with a 4x larger cache: {growth:+.1%} (goal <= +10%)")


if __name__ == "__main__":
    main()
