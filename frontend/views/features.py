"""Pages: an SAE's features — its analyses on the SAE's page (run one, live progress, cancel), the
feature list (filters, sorting, paging, find by label or token), one feature's dashboard
(statistics, histogram of its activations, top and interval examples as heatmaps, logit effects,
similar features, labels). "Which features fire on my text" is :mod:`frontend.views.feature_encode`.

Forms are plain HTML forms posted to these views, which validate them with the API's own
serializers and call the same services and selectors as ``/api/saes/<id>/analyses`` and
``/features`` (one path per operation), then redirect or show the error. The SAE's
page follows ``sae.<id>``, where ``analysis:*`` events arrive too, and refetches its analyses as
``/saes/<id>/?fragment=analyses`` (:func:`analyses_context`).

The feature page's "Steer with this feature" link opens the playground with the feature in its
Steering panel (``?model=<the SAE's model>&sae=<id>&feature=<n>``, :func:`steer_url`).
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST
from rest_framework.exceptions import ValidationError

from activations.models import ActivationCache, Dataset
from activations.selectors import completed_cache, dataset_choices, dataset_get
from features import selectors, services
from features.apis import FeatureDetailApi, FeatureListApi
from features.models import FeatureAnalysis
from features.search import feature_search
from frontend.access import reader_required, sae_or_404, writer_refusal
from frontend.charts import histogram_svg
from frontend.heatmap import heat_tokens, token_texts
from mistudio.access import linked_id, may_change
from mistudio.errors import ApplicationError
from mistudio.job_queue import queue_position
from saes.models import SparseAutoencoder
from saes.selectors import completed_sae

ANALYSES_SHOWN = 20
ANALYSIS_DATASETS_SHOWN = 50
PHASES = {
    0: "waiting for a worker",
    1: "pass 1 of 3: density, max, top examples",
    2: "pass 2 of 3: histograms, interval examples",
    3: "pass 3 of 3: interval contexts",
    4: "done",
}
SORTS = [
    ("index", "Index"),
    ("-density", "Densest first"),
    ("density", "Rarest first"),
    ("-max_activation", "Strongest first"),
    ("max_activation", "Weakest first"),
    ("-score", "Best explained first"),
    ("score", "Worst explained first"),
]
PAGE_SIZES = (25, 50, 100, 200)
FILTER_NAMES = [*FeatureListApi.FilterSerializer().fields]  # the API's query parameters, and only those
# The density bar's log scale: a feature firing on one token in a million draws nothing, on every
# token a full bar; densities of SAE features span these orders of magnitude.
DENSITY_DECADES = 6
HISTOGRAM_SIZE = (560, 220)
SEARCH_RESULTS = 20
EXPLANATION_JOBS_SHOWN = 5


# --- shared parts -----------------------------------------------------------------------------------


def validation_message(error: ValidationError) -> str:
    """A serializer's errors as one line, each field named (shown above the form it came from)."""
    detail = error.detail if isinstance(error.detail, dict) else {"form": error.detail}
    return " ".join(
        f"{name}: {' '.join(str(message) for message in (values if isinstance(values, list) else [values]))}"
        for name, values in detail.items()
    )


def feature_url(sae_id: str, index: int, analysis_id: str | None = None) -> str:
    """A feature's page; ``?analysis=`` only when the page was opened for a named analysis."""
    url = reverse("frontend:feature", args=[sae_id, index])
    return f"{url}?{urlencode({'analysis': analysis_id})}" if analysis_id else url


def density_bar(density: float) -> float:
    """The density as a bar's width in percent, on a log scale over ``DENSITY_DECADES`` decades."""
    if density <= 0:
        return 0.0
    return round(max(0.0, min(100.0, (math.log10(density) + DENSITY_DECADES) / DENSITY_DECADES * 100)), 1)


# --- the analyses on the SAE's page -----------------------------------------------------------------


