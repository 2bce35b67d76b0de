"""Pages: the playground (generate with a loaded model, streamed; optional capture and heatmap;
optional steering with an SAE feature or a saved steering vector, baseline and steered side by side)."""

import math
from typing import Any

from django.shortcuts import render
from django.views.decorators.http import require_safe

from activations import selectors as activation_selectors
from activations import services as activation_services
from frontend.access import reader_required
from frontend.heatmap import cache_tokenizer, sample_heatmap
from generation.interventions import UNITS
from generation.serializers import GenerateInputSerializer
from generation.services import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SWEEP_COEFFICIENTS,
    MAX_PROMPT_CHARACTERS,
    MAX_STOP_SEQUENCES,
    MAX_SWEEP_COEFFICIENTS,
    MAX_TOKENS_LIMIT,
)
from mistudio.errors import ApplicationError
from models_app.models import LanguageModel
from models_app.selectors import model_list
from saes.models import SparseAutoencoder
from saes.selectors import sae_list
from steering.models import SteeringVector
from steering.selectors import vector_list

# In units of the feature's max activation (the page's default unit for an SAE feature).
DEFAULT_STEERING_COEFFICIENT = 4.0
STEERING_KINDS = ("add", "clamp_feature", "ablate")
STEERING_POSITIONS = ("all", "prompt", "generated")


@reader_required
@require_safe
def playground_page(request):
    """The playground: pick a ready model, set sampling parameters, and watch the output stream.

    Generation goes through ``POST /api/generate`` with ``"stream": true`` from ``playground.js``;
    this view only renders the form (ready models, defaults and ranges as the API validates them).
    The Steering panel lists the completed SAEs and steering vectors the user can see;
    ``?sae=<id>&feature=<n>`` (optionally ``&coefficient=``, ``&kind=``, ``&positions=``) presets
    it, as the feature page's "Steer" link does; ``?vector=<id>`` presets a saved steering vector
    instead (an ``add`` intervention naming it, with ``&coefficient=`` and ``&positions=``). With
    steering on, ``playground.js`` sends two requests with one seed: the baseline and the same one
    with ``mistudio.interventions``.
    With ``?heatmap=<cache_id>&hook=…&neuron=…`` it answers the per-token heatmap fragment of a
    stored cache instead (see :func:`heatmap_fragment`).
    """
    if "heatmap" in request.GET:
        return heatmap_fragment(request)
    models = model_list(user=request.user, filters={"status": LanguageModel.Status.READY}).order_by("name")
    selected = request.GET.get("model", "")
    return render(
        request,
        "frontend/playground.html",
        {
            "models": models,
            "selected_model": selected if any(model.id == selected for model in models) else "",
            "defaults": {
                "temperature": GenerateInputSerializer.default_temperature,
                "top_p": GenerateInputSerializer.default_top_p,
                "top_k": 0,
                "max_tokens": DEFAULT_MAX_TOKENS,
                "repetition_penalty": 1.0,
            },
            "limits": {
                "max_tokens": MAX_TOKENS_LIMIT,
                "prompt_characters": MAX_PROMPT_CHARACTERS,
                "stop_sequences": MAX_STOP_SEQUENCES,
                "sweep_coefficients": MAX_SWEEP_COEFFICIENTS,
            },
            **steering_context(request),
        },
    )


def steering_context(request) -> dict[str, Any]:
    """The Steering panel: completed SAEs and steering vectors the user can see (each names its
    model, so the page can offer those of the chosen model) and the preset from the query string;
    a preset SAE or vector that is not among them is named in a notice rather than silently dropped."""
    completed = {"status": SparseAutoencoder.Status.COMPLETED}
    saes = list(sae_list(user=request.user, filters=completed).order_by("name", "id"))
    vectors = list(
        vector_list(user=request.user)
        .filter(status=SteeringVector.Status.COMPLETED)
        .select_related("model")
        .order_by("name", "id")
    )
    wanted = request.GET.get("sae", "")
    found = any(sae.id == wanted for sae in saes)
    wanted_vector = request.GET.get("vector", "")
    found_vector = any(vector.id == wanted_vector for vector in vectors)
    feature = request.GET.get("feature", "")
    coefficient = _finite(request.GET.get("coefficient"))
    kind = request.GET.get("kind", "add")
    unit = request.GET.get("unit", "max_activation")
    positions = request.GET.get("positions", "all")
    return {
        "steering_saes": saes,
        "steering_vectors": vectors,
        "steering": {
            "on": found or found_vector,
            "source": "vector" if found_vector or not saes else "feature",
            "sae": wanted if found else "",
            "missing_sae": wanted if wanted and not found else "",
            "vector": wanted_vector if found_vector else "",
            "missing_vector": wanted_vector if wanted_vector and not found_vector else "",
            "feature": int(feature) if feature.isdigit() else 0,
            "coefficient": DEFAULT_STEERING_COEFFICIENT if coefficient is None else coefficient,
            "kind": kind if kind in STEERING_KINDS else "add",
            "unit": unit if unit in UNITS else "max_activation",
            "sweep": ", ".join(f"{value:g}" for value in DEFAULT_SWEEP_COEFFICIENTS),
            "positions": positions if positions in STEERING_POSITIONS else "all",
        },
    }


def _finite(text: str | None) -> float | None:
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def heatmap_fragment(request):
    """One neuron over a generation's cache: ``partials/playground_heatmap.html``, inserted by playground.js.

    Rendered here rather than assembled in the browser because the slice API returns whole rows
    (every neuron of a wide hook) and no token text; the tokens are those of the activation
    browser's sample heatmap (:mod:`frontend.heatmap`), scaled to this generation's largest |value|.
    Errors come back as a notice fragment with the API's status and message.
    """
    try:
        cache_id = request.GET["heatmap"]
        hook = request.GET.get("hook", "")
        try:
            neuron = int(request.GET.get("neuron", "0"))
        except ValueError:
            raise ApplicationError("INVALID_NEURON", "The neuron must be a whole number.") from None
        cache = activation_selectors.completed_cache(user=request.user, cache_id=cache_id)
        store = activation_selectors.cache_store(cache, hook)
        width = store.shape(hook)[1]
        if not 0 <= neuron < width:
            raise ApplicationError("INVALID_NEURON", f"The hook has {width} neurons (0 to {width - 1}).")
        heatmap = sample_heatmap(store, hook=hook, neuron=neuron, sample=0, tokenizer=cache_tokenizer(cache))
        activation_services.cache_touch(cache)
    except ApplicationError as error:
        return render(
            request, "frontend/partials/cache_error.html", {"message": error.message}, status=error.status
        )
    return render(
        request,
        "frontend/partials/playground_heatmap.html",
        {
            **heatmap,
            "scale_label": f"{heatmap['scale']:.3g}",
            "lowest": repr(heatmap["sample_min"] or 0.0),
            "highest": repr(heatmap["sample_max"] or 0.0),
        },
    )
