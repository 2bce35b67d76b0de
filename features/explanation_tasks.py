"""The explanation job's body (``mistudio.jobs``): examples from the analysis, non-activating
contexts from its cache, then every feature explained and scored through the chosen endpoint.
It runs in a miStudio worker."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
from django.conf import settings

from activations.selectors import model_folder, token_strings, tokenizer_for
from engine.autointerp.chat import ChatClient
from engine.autointerp.pipeline import (
    Endpoints,
    FeatureExamples,
    FeatureResult,
    InterpretationConfig,
    interpret_many,
)
from engine.autointerp.prompts import PROMPT_VERSION, Example
from engine.configs import config_from_dict
from engine.generation.prompts import render_prompt
from features.explanations import LOCAL, explanation_summary
from features.models import Explanation, ExplanationJob, FeatureAnalysis
from features.rows import analysis_rows, token_table
from features.search import embedder, search_index_refresh
from features.selectors import FeatureFile, analysis_tokenizer
from mistudio.authentication import job_token_for
from mistudio.errors import ApplicationError
from mistudio.events import ProgressThrottle
from mistudio.job_runner import JobCancelled, JobContext, job_task
from mistudio.jobs import DAY, job_publish
from mistudio.structured_logging import redact
from mistudio.text import safe_text
from models_app.models import LanguageModel
from saes.tasks import sae_module

logger = logging.getLogger(__name__)

NON_ACTIVATING_WINDOWS = 1024  # random contexts of the cache drawn once per job
ENCODE_ROWS = 2048
# What a job row's ``config`` holds beside InterpretationConfig's fields (the explainer's context).
CONFIG_EXTRAS = ("context_tokens",)


@job_task(ExplanationJob, timeout=2 * DAY)
def run_explanation_job(row: ExplanationJob, job: JobContext) -> None:
    """Explain and score the job's features that have no explanation from it yet (so a resumed job
    goes on where it stopped), writing each feature's :class:`Explanation` as it comes."""
    analysis = row.analysis
    config = config_from_dict(InterpretationConfig, row.config, retired=CONFIG_EXTRAS)
    done = set(Explanation.objects.filter(job=row).values_list("index", flat=True))
    todo = [index for index in row.indices if index not in done]
    if done:
        job_publish(row, "progress", [], resumed_from=len(done))
    notes: list[str] = []
    tokenizer = analysis_tokenizer(analysis.sae)
    data = FeatureFile(analysis)
    try:
        non_activating = non_activating_examples(
            analysis, todo, config, tokenizer=tokenizer, device=job.worker.compute_device, job_row=row
        )
    except ApplicationError as error:  # the cache is gone: explanations without scores
        non_activating = {}
        notes.append(f"Not scored: {error.message}")
    features = (
        feature_examples(data, index, config, tokenizer, non_activating.get(index, [])) for index in todo
    )
    endpoints = job_endpoints(row, config)
    # What earlier runs of a resumed job spent, so that the row counts every run.
    spent = {
        "requests": row.requests_sent,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
    }
    counts = {"done": len(done), "failed": Explanation.objects.filter(job=row).exclude(error_code="").count()}
    throttle = ProgressThrottle(min_step=1.0, min_interval=0.5)
    watch = EndpointWatch(len(todo), local=row.endpoint == LOCAL)
    started = time.monotonic()
    finished_here = 0

    def progress() -> list[str]:
        per_minute = finished_here / max(1e-6, time.monotonic() - started) * 60
        return row.mark_progress(
            done=counts["done"],
            failed=counts["failed"],
            usage=merged_usage(endpoints, spent),
            per_minute=per_minute,
        )

    def on_result(result: FeatureResult) -> None:
        nonlocal finished_here
        watch.check(result)
        store_result(row, result)
        counts["done"] += 1
        finished_here += 1
        counts["failed"] += bool(result.error_code)
        if throttle.ready(100 * counts["done"] / max(1, len(row.indices))):
            job_publish(row, "progress", progress())

    def tick() -> bool:  # every result is stored as it comes: the job may yield between any two
        return job.should_cancel() or job.should_yield()

    try:
        completed = interpret_many(features, endpoints, config, on_result=on_result, tick=tick)
    finally:
        endpoints.explainer.close()
        endpoints.scorer.close()
    if not completed and not job.cancel_seen:
        job_publish(row, "progress", progress())  # what it spent so far, for the resumed run
        job.checkpoint_saved()
    if not completed:
        raise JobCancelled
    summary = job_summary(row, notes)
    if row.indices and summary["explained"] == 0:  # "completed" means something was explained
        row.summary = summary
        job_publish(row, "progress", [*progress(), "summary"])
        raise ApplicationError("NO_FEATURE_EXPLAINED", nothing_explained(summary, len(row.indices)))
    job_publish(row, "completed", [*progress(), *row.mark_completed(summary=summary)])
    refresh_search_index(analysis)


