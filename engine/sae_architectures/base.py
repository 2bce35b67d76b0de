"""What an SAE architecture is, and the registry that names each one once.

An architecture (shaped like SAELens' ``sae_lens/registry.py`` and its one class per SAE) owns
everything that differs between SAEs of one shape: its names, flags and training defaults; its
activation function in training and at inference; its sparsity penalty and auxiliary loss; the
form and the ``cfg.json`` keys it is saved with for SAELens; what one training step holds in memory;
and the per-feature values an intervention reads. The trainer, the formats, the budgets, the
import inspector and the services ask the registered object instead of comparing names.

No torch at module level: the web process validates requests and renders the architecture
choices from these classes. The tensor maths uses tensor methods, and the few torch-only helpers
(straight-through functions, AuxK) are imported inside the methods that run in a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    import torch

    from engine.sae.model import SparseAutoencoder
    from engine.sae.training import SaeTrainer, TrainingConfig

__all__ = [
    "REGISTRY",
    "Architecture",
    "KSparseArchitecture",
    "ThresholdInference",
    "TrainingForward",
    "architecture_named",
    "circuit_tracer_form",
    "register_architecture",
    "saelens_architecture_name",
    "saelens_form",
]


@dataclass(frozen=True)
class TrainingForward:
    """One training step's encoding: the reconstruction (before a skip path), how many features
    each row kept, and the features either dense or as the kept ``values`` at ``indices``."""

    recon: torch.Tensor
    active_per_row: torch.Tensor
    features: torch.Tensor | None = None
    values: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    # A penalty the encoding computed already (JumpReLU's L0 through its straight-through step).
    sparsity: torch.Tensor | None = None


class Architecture:
    """One SAE architecture. Subclasses set the class attributes and override what differs; the
    defaults are a plain rectified encoder whose decoder rows are renormalised each step."""

    name: ClassVar[str]
    label: ClassVar[str]
    # Where lists of choices put it (the registry's order): the default first.
    position: ClassVar[int] = 100
    # Trains nested prefixes of its dictionary, sized by ``matryoshka_widths`` (Matryoshka).
    nested: ClassVar[bool] = False
    # Keeps k features per row (topk) or per row on average over a batch (the batch-wide ones).
    k_sparse: ClassVar[bool] = False
    batch_wide: ClassVar[bool] = False
    # Its inference form has a per-feature threshold (a JumpReLU).
    thresholded: ClassVar[bool] = False
    # Its threshold is trained (as a log threshold beside the parameters).
    learns_threshold: ClassVar[bool] = False
    # The training config key of its sparsity penalty and the default coefficient (None: k).
    penalty: ClassVar[str | None] = None
    default_penalty: ClassVar[float | None] = None
    # Decoder rows' norm at initialisation (SAELens': 0.1 for the k-sparse ones, see TrainingConfig).
    decoder_init_norm: ClassVar[float] = 1.0
    # Decoder rows are set back to unit norm after every step (not when the penalty weighs them).
    renormalises_decoder: ClassVar[bool] = True
    # [batch, d_sae] float32 tensors alive at once in one training step, measured on the CPU.
    step_tensors: ClassVar[int] = 6
    # The architecture SAELens loads it as (inference form).
    saved_as: ClassVar[str] = ""
    # SAELens' transcoder classes of this inference form are named with this prefix ("" for
    # ``transcoder``, "jumprelu_" for ``jumprelu_transcoder``); None: SAELens has none (TopK).
    saelens_transcoder_prefix: ClassVar[str | None] = None
    # Reads SAELens' ``rescale_acts_by_decoder_norm`` (folded into the weights on load).
    reads_decoder_norm_rescale: ClassVar[bool] = False
    # (``architecture``, ``activation_fn_str``) pairs of older SAELens configs read as this one.
    saelens_legacy_names: ClassVar[tuple[tuple[str, str], ...]] = ()
    # circuit-tracer reads transcoders of its inference form (ReLU and JumpReLU ones; not TopK).
    circuit_tracer_form: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<architecture {self.name}>"

    # --- shape ------------------------------------------------------------------------------

    def check_shape(self, *, k: int | None, d_sae: int) -> None:
        """Refuse parameters this architecture cannot be built with (ValueError)."""
        if self.k_sparse and not (k and 0 < k <= d_sae):
            raise ValueError(f"{self.name} needs 0 < k <= d_sae")

    # --- inference --------------------------------------------------------------------------

    def activate(self, sae: SparseAutoencoder, hidden_pre: torch.Tensor) -> torch.Tensor:
        """The feature activations of pre-activations ``hidden_pre`` [..., d_sae] at inference."""
        raise NotImplementedError

    def activate_training(self, sae: SparseAutoencoder, hidden_pre: torch.Tensor) -> torch.Tensor:
        """The activations in training, where they may differ (BatchTopK: the batch-wide top)."""
        return self.activate(sae, hidden_pre)

    def feature_values(
        self, sae: SparseAutoencoder, x: torch.Tensor, features: tuple[int, ...]
    ) -> torch.Tensor:
        """``encode(x)[..., features]`` [tokens, n], from the encoder columns of ``features`` only:
        true where a feature's activation depends on its own pre-activation alone."""
        columns = list(features)
        sae_in = x.to(sae.W_enc.dtype)
        if sae.shape.apply_b_dec_to_input:
            sae_in = sae_in - sae.b_dec
        hidden_pre = sae_in @ sae.W_enc[:, columns] + sae.b_enc[columns]
        return self.column_activations(sae, hidden_pre, columns)

    def column_activations(
        self, sae: SparseAutoencoder, hidden_pre: torch.Tensor, columns: list[int]
    ) -> torch.Tensor:
        """The activations of the pre-activations of the features ``columns``, alone."""
        raise NotImplementedError

    # --- training ---------------------------------------------------------------------------

    def training_widths(self, config: TrainingConfig) -> tuple[int, ...]:
        """Nested dictionary sizes trained to reconstruct on their own (Matryoshka); none here."""
        return ()

    def training_forward(self, trainer: SaeTrainer, hidden_pre: torch.Tensor) -> TrainingForward:
        """One step's encoding and reconstruction of the pre-activations ``hidden_pre``."""
        features = self.activate_training(trainer.sae, hidden_pre)
        return TrainingForward(
            recon=trainer.sae.decode(features), active_per_row=(features > 0).sum(-1), features=features
        )

    def reconstruction_loss(
        self,
        trainer: SaeTrainer,
        forward: TrainingForward,
        target: torch.Tensor,
        skip: torch.Tensor | None,
        mse: torch.Tensor,
    ) -> torch.Tensor:
        """The reconstruction part of the loss, given the whole dictionary's ``mse``."""
        return mse

    def sparsity_loss(self, trainer: SaeTrainer, forward: TrainingForward) -> torch.Tensor | None:
        """The sparsity penalty, weighted (None: none)."""
        return forward.sparsity

    def auxiliary_loss(
        self,
        trainer: SaeTrainer,
        target: torch.Tensor,
        recon: torch.Tensor,
        hidden_pre: torch.Tensor,
        dead: torch.Tensor,
    ) -> torch.Tensor | None:
        """An auxiliary loss that revives dead features, weighted (None: none)."""
        return None

    def fired(self, forward: TrainingForward, steps_since_fired: torch.Tensor) -> torch.Tensor:
        """Which features fired in the step: bool [d_sae]."""
        return (forward.features > 0).any(0)

    def finish_training(self, trainer: SaeTrainer, sample: torch.Tensor) -> None:
        """Set what inference needs that training did not hold (a threshold), before the
        activations' scaling is folded into the weights."""

    # --- saving and loading -----------------------------------------------------------------

    def saelens_cfg(self, shape: Any) -> dict[str, Any]:
        """The ``cfg.json`` keys this saved form adds for SAELens."""
        return {}

    def k_from_saelens(self, cfg: dict[str, Any]) -> int | None:
        """The ``k`` a SAELens ``cfg.json`` of this form gives (None: it takes none)."""
        return None


