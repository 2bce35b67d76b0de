"""RQ entry point of an extraction. It takes an id and runs in the worker that hosts the model."""

import logging
import time
import uuid

from django.db import close_old_connections

from activations.models import ActivationCache, ExtractionJob
from activations.services import (
    cache_store_completed,
    cache_store_failed,
    cache_store_open,
    dataset_samples,
    extraction_cancel_requested,
    extraction_discard,
    extraction_enqueue,
    job_publish,
)
from activations.store import BackgroundWriter, CacheError
from engine.errors import EngineError
from engine.extraction import extract, plan_batches, tokenize_samples
from engine.hooks import list_hook_points
from mistudio.errors import ApplicationError
from mistudio.events import ProgressThrottle
from models_app.tasks import Requeued, current_worker, model_in_this_worker

logger = logging.getLogger(__name__)


class ExtractionCancelled(Exception):
    pass


def extraction_requeue(job: ExtractionJob) -> None:
    """Send the job after its model (to its host's queue), under a fresh RQ id."""
    job.rq_job_id = f"extract-{job.id}-{uuid.uuid4().hex[:6]}"
    job.save(update_fields=["rq_job_id"])
    extraction_enqueue(job)


def hook_widths(model, names: list[str], tokenized: list[list[int]]) -> dict[str, int]:
    """Width of each hook: from the hook table, or by a two-token probe for ``module:`` paths."""

    widths = {info.name: info.width for info in list_hook_points(model)}
    unknown = [name for name in names if name not in widths]
    if unknown:
        probe = next(extract(model, [tokenized[0][:2]], [[0]], hooks=unknown, dtype="float32"))
        widths.update({name: int(probe.activations[name].shape[-1]) for name in unknown})
    return {name: widths[name] for name in names}


def run_extraction(job_id: str) -> None:
    """Extract the job's hooks over its dataset into its cache; resumes from the last complete shard.

    Idempotent: a job that is no longer queued or running does nothing, and a retried job
    continues the cache it started instead of writing anything twice.
    """

    close_old_connections()
    identity = current_worker()
    job = ExtractionJob.objects.select_related("model", "dataset", "cache").filter(pk=job_id).first()
    if job is None or job.status not in ExtractionJob.ACTIVE or job.cache is None:
        return
    cache = job.cache
    writer = None
    try:
        if extraction_cancel_requested(job.id):
            raise ExtractionCancelled
        loaded = model_in_this_worker(
            job.model_id, identity.name, requeue=lambda: extraction_requeue(job), purpose="an extraction"
        )
        samples = dataset_samples(job.dataset, limit=job.sample_count)
        tokenized = tokenize_samples(loaded.tokenizer, samples, job.max_length)
        plan = plan_batches([len(ids) for ids in tokenized], job.batch_size)
        job_publish(
            job, "extraction:started", job.mark_running(host_worker=identity.name, total_samples=len(samples))
        )
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
            should_cancel=lambda: extraction_cancel_requested(job.id),
        )
        # The next batch's forward pass runs while this one is written (activations.store.pipeline).
        with BackgroundWriter(writer) as background:
            for batch in batches:
                background.add_extracted(batch)
                samples_done += len(batch.sample_indices)
                tokens_done += int(batch.token_ids.numel())
                progress = 100 * samples_done / max(len(samples), 1)
                if throttle.ready(progress, final=samples_done >= len(samples)):
                    rate = (tokens_done - resumed_tokens) / max(time.monotonic() - started, 1e-6)
                    fields = job.mark_progress(
                        samples_processed=samples_done, tokens_processed=tokens_done, tokens_per_second=rate
                    )
                    job_publish(job, "extraction:progress", fields)
        manifest = writer.finalize(num_samples=len(samples))
    except ExtractionCancelled:
        extraction_discard(job)
        return
    except Requeued:
        return
    except (ApplicationError, EngineError, CacheError) as error:
        code = getattr(error, "code", "EXTRACTION_FAILED")
        if code == "EXTRACTION_CANCELLED":
            extraction_discard(job)
            return
        extraction_failed(
            job, cache, code, getattr(error, "message", str(error)), remove_files=code == "DISK_FULL"
        )
        return
    except Exception as error:
        logger.exception("extraction %s failed", job_id)
        extraction_failed(job, cache, "EXTRACTION_FAILED", f"Extraction failed: {type(error).__name__}.")
        return
    finally:
        if writer is not None:
            writer.close()  # releases the cache directory's lock
    cache_store_completed(cache, manifest=manifest, size_bytes=writer.size_bytes)
    job_publish(
        job,
        "extraction:completed",
        job.mark_completed(cache=cache),
        file_size_bytes=cache.file_size_bytes,
        extraction_time_seconds=job.extraction_time_seconds,
    )


def extraction_failed(
    job: ExtractionJob, cache: ActivationCache, code: str, message: str, *, remove_files: bool = False
) -> None:
    """The job and its cache row say ``failed``; after a full disk, the partial files are removed."""
    cache_store_failed(cache, code=code, message=message, remove_files=remove_files)
    job_publish(
        job, "extraction:failed", job.mark_failed(code=code, message=message), code=code, message=message
    )