def nothing_explained(summary: dict[str, Any], features: int) -> str:
    """Why a job explained none of its features, in words: what each failure was, and what to do."""
    failures = ", ".join(f"{count} {code}" for code, count in sorted(summary["failures"].items()))
    hints = []
    if "PROMPT_TOO_LONG" in summary["failures"]:
        hints.append("choose an explainer with a longer context or fewer examples (explain_examples)")
    if "NO_EXPLANATION" in summary["failures"]:
        hints.append(
            "the explainer's answers held no explanation: a chat or instruction-tuned model explains "
            "(an external one through MISTUDIO_EXPLAINER_ENDPOINTS)"
        )
    return f"None of the {features} features was explained ({failures})." + (
        f" {'; '.join(hints).capitalize()}." if hints else ""
    )


# --- examples ------------------------------------------------------------------------------------


def example_tokens(tokenizer, token_ids) -> list[str]:
    """Each token's text as a prompt may hold it (a NUL, which no endpoint takes, shown as ␀)."""
    return [token.replace("\x00", "␀") for token in token_strings(tokenizer, token_ids)]


def _examples(data: FeatureFile, prefix: str, index: int, tokenizer) -> list[tuple[int, Example]]:
    """(row, example) of each filled slot of the feature's ``prefix`` examples."""
    rows = data.row(f"{prefix}_rows", index)
    context = np.nan_to_num(data.row(f"{prefix}_context", index).astype(np.float32))
    context_tokens = data.row(f"{prefix}_context_tokens", index)
    examples = []
    for slot, row in enumerate(rows):
        present = context_tokens[slot] >= 0
        if row < 0 or not present.any():
            continue
        tokens = example_tokens(tokenizer, context_tokens[slot][present])
        examples.append(
            (int(row), Example(tokens=tuple(tokens), values=tuple(float(v) for v in context[slot][present])))
        )
    return examples


