"""Pages: activation patching (``/models/<id>/patching/``) and the logit lens
(``/models/<id>/logit-lens/``) of one causal language model.

The pages only render the form; ``patching.js`` and ``logit_lens.js`` call
``POST /api/models/<id>/patching`` and ``/logit-lens`` (answered by the model's worker) and draw
the answer: a heatmap of hook points x positions, a table of layers x positions. Without the
model loaded the page says so, with a link to the model's page where it is loaded.
"""

from typing import Any

from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_safe

from engine.inspection import ENCODER_MODEL_TYPES
from frontend.access import reader_required
from frontend.views.models import hook_groups
from mistudio.errors import ApplicationError
from models_app import selectors
from models_app.models import LanguageModel

# The quick picks of the patching form: one hook point of every block (the API's default first).
HOOK_PICKS = (
    ("hook_resid_pre", "resid_pre (default)"),
    ("hook_attn_out", "attn_out"),
    ("hook_mlp_out", "mlp_out"),
    ("hook_resid_post", "resid_post"),
)
DEFAULT_LENS_TOP = 5


def is_causal_lm(model: LanguageModel) -> bool:
    """Patching and the lens read next-token logits: every supported family but the encoders."""
    return model.model_type not in ENCODER_MODEL_TYPES


def probe_context(request, model_id: str) -> dict[str, Any]:
    """What both pages show: the model (404 page if the user may not see it), whether it is loaded
    (a hint: the API decides, with ``MODEL_NOT_LOADED``) and whether it is a causal LM."""
    try:
        model = selectors.model_get(user=request.user, model_id=model_id)
    except ApplicationError as error:
        raise Http404(error.message) from None
    return {
        "model": model,
        "model_loaded": model.status == LanguageModel.Status.READY and bool(model.host_worker),
        "causal_lm": is_causal_lm(model),
    }


def hook_picks(model: LanguageModel) -> list[dict[str, str]]:
    """Each quick pick with the comma-separated hook names it fills in (those the model has)."""
    groups, _ = hook_groups(model)
    names = [point["name"] for group in groups if group["layer"] is not None for point in group["points"]]
    picks = []
    for suffix, label in HOOK_PICKS:
        chosen = [name for name in names if name.endswith(f".{suffix}")]
        if chosen:
            picks.append({"label": label, "hooks": ", ".join(chosen)})
    return picks


@reader_required
@require_safe
def patching_page(request, model_id: str):
    """Activation patching: clean and corrupted prompts, the answer and a wrong answer, optional
    hook points; ``patching.js`` posts them and draws the normalized effect as a heatmap."""
    context = probe_context(request, model_id)
    context["hook_picks"] = hook_picks(context["model"]) if context["causal_lm"] else []
    return render(request, "frontend/patching.html", context)


@reader_required
@require_safe
def logit_lens_page(request, model_id: str):
    """The logit lens: a prompt; ``logit_lens.js`` posts it and fills the layers x positions table."""
    return render(
        request, "frontend/logit_lens.html", {**probe_context(request, model_id), "top": DEFAULT_LENS_TOP}
    )
