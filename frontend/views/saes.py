"""Pages: sparse autoencoders — the list with the training and import forms, and one SAE's page
(live progress and training curves, held-out metrics, hyperparameters, actions).

The forms are plain HTML forms posted to these views, which validate them with the API's own
serializers and call the same services as ``/api/saes`` (one path per operation), then redirect
(or show the errors in the form). The SAE page follows ``sae.<id>`` over ``/ws/events/`` and
fetches its changing parts again as fragments rendered by the templates of the first load:
``?fragment=training`` (status, progress, curves), ``?fragment=results`` (held-out metrics and
the facts that change when a training ends) and ``?fragment=analyses`` (its feature analyses, as
:mod:`frontend.views.features` lists them); the list fetches one row as ``?fragment=row&sae=<id>``.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST
from rest_framework.exceptions import ValidationError

from activations import selectors as activation_selectors
from activations.models import ActivationCache
from engine.sae_architectures import K_SPARSE, REGISTRY, default_expansion, default_total_tokens
from engine.sae_architectures.defaults import default_k, k_rule
from features.selectors import analysed_sae_ids
from frontend.access import reader_required, sae_or_404, writer_refusal
from frontend.charts import line_chart_svg
from frontend.views.features import analyses_context, analysis_datasets
from mistudio.access import linked_id, may_change
from mistudio.errors import ApplicationError
from models_app.selectors import model_get, model_list
from saes import selectors, services
from saes.apis import SaeImportApi, SaeListApi
from saes.models import ARCHITECTURES, SparseAutoencoder

# The training form's fields that apply to some architectures only (left out of the request otherwise).
ARCHITECTURE_FIELDS = {
    "k": K_SPARSE,
    "l1_coefficient": ("standard",),
    "l0_coefficient": ("jumprelu",),
}
# The form field an error of the training service is about, shown under it as well.
ERROR_FIELDS = {"INVALID_HOOK": "hook", "CACHE_NOT_FOUND": "cache_id", "CACHE_NOT_READY": "cache_id"}
ARCHITECTURE_LABELS = {name: architecture.label for name, architecture in REGISTRY.items()}
TRAIN_DEFAULTS = {
    "architecture": "topk",
    "expansion_factor": "",
    "k": "",
    "l1_coefficient": "5",
    "l0_coefficient": "1",
    "lr": "0.0003",
    "batch_size": "4096",
    "total_tokens": "",
    "b_dec_init": "geometric_median",
    "dead_after_steps": "",
    "name": "",
}
IMPORT_FORMATS = [
    ("auto", "Guess from the files"),
    ("saelens", "SAELens folder (cfg.json + sae_weights.safetensors)"),
    ("gemma_scope", "Gemma Scope params.npz"),
]
# The training curves: (history key, title, y axis label, log scale), two charts to a row.
CURVE_SIZE = (440, 250)
CURVES = [
    ("mse", "MSE loss (scaled units)", "mse, activations scaled to norm √d_in", True),
    ("l0", "L0", "active features per token", False),
    ("explained_variance", "Explained variance", "explained variance", False),
    ("dead", "Dead features", "dead features", False),
]


# --- page parts -------------------------------------------------------------------------------------


def _posted(request, names) -> dict[str, Any]:
    """The form's non-empty values among ``names`` (an empty input means "the default")."""
    values: dict[str, Any] = {}
    for name in names:
        value = request.POST.get(name, "").strip()
        if value:
            values[name] = value
    return values


def _field_errors(error: ValidationError) -> dict[str, str]:
    detail = error.detail if isinstance(error.detail, dict) else {"form": error.detail}
    return {
        name: " ".join(str(message) for message in (messages if isinstance(messages, list) else [messages]))
        for name, messages in detail.items()
    }


