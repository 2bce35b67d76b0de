"""Page: which of an SAE's features fire on a text (``/saes/<id>/encode/``).

POST runs ``features.services.feature_encode`` (the worker holding the SAE's model runs it up to
the hook, the SAE encodes), as ``POST /api/saes/<id>/encode`` does, with the API's serializer;
the page shows each token with its top features and the overall top ones, each named by its label
or automatic label and linked to its dashboard. Without the model loaded the service's
``MODEL_NOT_LOADED`` is shown with a link to the model's page.
"""

from __future__ import annotations

from typing import Any

from django.shortcuts import render
from django.views.decorators.http import require_http_methods
from rest_framework.exceptions import ValidationError

from features import selectors, services
from features.apis import FeatureEncodeApi
from frontend.access import reader_required, sae_or_404, writer_refusal
from frontend.heatmap import token_texts
from frontend.views.features import feature_url, validation_message
from mistudio.errors import ApplicationError
from models_app.models import LanguageModel


def encoded_rows(result: dict[str, Any], tokenizer, sae_id: str) -> dict[str, Any]:
    """A live encoding (``with_feature_names``) as the page shows it: each token with its top
    features, and the overall top features with the token each peaks on."""
    texts = token_texts(tokenizer, result["token_ids"])
    names = result["features"]

    def named(index: int) -> dict[str, Any]:
        return {"index": index, "url": feature_url(sae_id, index), **names.get(str(index), {})}

    tokens = [
        {
            "position": position,
            "text": text,
            "raw": raw,
            "token_id": token_id,
            "features": [{**named(entry["index"]), "value": entry["value"]} for entry in features],
        }
        for position, ((text, raw), token_id, features) in enumerate(
            zip(texts, result["token_ids"], result["per_token"], strict=True)
        )
    ]
    overall = [
        {**entry, **named(entry["index"]), "peak_text": texts[entry["peak_token"]][0]}
        for entry in result["overall"]
    ]
    return {"tokens": tokens, "overall": overall, "analysis_id": result.get("analysis_id")}


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def feature_encode_page(request, sae_id: str):
    """Which of the SAE's features fire on a text: POST runs ``feature_encode`` (the SAE's model,
    loaded on a worker, runs up to the hook; the SAE encodes), as ``POST /api/saes/<id>/encode``
    does, and shows each token's top features and the overall top ones, named by their labels."""
    if request.method == "POST":
        refused = writer_refusal(request)
        if refused:
            return refused
    sae = sae_or_404(request.user, sae_id)
    model = sae.model
    context: dict[str, Any] = {
        "sae": sae,
        "text": "",
        "top": 10,
        # A hint before the first try; feature_encode decides (MODEL_NOT_LOADED).
        "model_loaded": bool(model and model.status == LanguageModel.Status.READY and model.host_worker),
    }
    status = 200
    if request.method == "POST":
        context["text"] = request.POST.get("text", "")
        context["top"] = request.POST.get("top", "").strip() or 10
        try:
            data = FeatureEncodeApi.InputSerializer(data={"text": context["text"], "top": context["top"]})
            data.is_valid(raise_exception=True)
            result = services.feature_encode(sae=sae, actor=request.user, **data.validated_data)
            result = selectors.with_feature_names(user=request.user, sae=sae, result=result)
        except ValidationError as error:
            context["problem"], status = validation_message(error), 400
        except ApplicationError as error:
            context["error"], status = error, error.status
        else:
            context["result"] = encoded_rows(result, selectors.analysis_tokenizer(sae), sae.id)
    return render(request, "frontend/feature_encode.html", context, status=status)
