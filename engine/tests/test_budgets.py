"""The memory estimates (``engine.budgets``) bound what the work really takes: each case runs in a
fresh process, whose peak resident memory above its state before the work must stay under the
estimate — and not by an absurd margin, or a budget would refuse what fits.

Also: a mean ablation's means are taken a bounded chunk at a time, equal to encoding every row
at once, and with memory that does not grow with the rows (it grew with min(rows, 65,536) x d_sae).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine import budgets
from engine.sae.evaluation import mean_feature_activations
from engine.testing.tiny_saes import random_sae

pytestmark = pytest.mark.slow

# The peak resident memory of this process: VmHWM, the high-water mark of its own address space
# (getrusage's ru_maxrss survives exec, so a child would start from its parent's peak).
HIGH_WATER = """
def high_water():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""

TRAINING = (
    HIGH_WATER
    + """
import json, sys
import torch
from engine.sae.training import TrainingConfig, train

architecture, d_in, d_sae, batch = sys.argv[1], *map(int, sys.argv[2:5])
data = torch.randn(batch * 4, d_in)
config = TrainingConfig(architecture=architecture, d_sae=d_sae, k=32 if "topk" in architecture else None,
                        batch_size=batch, total_tokens=batch * 4, b_dec_init="mean")

def batches():
    while True:
        for index in range(4):
            yield data[index * batch:(index + 1) * batch]

before = high_water()
train(batches(), d_in=d_in, config=config, sample=data[:8192], checkpoint_every_steps=2,
      on_checkpoint=lambda state: None)
print(json.dumps({"peak": high_water() - before}))
"""
)

MEANS = (
    HIGH_WATER
    + """
import json, sys
import torch
from engine import budgets
from engine.sae.evaluation import mean_feature_activations
from engine.testing.tiny_saes import random_sae

d_in, d_sae = map(int, sys.argv[1:3])
sae = random_sae(d_in, expansion=d_sae // d_in)
chunk = budgets.mean_encoding_rows(d_sae)
generator = torch.Generator().manual_seed(0)
before = high_water()
peaks = {}
for rows in map(int, sys.argv[3:]):  # growing: each peak is the high-water mark so far
    sizes = [min(chunk, rows - start) for start in range(0, rows, chunk)]
    chunks = (torch.randn(size, d_in, generator=generator) for size in sizes)
    mean_feature_activations(sae, chunks)
    peaks[rows] = high_water() - before
print(json.dumps({"peak": peaks}))
"""
)


def peak_of(script: str, *arguments):
    """The growth of a fresh process's peak resident memory over ``script``'s work, in bytes."""
    result = subprocess.run(
        [sys.executable, "-c", script, *map(str, arguments)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.parametrize(
    ("architecture", "d_in", "d_sae", "batch"),
    [("topk", 128, 16384, 2048), ("batchtopk", 64, 8192, 1024)],
)
def test_a_trainings_estimate_bounds_its_peak_memory(architecture, d_in, d_sae, batch):
    estimate = budgets.sae_training(
        architecture=architecture, d_in=d_in, d_sae=d_sae, batch_size=batch,
        buffered_rows=0, sample_rows=8192, evaluation_rows=0,
    )  # fmt: skip
    peak = peak_of(TRAINING, architecture, d_in, d_sae, batch)
    assert peak <= estimate.total, (peak, estimate.describe())
    assert estimate.total < 4 * peak + budgets.RUNTIME_BYTES, (peak, estimate.describe())


def test_the_means_of_a_mean_ablation_are_a_chunk_at_a_time_and_equal_encoding_all_rows():
    sae = random_sae(32, expansion=16)
    rows = torch.randn(5000, 32, generator=torch.Generator().manual_seed(1))
    chunk = budgets.mean_encoding_rows(512)
    chunked = mean_feature_activations(sae, (rows[start : start + 300] for start in range(0, len(rows), 300)))
    with torch.no_grad():
        whole = sae.encode(rows).double().mean(dim=0).float()
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    assert chunk * 512 == budgets.MEAN_ENCODE_FLOATS  # 32,768 rows of 512 features: 64 MiB each


def test_a_mean_ablations_memory_does_not_grow_with_the_rows():
    d_in, d_sae = 16, 8192
    estimate = budgets.mean_ablation(d_in=d_in, d_sae=d_sae)
    peaks = peak_of(MEANS, d_in, d_sae, 4096, 32768)
    few, many = peaks["4096"], peaks["32768"]
    assert many <= estimate.total, (many, estimate.describe())
    # 8 times the rows: more chunks, the same memory (it was 3 x min(rows, 65,536) x 8,192 x 4 B).
    assert many < few + 64 * 2**20, (few, many)
