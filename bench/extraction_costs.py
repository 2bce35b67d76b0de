"""Where extraction time goes for bench/gpu.py: the same batches through

* the bare forward pass, stopped after the deepest hooked block (bench/extraction.py's ``run_limit``);
* ``extract`` with every batch consumed and dropped: the forward pass and the device-to-host copies;
* ``extract`` into a cache on tmpfs and into the cache directory, through the extraction job's own
  writer: ``CacheWriter.create_or_resume`` fed by a ``BackgroundWriter`` on its thread, then
  ``finalize`` (activations/tasks.py), stored in the model's dtype;
* and the cache directory's own sequential write bandwidth (write + fsync of ``BANDWIDTH_BYTES``
  in ``BANDWIDTH_CHUNK`` chunks), measured in the same run: with the bytes a token takes in the
  cache it bounds what any writer can reach there.

Each is warmed up on the first batch, then timed ``repeats`` times (medians); a cache written by a
timed pass is removed after the clock stops. Django-free: the GPU machine has no Django.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from extraction import BATCH_SIZE, WARM_UP_BATCHES, cache_writer, dataset_batches, run_limit, timed

BANDWIDTH_BYTES = 2**30
BANDWIDTH_CHUNK = 64 * 2**20
# A tmpfs must hold the cache with this much to spare (the token table is written per shard and
# again whole at finalize; the estimate below counts both).
TMPFS_MARGIN = 1.25
TMPFS_DEFAULT = Path("/dev/shm")  # noqa: S108  (a place to measure, not a temporary file)
# The extraction job's shard size (mistudio/settings.py's ACTIVATION_SHARD_MAX_TOKENS default).
SHARD_MAX_TOKENS = 65536


@dataclass(frozen=True)
class ExtractionCosts:
    """Seconds of each way over the same ``tokens`` (medians); None where a way did not run."""

    tokens: int
    forward: float
    dropped: float
    tmpfs: float | None
    # Where the tmpfs cache went, or why it did not run.
    tmpfs_note: str
    cache_directory: float
    cache_directory_path: str
    # Bytes per second of write + fsync in the cache directory, and how many bytes were written.
    bandwidth: float
    bandwidth_bytes: int
    # The cache's size on disk (every file, token table included) per token.
    bytes_per_token: float

    @property
    def disk_bound(self) -> float:
        """Tokens/s the cache directory's bandwidth allows at this cache's bytes per token."""
        return self.bandwidth / self.bytes_per_token

    @property
    def bound(self) -> float:
        """Tokens/s extraction into the cache directory can reach: min(forward, disk)."""
        return min(self.tokens / self.forward, self.disk_bound)


def default_cache_parent() -> Path:
    """Where the extraction job writes its caches: mistudio/settings.py's ACTIVATION_CACHE_DIR,
    read from the same environment variables (this runs without Django)."""
    if os.environ.get("ACTIVATION_CACHE_DIR"):
        return Path(os.environ["ACTIVATION_CACHE_DIR"])
    data = Path(os.environ.get("MISTUDIO_DATA_DIR") or Path(__file__).resolve().parents[1] / "data")
    return data / "activations"


def estimated_cache_bytes(tokens: int, widths: dict[str, int], dtype: str) -> int:
    """Bytes of a finalized cache: each hook's rows and the token table, which is written per
    shard and again whole at finalize (``activations.store.cache_bytes_per_token``)."""
    from activations.store import cache_bytes_per_token

    return tokens * cache_bytes_per_token(widths.values(), dtype)


def tmpfs_folder(needed: int, preferred: Path = TMPFS_DEFAULT) -> tuple[Path | None, str]:
    """A writable tmpfs with room for ``needed`` bytes (``preferred`` first, then the roomiest
    other tmpfs mount), or None and why not."""
    mounts = []
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, point, kind, *_ = line.split()
            if kind == "tmpfs":
                mounts.append(Path(point.replace("\\040", " ")))
    except OSError:
        pass
    candidates = [preferred] if preferred.is_dir() else []
    usable = [
        point for point in mounts if point != preferred and point.is_dir() and os.access(point, os.W_OK)
    ]
    candidates += sorted(usable, key=lambda point: shutil.disk_usage(point).free, reverse=True)
    for point in candidates:
        if os.access(point, os.W_OK) and shutil.disk_usage(point).free >= TMPFS_MARGIN * needed:
            return point, str(point)
    if not candidates:
        return None, "skipped: no tmpfs mounted"
    roomiest = max(candidates, key=lambda point: shutil.disk_usage(point).free)
    return None, (
        f"skipped: the roomiest tmpfs ({roomiest}) has {shutil.disk_usage(roomiest).free / 2**20:,.0f} MiB "
        f"free, the cache needs {TMPFS_MARGIN * needed / 2**20:,.0f} MiB"
    )


def write_bandwidth(directory: Path, *, total: int = BANDWIDTH_BYTES, chunk: int = BANDWIDTH_CHUNK) -> float:
    """Bytes per second of writing ``total`` bytes to a new file in ``directory``, ``chunk`` bytes
    per ``write``, then ``fsync``: the most a writer that keeps its files durable can reach there."""
    block = os.urandom(chunk)  # incompressible, should the filesystem compress
    path = directory / "bandwidth.tmp"
    started = time.perf_counter()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < total:
            view = memoryview(block)[: min(chunk, total - written)]
            while view:
                view = view[os.write(descriptor, view) :]
            written += min(chunk, total - written)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    seconds = time.perf_counter() - started
    path.unlink()
    return total / seconds


def extract_into_cache(
    model, tokenized: list[list[int]], hooks: list[str], directory: Path, *, dtype: str
) -> dict:
    """The extraction job's path from token ids to a finalized cache in ``directory``, stored in
    ``dtype``: ``extract`` feeding a ``BackgroundWriter`` (the next batch's forward pass runs while
    this one is written), then ``finalize``. Returns the manifest."""
    from activations.store import BackgroundWriter, shard_tokens_for
    from engine.extraction import extract, plan_batches

    plan = plan_batches([len(ids) for ids in tokenized], BATCH_SIZE)
    widths = dict.fromkeys(hooks, model.config.hidden_size)
    shard_tokens = min(SHARD_MAX_TOKENS, shard_tokens_for(widths, dtype))
    writer = cache_writer(model, hooks, directory, shard_max_tokens=shard_tokens, dtype=dtype)
    with writer:  # releases the directory's lock, whatever happens
        batches = extract(model, tokenized, plan, hooks=hooks, dtype=dtype, start_batch=writer.next_batch)
        with BackgroundWriter(writer) as background:
            for batch in batches:
                background.add_extracted(batch)
        return writer.finalize(num_samples=len(tokenized))


def _warm_up_samples(tokenized: list[list[int]]) -> list[list[int]]:
    first = dataset_batches(len(tokenized))[:WARM_UP_BATCHES]
    return [tokenized[index] for batch in first for index in batch]


def time_dropped(model, tokenized: list[list[int]], hooks: list[str], *, dtype: str, repeats: int) -> float:
    """Median seconds of ``extract`` over every batch, each batch dropped once it arrives: the
    forward pass with the hooks and the copies to host memory, no cache."""
    from engine.extraction import extract, plan_batches

    def run(*, warm_up: bool) -> None:
        samples = _warm_up_samples(tokenized) if warm_up else tokenized
        plan = plan_batches([len(ids) for ids in samples], BATCH_SIZE)
        for _batch in extract(model, samples, plan, hooks=hooks, dtype=dtype):
            pass

    return timed(run, repeats=repeats)["seconds"]


def time_cache(
    model, tokenized: list[list[int]], hooks: list[str], parent: Path, *, dtype: str, repeats: int
) -> tuple[float, int]:
    """Median seconds of :func:`extract_into_cache` into a fresh folder under ``parent``, and the
    finalized cache's bytes on disk."""
    sizes = []

    def run(*, warm_up: bool) -> None:
        directory = Path(tempfile.mkdtemp(prefix="bench-cache-", dir=parent))
        try:
            samples = _warm_up_samples(tokenized) if warm_up else tokenized
            manifest = extract_into_cache(model, samples, hooks, directory / "cache", dtype=dtype)
            assert manifest["num_tokens"] == sum(len(ids) for ids in samples)
            if not warm_up:
                sizes.append(sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    return timed(run, repeats=repeats)["seconds"], sizes[-1]


def measure_extraction_costs(
    model,
    tokenized: list[list[int]],
    hooks: list[str],
    deepest: int,
    *,
    dtype: str,
    repeats: int,
    cache_parent: Path,
    tmpfs: Path = TMPFS_DEFAULT,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
    log=print,
) -> ExtractionCosts:
    """Every way above over ``tokenized``, logging each result as it comes (a run cut short
    still shows how far it got)."""
    tokens = sum(len(ids) for ids in tokenized)

    def note(label: str, seconds: float) -> None:
        log(f"  {label}: {seconds:.3f} s, {tokens / seconds:,.0f} tokens/s")

    forward = run_limit(model, tokenized, deepest, repeats=repeats)["seconds"]
    note(f"bare forward to block {deepest}", forward)
    dropped = time_dropped(model, tokenized, hooks, dtype=dtype, repeats=repeats)
    note("extract(), batches dropped", dropped)

    widths = dict.fromkeys(hooks, model.config.hidden_size)
    folder, tmpfs_note = tmpfs_folder(estimated_cache_bytes(tokens, widths, dtype), tmpfs)
    tmpfs_seconds = None
    if folder is None:
        log(f"  tmpfs: {tmpfs_note}")
    else:
        tmpfs_seconds, _ = time_cache(model, tokenized, hooks, folder, dtype=dtype, repeats=repeats)
        note(f"extraction into a cache on tmpfs ({folder})", tmpfs_seconds)

    cache_parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=cache_parent))
    try:
        bandwidth = write_bandwidth(scratch, total=bandwidth_bytes)
        log(f"  write + fsync of {bandwidth_bytes / 2**30:.2f} GiB in {scratch}: {bandwidth / 1e9:.2f} GB/s")
        on_disk, size = time_cache(model, tokenized, hooks, scratch, dtype=dtype, repeats=repeats)
        note(f"extraction into the cache directory ({cache_parent})", on_disk)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ExtractionCosts(
        tokens=tokens,
        forward=forward,
        dropped=dropped,
        tmpfs=tmpfs_seconds,
        tmpfs_note=tmpfs_note,
        cache_directory=on_disk,
        cache_directory_path=str(cache_parent),
        bandwidth=bandwidth,
        bandwidth_bytes=bandwidth_bytes,
        bytes_per_token=size / tokens,
    )
