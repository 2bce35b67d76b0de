"""The SAEBench run's body, on the model's worker: each (SAE, method) pair in turn, each stored as
a :class:`BenchResult` as soon as it is done (a resumed run skips the pairs it has)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from activations.models import Dataset
from activations.services.datasets import DatasetReader, dataset_labelled_samples
from engine.saebench.methods import bench_method
from evaluations.models import BenchResult, BenchRun
from mistudio.errors import ApplicationError
from mistudio.events import ProgressThrottle
from mistudio.job_runner import JobContext, job_task
from mistudio.jobs import job_publish
from models_app.tasks import model_in_this_worker
from saes.models import SparseAutoencoder
from saes.tasks import sae_module

# Samples read at first from the end of a dataset for the core metrics' tokens (doubled until enough).
TAIL_SAMPLES = 256


@dataclass
class RunContext:
    """What the pairs of one run share: the loaded model, inputs made once, progress reporting."""

    run: BenchRun
    loaded: Any
    report: Callable[[float], None]
    done: set[tuple[str, str]] = field(default_factory=set)
    made: dict[str, Any] = field(default_factory=dict)

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]


@dataclass
class MethodOutput:
    metrics: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)
    feature_metrics: dict[str, list[float]] = field(default_factory=dict)
    seconds: float | None = None  # its share of work done for several SAEs at once


def on_model_device(module: Any, model: Any) -> Any:
    """The SAE module on the model's device (a copy when the worker's cached one is elsewhere)."""
    from engine.placement import input_device

    device = input_device(model)
    return module if module.W_enc.device == device else copy.deepcopy(module).to(device)


def tail_texts(dataset: Dataset, tokenizer: Any, needed_tokens: int) -> list[list[int]]:
    """Token ids (no special tokens) of the last samples of ``dataset`` — the part training reads
    last, if at all — enough of them for ``needed_tokens`` when the dataset has that many."""
    count = dataset.sample_count
    take = min(TAIL_SAMPLES, count)
    with DatasetReader(dataset) as reader:
        while True:
            texts = reader(count - take, count)
            ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
            if sum(len(row) for row in ids) >= needed_tokens or take >= count:
                return ids
            take = min(count, take * 2)


def ignored_tokens(tokenizer: Any) -> set[int | None]:
    """SAEBench's ``ignore_tokens``: the tokenizer's pad, EOS and BOS ids."""
    return {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}


def hook_pair(sae: SparseAutoencoder) -> tuple[str, str]:
    """What an SAE reads and what it writes (a transcoder's two hook points; an SAE's one, twice)."""
    return sae.hook_name, sae.hook_name_out or sae.hook_name


def run_core(context: RunContext, sae: SparseAutoencoder) -> MethodOutput:
    """SAEBench's core metrics of one SAE (``engine.saebench.core``) over the run's text, computed
    together with every other SAE of the run at the same hook point still to be judged: they share
    each batch's pass, and the clean and ablated runs are computed once for all of them."""
    return judged_together(context, sae, "core", hook_pair, core_of_saes)


def judged_together(
    context: RunContext,
    sae: SparseAutoencoder,
    method: str,
    place: Callable[[SparseAutoencoder], Any],
    judge: Callable[[RunContext, list[SparseAutoencoder]], dict[str, MethodOutput]],
) -> MethodOutput:
    """``sae``'s output of ``judge``, run once for the run's completed SAEs at the same ``place``
    (its hook point) that ``method`` has not judged yet, in the run's order: judged together, they
    share the model's passes. An SAE that was not among them then is judged alone."""
    here = place(sae)

    def together() -> dict[str, MethodOutput]:
        run = context.run
        rows = SparseAutoencoder.objects.filter(pk__in=run.saes, status=SparseAutoencoder.Status.COMPLETED)
        pending = {row.id: row for row in rows if place(row) == here and (row.id, method) not in context.done}
        return judge(context, [pending[sae_id] for sae_id in run.saes if sae_id in pending])

    outputs = context.once(f"{method} {here}", together)
    return outputs[sae.id] if sae.id in outputs else judge(context, [sae])[sae.id]