def training_caches(user) -> list[ActivationCache]:
    """Completed caches the user may read, each with ``hook_widths``: (hook, width, the default
    expansion of an SAE there) in its order."""
    caches = list(
        activation_selectors.cache_list(user=user, filters={"status": ActivationCache.Status.COMPLETED})
        .select_related("model")
        .order_by("-created_at")
    )
    for cache in caches:
        cache.training_tokens = services.training_tokens(cache)
        widths = [(hook, (cache.activation_shapes.get(hook) or [0, 0])[1]) for hook in cache.hooks]
        cache.hook_widths = [
            (hook, width, default_expansion(width, cache.training_tokens)) for hook, width in widths
        ]
        cache.default_tokens = default_total_tokens(cache.training_tokens, int(TRAIN_DEFAULTS["batch_size"]))
    return caches


def sae_row_numbers(sae: SparseAutoencoder, *, analysed: set[str]) -> SparseAutoencoder:
    """The held-out numbers a row shows, read once from ``evaluation`` (None when not measured),
    and whether it has features to browse (its id in ``analysed``: a completed analysis)."""
    evaluation = sae.evaluation or {}
    sae.held_out = {
        key: evaluation.get(key)
        for key in ("explained_variance", "l0", "dead_features", "ce_loss_recovered", "mse")
    }
    sae.active = sae.status in SparseAutoencoder.ACTIVE
    sae.has_features = sae.id in analysed
    return sae


def curves(sae: SparseAutoencoder) -> list[dict[str, Any]]:
    """The four training curves against tokens seen, as SVG, with the newest value of each."""
    history = sae.history or []
    charts = []
    window = (sae.hyperparameters or {}).get("dead_after_steps")
    for key, title, y_label, log_y in CURVES:
        points = [(point.get("tokens"), point.get(key)) for point in history]
        if key == "dead" and window:  # not the held-out count: say over what it is counted
            title = f"Dead features (none active in the last {window:,} training steps)"
        charts.append(
            {
                "key": key,
                "title": title,
                "latest": history[-1].get(key) if history else None,
                "svg": line_chart_svg(
                    points,
                    label=f"{title} vs tokens",
                    x_label="tokens",
                    y_label=y_label,
                    log_y=log_y,
                    size=CURVE_SIZE,
                ),
            }
        )
    return charts


def evaluation_rows(sae: SparseAutoencoder, viewer) -> dict[str, Any]:
    """The held-out metrics as the page shows them to ``viewer`` (the cache they were measured on
    only if they may see it); ``ce_pending`` while an evaluation is queued."""
    evaluation = {**(sae.evaluation or {})}
    if "cache_id" in evaluation:
        evaluation["cache_id"] = linked_id(viewer, sae, ActivationCache, evaluation["cache_id"])
    return {
        "measured": any(key in evaluation for key in ("mse", "explained_variance")),
        "values": evaluation,
        "ce_pending": evaluation.get("ce_loss_recovered") is None and bool(sae.evaluation_status),
        "error": evaluation.get("error"),
    }


def training_context(sae: SparseAutoencoder) -> dict[str, Any]:
    return {"sae": sae, "active": sae.status in SparseAutoencoder.ACTIVE, "curves": curves(sae)}


def list_context(request, *, train_values=None, train_errors=None, import_values=None, import_errors=None):
    caches = training_caches(request.user)
    requested = train_values.get("cache_id") if train_values else request.GET.get("cache", "")
    chosen = next((cache for cache in caches if cache.id == requested), caches[0] if caches else None)
    # ?cache= chooses the form's cache (the cache page's "Train an SAE" link); ?model= filters the list.
    filters = {"model": request.GET.get("model", "").strip()}
    analysed = analysed_sae_ids(user=request.user)
    saes = [
        sae_row_numbers(sae, analysed=analysed)
        for sae in selectors.sae_list(user=request.user, filters=filters).select_related("cache")
    ]
    compare_models = {
        sae.model_id: sae.model.name
        for sae in selectors.sae_list(user=request.user, filters=filters).filter(status="completed")
        if sae.model_id
    }
    return {
        "saes": saes,
        # SAEBench's comparison of each model's SAEs (the compare page).
        "compare_models": sorted(compare_models.items(), key=lambda item: item[1]),
        "filtered": any(filters.values()),
        "caches": caches,
        "chosen_cache": chosen,
        "requested_cache_missing": bool(requested) and (chosen is None or chosen.id != requested),
        "requested_cache": requested,
        "architectures": [(value, ARCHITECTURE_LABELS.get(value, value)) for value in ARCHITECTURES],
        "b_dec_inits": services.B_DEC_INITS,
        "train": {**TRAIN_DEFAULTS, "hook": "", **(train_values or {})},
        "train_errors": train_errors or {},
        # The form's hint, from the rule the service applies (never restated in the template).
        "k_rule": k_rule(live=False),
        "k_example": default_k(768),
        "import_values": import_values or {"format": "auto"},
        "import_errors": import_errors or {},
        "import_formats": IMPORT_FORMATS,
        "models": model_list(user=request.user).order_by("name"),
        "open_import": bool(import_errors),
        "sae_groups": selectors.group_list(user=request.user).prefetch_related("members")[:20],
    }


