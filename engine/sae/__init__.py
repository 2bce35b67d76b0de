"""Sparse autoencoders: the model in SAELens' conventions, training in bounded memory, metrics.

``model`` holds the parameters and encode / decode, whose activation function, losses and saved
form are the registered architecture's (:mod:`engine.sae_architectures`: standard ReLU + L1, TopK,
BatchTopK, Matryoshka BatchTopK, JumpReLU); ``training`` the initialisation and loop;
``checkpoint`` its resumable state; ``evaluation`` held-out metrics and CE loss recovered;
``data`` the shuffle buffer that feeds training from a stream of activation chunks. Like the
rest of the engine it needs no Django; unlike most of it, importing it imports torch.
"""

from engine.sae.checkpoint import TrainingCheckpoint
from engine.sae.data import shuffled_batches
from engine.sae.model import ARCHITECTURES, SaeShape, SparseAutoencoder
from engine.sae.training import (
    StepMetrics,
    TrainedSae,
    TrainingConfig,
    default_dead_after_steps,
    default_expansion,
    default_k,
    default_live_k,
    default_live_tokens,
    default_total_tokens,
    explained_variance,
    l0,
    train,
)

__all__ = [
    "ARCHITECTURES",
    "SaeShape",
    "SparseAutoencoder",
    "StepMetrics",
    "TrainedSae",
    "TrainingCheckpoint",
    "TrainingConfig",
    "default_dead_after_steps",
    "default_expansion",
    "default_k",
    "default_live_k",
    "default_live_tokens",
    "default_total_tokens",
    "explained_variance",
    "l0",
    "shuffled_batches",
    "train",
]
