"""SAE training streamed from an activation cache on disk: throughput, memory, and our trainer
against sae-lens's on the same activations.

Writes two caches of planted sparse activations with the store's own writer (``--rows`` rows and
four times as many, width ``--d-in``) and a held-out one, then trains a TopK SAE on each cache,
every run in a fresh process:

* **ours** (this interpreter, the project's environment): the cache is read shard by shard
  (``ActivationStore.get``) through the engine's shuffle buffer into ``engine.sae.train``;
* **sae-lens** (``SAETrainer`` of SAELens 6, run by ``.venv-bench/bin/python``, see
  bench/requirements-bench.txt): fed by the same reader and the same shuffle buffer (both import
  without the project's other dependencies) as the iterator of activation batches that
  ``SAETrainer`` takes. Same hyper-parameters: TopK, ``--expansion``, ``--k``, learning rate,
  warm-up and linear decay, batch size, tokens, AuxK coefficient 1/32, dead after 1,000 steps,
  activations scaled to a mean norm of sqrt(d_in) estimated on the same first 4,096 rows,
  decoder rows of norm 0.1 at the start (sae-lens's default, and ours for TopK). What stays each
  trainer's own: ours starts ``b_dec`` at the geometric median, renormalises decoder rows after
  each step and decodes the k active features sparsely; sae-lens starts it at zero, rescales
  activations by the decoder norms and clips the gradient norm to 1.

Both train on ``--device`` (default cpu; ``cuda:0`` compares them on the same GPU), fed from the
CPU as each would be by its own pipeline: ours through the read-ahead thread, page-locked on a GPU
(as the SAE training job), sae-lens's trainer moving each batch to its device.

Reports tokens/s of each (wall time of the training call, reading and shuffling included), the
ratio, the peak RSS of each process, and the explained variance and L0 of both final SAEs on the
held-out rows: both are saved as SAELens folders, loaded by sae-lens's ``SAE.load_from_disk`` and
scored by one function. Goals: ours/sae-lens >= 1.0x on tokens/s with explained variance at least
as good; our peak RSS flat (<= 10 % growth) when the cache is 4x larger. Without .venv-bench only
our side runs.

    .venv/bin/python bench/sae.py [--rows 100000] [--d-in 256] [--expansion 8] [--k 32] [--repeats 3]
        [--device cuda:0]

The demo model's per-layer table with CE loss recovered is bench/sae_demo.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOOK = "blocks.0.hook_resid_post"
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
SAMPLE_ROWS = 4096  # the rows both trainers estimate the activation scale from
BUFFER_BATCHES = 16
HELD_OUT_ROWS = 16384
# Hyper-parameters both trainers get (besides --expansion, --k, --batch-size and the tokens).
LEARNING_RATE = 1e-3
DECAY_FRACTION = 0.2
AUX_COEFFICIENT = 1 / 32
DEAD_AFTER_STEPS = 1000


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


def schedule(rows: int, batch_size: int) -> tuple[int, int, int]:
    """Steps, warm-up steps and decay steps of a run over ``rows`` (ours' rules, given to both)."""
    steps = max(1, math.ceil(rows / batch_size))
    return steps, max(1, steps // 20), steps - int(steps * (1 - DECAY_FRACTION))


def cache_batches(directory: str, batch_size: int):
    """The store, and the cache's rows in shuffled batches: the stream both trainers read."""
    from activations.store import ActivationStore
    from engine.sae import shuffled_batches

    store = ActivationStore.open(Path(directory))
    rows, _ = store.shape(HOOK)

    def chunks(step: int = 16384):
        for start in range(0, rows, step):
            yield store.get(HOOK, start, min(start + step, rows), as_torch=True).float()

    return store, shuffled_batches(chunks(), batch_size=batch_size, buffer_rows=BUFFER_BATCHES * batch_size)


def start_device(device: str) -> None:
    """Create the device's context before the clock starts, in both trainers' processes (ours'
    read-ahead thread would otherwise do it untimed, page-locking its first batch)."""
    import torch

    if device.startswith("cuda"):
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)


def synchronize(device: str) -> None:
    """Wait for the device's queued work, so that the clock stops when the training has run."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def train_ours(
    directory: str,
    save_to: str,
    expansion: int,
    k: int,
    batch_size: int,
    *,
    device: str = "cpu",
    prefetch: bool = True,
) -> dict:
    """One run of our trainer over the whole cache on ``device``, in this process (called in a
    fresh one).

    ``prefetch``: batches read on a thread ahead of the step, as the SAE training job does
    (page-locked for a GPU)."""
    from engine.prefetch import prefetched
    from engine.sae import TrainingConfig, train
    from engine.sae.formats import save_saelens

    start_device(device)
    store, batches = cache_batches(directory, batch_size)
    if prefetch:
        batches = prefetched(batches, depth=4, pin_memory=device.startswith("cuda"))
    rows, d_in = store.shape(HOOK)
    _, warmup, _ = schedule(rows, batch_size)
    config = TrainingConfig(
        architecture="topk",
        d_sae=expansion * d_in,
        k=k,
        lr=LEARNING_RATE,
        batch_size=batch_size,
        total_tokens=rows,
        warmup_steps=warmup,
        decay_fraction=DECAY_FRACTION,
        aux_coefficient=AUX_COEFFICIENT,
        dead_after_steps=DEAD_AFTER_STEPS,
    )
    started = time.perf_counter()
    sample = store.get(HOOK, 0, SAMPLE_ROWS, as_torch=True)
    trained = train(batches, d_in=d_in, config=config, sample=sample, device=device)
    synchronize(device)
    seconds = time.perf_counter() - started
    save_saelens(trained.sae, save_to, hook_name=HOOK, model_name="bench-planted")
    return {
        "rows": rows,
        "tokens_per_second": trained.tokens / seconds,
        "dead": trained.history[-1].dead,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def train_saelens(
    directory: str, save_to: str, expansion: int, k: int, batch_size: int, *, device: str = "cpu"
) -> dict:
    """One run of sae-lens's ``SAETrainer`` over the same cache on ``device`` (in .venv-bench, a
    fresh process)."""
    from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    start_device(device)
    store, batches = cache_batches(directory, batch_size)
    rows, d_in = store.shape(HOOK)
    steps, warmup, decay = schedule(rows, batch_size)

    def data_provider():
        # SAETrainer estimates the scale from the provider's first batches: the rows ours uses.
        yield from store.get(HOOK, 0, SAMPLE_ROWS, as_torch=True).float().split(batch_size)
        yield from batches

    # Timed from the SAE's construction, as ours is (train() builds its SAE and optimizer): the
    # first Adam of a process imports torch._dynamo, about 3 s here, and both pay it.
    started = time.perf_counter()
    sae = TopKTrainingSAE(
        TopKTrainingSAEConfig(
            d_in=d_in,
            d_sae=expansion * d_in,
            k=k,
            normalize_activations="expected_average_only_in",
            aux_loss_coefficient=AUX_COEFFICIENT,
            decoder_init_norm=0.1,  # its default, and ours for TopK
            device=device,
        )
    )
    trainer = SAETrainer(
        cfg=SAETrainerConfig(
            total_training_samples=rows,
            train_batch_size_samples=batch_size,
            lr=LEARNING_RATE,
            lr_end=LEARNING_RATE,  # the constant scheduler's level, where the linear decay starts
            lr_warm_up_steps=warmup,
            lr_decay_steps=decay,
            dead_feature_window=DEAD_AFTER_STEPS,
            feature_sampling_window=steps + 1,
            n_batches_for_norm_estimate=SAMPLE_ROWS // batch_size,
            device=device,
        ),
        sae=sae,
        data_provider=data_provider(),
    )
    trained = trainer.fit()
    synchronize(device)
    seconds = time.perf_counter() - started
    trained.save_inference_model(save_to)
    return {
        "rows": rows,
        "tokens_per_second": trainer.n_training_samples / seconds,
        "dead": int(trainer.dead_neurons.sum()),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def held_out_quality(sae, rows) -> dict:
    """Explained variance and L0 of ``sae`` (anything with ``encode`` and ``decode``) on ``rows``:
    the one function both final SAEs are scored by."""
    import torch

    with torch.no_grad():
        features = sae.encode(rows)
        residual = (rows - sae.decode(features)).pow(2).sum()
        total = (rows - rows.mean(0)).pow(2).sum()
    return {
        "explained_variance": float(1 - residual / total),
        "l0": float((features > 0).sum(-1).float().mean()),
    }


def evaluate(held_out: str, folders: list[str]) -> list[dict]:
    """Each SAELens folder's quality on the held-out cache, loaded by sae-lens where it is
    installed (the neutral reader of both), by the engine's reader otherwise."""
    from activations.store import ActivationStore

    store = ActivationStore.open(Path(held_out))
    rows = store.get(HOOK, as_torch=True).float()
    try:
        from sae_lens import SAE

        load = SAE.load_from_disk
    except ImportError:
        from engine.sae.formats import load_saelens

        def load(folder):
            return load_saelens(folder)[0]

    return [held_out_quality(load(folder), rows) for folder in folders]


