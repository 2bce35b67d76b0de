"""SAEBench run workflows: a request (a job on the model's worker over the SAEs chosen or a
group's members), the owner's changes (name, sharing), cancel and delete. Every front door (API,
the comparison page, admin, ``manage.py saebench``) calls these."""

from __future__ import annotations

import functools
import json
from collections import Counter
from typing import Any

from django.db import transaction

from activations.models import Dataset
from engine import budgets
from engine.saebench.methods import METHODS
from engine.saebench.results import CoreConfig
from evaluations.models import BenchRun
from mistudio import jobs
from mistudio.access import check_may_change, reach
from mistudio.budgets import memory_budget_check
from mistudio.errors import ApplicationError
from models_app.models import LanguageModel
from models_app.services import model_heads, model_job_queue, model_worker_name
from saes.models import SaeGroup, SparseAutoencoder
from saes.services import check_single_layer

MAX_SAES = 64
DEFAULT_METHODS = tuple(name for name, method in METHODS.items() if not method.opt_in)
# Sparse probing's settings (SAEBench's defaults, smaller sets: a user's dataset is small).
PROBING_DEFAULTS: dict[str, Any] = {
    "k_values": [1, 2, 5],
    "context_length": 128,
    "train_fraction": 0.8,
    "max_per_class": 500,
    "seed": 42,
}
MAX_PROBING_TEXTS = 20_000
# Feature absorption's time: the probes' arithmetic at this rate (a CPU core's, roughly), and each
# k-sparse probe's logistic regression.
PROBE_FLOPS_PER_SECOND = 5e9
SECONDS_PER_REGRESSION = 0.05


def core_settings(values: dict[str, Any] | None) -> CoreConfig:
    """The core metrics' settings: SAEBench's defaults, with the batch sizes a request gives."""
    given = {key: value for key, value in (values or {}).items() if value is not None}
    return CoreConfig(**given)


def probing_settings(values: dict[str, Any] | None) -> dict[str, Any]:
    settings = {
        **PROBING_DEFAULTS,
        **{key: value for key, value in (values or {}).items() if value is not None},
    }
    settings["k_values"] = sorted({int(k) for k in settings["k_values"]})
    return settings


def absorption_settings(values: dict[str, Any] | None) -> dict[str, Any]:
    """Feature absorption's settings: SAEBench's defaults with what a request gives."""
    from engine.saebench.absorption import AbsorptionConfig

    given = {key: value for key, value in (values or {}).items() if value is not None}
    return AbsorptionConfig(**given).to_dict()


def absorption_plan_of(model: LanguageModel, saes: list[SparseAutoencoder], settings: dict[str, Any]) -> dict:
    """What absorption will cost on ``saes`` (:func:`engine.saebench.absorption.absorption_plan`, a
    hook at a time), and about how long it takes: the model's prompts at the throughput of its last
    extraction, the probes' arithmetic and regressions at a CPU core's pace."""
    from activations.selectors import model_folder, model_tokens_per_second

    folder = model_folder(model)
    if folder is None:
        raise ApplicationError(
            "MODEL_FILES_NOT_FOUND",
            f"{model.name}'s tokenizer is not on this machine (absorption builds its words from it): "
            "load the model once, then try again.",
            status=409,
        )
    plan: dict[str, Any] = {"tokens": 0, "prompts": 0, "seconds": 0.0}
    for hook, count in Counter(sae.hook_name for sae in saes).items():
        widest = max(sae.d_sae for sae in saes if sae.hook_name == hook)
        part = _absorption_plan(str(folder), json.dumps(settings, sort_keys=True), count)
        plan.update(words=part["words"], tokens_per_prompt=part["tokens_per_prompt"])
        plan["tokens"] += part["tokens"]
        plan["prompts"] += part["prompts"]
        plan["seconds"] += (
            part["tokens"] / model_tokens_per_second(model.id)
            + part["probe_flops_per_feature"] * widest / PROBE_FLOPS_PER_SECOND
            + part["regressions"] * SECONDS_PER_REGRESSION
        )
    plan["seconds"] = round(plan["seconds"], 1)
    return plan


@functools.lru_cache(maxsize=32)
def _absorption_plan(folder: str, settings: str, saes: int) -> dict[str, Any]:
    """:func:`engine.saebench.absorption.absorption_plan` of the tokenizer in ``folder`` (a walk over
    its whole vocabulary: kept for the pages that show it again)."""
    from activations.selectors import tokenizer_for
    from engine.saebench.absorption import AbsorptionConfig, absorption_plan

    return absorption_plan(tokenizer_for(folder), AbsorptionConfig(**json.loads(settings)), saes=saes)


