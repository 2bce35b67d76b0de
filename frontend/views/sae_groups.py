"""Pages: training from the model — the form that starts a group of SAEs and transcoders, and a
group's page comparing its members (the L0 / explained-variance frontier and CE loss recovered as
plots, a table of every member), live while it trains.

The form is validated by the API's own serializer and calls the service ``/api/saes/groups``
calls. The group page fetches ``?fragment=live`` (its status, members and plots, rendered by the
template of the first load) every two seconds while the group is queued or running.
"""

from __future__ import annotations

import json
import re
from typing import Any

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods
from rest_framework.exceptions import ValidationError

from activations import selectors as activation_selectors
from activations.models import Dataset
from activations.services.extractions import default_extraction_hook
from engine.sae_architectures import DEFAULT_LIVE_EXPANSION, REGISTRY, default_live_k
from engine.sae_architectures.defaults import k_rule
from frontend.access import reader_required, writer_refusal
from frontend.charts import scatter_chart_svg
from frontend.views.job_pages import cancel_form
from frontend.views.saes import _field_errors, _posted
from mistudio.access import linked_id, may_change
from mistudio.errors import ApplicationError
from mistudio.job_queue import queue_position
from models_app.selectors import model_list
from saes import groups, selectors
from saes.apis import sae_group_train_from_body
from saes.models import ARCHITECTURES, SaeGroup
from saes.serializers import parse_transcoders, parse_variants

CHART_SIZE = (440, 280)
FORM_DEFAULTS = {
    "architecture": "topk",
    "expansion_factor": "",
    "k": "",
    "lr": "0.0003",
    "batch_size": "4096",
    "total_tokens": "",
    "max_length": "",
    "hooks": "",
    "transcoders": "",
    "variants": "",
    "name": "",
}


def suggestion(model) -> dict[str, Any] | None:
    """What the form suggests for ``model``, from the defaults the service applies (nothing restated
    here): its middle resid_post, 16x, k, the tokens sized to the device it would train on with the
    time that takes, and the hooks of one transcoder per layer (what an attribution graph needs)."""
    if model is None or not model.hidden_size:
        return None
    d_in = model.hidden_size
    d_sae = DEFAULT_LIVE_EXPANSION * d_in
    sized = groups.device_tokens(model)
    tokens = groups.default_group_tokens(d_sae, sized)
    rate = sized["tokens_per_second"]
    layers = range(model.num_layers or 0)
    return {
        "model_id": model.id,
        "name": model.name,
        "hook": default_extraction_hook(model),
        "d_in": d_in,
        "d_sae": d_sae,
        "k": default_live_k(d_in),
        "k_rule": k_rule(live=True),
        "tokens": tokens,
        "expansion": DEFAULT_LIVE_EXPANSION,
        "device": sized["device"],
        "minutes": round(tokens / rate / 60) if rate else None,
        "rate": f"{rate:,.0f} tokens/s, {'measured on its last group' if sized['measured'] else 'assumed'}"
        if rate
        else "",
        "transcoders": "\n".join(
            f"blocks.{layer}.ln2.hook_normalized -> blocks.{layer}.hook_mlp_out" for layer in layers
        ),
        "analyze_members": groups.default_analyze_members(d_sae),
    }