class KSparseArchitecture(Architecture):
    """An architecture that keeps ``k`` features (per row or per row on average): sized by ``k``
    rather than a penalty, its decoder starting small, AuxK reviving its dead features."""

    k_sparse: ClassVar[bool] = True
    decoder_init_norm: ClassVar[float] = 0.1

    def auxiliary_loss(
        self,
        trainer: SaeTrainer,
        target: torch.Tensor,
        recon: torch.Tensor,
        hidden_pre: torch.Tensor,
        dead: torch.Tensor,
    ) -> torch.Tensor | None:
        """AuxK: dead features, ``d_in / 2`` of them per row, reconstruct the live ones' residual."""
        from engine.sae.losses import aux_k_loss

        return trainer.config.aux_coefficient * aux_k_loss(trainer.sae, target, recon, hidden_pre, dead)


class ThresholdInference(Architecture):
    """An inference form that is a JumpReLU: ``relu(h) * (h > threshold)``, strictly greater."""

    thresholded: ClassVar[bool] = True
    saved_as: ClassVar[str] = "jumprelu"
    saelens_transcoder_prefix: ClassVar[str | None] = "jumprelu_"
    circuit_tracer_form: ClassVar[bool] = True

    def activate(self, sae: SparseAutoencoder, hidden_pre: torch.Tensor) -> torch.Tensor:
        return hidden_pre.relu() * (hidden_pre > sae.threshold)

    def column_activations(
        self, sae: SparseAutoencoder, hidden_pre: torch.Tensor, columns: list[int]
    ) -> torch.Tensor:
        return hidden_pre * (hidden_pre > sae.threshold[columns])