def feature_examples(
    data: FeatureFile, index: int, config: InterpretationConfig, tokenizer, non_activating: list[Example]
) -> FeatureExamples:
    """The explainer sees the strongest ``explain_examples`` (at most half the top examples); the
    scorers get ``test_examples`` others, spread over the activation range (the interval examples,
    then the remaining top ones)."""
    top = _examples(data, "top", index, tokenizer)
    shown = top[: min(config.explain_examples, (len(top) + 1) // 2)]  # a rare feature keeps half back
    seen = {row for row, _ in shown}
    intervals = [
        (row, example) for row, example in _examples(data, "interval", index, tokenizer) if row not in seen
    ]
    if len(intervals) > config.test_examples:  # evenly over the intervals, strongest to weakest
        picks = np.linspace(0, len(intervals) - 1, config.test_examples).round().astype(int)
        intervals = [intervals[pick] for pick in picks]
    picked = {row for row, _ in intervals}
    rest = [(row, example) for row, example in top[len(shown) :] if row not in picked]
    held_out = [example for _, example in (intervals + rest)[: config.test_examples]]
    logit_tokens = None
    if "logit_top_ids" in data.names:
        logit_tokens = [
            text.strip() or text for text in token_strings(tokenizer, data.row("logit_top_ids", index)[:10])
        ]
    return FeatureExamples(
        index=index,
        train=[example for _, example in shown],
        test=held_out,
        non_activating=non_activating,
        logit_tokens=logit_tokens,
    )


def non_activating_examples(
    analysis: FeatureAnalysis,
    indices: list[int],
    config: InterpretationConfig,
    *,
    tokenizer,
    device: str,
    job_row: ExplanationJob | None = None,
) -> dict[int, list[Example]]:
    """For each feature, up to ``config.non_activating`` contexts of the analysis's text (windows
    as wide as its examples') on which the SAE leaves it at zero on every token. The windows are
    drawn once, at random (seeded), and encoded once for every feature, read in row order (from
    the model, each batch of samples runs once)."""
    import torch

    sae = analysis.sae
    store = analysis_rows(analysis, job_row=job_row)
    tokens = token_table(store)
    before, after = analysis.config.get("context_before", 8), analysis.config.get("context_after", 3)
    rng = np.random.default_rng(config.seed)
    centres = rng.choice(len(tokens), size=min(len(tokens), NON_ACTIVATING_WINDOWS), replace=False)
    windows = tokens.windows(centres, before, after)  # [n, w], -1 past a sample's ends
    module = sae_module(sae).to(device)
    wanted = torch.as_tensor(indices, dtype=torch.long)
    fires = np.zeros((len(windows), len(indices)), dtype=bool)
    spans = [(window[window >= 0].min(), window[window >= 0].max() + 1) for window in windows]
    in_row_order = sorted(range(len(windows)), key=lambda w: spans[w][0])
    per_part = max(1, ENCODE_ROWS // windows.shape[1])  # windows encoded together
    with torch.no_grad():
        for first in range(0, len(windows), per_part):
            part = in_row_order[first : first + per_part]
            rows = torch.cat(
                [store.get(sae.hook_name, int(spans[w][0]), int(spans[w][1]), as_torch=True) for w in part]
            )
            activations = module.encode(rows.float().to(device)).float().cpu()[:, wanted] > 0
            offset = 0
            for w in part:
                width = int(spans[w][1] - spans[w][0])
                fires[w] = activations[offset : offset + width].any(dim=0).numpy()
                offset += width
    texts = [example_tokens(tokenizer, tokens.ids(window[window >= 0])) for window in windows]
    out: dict[int, list[Example]] = {}
    for column, index in enumerate(indices):
        quiet = np.flatnonzero(~fires[:, column])[: config.non_activating]
        out[index] = [Example(tokens=tuple(texts[w]), values=(0.0,) * len(texts[w])) for w in quiet]
    return out


# --- endpoints -----------------------------------------------------------------------------------


def job_endpoints(row: ExplanationJob, config: InterpretationConfig) -> Endpoints:
    """Clients for the job's explainer and scorer. On ``local``: this workbench's /v1 as the job's
    owner (a signed job token), and prompts measured with the model's own tokenizer and chat
    rendering; elsewhere the configured URL, its key read from its variable now."""
    context = int(row.config.get("context_tokens", 2048))
    options: dict[str, Any] = {"connections": config.concurrency}
    if row.endpoint == LOCAL:
        if row.owner is None:
            raise ApplicationError(
                "OWNER_REQUIRED", "A job on this workbench's /v1 runs as a user.", status=400
            )
        url, key = settings.MISTUDIO_API_URL + "/v1", job_token_for(row)
    else:
        spec = settings.EXPLAINER_ENDPOINTS.get(row.endpoint)
        if spec is None:
            raise ApplicationError(
                "ENDPOINT_NOT_FOUND", f"The endpoint {row.endpoint!r} is no longer configured."
            )
        url, key = spec["url"], os.environ.get(spec["key_env"]) if spec["key_env"] else None
    explainer = ChatClient(base_url=url, model=row.explainer_model, api_key=key, **options)
    scorer = (
        explainer
        if row.scorer_model == row.explainer_model
        else ChatClient(base_url=url, model=row.scorer_model, api_key=key, **options)
    )
    counters = {model: prompt_tokens(row, model) for model in {row.explainer_model, row.scorer_model}}

    def fits(model: str, max_tokens: int):
        return lambda messages: counters[model](messages) + max_tokens <= context

    return Endpoints(
        explainer=explainer,
        scorer=scorer,
        explainer_fits=fits(row.explainer_model, config.explain_max_tokens),
        scorer_fits=fits(row.scorer_model, config.score_max_tokens),
        similarities=embedder().similarities if "embedding" in config.scorers else None,
    )


def prompt_tokens(row: ExplanationJob, model_ref: str):
    """How many tokens a prompt takes: counted with the model's tokenizer and chat rendering when
    it is this workbench's (its tokenizer read once), else at three characters a token."""
    if row.endpoint == LOCAL:
        model = LanguageModel.objects.filter(pk=model_ref).first()
        folder = model_folder(model) if model is not None else None
        if folder is not None:
            tokenizer = tokenizer_for(str(folder))
            return lambda messages: len(render_prompt(tokenizer, messages=messages))
    return lambda messages: sum(len(message["content"]) for message in messages) // 3


# The endpoint itself is wrong (unreachable, a bad key, an unknown model) when this many features
# from the start all fail on it: the job then fails at once instead of trying every feature.
ENDPOINT_FAILURES = frozenset({"ENDPOINT_UNREACHABLE", "ENDPOINT_ERROR", "ENDPOINT_BUSY"})
FAILURES_BEFORE_GIVING_UP = 8


class EndpointWatch:
    """Counts the first features' endpoint failures (see ``FAILURES_BEFORE_GIVING_UP``)."""

    def __init__(self, features: int, *, local: bool) -> None:
        self.needed = min(FAILURES_BEFORE_GIVING_UP, features)
        self.failures, self.answered = 0, False
        self.hint = " Check MISTUDIO_API_URL, where workers reach this workbench's /v1." if local else ""

    def check(self, result: FeatureResult) -> None:
        if self.answered:
            return
        if result.error_code not in ENDPOINT_FAILURES:
            self.answered = True
            return
        self.failures += 1
        if self.failures >= self.needed:
            raise ApplicationError(
                result.error_code,
                f"The first {self.failures} features all failed: {result.error_message}{self.hint}",
            )


def merged_usage(endpoints: Endpoints, spent: dict[str, int]) -> dict[str, int]:
    """Requests and tokens of both endpoints in this run (one client when they are the same), plus
    ``spent`` before it."""
    usage = dict(spent)
    for client in {id(client): client for client in (endpoints.explainer, endpoints.scorer)}.values():
        for name, value in client.usage.as_dict().items():
            usage[name] = usage.get(name, 0) + value
    return usage


# --- results -------------------------------------------------------------------------------------


def store_result(row: ExplanationJob, result: FeatureResult) -> Explanation:
    """The feature's explanation row (replaced if a retried job wrote it before)."""
    scores = {kind: score.as_dict() for kind, score in result.scores.items()}
    values = {
        "analysis_id": row.analysis_id,
        "text": safe_text(result.explanation)[:500],  # a model's words may become a label
        "explainer_model": row.explainer_model,
        "scorer_model": row.scorer_model,
        "prompt_version": PROMPT_VERSION,
        "prompt": result.prompt,
        **{
            column: result.scores[name].value if name in result.scores else None
            for name, column in Explanation.SCORE_COLUMNS.items()
        },
        "score": result.score,
        "scoring": scores,
        "error_code": result.error_code,
        "error_message": redact(result.error_message)[:2000],  # an endpoint's words, keys taken out
    }
    explanation, _ = Explanation.objects.update_or_create(job=row, index=result.index, defaults=values)
    return explanation


def job_summary(row: ExplanationJob, notes: list[str]) -> dict[str, Any]:
    columns = (*Explanation.SCORE_COLUMNS.values(), "score")
    rows = list(Explanation.objects.filter(job=row).values(*columns, "error_code"))
    failures: dict[str, int] = {}
    for entry in rows:
        if entry["error_code"]:
            failures[entry["error_code"]] = failures.get(entry["error_code"], 0) + 1
    return {
        "explained": sum(1 for entry in rows if not entry["error_code"]),
        "failures": failures,
        "scores": {name: explanation_summary([entry[name] for entry in rows]) for name in columns},
        "notes": notes,
    }


def refresh_search_index(analysis: FeatureAnalysis) -> None:
    """Embed the new explanations now, here in the worker, so that searches find them at once (a
    failure here leaves it to the rebuild a search asks for: ``features.search``)."""
    try:
        search_index_refresh(analysis)
    except Exception:
        logger.exception("the search index of %s was not refreshed", analysis.id)
