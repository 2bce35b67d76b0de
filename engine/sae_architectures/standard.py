"""The standard SAE: a ReLU encoder and an L1 penalty weighted by the decoder rows' norms."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sae_architectures.base import Architecture, TrainingForward, register_architecture

if TYPE_CHECKING:
    import torch

    from engine.sae.model import SparseAutoencoder
    from engine.sae.training import SaeTrainer


@register_architecture
class Standard(Architecture):
    """``relu(h)``. Its decoder rows keep their norms in training: the penalty weighs each
    feature's activation by its row's norm instead (SAELens' standard SAE)."""

    name = "standard"
    label = "Standard (ReLU + L1)"
    position = 4
    penalty = "l1_coefficient"
    default_penalty = 5.0
    renormalises_decoder = False
    step_tensors = 6
    saved_as = "standard"
    saelens_transcoder_prefix = ""
    circuit_tracer_form = True

    def activate(self, sae: SparseAutoencoder, hidden_pre: torch.Tensor) -> torch.Tensor:
        return hidden_pre.relu()

    def column_activations(
        self, sae: SparseAutoencoder, hidden_pre: torch.Tensor, columns: list[int]
    ) -> torch.Tensor:
        return hidden_pre.relu()

    def sparsity_loss(self, trainer: SaeTrainer, forward: TrainingForward) -> torch.Tensor | None:
        norms = trainer.sae.W_dec.norm(dim=1)
        return trainer.config.l1_coefficient * (forward.features * norms).sum(-1).mean()
