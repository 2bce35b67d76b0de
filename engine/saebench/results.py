"""SAEBench's settings and results, torch-free (the web process reads them): the core metrics'
settings (:class:`CoreConfig`), a result (:class:`CoreResult`) and :func:`saebench_results_json`,
a result in SAEBench's results JSON (``CoreEvalOutput`` and its siblings), the file
Neuronpedia-style viewers read. The maths is in :mod:`engine.saebench.core`."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "SAEBENCH_VERSION", "CoreConfig", "CoreResult", "core_eval_config", "core_feature_details",
    "saebench_results_json", "sparse_probing_output",
]  # fmt: skip

# The sae-bench release whose arithmetic this follows (and the equality tests check against).
SAEBENCH_VERSION = "0.6.0"
# SAEBench rounds per-feature details to this many digits in its JSON.
DETAIL_DIGITS = 10


@dataclass(frozen=True)
class CoreConfig:
    """SAEBench's ``CoreEvalConfig`` fields that change the numbers (its defaults, but every metric
    on: its ``multiple_evals`` runs them all)."""

    context_size: int = 128
    batch_size_prompts: int = 16
    n_eval_reconstruction_batches: int = 10
    n_eval_sparsity_variance_batches: int = 1
    compute_kl: bool = True
    compute_ce_loss: bool = True
    compute_l2_norms: bool = True
    compute_sparsity_metrics: bool = True
    compute_variance_metrics: bool = True
    compute_featurewise_density_statistics: bool = True
    compute_featurewise_weight_based_metrics: bool = True
    exclude_special_tokens_from_reconstruction: bool = False

    @property
    def batches(self) -> int:
        return max(self.n_eval_reconstruction_batches, self.n_eval_sparsity_variance_batches)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CoreResult:
    """The metrics by SAEBench category, and per-feature lists (``feature_metrics``)."""

    metrics: dict[str, dict[str, float]]
    feature_metrics: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    # Whether each batch's three runs shared one pass up to the hook point (engine.saebench.core).
    stacked: bool = False

    def flat(self) -> dict[str, float]:
        """Every scalar metric by its name (SAEBench's names are unique across categories)."""
        return {name: value for group in self.metrics.values() for name, value in group.items()}


def _finite(value: Any) -> Any:
    """SAEBench writes NaN as -1 (``replace_nans_with_negative_one``)."""
    if isinstance(value, float) and math.isnan(value):
        return -1
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def core_feature_details(feature_metrics: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The core metrics' per-feature lists as SAEBench's ``eval_result_details``: one entry per
    feature, rounded as SAEBench rounds them (none without the density statistics)."""
    if feature_metrics.get("consistent_activation_heuristic") is None:
        return []
    return list(_feature_details(feature_metrics))


def _feature_details(feature_metrics: dict[str, list[float]]) -> Iterator[dict[str, Any]]:
    names = sorted(feature_metrics)
    for index in range(len(feature_metrics["consistent_activation_heuristic"])):
        detail: dict[str, Any] = {"index": index}
        for name in names:
            detail[name] = round(feature_metrics[name][index], DETAIL_DIGITS)
        yield detail


def saebench_results_json(
    *,
    eval_type_id: str,
    eval_config: dict[str, Any],
    metrics: dict[str, Any],
    details: list[dict[str, Any]],
    eval_id: str,
    sae_id: str,
    sae_set: str,
    sae_cfg: dict[str, Any],
    created_millis: int | None = None,
    unstructured: Any = None,
    producer: str = "miStudio",
) -> dict[str, Any]:
    """One SAE's result of one method as SAEBench's results JSON (``CoreEvalOutput``,
    ``SparseProbingEvalOutput``…: the fields every ``BaseEvalOutput`` has), NaN written as -1."""
    return _finite(
        {
            "eval_type_id": eval_type_id,
            "eval_config": eval_config,
            "eval_id": eval_id,
            "datetime_epoch_millis": created_millis
            if created_millis is not None
            else int(time.time() * 1000),
            "eval_result_metrics": metrics,
            "eval_result_details": details,
            "sae_bench_commit_hash": f"{producer} (sae-bench {SAEBENCH_VERSION} arithmetic)",
            "sae_lens_id": sae_id,
            "sae_lens_release_id": sae_set,
            "sae_lens_version": None,
            "sae_cfg_dict": sae_cfg,
            "eval_result_unstructured": unstructured if unstructured is not None else {},
        }
    )


def core_eval_config(config: CoreConfig, *, model_name: str, dataset: str) -> dict[str, Any]:
    """SAEBench's ``CoreEvalConfig`` of a core run with ``config``."""
    return {
        "model_name": model_name,
        "llm_dtype": "float32",
        "dataset": dataset,
        **config.to_dict(),
        "verbose": False,
    }


def sparse_probing_output(
    metrics: dict[str, dict[str, float]], settings: dict[str, Any], *, model_name: str, dataset: str
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Sparse probing's ``eval_config``, ``eval_result_metrics`` and ``eval_result_details`` as
    SAEBench's ``SparseProbingEvalOutput`` holds them. The probes on every dimension
    (``llm_test_accuracy``, ``sae_test_accuracy``) are not run here: -1, SAEBench's mark for none."""
    llm = {"llm_test_accuracy": -1, **metrics.get("llm", {})}
    sae = {"sae_test_accuracy": -1, **metrics.get("sae", {})}
    config = {
        "model_name": model_name,
        "random_seed": settings.get("seed"),
        "dataset_names": [dataset],
        "context_length": settings.get("context_length"),
        "k_values": settings.get("k_values"),
    }
    return config, {"llm": llm, "sae": sae}, [{"dataset_name": dataset, **llm, **sae}]


def absorption_output(
    result: dict[str, Any], settings: dict[str, Any], *, model_name: str
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Feature absorption's ``eval_config``, ``eval_result_metrics`` and ``eval_result_details`` as
    SAEBench's ``AbsorptionEvalOutput`` holds them: the letters its means counted."""
    config = {
        "model_name": model_name,
        "random_seed": settings.get("seed"),
        "f1_jump_threshold": settings.get("f1_jump_threshold"),
        "max_k_value": settings.get("max_k"),
        "prompt_template": settings.get("prompt_template"),
        "prompt_token_pos": result.get("word_position"),
        "llm_dtype": "float32",
        "k_sparse_probe_l1_decay": settings.get("k_sparse_l1_decay"),
        "k_sparse_probe_batch_size": settings.get("k_sparse_batch_size"),
        "k_sparse_probe_num_epochs": settings.get("k_sparse_epochs"),
        "min_GT_probe_f1": settings.get("min_probe_f1"),
        "min_feats_for_eval": settings.get("min_letters"),
        "precalc_k_sparse_probe_sae_acts": True,
    }
    keys = (
        "mean_absorption_fraction", "full_absorption_rate", "num_full_absorption",
        "num_probe_true_positives", "num_split_features",
    )  # fmt: skip
    details = [
        {"first_letter": row["first_letter"], **{key: row[key] for key in keys}}
        for row in result["letters"]
        if row["counted"]
    ]
    return config, result["metrics"], details