def analyses_context(request, sae: SparseAutoencoder) -> dict[str, Any]:
    """The SAE's newest analyses as its page lists them (and ``?fragment=analyses`` re-renders)."""
    newest = selectors.analysis_list(user=request.user, sae=sae).select_related("cache", "dataset")
    analyses = list(newest[:ANALYSES_SHOWN])
    for analysis in analyses:
        analysis.active = analysis.status in FeatureAnalysis.ACTIVE
        analysis.phase_label = PHASES.get(analysis.phase, "")
        analysis.can_cancel = analysis.active and may_change(analysis, request.user)
        analysis.shown_cache_id = shown_cache_id(analysis, request.user)
        analysis.queue = queue_position(analysis, viewer=request.user)
        analysis.shown_dataset = analysis.dataset if linked_id(
            request.user, analysis, Dataset, analysis.dataset_id
        ) else None  # fmt: skip
    return {"sae": sae, "analyses": analyses, "model_analysis_tokens": f"{services.MODEL_ANALYSIS_TOKENS:,}"}


def analysis_datasets(request, sae: SparseAutoencoder) -> list[Dataset]:
    """The datasets an analysis may read through the SAE's model: the viewer's own first, newest
    first (none for an SAE without a model)."""
    if not sae.model_id:
        return []
    return dataset_choices(user=request.user, limit=ANALYSIS_DATASETS_SHOWN)


def shown_cache_id(analysis: FeatureAnalysis, viewer) -> str | None:
    """The id of the cache an analysis read, as ``viewer`` may see it (None: not theirs to see)."""
    return linked_id(viewer, analysis, ActivationCache, analysis.cache_id)


@reader_required
@require_POST
def analysis_action_page(request, sae_id: str):
    """Run a feature analysis (``action=run``, ``cache_id``: default the SAE's training cache) or
    cancel one (``action=cancel``, ``analysis``): ``analysis_request`` / ``analysis_cancel``, as
    ``POST /api/saes/<id>/analyses`` and ``…/cancel`` do; then back to the SAE's page."""
    refused = writer_refusal(request)
    if refused:
        return refused
    sae = sae_or_404(request.user, sae_id)
    action = request.POST.get("action", "")
    back = reverse("frontend:sae", args=[sae.id]) + "#features"
    try:
        if action == "run":
            sae = completed_sae(user=request.user, sae_id=sae.id)
            # ``source``: a cache's id or a dataset's (read through the model); ``cache_id`` as before.
            source = (request.POST.get("source") or request.POST.get("cache_id") or "").strip()
            reading = {"cache": None, "dataset": None}
            if source.startswith("ds_"):  # ids are prefixed by kind (mistudio.identifiers)
                reading["dataset"] = dataset_get(user=request.user, dataset_id=source)
            elif source:
                reading["cache"] = completed_cache(user=request.user, cache_id=source)
            shared = request.POST.get("shared") == "on"
            analysis = services.analysis_request(owner=request.user, sae=sae, shared=shared, **reading)
            messages.success(request, f"Feature analysis {analysis.id} queued.")
        elif action == "cancel":
            analysis = selectors.analysis_get(
                user=request.user, sae=sae, analysis_id=request.POST.get("analysis", "")
            )
            services.analysis_cancel(analysis=analysis, actor=request.user)
            messages.info(request, "Cancelling: a running analysis stops after its current chunk.")
        else:
            return render(
                request,
                "frontend/partials/cache_error.html",
                {"message": "Unknown action: run or cancel."},
                status=400,
            )
    except ApplicationError as error:
        messages.error(request, error.message)
    return redirect(back)


# --- the feature list -------------------------------------------------------------------------------


def _list_filters(request) -> tuple[dict[str, Any], dict[str, str], str]:
    """The list's query validated by the API's ``FilterSerializer``: (values, what was typed, error).
    An invalid query shows its error and the list without filters."""
    shown = {name: request.GET.get(name, "").strip() for name in FILTER_NAMES}
    shown["token"] = request.GET.get("token", "")  # a token's leading space is part of it
    given = {name: value for name, value in shown.items() if value.strip()}
    for name in ("dead", "labelled", "explained"):
        if given.get(name) == "any":
            del given[name]
    filters = FeatureListApi.FilterSerializer(data=given)
    if filters.is_valid():
        return dict(filters.validated_data), shown, ""
    defaults = FeatureListApi.FilterSerializer(data={})
    defaults.is_valid(raise_exception=True)
    kept = {"analysis": given["analysis"]} if "analysis" in given and "analysis" not in filters.errors else {}
    return {**defaults.validated_data, **kept}, shown, validation_message(ValidationError(filters.errors))


