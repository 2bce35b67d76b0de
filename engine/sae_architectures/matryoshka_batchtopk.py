"""Matryoshka BatchTopK: BatchTopK whose nested prefixes of the dictionary each learn to
reconstruct on their own (Bussmann et al. 2025, Nabeshima 2024)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sae_architectures.base import TrainingForward, register_architecture
from engine.sae_architectures.batchtopk import BatchTopK
from engine.sae_architectures.defaults import matryoshka_widths

if TYPE_CHECKING:
    import torch

    from engine.sae.training import SaeTrainer, TrainingConfig


@register_architecture
class MatryoshkaBatchTopK(BatchTopK):
    """The first ``matryoshka_widths[i]`` features reconstruct the target too, so the first
    prefix learns the most general features; at inference a JumpReLU like BatchTopK."""

    name = "matryoshka_batchtopk"
    label = "Matryoshka BatchTopK"
    position = 2
    step_tensors = 10
    nested = True

    def training_widths(self, config: TrainingConfig) -> tuple[int, ...]:
        return matryoshka_widths(config.d_sae, config.matryoshka_widths)

    def reconstruction_loss(
        self,
        trainer: SaeTrainer,
        forward: TrainingForward,
        target: torch.Tensor,
        skip: torch.Tensor | None,
        mse: torch.Tensor,
    ) -> torch.Tensor:
        sae, loss = trainer.sae, mse
        for width in trainer.widths[:-1]:
            prefix = forward.features[:, :width] @ sae.W_dec[:width] + sae.b_dec
            if skip is not None:
                prefix = prefix + skip
            loss = loss + (prefix - target).pow(2).sum(-1).mean()
        return loss
