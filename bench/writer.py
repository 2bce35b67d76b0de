"""The cache writer against a plain ``write`` of the same bytes to the same place.

Data: the batches an extraction of GPT-2 small's three ``resid_post`` hooks yields (width 768),
16 samples of 256 tokens per batch, random values, in the dtype asked (``--dtypes``); built
before any clock starts and handed over as extraction hands them (``add_extracted``: the batch
is the writer's to keep).

Rows, each the median of ``--repeats`` runs into a fresh directory under ``--dir`` (default
``/dev/shm``, a tmpfs, where neither disk nor page-cache write-back blurs the writer's own cost):

  plain   the same shard files (one per hook and one token table per shard, the same bytes)
          written with ``open``/``write``/``fsync``/``close`` on one thread, nothing else.
  writer  ``CacheWriter``: ``add_extracted`` per batch and ``finalize``, exactly as the
          extraction job writes (temp files, fsync, rename, checksums, manifest, token table).

Goal: writer >= 0.8 x plain (bytes per second), measured in the same run.

    .venv/bin/python bench/writer.py [--tokens 1048576] [--dtypes float32,bfloat16] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HOOKS = {f"blocks.{layer}.hook_resid_post": 768 for layer in (0, 6, 11)}
BATCH_TOKENS = 16 * 256
TOKEN_COLUMNS = ("token_ids", "sample_index", "positions")
GOAL = 0.8


def batches(tokens: int, dtype: str) -> list:
    import torch

    made = []
    generator = torch.Generator().manual_seed(0)
    for index, start in enumerate(range(0, tokens, BATCH_TOKENS)):
        count = min(BATCH_TOKENS, tokens - start)
        # What add_extracted reads of an engine.extraction.BatchActivations.
        made.append(
            SimpleNamespace(
                batch_index=index,
                token_ids=torch.randint(0, 50257, (count,), generator=generator),
                sample_index=torch.arange(start, start + count) // 256,
                positions=torch.arange(count) % 256,
                activations={
                    name: torch.randn(count, width, generator=generator).to(getattr(torch, dtype))
                    for name, width in HOOKS.items()
                },
            )
        )
    return made


def run_writer(directory: Path, made: list, dtype: str) -> float:
    from activations.store import CacheWriter, shard_tokens_for

    began = time.perf_counter()
    writer = CacheWriter.create_or_resume(
        directory, key={"bench": "writer"}, provenance={}, hooks=HOOKS, dtype=dtype,
        shard_max_tokens=shard_tokens_for(HOOKS, dtype),
    )  # fmt: skip
    for batch in made:
        writer.add_extracted(batch)
    writer.finalize(num_samples=int(made[-1].sample_index[-1]) + 1)
    return time.perf_counter() - began


def run_plain(directory: Path, made: list, manifest: dict) -> float:
    """The writer's shard files, byte for byte as many, written plainly (one thread, no checksum)."""
    shards = []
    position = 0
    for shard in manifest["shards"]:
        count = shard["last_batch"] - shard["first_batch"] + 1
        shards.append(made[position : position + count])
        position += count
    import torch

    began = time.perf_counter()
    for index, shard in enumerate(shards):
        files = {"tokens": [getattr(batch, column) for batch in shard for column in TOKEN_COLUMNS]}
        for name in HOOKS:
            files[name] = [batch.activations[name] for batch in shard]
        for name, tensors in files.items():
            folder = directory / name
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"{index:05d}.bin", "wb") as handle:
                for tensor in tensors:
                    handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())
                handle.flush()
                os.fsync(handle.fileno())
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2**20)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))  # noqa: S108 (a tmpfs, by design)
    args = parser.parse_args()

    from activations.store import ActivationStore

    cores = os.cpu_count()
    print(f"{args.tokens:,} tokens x {len(HOOKS)} hooks of width 768, into {args.dir} ({cores} cores)")
    print("| dtype | bytes | plain write | writer | writer / plain |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        made = batches(args.tokens, dtype)
        writer_times, plain_times = [], []
        size = 0
        for _ in range(args.repeats):
            base = Path(tempfile.mkdtemp(prefix="bench-writer-", dir=args.dir))
            try:
                writer_times.append(run_writer(base / "cache", made, dtype))
                store = ActivationStore.open(base / "cache")
                size = store.size_bytes
                manifest = store.manifest
                shutil.rmtree(base / "cache")  # one copy in the tmpfs at a time: no memory pressure
                plain_times.append(run_plain(base / "plain", made, manifest))
                plain_size = sum(path.stat().st_size for path in (base / "plain").rglob("*.bin"))
            finally:
                shutil.rmtree(base, ignore_errors=True)
        writer, plain = statistics.median(writer_times), statistics.median(plain_times)
        # Rates over the bytes each wrote (the writer's include headers, manifest and token table).
        ratio = (size / writer) / (plain_size / plain)
        verdict = "met" if ratio >= GOAL else "MISSED"
        print(
            f"| {dtype} | {size / 1e6:,.0f} MB | {plain_size / plain / 1e9:.2f} GB/s | "
            f"{size / writer / 1e9:.2f} GB/s | {ratio:.2f} x (goal >= {GOAL}: {verdict}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