def _query(request, **changes) -> str:
    """This page's query string with ``changes`` (None removes a name)."""
    query = request.GET.copy()
    for name, value in changes.items():
        query.pop(name, None)
        if value is not None:
            query[name] = value
    query.pop("index", None)
    return f"?{query.urlencode()}" if query else "?"


def _sort_header(request, sort: str, key: str) -> dict[str, Any]:
    """A column header's link: highest first on the first click (the densest, the strongest), the
    other way round on the next; its arrow says which is shown."""
    descending = f"-{key}"
    arrow = "↓" if sort == descending else "↑" if sort == key else ""
    target = key if sort == descending else descending
    return {"url": _query(request, sort=target, page=None), "arrow": arrow, "current": bool(arrow)}


@reader_required
@require_http_methods(["GET", "HEAD"])
def feature_list_page(request, sae_id: str):
    """The features of the SAE's newest completed analysis (``?analysis=`` names another): the
    API's filters (density range, dead, labelled, ``q`` over labels, notes and automatic labels,
    ``token`` over the activating tokens of top examples), sorting and paging; ``?index=N`` goes to
    feature N. The same ``feature_page`` selector as ``GET /api/saes/<id>/features``."""
    sae = sae_or_404(request.user, sae_id)
    if request.GET.get("index", "").strip():
        return _go_to_feature(request, sae)
    values, shown, problem = _list_filters(request)
    named = values.pop("analysis", None)
    context: dict[str, Any] = {
        "sae": sae,
        "shown": shown,
        "problem": problem,
        "sorts": SORTS,
        "page_sizes": PAGE_SIZES,
        "analyses": [],
        "analysis": None,
        # Encoding a text needs the SAE's model loaded somewhere: the form says so only when it is not.
        "model_ready": bool(sae.model_id) and sae.model.status == "ready",
    }
    try:
        analysis = selectors.current_analysis(user=request.user, sae=sae, analysis_id=named)
    except ApplicationError as error:
        context["error"] = error
        status = 200 if error.code == "NO_ANALYSIS" else error.status
        return render(request, "frontend/features.html", context, status=status)
    page_number, page_size = values.pop("page"), values.pop("page_size")
    page = selectors.feature_page(
        user=request.user, sae=sae, analysis=analysis, filters=values, page=page_number, page_size=page_size
    )
    pages = max(1, math.ceil(page["total"] / page_size))
    sort = values.get("sort") or "index"
    for row in page["features"]:
        row["url"] = feature_url(sae.id, row["index"], named)
        row["density_width"] = density_bar(row["density"])
    completed = selectors.analysis_list(user=request.user, sae=sae).filter(
        status=FeatureAnalysis.Status.COMPLETED
    )
    analysis.shown_cache_id = shown_cache_id(analysis, request.user)
    meaning = request.GET.get("meaning", "").strip()
    context.update(
        {
            "analysis": analysis,
            "meaning": meaning,
            "search": meaning_search(request, sae, analysis, meaning, named) if meaning else None,
            "explanation_jobs": list(
                selectors.explanation_job_list(user=request.user, analysis=analysis)[:EXPLANATION_JOBS_SHOWN]
            ),
            "named_analysis": named,
            "analyses": list(completed.select_related("cache")[:ANALYSES_SHOWN]),
            "page": page,
            "pages": pages,
            "filtered": any(values.get(name) not in (None, "") for name in values if name != "sort"),
            "sort": sort,
            "previous_url": _query(request, page=page_number - 1) if page_number > 1 else None,
            "next_url": _query(request, page=page_number + 1) if page_number < pages else None,
            "sort_headers": {
                "index": {"url": _query(request, sort="index", page=None), "current": sort == "index"},
                **{key: _sort_header(request, sort, key) for key in ("density", "max_activation")},
            },
            "export_url": reverse("feature-export", args=[sae.id])
            + (f"?{urlencode({'analysis': named})}" if named else ""),
        }
    )
    return render(request, "frontend/features.html", context, status=400 if problem else 200)