# --- views ------------------------------------------------------------------------------------------


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def sae_list_page(request):
    """Every SAE the user may see, newest first, with its held-out numbers (live while training);
    for writers the "Train an SAE" form (``?cache=<id>`` chooses its cache) and the import form.

    POST trains: ``sae_train_request`` with the values the API's ``TrainSerializer`` accepts, then
    a redirect to the new SAE's page; errors come back in the form (400, or the error's status).
    """
    if request.method == "POST":
        return train(request)
    if request.GET.get("fragment") == "row":
        sae = sae_or_404(request.user, request.GET.get("sae", ""))
        sae = sae_row_numbers(sae, analysed=analysed_sae_ids(user=request.user))
        return render(request, "frontend/partials/sae_row.html", {"sae": sae})
    return render(request, "frontend/saes.html", list_context(request))


def train(request):
    refused = writer_refusal(request)
    if refused:
        return refused
    names = ["cache_id", "hook", "architecture", "expansion_factor", "lr", "batch_size", "total_tokens"]
    names += ["b_dec_init", "dead_after_steps", "name", *ARCHITECTURE_FIELDS]
    shown = _posted(request, names)
    architecture = shown.get("architecture", TRAIN_DEFAULTS["architecture"])
    values = {
        name: value
        for name, value in shown.items()
        if architecture in ARCHITECTURE_FIELDS.get(name, (architecture,))
    }
    values["shared"] = request.POST.get("shared") == "on"
    try:
        data = SaeListApi.TrainSerializer(data=values)
        data.is_valid(raise_exception=True)
        validated = dict(data.validated_data)
        cache = activation_selectors.completed_cache(user=request.user, cache_id=validated.pop("cache_id"))
        sae = services.sae_train_request(owner=request.user, cache=cache, **validated)
    except ValidationError as error:
        errors, status = _field_errors(error), 400
        errors.setdefault("form", "Check the values below.")
    except ApplicationError as error:
        errors, status = {"form": error.message}, error.status
        if error.code in ERROR_FIELDS:
            errors[ERROR_FIELDS[error.code]] = error.message
    else:
        messages.success(request, f"Training of {sae.name} queued.")
        return redirect("frontend:sae", sae.id)
    shown["shared"] = values["shared"]
    context = list_context(request, train_values=shown, train_errors=errors)
    return render(request, "frontend/saes.html", context, status=status)


