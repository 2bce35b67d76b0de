"""How long an SAE training from a cache takes to resume, by how far it had got.

A time-sliced training resumes every few minutes under contention. Before stream positions, a
resume replayed the batch stream from its beginning to the checkpoint's step (every batch read from
the cache and shuffled again: quadratic over a sliced run); now the checkpoint keeps the stream's
position and the resume reads the rows its shuffle buffer held and the cache on from there.

Writes a float32 cache (``--rows`` rows of width ``--d-in``, in the store's shards), then walks the
training's stream (``saes.cache_data.training_batches``: the job's reading, shuffle buffer of 16
batches, 16,384-row chunks, as many epochs as the steps need) and, at each ``--steps``, times:

* **replay**: reaching that step from the stream's beginning (what a resume cost before; also
  what a checkpoint without a position still costs);
* **position**: opening the stream at that step's position until its next batch is out (a
  resume now), and the rows it read from the cache;

and reports the stream's throughput with and without positions (their per-batch cost) and the
bytes a position adds to a checkpoint. All in this process, on the CPU (the stream's device).

    .venv/bin/python bench/sae_resume.py [--rows 262144] [--d-in 256] [--batch-size 1024]
        [--steps 1000 10000 100000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOOK = "blocks.0.hook_resid_post"


def write_cache(directory: Path, *, rows: int, d_in: int) -> None:
    import torch

    from activations.store import CacheWriter

    generator = torch.Generator().manual_seed(0)
    writer = CacheWriter.create_or_resume(
        directory,
        key={"bench": "sae_resume", "rows": rows},
        provenance={},
        hooks={HOOK: d_in},
        dtype="float32",
    )
    with writer:
        chunk = 16384
        for batch, start in enumerate(range(0, rows, chunk)):
            count = min(chunk, rows - start)
            zeros = torch.zeros(count, dtype=torch.long)
            writer.add_batch(
                batch, token_ids=zeros, sample_index=torch.arange(start, start + count), positions=zeros,
                activations={HOOK: torch.randn(count, d_in, generator=generator)},
            )  # fmt: skip
        writer.finalize(num_samples=rows)


def counting_store(directory: Path):
    """The cache, counting the rows read from it (by range and by number)."""
    from activations.store import ActivationStore

    class CountingStore(ActivationStore):
        rows_read = 0

        def get(self, *args, **options):
            values = super().get(*args, **options)
            self.rows_read += len(values)
            return values

        def gather(self, *args, **options):
            values = super().gather(*args, **options)
            self.rows_read += len(values)
            return values

    return CountingStore.open(directory)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=262_144)
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10_000, 100_000])
    arguments = parser.parse_args()

    from activations.store import ActivationStore
    from engine.sae import shuffled_batches
    from saes.cache_data import SHUFFLE_BUFFER_BATCHES, row_chunks, training_batches

    steps = sorted(arguments.steps)
    epochs = -(-steps[-1] * arguments.batch_size // arguments.rows) + 1
    report: dict = {"rows": arguments.rows, "d_in": arguments.d_in, "batch_size": arguments.batch_size}
    with tempfile.TemporaryDirectory(prefix="sae-resume-") as folder:
        write_cache(Path(folder) / "cache", rows=arguments.rows, d_in=arguments.d_in)
        store = ActivationStore.open(Path(folder) / "cache")

        def stream(start=None):
            return training_batches(
                store,
                HOOK,
                arguments.rows,
                batch_size=arguments.batch_size,
                seed=0,
                epochs=epochs,
                start=start,
            )

        # The stream's throughput, with positions and without (as before), over two epochs.
        measured = 2 * arguments.rows // arguments.batch_size
        started = time.perf_counter()
        for _ in zip(range(measured), stream(), strict=False):
            pass
        with_positions = time.perf_counter() - started
        plain = shuffled_batches(
            row_chunks(store, HOOK, 0, arguments.rows, epochs=epochs), batch_size=arguments.batch_size,
            buffer_rows=SHUFFLE_BUFFER_BATCHES * arguments.batch_size,
        )  # fmt: skip
        started = time.perf_counter()
        for _ in zip(range(measured), plain, strict=False):
            pass
        without = time.perf_counter() - started
        report["stream_batches_per_second"] = {
            "with_positions": round(measured / with_positions, 1),
            "without": round(measured / without, 1),
        }

        report["resumes"] = []
        started, walk = time.perf_counter(), stream()
        for target in steps:
            position = next(position for _batch, position in walk if position.batches == target)
            replay = time.perf_counter() - started
            counting = counting_store(store.directory)
            opened = time.perf_counter()
            next(training_batches(
                counting, HOOK, arguments.rows, batch_size=arguments.batch_size, seed=0, epochs=epochs,
                start=position,
            ))  # fmt: skip
            resume = time.perf_counter() - opened
            held_bytes = sum(tensor.numel() * tensor.element_size() for tensor in position.buffer.values())
            report["resumes"].append({
                "step": target, "rows_trained": position.rows_given, "replay_seconds": round(replay, 2),
                "position_seconds": round(resume, 4), "position_rows_read": counting.rows_read,
                "position_bytes_in_checkpoint": held_bytes,
            })  # fmt: skip
            print(json.dumps(report["resumes"][-1]), flush=True)
            started = time.perf_counter() - replay  # the replay clock runs on from the last target
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