def meaning_search(
    request, sae: SparseAutoencoder, analysis, query: str, named: str | None
) -> dict[str, Any]:
    """ "Features about X": the ``feature_search`` of ``GET /api/saes/<id>/features/search``, or its error."""
    try:
        result = feature_search(user=request.user, sae=sae, analysis=analysis, query=query, k=SEARCH_RESULTS)
    except ApplicationError as error:
        return {"error": error}
    for row in result["results"]:
        row["url"] = feature_url(sae.id, row["index"], named)
    return result


def _go_to_feature(request, sae: SparseAutoencoder):
    raw = request.GET.get("index", "").strip().lstrip("#")
    try:
        index = int(raw)
    except ValueError:
        index = -1
    if not 0 <= index < sae.d_sae:
        messages.error(request, f"No feature {raw!r}: the SAE has features 0 to {sae.d_sae - 1}.")
        return redirect(reverse("frontend:features", args=[sae.id]) + _query(request, index=None))
    return redirect(feature_url(sae.id, index, request.GET.get("analysis") or None))


# --- one feature ------------------------------------------------------------------------------------


def example_rows(
    examples: list[dict[str, Any]], tokenizer, *, scale: float, label: str
) -> list[dict[str, Any]]:
    """Each example's context as heatmap tokens (``heat_tokens``), split around the token it was
    picked for, so the list lines those up in one column (as the activation browser's top list)."""
    rows = []
    for example in examples:
        ids, center = example["token_ids"], example["center"]
        first = example["position"] - center
        tokens = heat_tokens(
            token_texts(tokenizer, ids),
            ids,
            example["values"],
            scale,
            positions=list(range(first, first + len(ids))),
            label=label,
            center=center,
        )
        rows.append(
            {
                **example,
                "raw_value": repr(float(example["value"])),
                "before": tokens[:center],
                "center_token": tokens[center],
                "after": tokens[center + 1 :],
            }
        )
    return rows


def interval_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Interval examples grouped by their interval of the feature's range, highest interval first."""
    groups: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row["interval"]), []).append(row)
    return [
        {"low": low, "high": high, "examples": groups[low, high]}
        for low, high in sorted(groups, reverse=True)
    ]


def logit_rows(entries: list[dict[str, Any]], tokenizer) -> list[dict[str, Any]]:
    texts = token_texts(tokenizer, [entry["token_id"] for entry in entries])
    return [{**entry, "text": text, "raw": raw} for entry, (text, raw) in zip(entries, texts, strict=True)]


def scorer_rows(explanation: dict[str, Any]) -> list[dict[str, Any]]:
    """Each scorer's balanced accuracy with how many of its samples got a usable answer (a model
    that answers off-format leaves a score of none)."""
    return [
        {
            "name": name,
            "value": explanation[name],
            "answered": counts["total"] - counts["failed"],
            "total": counts["total"],
        }
        for name, counts in explanation["scoring"].items()
    ]


def steer_url(sae: SparseAutoencoder, index: int) -> str:
    """The playground with this feature preset in its Steering panel, and the SAE's model chosen
    (the playground ignores a model that is not loaded)."""
    query = {"model": sae.model_id} if sae.model_id else {}
    return reverse("frontend:playground") + "?" + urlencode({**query, "sae": sae.id, "feature": index})


