"""TopK: each row keeps its ``k`` largest pre-activations, rectified (Gao et al. 2024)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sae_architectures.base import KSparseArchitecture, TrainingForward, register_architecture

if TYPE_CHECKING:
    import torch

    from engine.sae.model import SaeShape, SparseAutoencoder
    from engine.sae.training import SaeTrainer


@register_architecture
class TopK(KSparseArchitecture):
    """Each row's ``k`` largest pre-activations, rectified; zeros elsewhere (SAELens' TopK). In
    training the kept features are decoded sparsely, never made dense."""

    name = "topk"
    label = "TopK"
    position = 0
    step_tensors = 4
    saved_as = "topk"
    reads_decoder_norm_rescale = True
    saelens_legacy_names = (("standard", "topk"),)

    def activate(self, sae: SparseAutoencoder, hidden_pre: torch.Tensor) -> torch.Tensor:
        values, indices = hidden_pre.topk(sae.shape.k, dim=-1, sorted=False)
        return hidden_pre.new_zeros(hidden_pre.shape).scatter(-1, indices, values.relu())

    def feature_values(
        self, sae: SparseAutoencoder, x: torch.Tensor, features: tuple[int, ...]
    ) -> torch.Tensor:
        """Through the whole encoder: whether a feature is kept depends on all the others."""
        return sae.encode(x)[..., list(features)]

    def training_forward(self, trainer: SaeTrainer, hidden_pre: torch.Tensor) -> TrainingForward:
        values, indices = hidden_pre.topk(trainer.config.k, dim=-1, sorted=False)
        values = values.relu()
        return TrainingForward(
            recon=trainer.sae.decode_sparse(values, indices),
            active_per_row=(values > 0).sum(-1),
            values=values,
            indices=indices,
        )

    def fired(self, forward: TrainingForward, steps_since_fired: torch.Tensor) -> torch.Tensor:
        import torch

        fired = torch.zeros_like(steps_since_fired, dtype=torch.bool)
        return fired.index_fill_(0, forward.indices[forward.values > 0], True)

    def saelens_cfg(self, shape: SaeShape) -> dict[str, Any]:
        return {"k": shape.k, "rescale_acts_by_decoder_norm": False}

    def k_from_saelens(self, cfg: dict[str, Any]) -> int | None:
        k = cfg.get("k") or (cfg.get("activation_fn_kwargs") or {}).get("k")
        return int(k) if k else None
