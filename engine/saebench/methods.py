"""The ways an SAE is judged side by side, registered once: SAEBench's core metrics, sparse probing
and feature absorption. Each names its version (the arithmetic it follows), what it needs and the
columns a comparison shows (with which way is better). Plain data, no torch: the web process reads
it for forms, comparison tables and exports; the worker maps each name to the engine function that
computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METHODS", "BenchColumn", "BenchMethod", "bench_method", "register_bench_method"]


@dataclass(frozen=True)
class BenchColumn:
    """One number a comparison shows: its key in the method's metrics, a label, and whether more
    is better (None: neither, such as L0)."""

    key: str
    label: str
    higher_is_better: bool | None = True


@dataclass(frozen=True)
class BenchMethod:
    name: str
    label: str
    version: str
    description: str
    columns: tuple[BenchColumn, ...]
    # A labelled dataset (text and a class per sample) is needed: sparse probing's.
    needs_labels: bool = False
    # Run only when asked for by name (long, or needing more than the SAE and the model).
    opt_in: bool = False
    # The method's results JSON's eval_type_id in SAEBench.
    eval_type_id: str = ""


METHODS: dict[str, BenchMethod] = {}


def register_bench_method(method: BenchMethod) -> BenchMethod:
    if method.name in METHODS:
        raise ValueError(f"bench method {method.name!r} is registered already")
    METHODS[method.name] = method
    return method


def bench_method(name: str) -> BenchMethod:
    """The registered method ``name``; ValueError naming the known ones otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: one of {', '.join(METHODS)}")
    return METHODS[name]


SAEBENCH = "sae-bench 0.6.0"

register_bench_method(
    BenchMethod(
        name="core",
        label="Core",
        version=f"{SAEBENCH} core",
        description="Reconstruction, sparsity, CE loss and KL with the SAE spliced in, feature density.",
        eval_type_id="core",
        columns=(
            BenchColumn("l0", "L0", None),
            BenchColumn("l1", "L1", None),
            BenchColumn("explained_variance", "Explained variance"),
            BenchColumn("mse", "MSE", False),
            BenchColumn("cossim", "Cosine similarity"),
            BenchColumn("ce_loss_score", "CE loss score"),
            BenchColumn("kl_div_score", "KL div score"),
            BenchColumn("ce_loss_with_sae", "CE loss with SAE", False),
            BenchColumn("l2_ratio", "L2 ratio", None),
            BenchColumn("relative_reconstruction_bias", "Relative reconstruction bias", None),
            BenchColumn("frac_alive", "Fraction alive"),
            BenchColumn("freq_over_10_percent", "Fraction over 10 % density", False),
        ),
    )
)

register_bench_method(
    BenchMethod(
        name="sparse_probing",
        label="Sparse probing",
        version=f"{SAEBENCH} sparse_probing",
        description="k-sparse logistic probes on SAE features against probes on the model's activations, "
        "one class against the rest, on a labelled dataset.",
        eval_type_id="sparse_probing",
        needs_labels=True,
        opt_in=True,
        columns=(
            BenchColumn("sae_top_1_test_accuracy", "Probe top-1 (SAE)"),
            BenchColumn("sae_top_2_test_accuracy", "Probe top-2 (SAE)"),
            BenchColumn("sae_top_5_test_accuracy", "Probe top-5 (SAE)"),
            BenchColumn("llm_top_1_test_accuracy", "Probe top-1 (model)"),
        ),
    )
)

register_bench_method(
    BenchMethod(
        name="absorption",
        label="Absorption",
        version=f"{SAEBENCH} absorption_first_letter",
        description="Feature absorption on first-letter tasks built from the model's vocabulary: how much "
        "of a letter's probe direction other features carry where the letter's own features do not fire.",
        eval_type_id="absorption_first_letter",
        opt_in=True,
        columns=(
            BenchColumn("mean_absorption_fraction_score", "Absorption fraction", False),
            BenchColumn("mean_full_absorption_score", "Full absorption", False),
            BenchColumn("mean_num_split_features", "Split features", None),
        ),
    )
)
