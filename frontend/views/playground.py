"""Pages: the playground (generate with a loaded model, streamed; optional capture and heatmap)."""

from django.http import HttpResponse
from django.shortcuts import render
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_safe

from activations import selectors as activation_selectors
from activations import services as activation_services
from frontend.access import reader_required
from generation.serializers import GenerateInputSerializer
from generation.services import (
    DEFAULT_MAX_TOKENS,
    MAX_PROMPT_CHARACTERS,
    MAX_STOP_SEQUENCES,
    MAX_TOKENS_LIMIT,
)
from mistudio.errors import ApplicationError
from models_app.models import LanguageModel
from models_app.selectors import model_list

BOUNDARY = mark_safe(
    '<span class="boundary" title="The generated tokens start here" aria-hidden="true"></span>'
)


@reader_required
@require_safe
def playground_page(request):
    """The playground: pick a ready model, set sampling parameters, and watch the output stream.

    Generation goes through ``POST /api/generate`` with ``"stream": true`` from ``playground.js``;
    this view only renders the form (ready models, defaults and ranges as the API validates them).
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
            },
        },
    )


def heatmap_fragment(request):
    """One neuron over a generation's cache, as ``span.tok`` elements (HTML, inserted by playground.js).

    Rendered here rather than assembled in the browser because the slice API returns whole rows
    (every neuron of a wide hook) and no token text; the values come from
    ``cache_sample_neuron`` and each token is decoded with the model's tokenizer, as the top-k
    API does. Errors come back as a notice fragment with the API's status and message.
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
        tokens = heatmap_tokens(cache, store, hook=hook, neuron=neuron)
        activation_services.cache_touch(cache)
    except ApplicationError as error:
        return HttpResponse(
            format_html('<p class="notice error" role="alert">{}</p>', error.message), status=error.status
        )
    return HttpResponse(heatmap_html(tokens, hook=hook, neuron=neuron))


def heatmap_html(tokens: list[dict], *, hook: str, neuron: int):
    """The legend (scale, prompt vs generated) and one ``span.tok`` per token, coloured by value."""
    values = [token["value"] for token in tokens]
    scale = max((abs(value) for value in values), default=0.0) or 1.0
    label = f"{hook}[{neuron}]"
    pieces = [
        token_span(
            token, after_prompt=index > 0 and tokens[index - 1]["kind"] == "prompt", scale=scale, label=label
        )
        for index, token in enumerate(tokens)
    ]
    spans = format_html_join("", "{}", ((piece,) for piece in pieces))
    return format_html(
        '<div class="heat-legend small">'
        '<span class="heat-scale" aria-hidden="true"></span>'
        '<span class="mono">{}</span><span class="mono">0</span><span class="mono">+{}</span>'
        '<span class="spacer"></span>'
        '<span class="key prompt">prompt</span><span class="key generated">generated</span>'
        "</div>"
        '<div class="tokens heatmap" data-min="{}" data-max="{}">{}</div>',
        f"{-scale:.3g}",
        f"{scale:.3g}",
        repr(min(values, default=0.0)),
        repr(max(values, default=0.0)),
        spans,
    )


def token_span(token: dict, *, after_prompt: bool, scale: float, label: str):
    """One token: red above zero, blue below, more opaque the larger; the exact value in its title."""
    span = format_html(
        '<span class="tok {} {}" data-row="{}" data-value="{}" data-alpha="{}" title="{}">{}</span>',
        token["kind"],
        "pos" if token["value"] >= 0 else "neg",
        token["row"],
        repr(token["value"]),
        f"{min(1.0, abs(token['value']) / scale) * 0.85:.3f}",
        f"{token['text']!r} · token {token['token_id']} · {token['kind']} · {label} = {token['value']:.6g}",
        token["display"],
    )
    if token["kind"] == "generated" and after_prompt:
        return BOUNDARY + span  # where the generation begins
    return span


def heatmap_tokens(cache, store, *, hook: str, neuron: int) -> list[dict]:
    """The generation's tokens (its cache's one sample): text, id, prompt or generated, the value."""
    import math

    view = activation_selectors.cache_sample_neuron(store, hook=hook, sample_index=0, neuron=neuron)
    token_ids, generated = view["token_ids"], view["generated"]
    tokenizer = cache_tokenizer(cache)
    tokens = []
    for row, (token_id, value) in enumerate(zip(token_ids, view["values"], strict=True)):
        text = token_text(tokenizer, token_ids, row) if tokenizer is not None else f"#{token_id}"
        tokens.append(
            {
                "row": row,
                "token_id": token_id,
                "text": text,
                # A newline token shows its mark and still breaks the line; an empty one stays visible.
                "display": text.replace("\n", "↵\n") if text else "∅",
                "kind": "generated" if generated and generated[row] else "prompt",
                "value": value if math.isfinite(value) else 0.0,
            }
        )
    return tokens


def cache_tokenizer(cache):
    """The cache's model's tokenizer, or None when its files are not on this machine (ids are shown)."""
    folder = activation_selectors.model_folder(cache.model)
    if folder is None:
        return None
    try:
        return activation_selectors.tokenizer_for(str(folder))
    except (OSError, ValueError):
        return None


def token_text(tokenizer, token_ids: list[int], row: int) -> str:
    """The text token ``row`` adds after the few before it.

    Decoding a token alone loses a SentencePiece token's leading space; the difference between
    two short windows keeps it. A token that ends inside a character decodes alone (U+FFFD).
    """
    before = tokenizer.decode(token_ids[max(0, row - 4) : row])
    after = tokenizer.decode(token_ids[max(0, row - 4) : row + 1])
    if after.startswith(before) and after != before and "\ufffd" not in after[len(before) :]:
        return after[len(before) :]
    return tokenizer.decode([token_ids[row]])