def check_absorbable(saes: list[SparseAutoencoder]) -> None:
    """Absorption compares a probe with decoder directions in the space the SAE reads: a
    transcoder's decoder writes elsewhere (409)."""
    transcoders = [sae.name or sae.id for sae in saes if sae.hook_name_out]
    if transcoders:
        raise ApplicationError(
            "NOT_AN_SAE",
            f"Absorption judges SAEs that reconstruct the hook they read; {', '.join(transcoders[:3])} "
            f"{'is a transcoder' if len(transcoders) == 1 else 'are transcoders'}: leave absorption out "
            "for them.",
            status=409,
        )


def check_methods(methods: list[str] | None) -> list[str]:
    chosen = list(dict.fromkeys(methods or DEFAULT_METHODS))
    unknown = [name for name in chosen if name not in METHODS]
    if unknown or not chosen:
        raise ApplicationError(
            "INVALID_METHOD",
            f"Unknown method {', '.join(unknown) or '(none)'}: choose among {', '.join(METHODS)}.",
            details={"fields": {"methods": [f"One of {', '.join(METHODS)}."]}},
        )
    return chosen


def check_saes(saes: list[SparseAutoencoder]) -> LanguageModel:
    """The SAEs' one model: every SAE completed, single-layer, of one registered model (400 / 409)."""
    if not saes or len(saes) > MAX_SAES:
        raise ApplicationError(
            "INVALID_SAES",
            f"Choose 1 to {MAX_SAES} SAEs.",
            details={"fields": {"sae_ids": ["1 to 64 SAEs."]}},
        )
    for sae in saes:
        if sae.status != SparseAutoencoder.Status.COMPLETED:
            raise ApplicationError("SAE_NOT_READY", f"{sae.name or sae.id} is {sae.status}.", status=409)
        check_single_layer(sae, "SAEBench")
    models = {sae.model_id for sae in saes}
    if None in models:
        raise ApplicationError("MODEL_REQUIRED", "Every SAE must name its registered model.")
    if len(models) > 1:
        raise ApplicationError(
            "MIXED_MODELS", "The SAEs belong to different models: judge one model's SAEs at a time.",
            details={"model_ids": sorted(models)},
        )  # fmt: skip
    return saes[0].model


def default_text_dataset(*, saes: list[SparseAutoencoder], group: SaeGroup | None, user) -> Dataset | None:
    """The text a group trained on, or the first SAE's training cache's, when ``user`` may read it."""
    candidates = [group.dataset if group is not None else None]
    candidates += [
        sae.cache.dataset if sae.cache_id and sae.cache and sae.cache.dataset_id else None for sae in saes
    ]
    for dataset in candidates:
        if dataset is None:
            continue
        try:
            return reach(user, dataset)
        except ApplicationError:
            continue
    return None


def check_probing_dataset(dataset: Dataset | None) -> Dataset:
    if dataset is None:
        raise ApplicationError(
            "DATASET_REQUIRED", "Sparse probing needs a labelled dataset (probing_dataset_id).",
            details={"fields": {"probing_dataset_id": ["A dataset with a label column."]}},
        )  # fmt: skip
    if not dataset.label_field or len(dataset.classes or {}) < 2:
        raise ApplicationError(
            "DATASET_NOT_LABELLED",
            f"{dataset.name} has no labels of two classes or more: upload it with its label column named "
            "(label_field).",
            details={"fields": {"probing_dataset_id": ["A dataset with a label column of 2+ classes."]}},
        )
    return dataset


def bench_estimate(
    model: LanguageModel, saes: list[SparseAutoencoder], methods: list[str], config: dict
) -> int:
    """The run's peak memory: the largest of its methods' on its largest SAE (refused over budget)."""
    widest = max(saes, key=lambda sae: sae.d_sae)
    shape = {
        "hidden": model.hidden_size or widest.d_in,
        "layers": model.num_layers or 1,
        "heads": model_heads(model),
    }
    estimates = []
    if "core" in methods:
        core = CoreConfig(**config["core"])
        together = Counter((sae.hook_name, sae.hook_name_out) for sae in saes)  # judged in one pass
        estimates.append(
            budgets.saebench_core(
                d_in=widest.d_in,
                d_sae=widest.d_sae,
                vocab=model.vocab_size or 50_000,
                prompts=core.batch_size_prompts,
                context=core.context_size,
                saes=max(together.values()),
                **shape,
            )
        )
    if "absorption" in methods:
        absorption = config["absorption"]
        estimates.append(
            budgets.absorption(
                d_in=widest.d_in,
                d_sae=widest.d_sae,
                words=absorption["plan"]["words"],
                context=absorption["plan"]["tokens_per_prompt"],
                batch=absorption["batch_size"],
                **shape,
            )
        )
    if "sparse_probing" in methods:
        probing = config["sparse_probing"]
        estimates.append(
            budgets.sparse_probing(
                d_in=widest.d_in,
                d_sae=widest.d_sae,
                texts=probing["texts"],
                context=probing["context_length"],
                batch=8,
                **shape,
            )
        )
    largest = max(estimates, key=lambda estimate: estimate.total)
    return memory_budget_check(largest, what="this SAEBench run", worker_name=model_worker_name(model))


