"""SAE test fixtures: a completed activation cache of planted sparse activations, written by the
store's own writer (no model run needed), at a hook of the tiny GPT-2 whose width it matches."""

import uuid

import pytest
import torch

from activations.models import ActivationCache
from activations.services import cache_store_completed, cache_store_open
from models_app.services import model_register

HOOK = "blocks.0.hook_resid_post"
D_IN = 64  # the tiny GPT-2's width
TOKENS_PER_SAMPLE = 16


def planted_rows(rows: int, *, seed: int = 0) -> torch.Tensor:
    """Sparse non-negative combinations of 4 * D_IN unit atoms, 4 active per row."""
    atoms = torch.randn(4 * D_IN, D_IN, generator=torch.Generator().manual_seed(0))
    atoms /= atoms.norm(dim=1, keepdim=True)
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.rand(rows, len(atoms), generator=generator).argsort(dim=1)[:, :4]
    codes = torch.zeros(rows, len(atoms)).scatter(1, chosen, torch.rand(rows, 4, generator=generator) + 0.5)
    return codes @ atoms


def write_planted_cache(model, owner, *, samples: int = 256) -> ActivationCache:
    cache = ActivationCache.objects.create(
        key_hash=uuid.uuid4().hex, key={"test": "planted", "samples": samples}, model=model, hooks=[HOOK],
        max_length=TOKENS_PER_SAMPLE, dtype="float32", sample_count=samples, owner=owner,
    )  # fmt: skip
    rows = samples * TOKENS_PER_SAMPLE
    values = planted_rows(rows)
    writer = cache_store_open(cache, provenance={"test": True}, hooks={HOOK: D_IN})
    with writer:
        per_batch = 32 * TOKENS_PER_SAMPLE
        for batch, start in enumerate(range(0, rows, per_batch)):
            stop = min(rows, start + per_batch)
            index = torch.arange(start, stop)
            writer.add_batch(
                batch,
                token_ids=(index * 7919) % 1000,
                sample_index=index // TOKENS_PER_SAMPLE,
                positions=index % TOKENS_PER_SAMPLE,
                activations={HOOK: values[start:stop]},
            )
        manifest = writer.finalize(num_samples=samples)
    cache_store_completed(cache, manifest=manifest, size_bytes=writer.size_bytes)
    return cache


@pytest.fixture
def tiny_model(tiny_gpt2_folder, writer):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)


@pytest.fixture
def planted_cache(tiny_model, writer):
    return write_planted_cache(tiny_model, writer)
