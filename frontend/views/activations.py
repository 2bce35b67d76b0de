"""Pages: activation caches and the activation browser.

The browser reads a completed cache through ``activations.store`` (memory-mapped): per hook a
histogram of values and a norm chart across hooks (server-side SVG, :mod:`frontend.charts`, from the
per-hook numbers :mod:`frontend.hook_stats` keeps), a
neuron's top-activating tokens in context, and one sample's tokens as a heatmap for that neuron.
Changing the neuron or the sample fetches just that part of the page again
(``?fragment=neuron`` / ``?fragment=sample``), rendered by the same templates as the first load;
everything the page *does* (delete) goes through the REST API.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.http import Http404
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_safe

from activations import selectors, services
from activations.models import ActivationCache, ExtractionJob
from activations.store import iter_files
from frontend.access import reader_required
from frontend.charts import hook_sort_key, norm_chart_svg, short_hook_name
from frontend.heatmap import cache_tokenizer, heat_tokens, sample_heatmap, token_texts
from frontend.hook_stats import histogram_of, summary_of
from mistudio.errors import ApplicationError

TOP_K = 20
CONTEXT_TOKENS = 8
CACHE_STATUS_CHOICES = [choice for choice, _label in ActivationCache.Status.choices]


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
    summary = summary_of(cache, hook)
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
            label=f"{hook}[{neuron}]",
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
    return sample_heatmap(
        store,
        hook=hook,
        neuron=neuron,
        sample=sample,
        tokenizer=tokenizer,
        scale=summary_of(cache, hook).heat_scale(neuron),
    )


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
    summary = summary_of(cache, hook)
    default_neuron = summary.top_by_max[0][0] if summary.top_by_max else 0
    neuron, neuron_problem = _int_param(request, "neuron", default=default_neuron, upper=summary.width)
    sample, sample_problem = _int_param(request, "sample", default=0, upper=max(1, store.num_samples or 0))
    tokenizer = cache_tokenizer(cache)

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
    norms = {name: summary_of(cache, name).mean_l2_norm for name in hooks}
    histogram = histogram_of(cache, hook)
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
