"""Page: SAEs side by side, judged as SAEBench judges them (``/saes/compare/``).

Which SAEs: ``?group=`` (a group's members), ``?run=`` (a SAEBench run's SAEs, with its live
progress), ``?saes=`` (ids, comma-separated or repeated) or ``?model=`` (a model's completed SAEs,
with boxes to choose some). The page shows a table of every method's newest numbers for each SAE,
sorted by any column (``?sort=`` a column key, ``?order=asc|desc``: links in the header, no script
needed), frontier plots (L0 against each higher-is-better metric), each SAE's SAEBench JSON, and for
writers the form that judges them (POST: the service ``POST /api/saebench`` calls; a run's page is
this one with ``?run=``). ``?fragment=live`` renders the changing part alone while a run is going.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods
from rest_framework.exceptions import ValidationError

from activations import selectors as activation_selectors
from engine.saebench.methods import METHODS
from engine.saebench.results import CoreConfig
from evaluations import selectors
from evaluations.apis import bench_from_body, compared
from evaluations.models import BenchRun
from evaluations.serializers import bench_state
from evaluations.services import (
    PROBING_DEFAULTS,
    absorption_plan_of,
    absorption_settings,
    bench_cancel,
    check_absorbable,
    check_saes,
    default_text_dataset,
)
from frontend.access import reader_required, writer_refusal
from frontend.charts import scatter_chart_svg
from frontend.views.features import validation_message
from frontend.views.job_pages import cancel_form
from mistudio import roles
from mistudio.access import may_change
from mistudio.errors import ApplicationError
from saes.models import SparseAutoencoder
from saes.selectors import group_get, sae_list

CHART_SIZE = (420, 270)
L0 = "core.l0"


def chosen_ids(request) -> list[str]:
    values = request.GET.getlist("saes")
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def selection(request) -> dict[str, Any]:
    """What the page compares, from its query: the API's query fields, and how to say it."""
    query = request.GET
    if query.get("run"):
        return {"run_id": query["run"]}
    if query.get("group"):
        return {"sae_group_id": query["group"]}
    if chosen_ids(request):
        return {"sae_ids": ",".join(chosen_ids(request))}
    if query.get("model"):
        saes = sae_list(user=request.user, filters={"model": query["model"], "status": "completed"})
        ids = [sae.id for sae in saes.filter(n_layers__isnull=True).order_by("created_at")[:64]]
        return {"sae_ids": ",".join(ids)} if ids else {}
    return {}


