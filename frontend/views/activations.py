"""Pages: activation caches and the activation browser.

The browser reads a completed cache through ``activations.store`` (memory-mapped): per hook a
histogram of values and a norm chart across hooks (server-side SVG, :mod:`frontend.charts`), a
neuron's top-activating tokens in context, and one sample's tokens as a heatmap for that neuron.
Changing the neuron or the sample fetches just that part of the page again
(``?fragment=neuron`` / ``?fragment=sample``), rendered by the same templates as the first load;
everything the page *does* (delete) goes through the REST API.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import numpy as np
from django.http import Http404
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.views.decorators.http import require_safe

from activations import selectors, services
from activations.models import ActivationCache, ExtractionJob
from activations.store import ActivationStore, iter_files
from frontend.access import reader_required
from frontend.charts import histogram_svg, hook_sort_key, norm_chart_svg, short_hook_name
from mistudio.errors import ApplicationError

HISTOGRAM_BINS = 60
# The histogram reads at most this many values of a hook (the first tokens), so a first page load
# of a multi-gigabyte cache stays a few seconds; the caption says when it is a prefix.
HISTOGRAM_MAX_VALUES = 20_000_000
TOP_K = 20
CONTEXT_TOKENS = 8
QUICK_PICKS = 10
# Above this alpha the token's text switches colour, so it stays readable on a strong background.
STRONG_ALPHA = 0.6
MAX_ALPHA = 0.85
CACHE_STATUS_CHOICES = [choice for choice, _label in ActivationCache.Status.choices]


# --- per-hook summaries, computed once per (cache, hook) in this process -------------------------------


@dataclass(frozen=True)
class HookSummary:
    """What the page needs from ``store.stats(hook)``: its width, norm and per-neuron extremes."""

    width: int
    count: int
    mean_l2_norm: float
    neuron_max: np.ndarray
    neuron_min: np.ndarray
    top_by_max: list[tuple[int, float]]

    def heat_scale(self, neuron: int) -> float:
        """The neuron's largest |value| in the cache: what a full-strength token colour means."""
        largest = max(abs(float(self.neuron_max[neuron])), abs(float(self.neuron_min[neuron])))
        return largest if math.isfinite(largest) and largest > 0 else 1.0


@dataclass(frozen=True)
class HookHistogram:
    linear_svg: str
    log_svg: str
    count: int
    nonfinite: int
    low: float | None
    high: float | None
    tokens_read: int


# A cache's files never change once it is completed, but a failed cache can be rewritten under the
# same id; the completion time in the key keeps a rewritten cache from reusing old results.
@functools.lru_cache(maxsize=256)
def hook_summary(directory: str, completed: str, hook: str) -> HookSummary:

    store = ActivationStore.open(directory)
    stats = store.stats(hook)
    maxima = np.asarray(stats["max"], dtype=np.float32)
    ranked = np.where(np.isnan(maxima), -np.inf, maxima)
    order = np.argsort(-ranked, kind="stable")[:QUICK_PICKS]
    return HookSummary(
        width=store.shape(hook)[1],
        count=int(stats["count"]),
        mean_l2_norm=float(stats["mean_l2_norm"]),
        neuron_max=maxima,
        neuron_min=np.asarray(stats["min"], dtype=np.float32),
        top_by_max=[(int(index), float(maxima[index])) for index in order if np.isfinite(ranked[index])],
    )


