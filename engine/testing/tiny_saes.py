"""A sparse autoencoder with random weights, for tests that need one whose features fire."""

from __future__ import annotations

from engine.sae import SaeShape, SparseAutoencoder


def random_sae(
    width: int, architecture: str = "standard", *, k: int | None = None, expansion: int = 4, seed: int = 7
) -> SparseAutoencoder:
    """An SAE of ``expansion * width`` features whose weights and biases are all drawn from
    N(0, 0.3²) with ``seed`` (large enough biases that many features fire on any input)."""
    import torch

    sae = SparseAutoencoder(SaeShape(architecture, width, expansion * width, k=k))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            parameter = getattr(sae, name)
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return sae.eval()
