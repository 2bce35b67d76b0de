"""JumpReLU: a feature fires only above its own learnt threshold (Rajamanoharan et al. 2024)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sae_architectures.base import ThresholdInference, TrainingForward, register_architecture

if TYPE_CHECKING:
    import torch

    from engine.sae.training import SaeTrainer


@register_architecture
class JumpReLU(ThresholdInference):
    """``relu(h) * (h > threshold)``. The threshold is learnt as a log threshold through a
    rectangle kernel's pseudo-derivative, with an L0 penalty through the same straight-through
    step."""

    name = "jumprelu"
    label = "JumpReLU"
    position = 3
    learns_threshold = True
    penalty = "l0_coefficient"
    default_penalty = 1.0
    step_tensors = 9

    def training_forward(self, trainer: SaeTrainer, hidden_pre: torch.Tensor) -> TrainingForward:
        from engine.sae.losses import JumpReLUFunction, StepFunction

        config = trainer.config
        threshold = trainer.log_threshold.exp()
        features = JumpReLUFunction.apply(hidden_pre, threshold, config.jumprelu_bandwidth)
        l0 = StepFunction.apply(hidden_pre, threshold, config.jumprelu_bandwidth).sum(-1)
        sparsity = config.l0_coefficient * l0.mean()
        return TrainingForward(
            recon=trainer.sae.decode(features),
            active_per_row=(features > 0).sum(-1),
            features=features,
            sparsity=sparsity,
        )

    def finish_training(self, trainer: SaeTrainer, sample: torch.Tensor) -> None:
        trainer.sae.threshold.copy_(trainer.log_threshold.exp())