def bench_tokens(saes: list[SparseAutoencoder], methods: list[str], config: dict) -> int:
    """Tokens the run puts through the model (three passes a core batch; one a probing text)."""
    tokens = 0
    if "core" in methods:
        core = CoreConfig(**config["core"])
        tokens += 3 * core.batches * core.batch_size_prompts * core.context_size
    if "sparse_probing" in methods:
        tokens += config["sparse_probing"]["texts"] * config["sparse_probing"]["context_length"]
    tokens *= len(saes)
    if "absorption" in methods:
        tokens += config["absorption"]["plan"]["tokens"]  # for all the SAEs
    return tokens


def bench_request(
    *,
    owner,
    saes: list[SparseAutoencoder],
    group: SaeGroup | None = None,
    methods: list[str] | None = None,
    dataset: Dataset | None = None,
    probing_dataset: Dataset | None = None,
    core: dict[str, Any] | None = None,
    probing: dict[str, Any] | None = None,
    absorption: dict[str, Any] | None = None,
    name: str = "",
    shared: bool = False,
    estimate_only: bool = False,
) -> BenchRun | dict[str, Any]:
    """Queue SAEBench's ``methods`` (default: those not opt-in) over ``saes`` (rows the caller may
    use, resolved by the caller) on their model's worker. The core metrics run the model over
    ``dataset`` (default: the group's or the first SAE's training text); sparse probing reads
    ``probing_dataset``'s labels; absorption builds its tasks from the model's vocabulary. Refused
    before anything is queued: unknown methods, SAEs not completed or of different models, a missing
    or unlabelled dataset, too many tokens, too much memory. ``estimate_only``: nothing is queued;
    what the run would be is returned (its settings with absorption's plan and time, its tokens and
    memory)."""
    chosen = check_methods(methods)
    model = check_saes(saes)
    config: dict[str, Any] = {}
    if "core" in chosen:
        dataset = dataset or default_text_dataset(saes=saes, group=group, user=owner)
        if dataset is None:
            raise ApplicationError(
                "DATASET_REQUIRED", "Name a text dataset for the core metrics (dataset_id).",
                details={"fields": {"dataset_id": ["The text the model runs over."]}},
            )  # fmt: skip
        config["core"] = core_settings(core).to_dict()
    if "sparse_probing" in chosen:
        probing_dataset = check_probing_dataset(probing_dataset)
        settings = probing_settings(probing)
        per_class = settings["max_per_class"]
        settings["texts"] = min(
            MAX_PROBING_TEXTS, sum(min(count, per_class) for count in probing_dataset.classes.values())
        )
        config["sparse_probing"] = settings
    if "absorption" in chosen:
        check_absorbable(saes)
        settings = absorption_settings(absorption)
        config["absorption"] = {**settings, "plan": absorption_plan_of(model, saes, settings)}
    if estimate_only:
        return {
            "methods": chosen,
            "config": config,
            "tokens": bench_tokens(saes, chosen, config),
            "memory_estimate_bytes": bench_estimate(model, saes, chosen, config),
        }
    with transaction.atomic():
        jobs.job_admit(owner=owner, tokens=bench_tokens(saes, chosen, config))
        estimate = bench_estimate(model, saes, chosen, config)
        run = BenchRun.objects.create(
            name=name,
            model=model,
            group=group,
            saes=[sae.id for sae in saes],
            methods=chosen,
            dataset=dataset if "core" in chosen else None,
            probing_dataset=probing_dataset if "sparse_probing" in chosen else None,
            config=config,
            memory_estimate_bytes=estimate,
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=shared,
        )
        jobs.job_submit(run, queue=model_job_queue(model.id))
    return run


def bench_update(*, run: BenchRun, actor, **changes: Any) -> BenchRun:
    jobs.job_update(run, actor=actor, changes=changes)
    return run


def bench_cancel(*, run: BenchRun, actor) -> BenchRun:
    return jobs.job_cancel(run, actor=actor)


def bench_delete(*, run: BenchRun, actor) -> None:
    """Delete the run and its results; a run in progress must be cancelled first."""
    check_may_change(run, actor, what="SAEBench run")
    if run.status in BenchRun.ACTIVE:
        raise ApplicationError("BENCH_BUSY", "The run is in progress; cancel it first.", status=409)
    run.delete()