def core_of_saes(context: RunContext, saes: list[SparseAutoencoder]) -> dict[str, MethodOutput]:
    from engine.sae.evaluation import EvaluationError
    from engine.saebench.core import context_batches, core_metrics_many
    from engine.saebench.results import CoreConfig

    config = CoreConfig(**context.run.config["core"])
    tokenizer = context.loaded.tokenizer
    if context.run.dataset is None:
        raise ApplicationError("DATASET_NOT_FOUND", "The run's text dataset is gone.")

    def batches():
        needed = config.batches * config.batch_size_prompts * config.context_size
        try:
            made = context_batches(
                tail_texts(context.run.dataset, tokenizer, needed),
                context_size=config.context_size,
                batch_size=config.batch_size_prompts,
                batches=config.batches,
                bos_token_id=tokenizer.bos_token_id,
            )
        except EvaluationError:  # not one batch: said below, with the dataset's name
            made = []
        if len(made) < config.batches:
            raise ApplicationError(
                "NOT_ENOUGH_TOKENS",
                f"{context.run.dataset.name} gives {len(made)} batches of {config.batch_size_prompts} x "
                f"{config.context_size} tokens; {config.batches} are needed: choose a larger text, or fewer "
                "or smaller batches.",
            )
        return made

    made = context.once("core batches", batches)
    first = saes[0]
    started = time.monotonic()
    results = core_metrics_many(
        context.loaded.model,
        [on_model_device(sae_module(sae), context.loaded.model) for sae in saes],
        made,
        hook_name=first.hook_name_out or first.hook_name,
        input_hook=first.hook_name if first.hook_name_out else None,
        ignore_tokens=ignored_tokens(tokenizer),
        config=config,
        progress=lambda done, total: context.report(done / total),
    )
    share = (time.monotonic() - started) / len(saes)
    return {
        sae.id: MethodOutput(
            metrics=result.metrics,
            details={"batches": len(made), "judged_together": len(saes), "stacked": result.stacked},
            feature_metrics=result.feature_metrics,
            seconds=share,
        )
        for sae, result in zip(saes, results, strict=True)
    }


def run_sparse_probing(context: RunContext, sae: SparseAutoencoder) -> MethodOutput:
    """SAEBench's sparse probing of one SAE (``engine.saebench.sparse_probing``) on the run's labelled
    dataset, computed together with every other SAE of the run at the same hook point still to be
    judged: one pass of the model for all, its own probes trained once. The split is made once per
    run, so every SAE is probed on the same texts."""
    return judged_together(context, sae, "sparse_probing", lambda row: row.hook_name, probing_of_saes)


def probing_of_saes(context: RunContext, saes: list[SparseAutoencoder]) -> dict[str, MethodOutput]:
    from engine.saebench.sparse_probing import sparse_probing, split_by_class

    settings = context.run.config["sparse_probing"]
    if context.run.probing_dataset is None:
        raise ApplicationError("DATASET_NOT_FOUND", "The run's labelled dataset is gone.")

    def split():
        return split_by_class(
            dataset_labelled_samples(context.run.probing_dataset),
            train_fraction=settings["train_fraction"],
            max_per_class=settings["max_per_class"],
            seed=settings["seed"],
        )

    made = context.once("probing split", split)
    started = time.monotonic()
    found = sparse_probing(
        context.loaded.model,
        context.loaded.tokenizer,
        [on_model_device(sae_module(sae), context.loaded.model) for sae in saes],
        made,
        hook_name=saes[0].hook_name,
        k_values=settings["k_values"],
        context_length=settings["context_length"],
        seed=settings["seed"],
        progress=lambda done, total: context.report(done / total),
    )
    share = (time.monotonic() - started) / len(saes)
    classes = {label: [len(made.train[label]), len(made.test[label])] for label in made.train}
    return {
        sae.id: MethodOutput(
            metrics=result["metrics"],
            details={"per_class": result["per_class"], "classes": classes, "judged_together": len(saes)},
            seconds=share,
        )
        for sae, result in zip(saes, found, strict=True)
    }


def run_absorption(context: RunContext, sae: SparseAutoencoder) -> MethodOutput:
    """SAEBench's feature absorption of one SAE (``engine.saebench.absorption``), computed together
    with every other SAE of the run at the same hook point still to be judged: the model's
    first-letter probe is trained once for them."""
    return judged_together(context, sae, "absorption", lambda row: row.hook_name, absorption_of_saes)


