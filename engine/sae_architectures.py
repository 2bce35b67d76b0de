"""SAE architectures, named once: what each is called, what sparsity parameter it takes, how it
is saved for inference, and the training defaults a researcher would pick.

Torch-free, so that the web process validates a request and the pages describe an architecture
without importing torch; ``engine.sae`` holds the maths.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    label: str
    # Keeps k features per row (topk) or per row on average over a batch (the batch-wide ones).
    k_sparse: bool = False
    batch_wide: bool = False
    # Its inference form has a per-feature threshold (a JumpReLU).
    thresholded: bool = False
    # The training config key of its sparsity penalty and the default coefficient (None: k).
    penalty: str | None = None
    default_penalty: float | None = None
    # Decoder rows' norm at initialisation (SAELens': 0.1 for the k-sparse ones, see TrainingConfig).
    decoder_init_norm: float = 1.0
    # [batch, d_sae] float32 tensors alive at once in one training step, measured on the CPU.
    step_tensors: int = 6
    # The architecture SAELens loads it as (inference form).
    saved_as: str = ""


REGISTRY: dict[str, Architecture] = {
    architecture.name: architecture
    for architecture in (
        Architecture("topk", "TopK", k_sparse=True, decoder_init_norm=0.1, step_tensors=4, saved_as="topk"),
        Architecture(
            "batchtopk", "BatchTopK", k_sparse=True, batch_wide=True, thresholded=True,
            decoder_init_norm=0.1, step_tensors=9, saved_as="jumprelu",
        ),
        Architecture(
            "matryoshka_batchtopk", "Matryoshka BatchTopK", k_sparse=True, batch_wide=True,
            thresholded=True, decoder_init_norm=0.1, step_tensors=10, saved_as="jumprelu",
        ),
        Architecture(
            "jumprelu", "JumpReLU", thresholded=True, penalty="l0_coefficient", default_penalty=1.0,
            step_tensors=9, saved_as="jumprelu",
        ),
        Architecture(
            "standard", "Standard (ReLU + L1)", penalty="l1_coefficient", default_penalty=5.0,
            step_tensors=6, saved_as="standard",
        ),
    )
}  # fmt: skip
ARCHITECTURES: tuple[str, ...] = tuple(REGISTRY)
K_SPARSE: tuple[str, ...] = tuple(name for name, arch in REGISTRY.items() if arch.k_sparse)
BATCH_WIDE: tuple[str, ...] = tuple(name for name, arch in REGISTRY.items() if arch.batch_wide)
THRESHOLDED: tuple[str, ...] = tuple(name for name, arch in REGISTRY.items() if arch.thresholded)
PENALIZED: dict[str, str] = {name: arch.penalty for name, arch in REGISTRY.items() if arch.penalty}

# What a researcher picks today (issue 27): TopK, 16x, k 64 on a research-scale model.
DEFAULT_ARCHITECTURE = "topk"


def matryoshka_widths(d_sae: int, widths: list[int] | tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The nested dictionary sizes of a Matryoshka SAE, ending at ``d_sae``: the given ones, or
    d_sae / 16, / 4 and the whole (the first prefix learns the most general features)."""
    if widths:
        found = tuple(sorted({int(width) for width in widths}))
        if found[0] < 1 or found[-1] > d_sae:
            raise ValueError(f"Matryoshka widths must lie in 1..{d_sae}")
        return found if found[-1] == d_sae else (*found, d_sae)
    return tuple(sorted({max(1, d_sae // 16), max(1, d_sae // 4), d_sae}))
