"""Reading SAEBench runs and results: the runs a user may see, the newest result of each method
for each SAE (of runs the user may see, for SAEs the user may see), a comparison table of many
SAEs with every method's columns, and one result in SAEBench's results JSON."""

from __future__ import annotations

import json
import math
from typing import Any

from django.db.models import QuerySet

from engine.saebench.methods import METHODS
from engine.saebench.results import (
    absorption_output,
    core_feature_details,
    saebench_results_json,
    sparse_probing_output,
)
from evaluations.models import BenchResult, BenchRun
from evaluations.serializers import bench_state
from mistudio.access import check_may_change, visible_row, visible_rows
from mistudio.errors import ApplicationError
from mistudio.events import register_group_kind
from saes.models import SparseAutoencoder
from saes.selectors import sae_list

SAE_SET = "miStudio"


def bench_run_list(*, user, model_id: str | None = None) -> QuerySet[BenchRun]:
    """Runs the user may see: their own and shared ones (all for an admin)."""
    runs = visible_rows(BenchRun.objects.select_related("owner", "model"), user, shareable=True)
    return runs.filter(model_id=model_id) if model_id else runs


def bench_run_get(*, user, run_id: str) -> BenchRun:
    return visible_row(bench_run_list(user=user), run_id, code="BENCH_NOT_FOUND", what="SAEBench run")


def bench_run_get_to_change(*, user, run_id: str) -> BenchRun:
    run = bench_run_get(user=user, run_id=run_id)
    check_may_change(run, user, what="SAEBench run")
    return run


def result_list(*, user, sae_ids: list[str] | None = None) -> QuerySet[BenchResult]:
    """Results of runs the user may see, for SAEs the user may see (newest first)."""
    results = BenchResult.objects.filter(
        run__in=bench_run_list(user=user), sae__in=sae_list(user=user)
    ).select_related("run", "sae")
    if sae_ids is not None:
        results = results.filter(sae_id__in=sae_ids)
    return results.order_by("-created_at", "-id")


def latest_results(*, user, sae_ids: list[str]) -> dict[tuple[str, str], BenchResult]:
    """(SAE id, method) to its newest result the user may see."""
    newest: dict[tuple[str, str], BenchResult] = {}
    for result in result_list(user=user, sae_ids=sae_ids):
        newest.setdefault((result.sae_id, result.method), result)
    return newest


def result_get(*, user, run_id: str, sae_id: str, method: str) -> BenchResult:
    result = result_list(user=user, sae_ids=[sae_id]).filter(run_id=run_id, method=method).first()
    if result is None:
        raise ApplicationError("RESULT_NOT_FOUND", "No such result.", status=404)
    return result


def columns() -> list[dict[str, Any]]:
    """Every method's comparison columns, in registry order: key (``method.metric``), labels and
    which way is better."""
    return [
        {
            "key": f"{method.name}.{column.key}",
            "method": method.name,
            "metric": column.key,
            "label": column.label,
            "method_label": method.label,
            "higher_is_better": column.higher_is_better,
        }
        for method in METHODS.values()
        for column in method.columns
    ]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def comparison(*, user, saes: list[SparseAutoencoder]) -> dict[str, Any]:
    """The table a comparison shows: one row per SAE (its name, architecture, width, hook and the
    newest value of every column), the columns, and which result each value came from."""
    newest = latest_results(user=user, sae_ids=[sae.id for sae in saes])
    rows = []
    for sae in saes:
        values: dict[str, float | None] = {}
        sources: dict[str, dict[str, Any]] = {}
        for method in METHODS.values():
            result = newest.get((sae.id, method.name))
            if result is None:
                continue
            flat = result.flat_metrics()
            for column in method.columns:
                values[f"{method.name}.{column.key}"] = _number(flat.get(column.key))
            sources[method.name] = {
                "run_id": result.run_id,
                "method_version": result.method_version,
                "created_at": result.created_at.isoformat(),
            }
        rows.append(
            {
                "sae_id": sae.id,
                "name": sae.name,
                "architecture": sae.architecture,
                "hook_name": sae.hook_name,
                "d_sae": sae.d_sae,
                "values": values,
                "results": sources,
            }
        )
    return {"columns": columns(), "rows": rows}


def sorted_rows(rows: list[dict[str, Any]], key: str, *, descending: bool) -> list[dict[str, Any]]:
    """``rows`` by column ``key`` (or ``name``); rows without a value last, whichever the order."""

    def value(row: dict[str, Any]) -> Any:
        return row["name"] or row["sae_id"] if key == "name" else row["values"].get(key)

    present = [row for row in rows if value(row) is not None]
    missing = [row for row in rows if value(row) is None]
    return sorted(present, key=value, reverse=descending) + missing


def result_export(result: BenchResult) -> dict[str, Any]:
    """One result in SAEBench's results JSON (``<eval_type_id>`` output), as its viewer and
    Neuronpedia read it: the core metrics with one detail per feature, sparse probing with its
    per-class accuracies, absorption with the letters its means counted."""
    sae = result.sae
    config = result.run.config.get(result.method, {})
    model_name = result.run.model.name if result.run.model_id else sae.model_name
    metrics = result.metrics
    if result.method == "core":
        eval_config = {
            "model_name": model_name,
            "llm_dtype": "float32",
            "dataset": result.run.dataset.name if result.run.dataset_id else "",
            **config,
            "verbose": False,
        }
        details = core_feature_details(feature_metrics(result))
    elif result.method == "absorption":
        eval_config, metrics, details = absorption_output(
            {**result.details, "metrics": result.metrics}, config, model_name=model_name
        )
    else:
        dataset = result.run.probing_dataset.name if result.run.probing_dataset_id else ""
        eval_config, metrics, details = sparse_probing_output(
            result.metrics, config, model_name=model_name, dataset=dataset
        )
    return saebench_results_json(
        eval_type_id=METHODS[result.method].eval_type_id,
        eval_config=eval_config,
        metrics=metrics,
        details=details,
        eval_id=result.run_id,
        sae_id=sae.id,
        sae_set=SAE_SET,
        sae_cfg=_saelens_cfg(sae),
        created_millis=int(result.created_at.timestamp() * 1000),
        unstructured=result.details.get("eval_result_unstructured"),
    )


def feature_metrics(result: BenchResult) -> dict[str, list[float]]:
    """The per-feature lists the core metrics stored beside the run (none when the file is gone)."""
    from safetensors.numpy import load_file

    try:
        arrays = load_file(result.feature_file)
    except (OSError, ValueError):
        return {}
    return {name: array.astype(float).tolist() for name, array in arrays.items()}


def _saelens_cfg(sae: SparseAutoencoder) -> dict[str, Any]:
    try:
        return json.loads((sae.directory / "cfg.json").read_text())
    except (OSError, ValueError):
        return {
            "d_in": sae.d_in,
            "d_sae": sae.d_sae,
            "hook_name": sae.hook_name,
            "architecture": sae.architecture,
        }


def bench_snapshot(user, key: str | None) -> dict[str, Any] | None:
    run = bench_run_list(user=user).filter(pk=key).first() if key else None
    return bench_state(run, viewer=user) if run is not None else None


def register_event_groups() -> None:
    register_group_kind(
        "bench",
        keyed=True,
        snapshot=bench_snapshot,
        visible=lambda user, key: bench_run_list(user=user).filter(pk=key).exists(),
    )