def absorption_of_saes(context: RunContext, saes: list[SparseAutoencoder]) -> dict[str, MethodOutput]:
    from engine.saebench.absorption import AbsorptionConfig, absorption

    settings = {key: value for key, value in context.run.config["absorption"].items() if key != "plan"}
    started = time.monotonic()
    found = absorption(
        context.loaded.model,
        context.loaded.tokenizer,
        [on_model_device(sae_module(sae), context.loaded.model) for sae in saes],
        hook_name=saes[0].hook_name,
        config=AbsorptionConfig(**settings),
        progress=context.report,  # which also stops a cancelled run
    )
    share = (time.monotonic() - started) / len(saes)
    return {
        sae.id: MethodOutput(
            metrics=result.pop("metrics"), details={**result, "judged_together": len(saes)}, seconds=share
        )
        for sae, result in zip(saes, found, strict=True)
    }


RUNNERS: dict[str, Callable[[RunContext, SparseAutoencoder], MethodOutput]] = {
    "core": run_core,
    "sparse_probing": run_sparse_probing,
    "absorption": run_absorption,
}


@job_task(BenchRun, timeout=2 * 24 * 3600)
def run_bench(run: BenchRun, job: JobContext) -> None:
    """Judge each of the run's SAEs by each of its methods, storing each result as it is done; a
    resumed run goes on from the first pair without a result."""
    if run.model_id is None:
        raise ApplicationError("MODEL_NOT_FOUND", "The run's model is gone.")
    loaded = model_in_this_worker(run.model_id, run, purpose="a SAEBench run")
    pairs = [(sae_id, method) for sae_id in run.saes for method in run.methods]
    done = set(run.results.values_list("sae_id", "method"))
    throttle = ProgressThrottle(min_step=1.0, min_interval=0.5)
    seconds: dict[str, float] = dict(run.summary.get("seconds", {}))
    skipped: list[str] = list(run.summary.get("skipped", []))
    position = {"index": 0}

    def report(fraction: float) -> None:
        job.check_cancel()
        percent = 100 * (position["index"] + fraction) / len(pairs)
        if throttle.ready(percent):
            run.progress = round(percent, 2)
            job_publish(run, "progress", ["progress"])

    context = RunContext(run=run, loaded=loaded, report=report, done=done)
    for index, (sae_id, method) in enumerate(pairs):
        position["index"] = index
        if (sae_id, method) in done:
            continue
        job.check_cancel()
        sae = SparseAutoencoder.objects.filter(pk=sae_id, status=SparseAutoencoder.Status.COMPLETED).first()
        if sae is None:  # deleted meanwhile: the others go on
            skipped.append(sae_id)
            continue
        started = time.monotonic()
        output = RUNNERS[method](context, sae)
        elapsed = output.seconds if output.seconds is not None else time.monotonic() - started
        seconds[method] = round(seconds.get(method, 0.0) + elapsed, 3)
        store_result(run, sae, method, output, seconds=elapsed)
        run.summary = {**run.summary, "seconds": seconds, "skipped": skipped, "done": len(done) + 1,
                       "pairs": len(pairs)}  # fmt: skip
        done.add((sae_id, method))
        job_publish(run, "progress", [*run.mark_progress(done=index + 1, total=len(pairs)), "summary"])
        job.checkpoint_saved()  # yield here if another user's job waits: the next pair resumes
    summary = {"seconds": seconds, "skipped": skipped, "done": len(done), "pairs": len(pairs)}
    job_publish(run, "completed", run.mark_completed(summary=summary))


def store_result(
    run: BenchRun, sae: SparseAutoencoder, method: str, output: MethodOutput, *, seconds: float
) -> None:
    """The pair's row, with the per-feature lists (if any) in the run's folder, written first."""
    result = BenchResult(
        run=run,
        sae=sae,
        method=method,
        method_version=bench_method(method).version,
        metrics=output.metrics,
        details=output.details,
        seconds=round(seconds, 3),
    )
    if output.feature_metrics:
        import numpy as np
        from safetensors.numpy import save_file

        run.directory.mkdir(parents=True, exist_ok=True)
        arrays = {
            name: np.asarray(values, dtype=np.float32) for name, values in output.feature_metrics.items()
        }
        temporary = result.feature_file.with_suffix(".partial")
        save_file(arrays, str(temporary))
        temporary.replace(result.feature_file)
    result.save()