def form_context(request, *, values=None, errors=None) -> dict[str, Any]:
    models = list(model_list(user=request.user).order_by("name"))
    datasets = activation_selectors.dataset_choices(user=request.user)
    wanted = (values or {}).get("model_id") or request.GET.get("model", "")
    chosen = next((model for model in models if model.id == wanted), models[0] if models else None)
    suggested = suggestion(chosen)
    shown = {**FORM_DEFAULTS, **(values or {})}
    if not shown["hooks"] and suggested:
        shown["hooks"] = suggested["hook"]
    if "analyze_members" not in shown:
        shown["analyze_members"] = suggested["analyze_members"] if suggested else True
    return {
        "models": models,
        "datasets": datasets,
        "chosen_model": chosen,
        "suggestion": suggested,
        # Every model's, for the page's script: the suggestion follows the model chosen.
        "suggestions_json": json.dumps({model.id: suggestion(model) for model in models}),
        "form": shown,
        "errors": errors or {},
        "architectures": [(name, REGISTRY[name].label) for name in ARCHITECTURES],
    }


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def sae_group_new_page(request):
    """The form that trains a group from the model (POST: ``sae_group_train_request``, then the
    group's page; errors come back in the form)."""
    if request.method == "GET" or request.method == "HEAD":
        return render(request, "frontend/sae_group_new.html", form_context(request))
    refused = writer_refusal(request)
    if refused:
        return refused
    names = ["model_id", "dataset_id", "architecture", "expansion_factor", "k", "lr", "batch_size"]
    names += ["total_tokens", "max_length", "name"]
    shown = _posted(request, names)
    for name in ("hooks", "transcoders", "variants"):
        shown[name] = request.POST.get(name, "")
    try:
        values = {
            key: value for key, value in shown.items() if key not in ("hooks", "transcoders", "variants")
        }
        values["hooks"] = [hook for hook in re.split(r"[\s,]+", shown["hooks"]) if hook]
        values["transcoders"] = parse_transcoders(shown["transcoders"])
        values["variants"] = parse_variants(shown["variants"])
        values["shared"] = request.POST.get("shared") == "on"
        values["analyze_members"] = request.POST.get("analyze_members") == "on"
        values["cross_layer_transcoder"] = request.POST.get("cross_layer_transcoder") == "on"
        group = sae_group_train_from_body(user=request.user, body=values)
    except ValidationError as error:
        errors, status = _field_errors(error), 400
        errors.setdefault("form", "Check the values below.")
    except ApplicationError as error:
        errors, status = {"form": error.message}, error.status
    else:
        messages.success(request, f"Training of {group.name} queued.")
        return redirect("frontend:sae-group", group.id)
    shown["shared"] = request.POST.get("shared") == "on"
    shown["analyze_members"] = request.POST.get("analyze_members") == "on"
    shown["cross_layer_transcoder"] = request.POST.get("cross_layer_transcoder") == "on"
    return render(
        request,
        "frontend/sae_group_new.html",
        form_context(request, values=shown, errors=errors),
        status=status,
    )


def group_charts(members: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The frontier plots: L0 against explained variance and against CE loss recovered."""
    charts = []
    for key, title in (
        ("explained_variance", "Explained variance"),
        ("ce_loss_recovered", "CE loss recovered"),
    ):
        points = [(m["evaluation"].get("l0"), m["evaluation"].get(key), m["name"]) for m in members]
        charts.append(
            {
                "key": key,
                "title": f"L0 vs {title.lower()}",
                "svg": scatter_chart_svg(
                    points,
                    label=f"{title} against L0, one dot per SAE",
                    x_label="L0 (held out)",
                    y_label=title.lower(),
                    size=CHART_SIZE,
                ),
            }
        )
    return charts


def group_context(request, group: SaeGroup) -> dict[str, Any]:
    from saes.serializers import sae_group_state

    state = sae_group_state(group, viewer=request.user)
    return {
        "group": group,
        "state": state,
        "active": group.status in SaeGroup.ACTIVE,
        "charts": group_charts(state["members"]),
        "queue": queue_position(group, viewer=request.user),
        "can_change": may_change(group, request.user),
        "dataset_visible": linked_id(request.user, group, Dataset, group.dataset_id) is not None,
    }


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def sae_group_page(request, group_id: str):
    """One group: status, tokens/s, the frontier plots and every member's results; ``action=cancel``
    POSTed here cancels it. ``?fragment=live``: the part that changes while it trains."""
    refused = writer_refusal(request) if request.method == "POST" else None
    if refused:  # by role, before the lookup
        return refused
    try:
        group = selectors.group_get(user=request.user, group_id=group_id)
    except ApplicationError as error:
        raise Http404(error.message) from None
    if request.method == "POST" and request.POST.get("action") == "stop":
        try:
            groups.sae_group_stop(group=group, actor=request.user)
            messages.info(
                request, "Stopping: training ends at its next step; the members are evaluated and kept."
            )
        except ApplicationError as error:
            messages.error(request, error.message)
        return redirect(reverse("frontend:sae-group", args=[group.id]))
    if request.method == "POST":
        return cancel_form(
            request,
            cancel=lambda: groups.sae_group_cancel(group=group, actor=request.user),
            cancelling="Cancelling: the group stops after its current step.",
            back=reverse("frontend:sae-group", args=[group.id]),
        )
    context = group_context(request, group)
    if request.GET.get("fragment") == "live":
        return render(request, "frontend/partials/sae_group_live.html", context)
    return render(request, "frontend/sae_group.html", context)
