"""BatchTopK: the ``k * rows`` largest activations over a whole batch in training, a JumpReLU
with one learnt threshold at inference (Bussmann et al. 2024; what SAELens saves it as)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sae_architectures.base import KSparseArchitecture, ThresholdInference, register_architecture

if TYPE_CHECKING:
    import torch

    from engine.sae.model import SparseAutoencoder
    from engine.sae.training import SaeTrainer


@register_architecture
class BatchTopK(KSparseArchitecture, ThresholdInference):
    """k features per row on average over a batch; at inference, above one threshold taken at
    the end of training on the sample (:func:`engine.sae.training.batch_topk_threshold`)."""

    name = "batchtopk"
    label = "BatchTopK"
    position = 1
    batch_wide = True
    step_tensors = 9

    def activate_training(self, sae: SparseAutoencoder, hidden_pre: torch.Tensor) -> torch.Tensor:
        """The ``k * rows`` largest rectified pre-activations of the batch; zeros elsewhere."""
        flat = hidden_pre.relu().reshape(-1)
        rows = hidden_pre.numel() // hidden_pre.shape[-1]
        values, indices = flat.topk(min(sae.shape.k * rows, flat.numel()), sorted=False)
        return flat.new_zeros(flat.shape).scatter(0, indices, values).reshape(hidden_pre.shape)

    def finish_training(self, trainer: SaeTrainer, sample: torch.Tensor) -> None:
        from engine.sae.training import batch_topk_threshold

        scaled = sample.to(trainer.device).float() * trainer.scaling
        trainer.sae.threshold.fill_(batch_topk_threshold(trainer.sae, scaled, trainer.config.k))
