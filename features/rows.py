"""Where an analysis's rows come from: its activation cache on disk, or its dataset read through the
model (:class:`engine.features.model_rows.ModelRows`, no cache written). Both answer ``tokens()``
and ``get(hook, start, stop, as_torch=True)``; the analysis job and the explanations' quiet
examples read them alike. Runs in a worker."""

from typing import Any

from activations.services import dataset_samples
from engine.extraction import plan_batches, tokenize_samples
from engine.features.analysis import TokenTable
from engine.features.model_rows import ModelRows
from features.models import FeatureAnalysis
from mistudio.errors import ApplicationError
from mistudio.jobs import JobRow
from models_app.tasks import model_in_this_worker
from saes.tasks import open_cache


def analysis_rows(analysis: FeatureAnalysis, *, job_row: JobRow | None, should_cancel=None) -> Any:
    """The rows of ``analysis``'s SAE hook: its cache's store, or :class:`ModelRows` over its
    dataset, the model loaded here for ``job_row`` if no worker has it (or the row follows the
    model to its host)."""
    sae = analysis.sae
    if analysis.source == "cache":
        return open_cache(analysis.cache, sae.hook_name)
    if analysis.dataset is None or not sae.model_id:
        raise ApplicationError("DATASET_GONE", "The dataset this analysis read through the model is gone.")
    if job_row is None:
        raise ApplicationError("MODEL_REQUIRED", "This analysis's rows are computed by its model, in a job.")
    loaded = model_in_this_worker(sae.model_id, job_row, purpose="a feature analysis from the model")
    reading = analysis.reading
    samples = dataset_samples(analysis.dataset, limit=reading["sample_count"])
    tokenized = tokenize_samples(loaded.tokenizer, samples, reading["max_length"])
    plan = plan_batches([len(ids) for ids in tokenized], reading["batch_size"])
    return ModelRows(
        loaded.model, tokenized, plan, hook=sae.hook_name, dtype=reading["dtype"], should_cancel=should_cancel
    )


def token_table(rows: Any) -> TokenTable:
    table = rows.tokens()
    return TokenTable(table["token_ids"], table["sample_index"], table["position"])
