"""Free text people type for others to read — names, labels, notes: no control characters and no
bidirectional overrides (which can make a label read as something it is not, "Trojan Source")."""

from __future__ import annotations

import unicodedata

from mistudio.errors import ApplicationError

# Explicit direction embeddings, overrides and isolates; the marks LRM/RLM/ALM are harmless.
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
LINE_BREAKS = frozenset("\n\r\t")


def unsafe_characters(text: str, *, multiline: bool = False) -> list[str]:
    """The code points of ``text`` that free text may not hold (``U+202E`` …), in order, once each."""
    found: dict[str, None] = {}
    for character in text:
        if multiline and character in LINE_BREAKS:
            continue
        if character in BIDI_CONTROLS or unicodedata.category(character) in ("Cc", "Cs"):
            found[f"U+{ord(character):04X}"] = None
    return list(found)


def check_label_text(text: str, *, field: str, multiline: bool = False) -> str:
    """``text`` if it holds no control characters or direction overrides (``multiline``: line
    breaks and tabs allowed); 400 ``INVALID_TEXT`` naming them otherwise."""
    bad = unsafe_characters(text, multiline=multiline)
    if bad:
        raise ApplicationError(
            "INVALID_TEXT",
            f"{field} holds control or text-direction characters ({', '.join(bad[:5])}).",
            details={"fields": {field: [f"No control or text-direction characters ({', '.join(bad[:5])})."]}},
        )
    return text


def safe_text(text: str) -> str:
    """``text`` without what free text may not hold (a model's output made fit to be a label)."""
    return "".join(
        character
        for character in text
        if character not in BIDI_CONTROLS and unicodedata.category(character) not in ("Cc", "Cs")
    )
