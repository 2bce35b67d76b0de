"""Pages: the models grid and one model's detail (configuration, memory, hook points, extraction,
its caches, extractions and SAEs).

The pages only read (through the selectors); every action — register, load, unload, cancel,
delete, extract — goes through the REST API from ``models.js`` / ``model_detail.js``.
"""

import json
import logging
from typing import Any

from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_safe

from activations import selectors as activation_selectors
from activations.services import STORAGE_DTYPES, storage_dtype_for
from activations.services.extractions import DTYPE_BYTES, default_extraction_hook, default_max_length
from activations.store import cache_bytes_per_token
from frontend.access import reader_required
from mistudio.errors import ApplicationError
from mistudio.job_queue import running_jobs
from mistudio.jobs import JobRow
from models_app import selectors
from models_app.models import LanguageModel
from saes.selectors import sae_list

logger = logging.getLogger(__name__)

QUANTIZATION_LABELS = {
    "none": "None (float32)",
    "fp16": "fp16 (half precision)",
    "bf16": "bf16 (bfloat16)",
    "int8": "int8 (bitsandbytes)",
    "int4": "int4 (bitsandbytes nf4)",
}
DTYPE_LABELS = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
RECENT_EXTRACTIONS = 20
RECENT_SAES = 10

# Configuration keys researchers look for first, under the names the families use for them. The row's
# own columns (filled in by inspection, the same for every family) come first where there is one.
CONFIG_SUMMARY: list[tuple[str, str | None, tuple[str, ...]]] = [
    ("Hidden size", "hidden_size", ("hidden_size", "n_embd", "d_model")),
    ("Layers", "num_layers", ("num_hidden_layers", "n_layer", "num_layers")),
    ("Attention heads", None, ("num_attention_heads", "n_head", "num_heads")),
    ("Key / value heads", None, ("num_key_value_heads",)),
    ("Head size", None, ("head_dim",)),
    ("MLP size", None, ("intermediate_size", "n_inner", "ffn_dim", "d_ff")),
    ("Vocabulary", "vocab_size", ("vocab_size",)),
    ("Context length", "context_length", ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")),
    ("Activation", None, ("hidden_act", "activation_function")),
    ("Norm epsilon", None, ("layer_norm_epsilon", "rms_norm_eps", "layer_norm_eps")),
    ("Rotary base", None, ("rope_theta",)),
    ("Tied embeddings", None, ("tie_word_embeddings",)),
    ("Weights dtype", None, ("torch_dtype", "dtype")),
]


def shown_value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def config_summary(model: LanguageModel) -> list[dict[str, str]]:
    """The important configuration values as (label, value, config key) rows; absent ones left out."""
    config = model.config or {}
    rows = [
        {"label": "Architecture", "value": model.architecture or "—", "key": "architectures"},
        {"label": "Family", "value": model.model_type or "—", "key": "model_type"},
    ]
    for label, column, keys in CONFIG_SUMMARY:
        key = next((key for key in keys if config.get(key) is not None), None)
        value = getattr(model, column) if column else None
        if value is None and key is not None:
            value = config[key]
        if value is not None:
            rows.append({"label": label, "value": shown_value(value), "key": key or column or ""})
    return rows


def hook_groups(model: LanguageModel) -> tuple[list[dict[str, Any]], str]:
    """The model's hook points grouped as the picker shows them (embedding, each layer, final), and an
    error message when its structure cannot be built (the page stays usable without them)."""
    try:
        points = activation_selectors.hook_points(model)["hook_points"]
    except ApplicationError as error:
        return [], error.message
    except Exception:  # an unusual config must not take the whole page down
        logger.exception("hook points of %s", model.id)
        return [], "The hook points of this model could not be listed."
    groups: dict[str, dict[str, Any]] = {}
    for point in points:
        layer = point["layer"]
        if layer is not None:
            key, label = f"layer-{layer}", f"Layer {layer}"
        elif point["name"].startswith("hook_embed"):
            key, label = "embed", "Embedding"
        else:
            key, label = "final", "Final"
        group = groups.setdefault(key, {"key": key, "label": label, "layer": layer, "points": []})
        short = point["name"].removeprefix(f"blocks.{layer}.") if layer is not None else point["name"]
        group["points"].append({"name": point["name"], "short": short, "width": point["shape"][-1]})
    order = ["embed", *[key for key in groups if key.startswith("layer-")], "final"]
    return [groups[key] for key in order if key in groups], ""


def memory_rows(model: LanguageModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per quantization option: its estimate, its share of the largest, and which live workers have room."""
    try:
        report = selectors.model_memory_report(model)
    except Exception:  # Redis down: the estimates are still worth showing, without the fit
        logger.warning("memory report of %s without workers", model.id, exc_info=True)
        report = {
            "estimates": {key: {"bytes": size} for key, size in model.memory_estimates.items()},
            "workers": [],
        }
    largest = max((entry["bytes"] for entry in report["estimates"].values()), default=0) or 1
    rows = []
    for option, entry in report["estimates"].items():
        fitting = [worker["name"] for worker in report["workers"] if worker["fits"].get(option)]
        rows.append(
            {
                "option": option,
                "label": QUANTIZATION_LABELS.get(option, option),
                "bytes": entry["bytes"],
                "percent": round(100 * entry["bytes"] / largest, 1),
                "current": option == model.quantization,
                "fitting": fitting,
            }
        )
    return rows, report["workers"]


@reader_required
@require_safe
def model_list_page(request):
    """Every model as a card, with filters (status, family, search) that ``models.js`` applies
    instantly; ``?status=&family=&q=`` pre-set them. Live updates over the ``models`` group."""
    models = list(selectors.model_list(user=request.user))
    for model in models:
        model.memory_estimate = model.memory_estimates.get(model.quantization)
        model.estimates_json = json.dumps(model.memory_estimates)
        model.search_text = " ".join(
            [model.name, model.display_identifier, model.id, model.model_type]
        ).lower()
    filters = {
        "status": request.GET.get("status", ""),
        "family": request.GET.get("family", ""),
        "q": request.GET.get("q", "").strip(),
    }
    waits = None  # what a queued load waits for: the jobs the workers run now (they yield to it)
    for model in models:
        if model.status == LanguageModel.Status.LOADING and model.progress == 0:
            waits = waits or running_jobs(viewer=request.user)
            model.queue = waits
        model.filtered_out = bool(
            (filters["status"] and model.status != filters["status"])
            or (filters["family"] and model.model_type != filters["family"])
            or (filters["q"] and filters["q"].lower() not in model.search_text)
        )
    return render(
        request,
        "frontend/models.html",
        {
            "models": models,
            "shown_count": sum(not model.filtered_out for model in models),
            "filters": filters,
            "statuses": LanguageModel.Status.values,
            "families": sorted({model.model_type for model in models if model.model_type}),
            "quantizations": [
                (value, QUANTIZATION_LABELS.get(value, value)) for value in LanguageModel.Quantization.values
            ],
        },
    )


@reader_required
@require_safe
def model_detail_page(request, model_id: str):
    """One model: status and actions (live over ``model.<id>``), configuration, memory estimate per
    quantization, hook points, its caches and extractions, and the extraction form.

    ``model_detail.js`` asks for one new row of the caches or jobs table as
    ``?fragment=cache-row&cache=<id>`` or ``?fragment=job-row&job=<id>`` (see :func:`table_row`).
    """
    try:
        model = selectors.model_get(user=request.user, model_id=model_id)
    except ApplicationError as error:
        raise Http404(error.message) from None
    if request.GET.get("fragment") in ("cache-row", "job-row"):
        return table_row(request, model)
    groups, hooks_error = hook_groups(model)
    estimates, workers = memory_rows(model)
    extractions = list(
        activation_selectors.extraction_list(user=request.user)
        .filter(model=model)
        .select_related("dataset", "cache")[:RECENT_EXTRACTIONS]
    )
    active = next((job for job in extractions if job.status in JobRow.ACTIVE), None)
    context_length = model.context_length or default_max_length(model)
    saes = sae_list(user=request.user, filters={"model": model.id})
    return render(
        request,
        "frontend/model_detail.html",
        {
            "model": model,
            "memory_estimate": model.memory_estimates.get(model.quantization),
            "estimates_json": json.dumps(model.memory_estimates),
            "numbers": {
                column: "—" if getattr(model, column) is None else shown_value(getattr(model, column))
                for column in ("hidden_size", "vocab_size", "context_length", "num_layers")
            },
            "config_rows": config_summary(model),
            "config_json": json.dumps(model.config, indent=2, sort_keys=True),
            "hook_groups": groups,
            "default_hook": default_extraction_hook(model),
            "hook_count": sum(len(group["points"]) for group in groups),
            "hooks_error": hooks_error,
            "memory_rows": estimates,
            "workers": workers,
            "caches": activation_selectors.cache_list(user=request.user, filters={"model": model.id}),
            "extractions": extractions,
            "active_extraction": active,
            "saes": saes[:RECENT_SAES],
            "sae_count": saes.count(),
            "datasets": activation_selectors.dataset_choices(user=request.user),
            "dtypes": storage_dtype_choices(model),
            # The int64 token columns a cache keeps per token besides the rows (the size estimate's).
            "token_table_bytes": cache_bytes_per_token([], "float32"),
            "default_max_length": default_max_length(model),
            "context_length": context_length,
        },
    )


def storage_dtype_choices(model: LanguageModel) -> list[dict]:
    """The extraction form's dtypes: the model's own first and chosen, with its bytes per value."""
    own = storage_dtype_for(model)
    choices = [
        {
            "value": value,
            "label": DTYPE_LABELS[value] + (" (the model's dtype)" if value == own else ""),
            "bytes": DTYPE_BYTES[value],
            "selected": value == own,
        }
        for value in STORAGE_DTYPES
    ]
    return sorted(choices, key=lambda choice: not choice["selected"])


def table_row(request, model: LanguageModel):
    """One row of the model page's caches or jobs table, by the templates that render the page's rows."""
    if request.GET["fragment"] == "cache-row":
        cache = (
            activation_selectors.cache_list(user=request.user, filters={"model": model.id})
            .filter(pk=request.GET.get("cache", ""))
            .first()
        )
        if cache is None:
            raise Http404("No such cache of this model.")
        return render(request, "frontend/partials/model_cache_row.html", {"cache": cache})
    job = (
        activation_selectors.extraction_list(user=request.user)
        .filter(model=model, pk=request.GET.get("job", ""))
        .select_related("dataset", "cache")
        .first()
    )
    if job is None:
        raise Http404("No such extraction of this model.")
    return render(request, "frontend/partials/extraction_row.html", {"job": job})