def run_json(python: Path | str, *arguments: str) -> dict | list:
    """The last line of a fresh process's output, as JSON (progress bars silenced)."""
    command = [str(python), __file__, *arguments]
    environment = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if finished.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--expansion", type=int, default=8)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each trainer per cache (median)")
    parser.add_argument("--bench-python", default=str(BENCH_PYTHON), help="the interpreter with sae-lens")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where both trainers train: cpu (default) or cuda:N, the same for both",
    )
    # internal: one run in this process
    parser.add_argument("--train", nargs=2, metavar=("CACHE", "SAVE_TO"), help=argparse.SUPPRESS)
    parser.add_argument("--no-prefetch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train-saelens", nargs=2, metavar=("CACHE", "SAVE_TO"), help=argparse.SUPPRESS)
    parser.add_argument("--evaluate", nargs="+", metavar="FOLDER", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    shape = (arguments.expansion, arguments.k, arguments.batch_size)
    device = arguments.device
    if arguments.train:
        result = train_ours(*arguments.train, *shape, device=device, prefetch=not arguments.no_prefetch)
        print(json.dumps(result))
        return
    if arguments.train_saelens:
        print(json.dumps(train_saelens(*arguments.train_saelens, *shape, device=device)))
        return
    if arguments.evaluate:
        print(json.dumps(evaluate(arguments.evaluate[0], arguments.evaluate[1:])))
        return

    compare = Path(arguments.bench_python).exists()
    if not compare:
        print(f"{arguments.bench_python} not found: our trainer only (see bench/requirements-bench.txt)")
    trainers = {"ours": sys.executable, **({"sae-lens": arguments.bench_python} if compare else {})}
    internal = {"ours": "--train", "sae-lens": "--train-saelens"}
    options = ["--expansion", str(arguments.expansion), "--k", str(arguments.k)]
    options += ["--batch-size", str(arguments.batch_size), "--device", device]
    results = []
    with tempfile.TemporaryDirectory() as temporary:
        held_out = Path(temporary) / "held-out"
        write_cache(held_out, rows=HELD_OUT_ROWS, d_in=arguments.d_in, seed=1000)
        for factor in (1, 4):
            directory = Path(temporary) / f"cache-{factor}x"
            write_cache(directory, rows=factor * arguments.rows, d_in=arguments.d_in, seed=factor)
            runs: dict[str, list[dict]] = {name: [] for name in trainers}
            for _ in range(arguments.repeats):  # alternated, so a busy spell hits both
                for name, python in trainers.items():
                    saved = str(Path(temporary) / f"{name}-{factor}x")
                    runs[name].append(run_json(python, internal[name], str(directory), saved, *options))
            folders = [str(Path(temporary) / f"{name}-{factor}x") for name in trainers]
            judge = trainers.get("sae-lens", sys.executable)
            qualities = run_json(judge, "--evaluate", str(held_out), *folders)
            for (name, name_runs), quality in zip(runs.items(), qualities, strict=True):
                results.append(
                    {
                        "trainer": name,
                        "rows": name_runs[0]["rows"],
                        "tokens_per_second": statistics.median(run["tokens_per_second"] for run in name_runs),
                        "all_tokens_per_second": [run["tokens_per_second"] for run in name_runs],
                        "dead": name_runs[-1]["dead"],
                        "peak_rss_mib": max(run["peak_rss_mib"] for run in name_runs),
                        **quality,
                    }
                )
    report(results, arguments)


def report(results: list[dict], arguments: argparse.Namespace) -> None:
    print(
        f"TopK, d_in {arguments.d_in}, {arguments.expansion}x ({arguments.expansion * arguments.d_in} "
        f"features), k {arguments.k}, batch {arguments.batch_size}, lr {LEARNING_RATE}, on "
        f"{arguments.device}; median of {arguments.repeats} runs; quality on {HELD_OUT_ROWS:,} held-out rows"
    )
    for result in results:
        runs = ", ".join(f"{value:,.0f}" for value in result["all_tokens_per_second"])
        print(
            f"{result['trainer']:>8} {result['rows']:>9,} rows  {result['tokens_per_second']:>9,.0f} tok/s "
            f"({runs})  explained variance {result['explained_variance']:.3f}  L0 {result['l0']:.1f}  "
            f"dead {result['dead']}  peak RSS {result['peak_rss_mib']:,.0f} MiB"
        )
    ours = {result["rows"]: result for result in results if result["trainer"] == "ours"}
    small, large = sorted(ours)
    growth = ours[large]["peak_rss_mib"] / ours[small]["peak_rss_mib"] - 1
    print(f"our peak RSS growth with a 4x larger cache: {growth:+.1%} (goal <= +10%)")
    for result in results:
        if result["trainer"] == "sae-lens":
            mine = ours[result["rows"]]
            ratio = mine["tokens_per_second"] / result["tokens_per_second"]
            print(
                f"{result['rows']:>9,} rows: ours / sae-lens {ratio:.2f}x "
                f"tokens/s (goal >= 1.0x); explained variance {mine['explained_variance']:.3f} vs "
                f"{result['explained_variance']:.3f}, L0 {mine['l0']:.1f} vs {result['l0']:.1f}"
            )


if __name__ == "__main__":
    main()
