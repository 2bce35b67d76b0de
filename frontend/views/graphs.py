"""Pages: attribution graphs (circuits).

- ``/graphs/``: the graphs you can see, and the form for a new one: a loaded model, a prompt, and
  its transcoders (an SAE group that trained one per layer, or the SAE ids, layer 0 first).
- ``/graphs/<id>/``: while the job runs, its progress (live, ``?fragment=live``); then the graph
  (``graph.js`` draws it from ``GET /api/graphs/<id>/nodes``): nodes by layer and position, edges
  by weight and sign, hover and click for a feature's label, explanation and dashboard; pin nodes,
  group them into named supernodes, the subgraph of the pinned nodes, prune thresholds as live
  controls (the node threshold up to what the graph's bounded view holds), interventions, and the
  export. The page itself never reads the graph's files: the nodes route prunes its bounded view.
  POST ``action=cancel`` cancels a running job.

The form is validated with the API's serializer and calls the same service as ``POST /api/graphs``.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods
from rest_framework.exceptions import ValidationError

from circuits import selectors, services
from circuits.apis import graph_from_body
from circuits.models import AttributionGraph
from circuits.serializers import graph_state
from frontend.access import reader_required, writer_refusal
from frontend.views.features import validation_message
from frontend.views.job_pages import cancel_form
from mistudio import roles
from mistudio.access import may_change
from mistudio.errors import ApplicationError
from mistudio.jobs import JobStatus
from models_app.models import LanguageModel
from models_app.selectors import model_list
from saes.selectors import group_list, sae_list

EXAMPLE_PROMPT = "def add(a, b):\n    return a +"


# The "Transcoders" choice of a cross-layer transcoder (one SAE row) rather than a group.
CLT_CHOICE = "sae:"


def _transcoder_groups(user) -> list[dict[str, Any]]:
    """The SAE groups whose members include one MLP transcoder per layer of their model, then the
    completed cross-layer transcoders (each replaces every MLP alone)."""
    groups = []
    for group in group_list(user=user).select_related("model").filter(status=JobStatus.COMPLETED):
        transcoders = services.transcoders_of_group(group)
        layers = group.model.num_layers if group.model else None
        if transcoders and len(transcoders) == layers:
            groups.append({"id": group.id, "name": f"{group.name or group.id} · one per layer",
                           "model_id": group.model_id})  # fmt: skip
    clts = sae_list(user=user).filter(status=JobStatus.COMPLETED, n_layers__isnull=False)
    for sae in clts.order_by("-created_at")[:100]:
        name = f"{sae.name or sae.id} · cross-layer, {sae.n_layers} layers of {sae.d_sae:,} features"
        groups.append({"id": CLT_CHOICE + sae.id, "model_id": sae.model_id, "name": name})
    return groups


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def graph_list_page(request):
    """The list and the new-graph form; POST queues a graph and opens its page."""
    if request.method == "POST" and (refused := writer_refusal(request)):
        return refused
    models = list(model_list(user=request.user).filter(status=LanguageModel.Status.READY))
    context: dict[str, Any] = {
        "graphs": [
            graph_state(graph, viewer=request.user) for graph in selectors.graph_list(user=request.user)[:200]
        ],
        "models": models,
        "groups": _transcoder_groups(request.user),
        "values": {"prompt": EXAMPLE_PROMPT, "max_feature_nodes": "", "node_threshold": "0.8"},
    }
    if request.method != "POST":
        return render(request, "frontend/graphs.html", context)
    post = request.POST
    context["values"] = post.dict()
    body: dict[str, Any] = {
        "model_id": post.get("model_id", ""),
        "prompt": post.get("prompt", ""),
        "name": post.get("name", ""),
        "shared": post.get("shared") == "on",
    }
    if post.get("sae_group_id", "").startswith(CLT_CHOICE):
        body["transcoder_ids"] = [post["sae_group_id"].removeprefix(CLT_CHOICE)]
    elif post.get("sae_group_id"):
        body["sae_group_id"] = post["sae_group_id"]
    else:
        body["transcoder_ids"] = [
            part for part in post.get("transcoder_ids", "").replace(",", " ").split() if part
        ]
    if post.get("target_kind") == "tokens":
        body["target_tokens"] = [part for part in post.get("target_tokens", "").split("|") if part]
    elif post.get("target_kind") == "difference":
        body["target_difference"] = [post.get("target_first", ""), post.get("target_second", "")]
    if post.get("max_feature_nodes", "").strip():
        body["max_feature_nodes"] = post["max_feature_nodes"]
    try:
        graph = graph_from_body(request.user, body)
    except ValidationError as error:
        context["form_error"] = validation_message(error)
        return render(request, "frontend/graphs.html", context, status=400)
    except ApplicationError as error:
        context["form_error"] = error.message
        return render(request, "frontend/graphs.html", context, status=error.status)
    messages.success(request, f"Attribution graph {graph.id} queued.")
    return redirect(reverse("frontend:graph", args=[graph.id]))


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def graph_page(request, graph_id: str):
    """A graph: its job's progress while it runs (``?fragment=live``), then the graph explorer."""
    if request.method == "POST" and (refused := writer_refusal(request)):
        return refused
    try:
        graph = selectors.graph_get(user=request.user, graph_id=graph_id)
    except ApplicationError as error:
        return render(request, "frontend/partials/cache_error.html", {"message": error.message}, status=404)
    if request.method == "POST":
        return cancel_form(
            request,
            cancel=lambda: services.graph_cancel(graph=graph, actor=request.user),
            cancelling="Cancelling: the job stops after its current batch of targets.",
            back=request.path,
        )
    context = {
        "graph": graph,
        "state": graph_state(graph, viewer=request.user),
        "active": graph.status in AttributionGraph.ACTIVE,
        "can_change": may_change(graph, request.user),
        "can_write": request.user.has_perm(roles.WRITE),  # saving a subgraph of a graph one may see
    }
    if request.GET.get("fragment") == "live":
        return render(request, "frontend/partials/graph_live.html", context)
    return render(request, "frontend/graph.html", context)