@reader_required
@require_POST
def sae_import_page(request):
    """The import form: ``sae_import`` (a SAELens folder or Gemma Scope ``params.npz`` under
    ``LOCAL_MODEL_ROOTS``), then the new SAE's page; errors come back in the form on the list."""
    refused = writer_refusal(request)
    if refused:
        return refused
    shown = _posted(request, ["local_path", "format", "model_id", "hook", "name"])
    values = {**shown, "shared": request.POST.get("shared") == "on"}
    try:
        data = SaeImportApi.InputSerializer(data=values)
        data.is_valid(raise_exception=True)
        validated = dict(data.validated_data)
        model_id = validated.pop("model_id", None)
        model = model_get(user=request.user, model_id=model_id) if model_id else None
        sae, created = services.sae_import(owner=request.user, model=model, **validated)
    except ValidationError as error:
        errors, status = _field_errors(error), 400
        errors.setdefault("form", "Check the values below.")
    except ApplicationError as error:
        errors, status = {"form": error.message}, error.status
    else:
        if created:
            messages.success(request, f"Import of {sae.name} queued: a worker reads its arrays.")
        else:
            messages.info(request, f"You imported these files before: {sae.name}.")
        return redirect("frontend:sae", sae.id)
    context = list_context(request, import_values={**values}, import_errors=errors)
    return render(request, "frontend/saes.html", context, status=status)


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def sae_detail_page(request, sae_id: str):
    """One SAE: status and progress, live training curves, held-out metrics, hyperparameters,
    and (for whoever may change it) cancel, evaluate and delete — POSTed here as ``action``.

    ``?fragment=training`` / ``?fragment=results`` / ``?fragment=analyses`` return just those
    parts, for ``saes.js``.
    """
    if request.method == "POST":
        refused = writer_refusal(request)
        return refused or act(request, sae_id)
    sae = sae_or_404(request.user, sae_id)
    fragment = request.GET.get("fragment")
    if fragment == "training":
        return render(request, "frontend/partials/sae_training.html", training_context(sae))
    if fragment == "results":
        return render(
            request, "frontend/partials/sae_results.html", {"sae": sae, **evaluation_rows(sae, request.user)}
        )
    if fragment == "analyses":
        return render(request, "frontend/partials/sae_analysis_list.html", analyses_context(request, sae))
    hyperparameters = sorted((sae.hyperparameters or {}).items())
    # The caches an evaluation or a feature analysis can read: the SAE's hook at its width.
    wanted = (sae.hook_name, sae.d_in)
    matching_caches = [
        cache
        for cache in training_caches(request.user)
        if any((hook, width) == wanted for hook, width, _ in cache.hook_widths)
    ]
    return render(
        request,
        "frontend/sae_detail.html",
        {
            **training_context(sae),
            **evaluation_rows(sae, request.user),
            **analyses_context(request, sae),
            "can_change": may_change(sae, request.user),
            "hyperparameters": hyperparameters,
            "architecture_label": ARCHITECTURE_LABELS.get(sae.architecture, sae.architecture),
            "export_url": reverse("sae-export", args=[sae.id]),
            "cache_visible": linked_id(request.user, sae, ActivationCache, sae.cache_id) is not None,
            "evaluation_caches": matching_caches,
            "analysis_datasets": analysis_datasets(request, sae),
        },
    )


def act(request, sae_id: str):
    """Cancel, evaluate or delete (the services the API's routes call); back to the page with a
    message saying what happened or why not."""
    action = request.POST.get("action", "")
    try:
        sae = selectors.sae_get_to_change(user=request.user, sae_id=sae_id)
    except ApplicationError as error:
        if error.status == 404:
            raise Http404(error.message) from None
        messages.error(request, error.message)
        return redirect("frontend:sae", sae_id)
    try:
        if action == "cancel":
            services.sae_cancel(sae=sae, actor=request.user)
            messages.info(request, "Cancelling: a running training stops after its current step.")
        elif action == "evaluate":
            cache_id = request.POST.get("cache_id", "").strip()
            cache = None
            if cache_id:
                cache = activation_selectors.completed_cache(user=request.user, cache_id=cache_id)
            services.sae_evaluate_request(sae=sae, actor=request.user, cache=cache)
            messages.info(request, "Evaluation queued.")
        elif action == "delete":
            services.sae_delete(sae=sae, actor=request.user)
            messages.success(request, f"Deleted {sae.name}.")
            return redirect("frontend:saes")
        else:
            return render(
                request,
                "frontend/partials/cache_error.html",
                {"message": "Unknown action: cancel, evaluate or delete."},
                status=400,
            )
    except ApplicationError as error:
        messages.error(request, error.message)
    return redirect("frontend:sae", sae.id)