def feature_context(request, sae: SparseAutoencoder, index: int) -> tuple[dict[str, Any], int]:
    """The dashboard's context from ``feature_detail`` (the API's JSON), and the status to answer;
    an error (no analysis, missing files, no such feature) is shown on the page."""
    named = request.GET.get("analysis") or None
    context: dict[str, Any] = {"sae": sae, "index": index, "named_analysis": named}
    context["list_url"] = reverse("frontend:features", args=[sae.id]) + (
        f"?{urlencode({'analysis': named})}" if named else ""
    )
    context["steer_url"] = steer_url(sae, index)
    context["previous_url"] = feature_url(sae.id, index - 1, named) if 0 < index < sae.d_sae else None
    context["next_url"] = feature_url(sae.id, index + 1, named) if 0 <= index < sae.d_sae - 1 else None
    try:
        analysis = selectors.current_analysis(user=request.user, sae=sae, analysis_id=named)
        detail = selectors.feature_detail(user=request.user, sae=sae, analysis=analysis, index=index)
    except ApplicationError as error:
        context["error"] = error
        return context, error.status
    tokenizer = selectors.analysis_tokenizer(sae)
    label = f"feature {index}"
    scale = detail["max_activation"] or 1.0
    mine = next((entry for entry in detail["labels"] if entry["mine"]), None)
    logits = detail["logit_effects"]
    analysis.shown_cache_id = shown_cache_id(analysis, request.user)
    context.update(
        {
            "analysis": analysis,
            "detail": detail,
            "density_width": density_bar(detail["density"]),
            "one_in": round(1 / detail["density"]) if detail["density"] > 0 else None,
            "histogram": histogram_svg(
                detail["histogram"]["counts"],
                detail["histogram"]["edges"],
                label=f"Non-zero activations of feature {index}",
                x_label="activation value",
                size=HISTOGRAM_SIZE,
            ),
            "top_examples": example_rows(detail["top_examples"], tokenizer, scale=scale, label=label),
            "interval_groups": interval_groups(
                example_rows(detail["interval_examples"], tokenizer, scale=scale, label=label)
            ),
            "logits": None
            if logits is None
            else {
                "top": logit_rows(logits["top"], tokenizer),
                "bottom": logit_rows(logits["bottom"], tokenizer),
                "histogram": histogram_svg(
                    logits["histogram"]["counts"],
                    logits["histogram"]["edges"],
                    label=f"Logit weights of feature {index} over the vocabulary",
                    x_label="direct effect on the logit",
                    size=HISTOGRAM_SIZE,
                ),
            },
            "logit_note": (analysis.summary or {}).get("logit_note")
            or "No logit effects were computed for this analysis.",
            "similar": [
                {**entry, "url": feature_url(sae.id, entry["index"], named)} for entry in detail["similar"]
            ],
            "explanations": [
                {**entry, "scorers": scorer_rows(entry)}
                for entry in detail["explanations"]
                if not entry["error_code"]
            ],
            "failed_explanations": [entry for entry in detail["explanations"] if entry["error_code"]],
            "my_label": mine,
            "other_labels": [entry for entry in detail["labels"] if not entry["mine"]],
            "label_values": {
                "label": mine["label"] if mine else "",
                "notes": mine["notes"] if mine else "",
                "shared": mine["shared"] if mine else False,
            },
            "tokenizer_missing": tokenizer is None,
        }
    )
    return context, 200


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def feature_detail_page(request, sae_id: str, index: int):
    """One feature's dashboard (``feature_detail``, the JSON of ``GET /api/saes/<id>/features/<n>``);
    POST saves the user's own label, notes and sharing through ``feature_label_set``, as ``PATCH``
    there does. ← / → (and k / j) go to the previous / next feature (``features.js``)."""
    if request.method == "POST":
        refused = writer_refusal(request)
        if refused:
            return refused
    sae = sae_or_404(request.user, sae_id)
    if request.method == "POST":
        return label_save(request, sae, index)
    context, status = feature_context(request, sae, index)
    return render(request, "frontend/feature_detail.html", context, status=status)


def label_save(request, sae: SparseAutoencoder, index: int):
    """The label form: its label, notes and "shared" box (unticked: not sent, so not shared)."""
    if "label" not in request.POST and "notes" not in request.POST:
        return render(
            request,
            "frontend/partials/cache_error.html",
            {"message": "Nothing to save: the form sends a label and notes."},
            status=400,
        )
    values = {
        "label": request.POST.get("label", ""),
        "notes": request.POST.get("notes", ""),
        "shared": request.POST.get("shared") == "on",
    }
    try:
        data = FeatureDetailApi.LabelSerializer(data=values)
        data.is_valid(raise_exception=True)
        saved = services.feature_label_set(sae=sae, index=index, actor=request.user, **data.validated_data)
    except ValidationError as error:
        problem, status = validation_message(error), 400
    except ApplicationError as error:
        problem, status = error.message, error.status
    else:
        messages.success(request, "Label saved." if saved.pk else "Label removed.")
        return redirect(request.get_full_path())
    context, _ = feature_context(request, sae, index)
    context.update({"label_values": values, "label_error": problem})
    return render(request, "frontend/feature_detail.html", context, status=status)
