"""SAE architectures and member kinds, registered once (:mod:`.base`, one module per
architecture), and the training defaults a researcher would pick (:mod:`.defaults`).

Torch-free, so that the web process validates a request and the pages describe an architecture
without importing torch; the maths runs in a worker through tensor methods and lazy imports. A
new architecture is one module here with one ``@register_architecture`` class, imported below.
"""

from engine.sae_architectures import batchtopk, jumprelu, matryoshka_batchtopk, standard, topk  # noqa: F401
from engine.sae_architectures.base import (
    REGISTRY,
    Architecture,
    TrainingForward,
    architecture_named,
    circuit_tracer_form,
    register_architecture,
    saelens_architecture_name,
    saelens_form,
)
from engine.sae_architectures.defaults import (
    DEFAULT_ARCHITECTURE,
    DEFAULT_EXPANSION,
    DEFAULT_LIVE_EXPANSION,
    LIVE_TOKENS_BOUNDS,
    LIVE_TOKENS_PER_FEATURE,
    MIN_DEFAULT_STEPS,
    MIN_TOKENS_PER_FEATURE,
    default_dead_after_steps,
    default_expansion,
    default_k,
    default_live_k,
    default_live_tokens,
    default_total_tokens,
    matryoshka_widths,
)
from engine.sae_architectures.members import MEMBER_KINDS, MemberKind, member_kind, saelens_member

ARCHITECTURES: tuple[str, ...] = tuple(REGISTRY)
K_SPARSE: tuple[str, ...] = tuple(name for name, arch in REGISTRY.items() if arch.k_sparse)
BATCH_WIDE: tuple[str, ...] = tuple(name for name, arch in REGISTRY.items() if arch.batch_wide)
THRESHOLDED: tuple[str, ...] = tuple(name for name, arch in REGISTRY.items() if arch.thresholded)
PENALIZED: dict[str, str] = {name: arch.penalty for name, arch in REGISTRY.items() if arch.penalty}

__all__ = [
    "ARCHITECTURES",
    "BATCH_WIDE",
    "DEFAULT_ARCHITECTURE",
    "DEFAULT_EXPANSION",
    "DEFAULT_LIVE_EXPANSION",
    "K_SPARSE",
    "LIVE_TOKENS_BOUNDS",
    "LIVE_TOKENS_PER_FEATURE",
    "MEMBER_KINDS",
    "MIN_DEFAULT_STEPS",
    "MIN_TOKENS_PER_FEATURE",
    "PENALIZED",
    "REGISTRY",
    "THRESHOLDED",
    "Architecture",
    "MemberKind",
    "TrainingForward",
    "architecture_named",
    "circuit_tracer_form",
    "default_dead_after_steps",
    "default_expansion",
    "default_k",
    "default_live_k",
    "default_live_tokens",
    "default_total_tokens",
    "matryoshka_widths",
    "member_kind",
    "register_architecture",
    "saelens_architecture_name",
    "saelens_form",
    "saelens_member",
]