_ArchitectureClass = TypeVar("_ArchitectureClass", bound=type[Architecture])

REGISTRY: dict[str, Architecture] = {}


def register_architecture(cls: _ArchitectureClass) -> _ArchitectureClass:
    """Class decorator: register one instance of ``cls`` under its ``name`` (once), the registry
    kept in ``position`` order."""
    if cls.name in REGISTRY:
        raise ValueError(f"architecture {cls.name!r} is registered already")
    registered = sorted([*REGISTRY.values(), cls()], key=lambda architecture: architecture.position)
    REGISTRY.clear()
    REGISTRY.update((architecture.name, architecture) for architecture in registered)
    return cls


def architecture_named(name: str) -> Architecture:
    """The registered architecture called ``name``; ValueError naming the known ones otherwise."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"architecture must be one of {', '.join(REGISTRY)}") from None


def saelens_form(name: Any) -> Architecture | None:
    """The architecture a SAELens ``cfg.json`` saying ``name`` is read as: one that is its own
    saved form (standard, topk, jumprelu); None for any other name."""
    architecture = REGISTRY.get(name) if isinstance(name, str) else None
    return architecture if architecture is not None and architecture.saved_as == name else None


def saelens_architecture_name(cfg: dict[str, Any]) -> Any:
    """The architecture a SAELens ``cfg.json`` names: its ``architecture`` (``standard`` when it
    says none, SAELens' default), or the one that reads an older SAELens' pair of ``architecture``
    and ``activation_fn_str`` (SAELens 5's TopK: a standard SAE with a ``topk`` activation)."""
    name = cfg.get("architecture", "standard")
    pair = (name, cfg.get("activation_fn_str") or "relu")
    for architecture in REGISTRY.values():
        if pair in architecture.saelens_legacy_names:
            return architecture.name
    return name


def circuit_tracer_form(*, thresholded: bool) -> Architecture:
    """The form a circuit-tracer transcoder file is read as: a JumpReLU when it has a threshold,
    a ReLU otherwise."""
    return next(
        architecture
        for architecture in REGISTRY.values()
        if architecture.circuit_tracer_form
        and architecture.saved_as == architecture.name
        and architecture.thresholded == thresholded
    )
