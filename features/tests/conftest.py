"""Feature test fixtures: a completed activation cache of planted sparse activations (the SAE
tests' fixture) and a completed SAE over its hook, with random weights saved in SAELens' layout."""

import pytest
import torch

from engine.sae import SaeShape, SparseAutoencoder
from engine.sae.formats import save_saelens
from models_app.services import model_register
from saes.models import SparseAutoencoder as SaeRow
from saes.services import folder_size
from saes.tests.conftest import D_IN, HOOK, write_planted_cache

D_SAE = 96


def random_sae_module(*, seed: int = 0) -> SparseAutoencoder:
    generator = torch.Generator().manual_seed(seed)
    module = SparseAutoencoder(SaeShape("standard", D_IN, D_SAE))
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            parameter = getattr(module, name)
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        module.b_enc -= 0.8  # sparse: most features fire on a few tokens
        module.b_enc[:3] = -1e4  # three dead features
    return module


def completed_sae_row(model, cache, owner, *, shared: bool = False) -> SaeRow:
    module = random_sae_module()
    sae = SaeRow(
        name="random", model=model, model_name=model.display_identifier, cache=cache, hook_name=HOOK,
        architecture="standard", d_in=D_IN, d_sae=D_SAE, status=SaeRow.Status.COMPLETED, progress=100,
        owner=owner, shared=shared,
    )  # fmt: skip
    save_saelens(module, sae.directory, hook_name=HOOK, model_name=sae.model_name)
    sae.file_size_bytes = folder_size(sae.directory)
    sae.save()
    return sae


@pytest.fixture
def tiny_model(tiny_gpt2_folder, writer):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)


@pytest.fixture
def planted_cache(tiny_model, writer):
    return write_planted_cache(tiny_model, writer, samples=96)


@pytest.fixture
def sae_row(tiny_model, planted_cache, writer):
    return completed_sae_row(tiny_model, planted_cache, writer)
