"""The extraction job's body. It runs in the worker that hosts the model (``mistudio.jobs``)."""

import time

from activations.models import ExtractionJob
from activations.services import (
    cache_store_completed,
    cache_store_open,
    dataset_samples,
)
from activations.store import BackgroundWriter
from engine.extraction import extract, plan_batches, tokenize_samples
from engine.hooks import list_hook_points
from mistudio.events import ProgressThrottle
from mistudio.job_runner import JobCancelled, JobContext, job_task
from mistudio.jobs import DAY, job_publish
from models_app.tasks import model_in_this_worker


def hook_widths(model, names: list[str], tokenized: list[list[int]]) -> dict[str, int]:
    """Width of each hook: from the hook table, or by a two-token probe for ``module:`` paths."""

    widths = {info.name: info.width for info in list_hook_points(model)}
    unknown = [name for name in names if name not in widths]
    if unknown:
        probe = next(extract(model, [tokenized[0][:2]], [[0]], hooks=unknown, dtype="float32"))
        widths.update({name: int(probe.activations[name].shape[-1]) for name in unknown})
    return {name: widths[name] for name in names}


@job_task(ExtractionJob, timeout=DAY)
def run_extraction(job: ExtractionJob, context: JobContext) -> None:
    """Extract the job's hooks over its dataset into its cache; resumes from the last complete shard.

    A retried job continues the cache it started instead of writing anything twice.
    """
    cache = job.cache
    if cache is None:
        raise JobCancelled  # its cache went with a cancel
    loaded = model_in_this_worker(job.model_id, job, purpose="an extraction")
    samples = dataset_samples(job.dataset, limit=job.sample_count)
    tokenized = tokenize_samples(loaded.tokenizer, samples, job.max_length)
    plan = plan_batches([len(ids) for ids in tokenized], job.batch_size)
    job.total_samples = len(samples)
    job_publish(job, "progress", ["total_samples"])
    widths = hook_widths(loaded.model, job.hooks, tokenized)
    writer = cache_store_open(
        cache,
        provenance={
            "cache_id": cache.id, "model_id": job.model_id, "model": job.model.display_identifier,
            "quantization": job.model.quantization, "dataset_id": job.dataset_id,
            "dataset_name": job.dataset.name, "batch_size": job.batch_size,
        },
        hooks=widths,
    )  # fmt: skip
    with writer:  # releases the cache directory's lock, whatever happens
        samples_done = sum(len(plan[index]) for index in range(writer.next_batch))
        tokens_done = writer.num_tokens
        resumed_tokens, started = tokens_done, time.monotonic()
        throttle = ProgressThrottle()
        batches = extract(
            loaded.model,
            tokenized,
            plan,
            start_batch=writer.next_batch,
            hooks=job.hooks,
            dtype=job.dtype,
            should_cancel=context.should_cancel,
        )
        # The next batch's forward pass runs while this one is written (activations.store.pipeline).
        with BackgroundWriter(writer) as background:
            for batch in batches:
                background.add_extracted(batch)
                if context.should_yield():  # its time slice ends: what is extracted goes to disk first
                    background.finish()
                    writer.flush()
                    context.checkpoint_saved()
                samples_done += len(batch.sample_indices)
                tokens_done += int(batch.token_ids.numel())
                progress = 100 * samples_done / max(len(samples), 1)
                if throttle.ready(progress, final=samples_done >= len(samples)):
                    rate = (tokens_done - resumed_tokens) / max(time.monotonic() - started, 1e-6)
                    fields = job.mark_progress(
                        samples_processed=samples_done, tokens_processed=tokens_done, tokens_per_second=rate
                    )
                    job_publish(job, "progress", fields)
        manifest = writer.finalize(num_samples=len(samples))
    cache_store_completed(cache, manifest=manifest, size_bytes=writer.size_bytes)
    job_publish(
        job,
        "completed",
        job.mark_completed(cache=cache),
        file_size_bytes=cache.file_size_bytes,
        extraction_time_seconds=job.extraction_time_seconds,
    )