def frontier_charts(rows: list[dict[str, Any]], columns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """L0 against every higher-is-better column some SAE has a value for; the line joins the
    frontier (the most of the metric for the least L0)."""
    charts = []
    for column in columns:
        if not column["higher_is_better"] or column["key"] == L0:
            continue
        points = [(row["values"].get(L0), row["values"].get(column["key"]), row["name"] or row["sae_id"])
                  for row in rows]  # fmt: skip
        if sum(1 for x, y, _ in points if x is not None and y is not None) == 0:
            continue
        charts.append(
            {
                "key": column["key"],
                "title": f"L0 vs {column['label']}",
                "svg": scatter_chart_svg(
                    points,
                    label=f"{column['label']} against L0, one dot per SAE",
                    x_label="L0",
                    y_label=column["label"].lower(),
                    size=CHART_SIZE,
                ),
            }
        )
    return charts


def sort_link(request, key: str, *, higher_is_better: bool | None, current: str, descending: bool) -> str:
    """A column header's link: sorted by it, best first (a second click flips the order)."""
    best_first = "desc" if higher_is_better in (True, None) else "asc"
    query = request.GET.copy()
    query["sort"] = key
    query["order"] = ("asc" if descending else "desc") if key == current else best_first
    query.pop("fragment", None)
    return f"?{query.urlencode()}"


def compare_context(request) -> dict[str, Any]:
    chosen = selection(request)
    context: dict[str, Any] = {"chosen": chosen, "error": None, "rows": [], "columns": [], "charts": []}
    run = None
    if chosen.get("run_id"):
        run = selectors.bench_run_get(user=request.user, run_id=chosen["run_id"])
        context.update(
            run=run,
            run_state=bench_state(run, viewer=request.user),
            active=run.status in BenchRun.ACTIVE,
            can_change=may_change(run, request.user),
        )
    if chosen:
        table = compared(request.user, chosen)
        sort = request.GET.get("sort") or L0
        descending = request.GET.get("order", "desc") != "asc"
        rows = selectors.sorted_rows(table["rows"], sort, descending=descending)
        present = {key for row in rows for key, value in row["values"].items() if value is not None}
        columns = [
            {**column, "link": sort_link(request, column["key"], higher_is_better=column["higher_is_better"],
                                         current=sort, descending=descending)}
            for column in table["columns"]
            if column["key"] in present or column["method"] == "core"
        ]  # fmt: skip
        for row in rows:
            row["cells"] = [
                {"key": column["key"], "value": row["values"].get(column["key"])} for column in columns
            ]
        context.update(
            rows=rows,
            columns=columns,
            methods=[
                {"label": METHODS[name].label, "span": sum(1 for c in columns if c["method"] == name)}
                for name in METHODS
                if any(column["method"] == name for column in columns)
            ],
            charts=frontier_charts(rows, columns),
            sort=sort,
            descending=descending,
            name_link=sort_link(request, "name", higher_is_better=False, current=sort, descending=descending),
        )
    return context


def form_context(request, context: dict[str, Any], values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The form's choices and defaults (the service's own: CoreConfig, PROBING_DEFAULTS)."""
    datasets = activation_selectors.dataset_choices(user=request.user)
    saes = [row["sae_id"] for row in context["rows"]]
    group = None
    if context["chosen"].get("sae_group_id"):
        group = group_get(user=request.user, group_id=context["chosen"]["sae_group_id"])
    rows = list(sae_list(user=request.user).filter(pk__in=saes)) if saes else []
    default_dataset = default_text_dataset(saes=rows, group=group, user=request.user) if rows else None
    core = CoreConfig()
    shown = {
        "dataset_id": default_dataset.id if default_dataset else "",
        "core": True,
        "batch_size_prompts": core.batch_size_prompts,
        "context_size": core.context_size,
        "n_eval_reconstruction_batches": core.n_eval_reconstruction_batches,
        "k_values": ", ".join(str(k) for k in PROBING_DEFAULTS["k_values"]),
        **(values or {}),
    }
    return {
        "absorption": absorption_estimate(rows),
        "text_datasets": [dataset for dataset in datasets if not dataset.label_field],
        "labelled_datasets": [dataset for dataset in datasets if dataset.label_field],
        "form": shown,
        "can_write": request.user.has_perm(roles.WRITE),
        "completed_count": sum(1 for sae in rows if sae.status == SparseAutoencoder.Status.COMPLETED),
        "runs": [
            bench_state(run, viewer=request.user) for run in selectors.bench_run_list(user=request.user)[:20]
        ],
    }


def absorption_estimate(rows: list[SparseAutoencoder]) -> dict[str, Any]:
    """Absorption's plan for the completed SAEs shown (its words and time, by SAEBench's defaults),
    or why it cannot run on them."""
    saes = [sae for sae in rows if sae.status == SparseAutoencoder.Status.COMPLETED]
    if not saes:
        return {"reason": "no completed SAEs"}
    try:
        model = check_saes(saes)
        check_absorbable(saes)
        return {"plan": absorption_plan_of(model, saes, absorption_settings(None))}
    except ApplicationError as error:
        return {"reason": error.message}


def posted_body(request, context: dict[str, Any]) -> dict[str, Any]:
    post = request.POST
    methods = [name for name in METHODS if post.get(f"method_{name}") == "on"]
    body: dict[str, Any] = {
        "methods": methods,
        "name": post.get("name", ""),
        "shared": post.get("shared") == "on",
    }
    if context["chosen"].get("sae_group_id"):
        body["sae_group_id"] = context["chosen"]["sae_group_id"]
    else:
        body["sae_ids"] = [row["sae_id"] for row in context["rows"]]
    if post.get("dataset_id"):
        body["dataset_id"] = post["dataset_id"]
    if "sparse_probing" in methods and post.get("probing_dataset_id"):
        body["probing_dataset_id"] = post["probing_dataset_id"]
    sizes = ("batch_size_prompts", "context_size", "n_eval_reconstruction_batches")
    core = {name: post[name] for name in sizes if post.get(name)}
    if core:
        body["core"] = core
    if "absorption" in methods and post.get("max_words"):
        body["absorption"] = {"max_words": post["max_words"]}
    if "sparse_probing" in methods and post.get("k_values"):
        body["sparse_probing"] = {
            "k_values": [part for part in post["k_values"].replace(",", " ").split() if part]
        }
    return body


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def sae_compare_page(request):
    """The comparison; POST judges the SAEs shown (``action=run``) or cancels the run (``cancel``)."""
    if request.method == "POST" and (refused := writer_refusal(request)):
        return refused
    try:
        context = compare_context(request)
    except ApplicationError as error:
        return render(
            request, "frontend/partials/cache_error.html", {"message": error.message}, status=error.status
        )
    if request.method == "POST" and request.POST.get("action") == "cancel" and context.get("run"):
        run = context["run"]
        return cancel_form(
            request,
            cancel=lambda: bench_cancel(run=run, actor=request.user),
            cancelling="Cancelling: the SAE being judged finishes its current batch; finished results stay.",
            back=request.get_full_path(),
        )
    if request.GET.get("fragment") == "live":
        return render(request, "frontend/partials/sae_compare_live.html", context)
    context.update(form_context(request, context))
    if request.method != "POST":
        return render(request, "frontend/sae_compare.html", context)
    try:
        run = bench_from_body(request.user, posted_body(request, context))
    except ValidationError as error:
        context["form_error"] = validation_message(error)
        return render(request, "frontend/sae_compare.html", context, status=400)
    except ApplicationError as error:
        context["form_error"] = error.message
        return render(request, "frontend/sae_compare.html", context, status=error.status)
    messages.success(
        request, f"SAEBench run {run.id} queued: {len(run.saes)} SAEs, {', '.join(run.methods)}."
    )
    return redirect(f"{reverse('frontend:sae-compare')}?{urlencode({'run': run.id})}")