@functools.lru_cache(maxsize=64)
def hook_histogram(directory: str, completed: str, hook: str) -> HookHistogram:

    store = ActivationStore.open(directory)
    max_tokens = max(1, HISTOGRAM_MAX_VALUES // store.shape(hook)[1])
    result = store.histogram(hook, bins=HISTOGRAM_BINS, max_tokens=max_tokens)
    counts, edges = result["counts"].tolist(), result["edges"].tolist()
    label = f"Histogram of the values of {hook}"
    return HookHistogram(
        linear_svg=histogram_svg(counts, edges, label=label),
        log_svg=histogram_svg(counts, edges, label=f"{label} (log scale)", log_scale=True),
        count=result["count"],
        nonfinite=result["nonfinite"],
        low=result["min"],
        high=result["max"],
        tokens_read=min(store.num_tokens, max_tokens),
    )


def _summary(cache: ActivationCache, hook: str) -> HookSummary:
    return hook_summary(str(cache.directory), _completed_stamp(cache), hook)


def _completed_stamp(cache: ActivationCache) -> str:
    return cache.completed_at.isoformat() if cache.completed_at else ""


# --- tokens as people read them ---------------------------------------------------------------------


def _tokenizer(cache: ActivationCache):
    folder = selectors.model_folder(cache.model)
    if folder is None or not Path(folder).is_dir():
        return None
    try:
        return selectors.tokenizer_for(str(folder))
    except (OSError, ValueError):  # no tokenizer files there: show ids instead
        return None


def readable_token(tokenizer, raw: str) -> str:
    """One token as text: byte-level BPE marks decoded (``Ġ`` → space, ``Ċ`` → newline) and
    SentencePiece's ``▁`` as a space; then newlines and tabs drawn as ``↵`` and ``⇥``."""
    if raw in tokenizer.all_special_tokens:
        text = raw
    elif "▁" in raw:
        text = raw.replace("▁", " ")
    else:
        text = tokenizer.convert_tokens_to_string([raw])
    text = text.replace("\r\n", "↵").replace("\n", "↵").replace("\r", "↵").replace("\t", "⇥")
    return text or "∅"


def token_texts(tokenizer, token_ids: list[int]) -> list[tuple[str, str]]:
    """(shown text, raw token) per id; ``#id`` for both when the tokenizer is not on this machine."""
    if tokenizer is None:
        return [(f"#{token_id}", f"#{token_id}") for token_id in token_ids]
    raws = tokenizer.convert_ids_to_tokens(token_ids)
    return [(readable_token(tokenizer, str(raw)), str(raw)) for raw in raws]


def heat_tokens(
    texts: list[tuple[str, str]],
    token_ids: list[int],
    values: list[float],
    scale: float,
    *,
    positions: list[int],
    center: int | None = None,
    generated: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Per token what its span shows: text, sign class, alpha = |value| / scale, and its tooltip."""
    tokens = []
    for index, ((text, raw), token_id, value, position) in enumerate(
        zip(texts, token_ids, values, positions, strict=True)
    ):
        finite = math.isfinite(value)
        alpha = min(MAX_ALPHA, abs(value) / scale * MAX_ALPHA) if finite else 0.0
        classes = ["tok", "pos" if finite and value >= 0 else "neg"]
        if alpha >= STRONG_ALPHA:
            classes.append("strong")
        if index == center:
            classes.append("center")
        if generated and generated[index]:
            classes.append("generated")
        # Built here, not in a template, so nothing (not even a newline) comes between two tokens.
        html = format_html(
            '<span class="{}" data-alpha="{}" title="{}" data-value="{}">{}</span>',
            " ".join(classes),
            f"{alpha:.3f}",
            f"{value:+.4f} · {raw!r} (id {token_id}) · position {position}",
            repr(float(value)),
            text,
        )
        tokens.append({"text": text, "value": value, "html": html})
    return tokens


# --- page parts -------------------------------------------------------------------------------------


def _cache_or_404(user, cache_id: str) -> ActivationCache:
    try:
        return selectors.cache_get(user=user, cache_id=cache_id)
    except ApplicationError as error:
        raise Http404(error.message) from None


def _int_param(request, name: str, *, default: int, upper: int) -> tuple[int, str | None]:
    """A query parameter in ``[0, upper)``: the value and no error, or the default and what was wrong."""
    raw = request.GET.get(name, "").strip()
    if raw == "":
        return default, None
    try:
        value = int(raw)
    except ValueError:
        return default, f"{name.capitalize()} must be a whole number, not {raw!r}."
    if not 0 <= value < upper:
        return default, f"{name.capitalize()} {value} is out of range: 0 to {upper - 1}."
    return value, None


def neuron_context(cache: ActivationCache, store, hook: str, neuron: int, tokenizer) -> dict[str, Any]:
    """The neuron panel: its top-k tokens with their contexts coloured by this neuron."""
    summary = _summary(cache, hook)
    scale = summary.heat_scale(neuron)
    rows = selectors.cache_neuron_top_contexts(
        store, hook=hook, neuron=neuron, k=TOP_K, context=CONTEXT_TOKENS
    )
    top = []
    for row in rows:
        texts = token_texts(tokenizer, row["context_token_ids"])
        tokens = heat_tokens(
            texts,
            row["context_token_ids"],
            row["context_values"],
            scale,
            positions=row["context_positions"],
            center=row["center"],
        )
        top.append(
            {
                "value": row["value"],
                "raw_value": repr(float(row["value"])),
                "sample_index": row["sample_index"],
                "position": row["position"],
                "token": texts[row["center"]][0],
                # Split around the top token, so the list lines the top tokens up in one column.
                "before": tokens[: row["center"]],
                "center": tokens[row["center"]],
                "after": tokens[row["center"] + 1 :],
            }
        )
    return {
        "neuron": neuron,
        "top": top,
        "scale": scale,
        "neuron_max": float(summary.neuron_max[neuron]),
        "neuron_min": float(summary.neuron_min[neuron]),
    }


def sample_context(cache: ActivationCache, store, hook: str, neuron: int, sample: int, tokenizer) -> dict:
    """The sample panel: one sample's tokens coloured by the neuron's value at each."""
    view = selectors.cache_sample_neuron(store, hook=hook, sample_index=sample, neuron=neuron)
    scale = _summary(cache, hook).heat_scale(neuron)
    values = view["values"]
    finite = [value for value in values if math.isfinite(value)]
    return {
        "sample": sample,
        "neuron": neuron,
        "tokens": heat_tokens(
            token_texts(tokenizer, view["token_ids"]),
            view["token_ids"],
            values,
            scale,
            positions=view["positions"],
            generated=view["generated"],
        ),
        "has_generated": view["generated"] is not None,
        "generated_count": sum(view["generated"] or []),
        "sample_max": max(finite) if finite else None,
        "sample_min": min(finite) if finite else None,
        "scale": scale,
    }


def python_snippet(cache: ActivationCache, hook: str) -> str:
    """How to read this cache outside miStudio: plain safetensors + numpy, or the store."""
    if cache.dtype == "bfloat16":
        loader = "from safetensors.torch import load_file  # numpy has no bfloat16"
        convert = '["activations"].float().numpy()'
    else:
        loader = "from safetensors.numpy import load_file"
        convert = '["activations"]'
    return f"""# tar -xf {cache.id}.tar   (the download below)
import json
from pathlib import Path

import numpy as np
{loader}

root = Path("{cache.id}")
manifest = json.loads((root / "manifest.json").read_text())
hook = next(h for h in manifest["hooks"] if h["name"] == "{hook}")
activations = np.concatenate([
    load_file(root / hook["directory"] / f"{{shard['index']:05d}}.safetensors"){convert}
    for shard in manifest["shards"]
])  # [tokens, width], no padding rows
tokens = load_file(root / "tokens.safetensors")  # token_ids, sample_index, position per row

# Or memory-mapped, with miStudio's reader (per sample, stats, top-k):
from activations.store import ActivationStore

store = ActivationStore.open(root)
first_sample = store.sample("{hook}", 0)
"""


def _files(cache: ActivationCache, *, manifest_size: int) -> list[dict[str, Any]]:
    """The cache's files, with the size each download has (the manifest is the user's own)."""

    download = reverse("cache-download", args=[cache.id])
    files = []
    for path in iter_files(cache.directory):
        relative = str(path.relative_to(cache.directory))
        files.append(
            {
                "name": relative,
                "size": manifest_size if relative == selectors.MANIFEST_FILE else path.stat().st_size,
                "url": f"{download}?{urlencode({'file': relative})}",
            }
        )
    return files


def _provenance(cache: ActivationCache, manifest: dict | None) -> dict[str, Any]:
    provenance = (manifest or {}).get("provenance", {})
    return {
        "dataset_name": provenance.get("dataset_name"),
        "generation_id": provenance.get("generation_id"),
        "prompt_tokens": provenance.get("prompt_tokens"),
        "generated_tokens": provenance.get("generated_tokens"),
        "batch_size": provenance.get("batch_size"),
        "quantization": provenance.get("quantization") or cache.model.quantization,
    }


# --- views ------------------------------------------------------------------------------------------


@reader_required
@require_safe
def cache_list_page(request):
    """Every activation cache the user may read, newest first, filterable by model and status."""
    filters = {}
    for name, allowed in (("model", None), ("status", CACHE_STATUS_CHOICES)):
        value = request.GET.get(name, "").strip()
        if value and (allowed is None or value in allowed):
            filters[name] = value
    caches = list(selectors.cache_list(user=request.user, filters=filters).select_related("model"))
    now = timezone.now()
    for cache in caches:
        hooks = sorted(cache.hooks, key=hook_sort_key)
        cache.hook_summary = ", ".join(short_hook_name(hook) for hook in hooks[:4]) + (
            f", +{len(hooks) - 4}" if len(hooks) > 4 else ""
        )
        cache.read_recently = (now - cache.last_accessed_at).total_seconds() < 60
    everything = selectors.cache_list(user=request.user)
    models = sorted(
        {(cache.model_id, cache.model.name) for cache in everything.select_related("model")},
        key=lambda pair: pair[1].lower(),
    )
    return render(
        request,
        "frontend/caches.html",
        {
            "caches": caches,
            "filters": filters,
            "filtered": bool(filters),
            "total": everything.count(),
            "model_choices": models,
            "status_choices": CACHE_STATUS_CHOICES,
        },
    )


@reader_required
@require_safe
def cache_browser_page(request, cache_id: str):
    """One cache: provenance and downloads; for a completed cache, per hook a value histogram, the
    norm across hooks, a neuron's top tokens in context and a per-sample heatmap.

    ``?hook=``, ``?neuron=`` and ``?sample=`` choose what is shown (links can be shared);
    ``?fragment=neuron`` or ``?fragment=sample`` returns just that panel, for ``activations.js``.
    """
    cache = _cache_or_404(request.user, cache_id)
    fragment = request.GET.get("fragment")
    manifest = selectors.cache_manifest(cache, user=request.user) if cache.directory.exists() else None
    context: dict[str, Any] = {
        "cache": cache,
        "provenance": _provenance(cache, manifest),
        "completed": cache.status == ActivationCache.Status.COMPLETED,
        "download_url": reverse("cache-download", args=[cache.id]),
    }
    if cache.status == ActivationCache.Status.WRITING:
        # The job writing it, whose progress the page follows live (and reloads when it ends).
        context["active_job"] = (
            selectors.extraction_list(user=request.user)
            .filter(cache=cache, status__in=ExtractionJob.ACTIVE)
            .first()
        )
    store = None
    if context["completed"]:
        try:
            store = selectors.open_store(cache)
        except ApplicationError as error:
            context["cache_error"] = error.message
    if store is None:
        if fragment:
            raise Http404("The cache cannot be read.")
        return render(request, "frontend/cache_browser.html", context)

    services.cache_touch(cache)
    hooks = sorted(store.hooks, key=hook_sort_key)
    hook = request.GET.get("hook") or hooks[0]
    problems = []
    if hook not in store.hooks:
        problems.append(f"The cache has no hook {hook!r}; showing {hooks[0]}.")
        hook = hooks[0]
    summary = _summary(cache, hook)
    default_neuron = summary.top_by_max[0][0] if summary.top_by_max else 0
    neuron, neuron_problem = _int_param(request, "neuron", default=default_neuron, upper=summary.width)
    sample, sample_problem = _int_param(request, "sample", default=0, upper=max(1, store.num_samples or 0))
    tokenizer = _tokenizer(cache)

    if fragment in ("neuron", "sample"):
        problem = neuron_problem or (sample_problem if fragment == "sample" else None)
        if problem:
            return render(request, "frontend/partials/cache_error.html", {"message": problem}, status=400)
        if fragment == "neuron":
            part = neuron_context(cache, store, hook, neuron, tokenizer)
            template = "frontend/partials/cache_neuron.html"
        else:
            part = sample_context(cache, store, hook, neuron, sample, tokenizer)
            template = "frontend/partials/cache_sample.html"
        return render(request, template, {"cache": cache, "hook": hook, **part})

    problems += [problem for problem in (neuron_problem, sample_problem) if problem]
    page_url = reverse("frontend:cache", args=[cache.id])
    norms = {name: _summary(cache, name).mean_l2_norm for name in hooks}
    histogram = hook_histogram(str(cache.directory), _completed_stamp(cache), hook)
    context.update(
        {
            "hooks": [
                {
                    "name": name,
                    "short": short_hook_name(name, limit=24),
                    "width": store.shape(name)[1],
                    "url": f"{page_url}?{urlencode({'hook': name})}",
                }
                for name in hooks
            ],
            "hook": hook,
            "summary": summary,
            "problems": problems,
            "histogram": histogram,
            "histogram_truncated": histogram.tokens_read < store.num_tokens,
            "norm_chart": norm_chart_svg(
                norms, current=hook, href_for=lambda name: f"{page_url}?{urlencode({'hook': name})}"
            ),
            "norms": [(name, norms[name]) for name in hooks],
            "quick_picks": summary.top_by_max,
            "num_samples": store.num_samples or 0,
            "tokenizer_missing": tokenizer is None,
            "neuron_part": neuron_context(cache, store, hook, neuron, tokenizer),
            "sample_part": sample_context(cache, store, hook, neuron, sample, tokenizer),
            "snippet": python_snippet(cache, hook),
            "top_k": TOP_K,
            "context_tokens": CONTEXT_TOKENS,
            "files": _files(
                cache, manifest_size=len(selectors.cache_manifest_bytes(cache, user=request.user))
            ),
            "shape": store.shape(hook),
        }
    )
    return render(request, "frontend/cache_browser.html", context)
