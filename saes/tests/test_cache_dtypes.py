"""A cache in the model's dtype (bf16, fp16) reads and trains like a float32 cache of the same
values: training, evaluation, statistics and top-k see exactly the values the cache stores, so
results differ from a float32 cache only by the storage's rounding."""

from pathlib import Path

import pytest
import torch

from activations.store import ActivationStore, CacheWriter
from engine.sae import TrainingConfig, shuffled_batches, train
from engine.sae.evaluation import evaluate_activations
from saes.cache_data import row_chunks, spread_sample

HOOK = "blocks.0.hook_resid_post"
D_IN, ROWS, BATCH = 16, 2048, 64


def rows() -> torch.Tensor:
    """Sparse non-negative combinations of a few directions (features that fire), plus noise."""
    generator = torch.Generator().manual_seed(0)
    atoms = torch.randn(32, D_IN, generator=generator) * 4
    codes = torch.rand(ROWS, 32, generator=generator) * (torch.rand(ROWS, 32, generator=generator) < 0.15)
    return codes @ atoms + 0.05 * torch.randn(ROWS, D_IN, generator=generator)


def write(directory: Path, values: torch.Tensor, dtype: str) -> ActivationStore:
    writer = CacheWriter.create_or_resume(
        directory, key={"dtype test": dtype}, provenance={}, hooks={HOOK: D_IN}, dtype=dtype,
        shard_max_tokens=512,
    )  # fmt: skip
    for index, start in enumerate(range(0, ROWS, 256)):
        count = min(256, ROWS - start)
        writer.add_batch(
            index,
            token_ids=torch.arange(count),
            sample_index=torch.full((count,), index),
            positions=torch.arange(count),
            activations={HOOK: values[start : start + count]},
        )
    writer.finalize(num_samples=ROWS // 256)
    return ActivationStore.open(directory)


def hook_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in (directory / HOOK).iterdir())


def trained(store: ActivationStore):
    config = TrainingConfig(architecture="topk", d_sae=64, k=4, lr=3e-3, batch_size=BATCH, total_tokens=ROWS)
    batches = shuffled_batches(row_chunks(store, HOOK, 0, ROWS), batch_size=BATCH, buffer_rows=8 * BATCH)
    return train(batches, d_in=D_IN, config=config, sample=spread_sample(store, HOOK, ROWS, rows=512))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_cache_trains_and_reads_as_its_values_in_float32(tmp_path, dtype):
    values = rows()
    rounded = values.to(getattr(torch, dtype)).float()  # what the half-precision cache holds
    half = write(tmp_path / "half", values, dtype)
    full = write(tmp_path / "full", rounded, "float32")
    assert half.dtype == dtype and hook_bytes(tmp_path / "half") < 0.55 * hook_bytes(tmp_path / "full")

    # The training reads the stored dtype (upcast on the training device) and ends bit for bit
    # where a float32 cache of the same values leads.
    chunk = next(row_chunks(half, HOOK, 0, ROWS))
    assert chunk.dtype == getattr(torch, dtype)
    from_half, from_full = trained(half), trained(full)
    for name, tensor in from_full.sae.state_dict().items():
        torch.testing.assert_close(from_half.sae.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert [step.mse for step in from_half.history] == [step.mse for step in from_full.history]

    evaluated = evaluate_activations(from_half.sae, row_chunks(half, HOOK, 0, ROWS))
    reference = evaluate_activations(from_half.sae, [rounded])
    assert evaluated.explained_variance == pytest.approx(reference.explained_variance, abs=1e-6)
    assert evaluated.l0 == pytest.approx(reference.l0)

    # Statistics and top-k, as the activation browser reads them.
    stats, expected = half.stats(HOOK), full.stats(HOOK)
    for key in ("mean", "std", "max", "min"):
        torch.testing.assert_close(torch.from_numpy(stats[key]), torch.from_numpy(expected[key]), msg=key)
    assert [entry["row"] for entry in half.top_k(HOOK, 3, k=10)] == [
        entry["row"] for entry in full.top_k(HOOK, 3, k=10)
    ]
    slice_ = torch.as_tensor(half.get(HOOK, 100, 200)).float()  # numpy: float32 for bf16, float16 for fp16
    torch.testing.assert_close(slice_, rounded[100:200], rtol=0, atol=0)
