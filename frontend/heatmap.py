"""Tokens coloured by one neuron's values: the one heatmap of every page.

The activation browser (a neuron's top contexts, a sample's tokens) and the playground (a
generation's capture) both show tokens through :func:`token_texts` and :func:`heat_tokens`, so a
token reads and colours the same wherever it is shown; only the scale (what a full-strength colour
means) is the caller's choice. Each span carries its colour strength as ``data-alpha``, which
``app.js`` applies (the Content-Security-Policy refuses ``style=""``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from django.utils.html import format_html

from activations import selectors
from activations.models import ActivationCache

# Above this alpha the token's text switches colour, so it stays readable on a strong background.
STRONG_ALPHA = 0.6
MAX_ALPHA = 0.85
# How a line break, a tab and an empty token are drawn, so that every token stays visible on one line.
NEWLINE_MARK, TAB_MARK, EMPTY_MARK = "↵", "⇥", "∅"


def cache_tokenizer(cache: ActivationCache):
    """The cache's model's tokenizer, or None when its files are not on this machine (ids are shown)."""
    folder = selectors.model_folder(cache.model)
    if folder is None or not Path(folder).is_dir():
        return None
    try:
        return selectors.tokenizer_for(str(folder))
    except (OSError, ValueError):  # no tokenizer files there
        return None


def readable_token(tokenizer, raw: str) -> str:
    """One vocabulary entry as text: byte-level BPE marks decoded (``Ġ`` → space, ``Ċ`` → newline) and
    SentencePiece's ``▁`` as a space; then newlines and tabs drawn as ``↵`` and ``⇥``."""
    if raw in tokenizer.all_special_tokens:
        text = raw
    elif "▁" in raw:
        text = raw.replace("▁", " ")
    else:
        text = tokenizer.convert_tokens_to_string([raw])
    for line_break in ("\r\n", "\n", "\r"):
        text = text.replace(line_break, NEWLINE_MARK)
    text = text.replace("\t", TAB_MARK)
    return text or EMPTY_MARK


def token_texts(tokenizer, token_ids: list[int]) -> list[tuple[str, str]]:
    """(shown text, raw token) per id; ``#id`` for both when the tokenizer is not on this machine."""
    if tokenizer is None:
        return [(f"#{token_id}", f"#{token_id}") for token_id in token_ids]
    raws = tokenizer.convert_ids_to_tokens(token_ids)
    return [(readable_token(tokenizer, str(raw)), str(raw)) for raw in raws]


def heat_tokens(
    texts: list[tuple[str, str]],
    token_ids: list[int],
    values: list[float],
    scale: float,
    *,
    positions: list[int],
    label: str,
    center: int | None = None,
    generated: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Per token its span: text, sign class, alpha = |value| / scale, and a tooltip with the exact value.

    ``label`` names what the value is (``hook[neuron]``); ``center`` marks one token (a top token in
    its context); ``generated`` (a generation's per-token flags) classes tokens prompt or generated,
    and ``starts_generation`` says where the generated ones begin.
    """
    tokens = []
    for index, ((text, raw), token_id, value, position) in enumerate(
        zip(texts, token_ids, values, positions, strict=True)
    ):
        finite = math.isfinite(value)
        alpha = min(MAX_ALPHA, abs(value) / scale * MAX_ALPHA) if finite else 0.0
        classes = ["tok", "pos" if finite and value >= 0 else "neg"]
        if alpha >= STRONG_ALPHA:
            classes.append("strong")
        if index == center:
            classes.append("center")
        kind = None
        if generated is not None:
            kind = "generated" if generated[index] else "prompt"
            classes.append(kind)
        if NEWLINE_MARK in text:
            classes.append("newline")  # a page may break the line after it (the playground does)
        # Built here, not in a template, so nothing (not even a newline) comes between two tokens.
        html = format_html(
            '<span class="{}" data-alpha="{}" title="{}" data-value="{}">{}</span>',
            " ".join(classes),
            f"{alpha:.3f}",
            f"{label} = {value:.6g} · {raw!r} (id {token_id}) · position {position}"
            + (f" · {kind}" if kind else ""),
            repr(float(value)),
            text,
        )
        tokens.append(
            {
                "text": text,
                "value": value,
                "html": html,
                "starts_generation": kind == "generated" and index > 0 and not generated[index - 1],
            }
        )
    return tokens


def sample_heatmap(
    store, *, hook: str, neuron: int, sample: int, tokenizer, scale: float | None = None
) -> dict[str, Any]:
    """One sample's tokens coloured by one neuron, and what a caption says about them.

    ``scale`` defaults to the sample's own largest |value| (a generation's capture is one sample).
    """
    view = selectors.cache_sample_neuron(store, hook=hook, sample_index=sample, neuron=neuron)
    values = view["values"]
    finite = [value for value in values if math.isfinite(value)]
    if scale is None:
        scale = max((abs(value) for value in finite), default=0.0) or 1.0
    return {
        "sample": sample,
        "neuron": neuron,
        "tokens": heat_tokens(
            token_texts(tokenizer, view["token_ids"]),
            view["token_ids"],
            values,
            scale,
            positions=view["positions"],
            label=f"{hook}[{neuron}]",
            generated=view["generated"],
        ),
        "has_generated": view["generated"] is not None,
        "generated_count": sum(view["generated"] or []),
        "sample_max": max(finite) if finite else None,
        "sample_min": min(finite) if finite else None,
        "scale": scale,
    }
