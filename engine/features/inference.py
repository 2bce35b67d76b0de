"""Which features fire on a text: the model runs up to the SAE's hook (the extraction path, so the
activations are those a cache of the same text holds), the SAE encodes them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.extraction import extract, tokenize_samples


@dataclass(frozen=True)
class TextFeatures:
    token_ids: list[int]
    # [tokens, d_sae] float32: every feature's activation on every token.
    activations: np.ndarray

    def per_token(self, top: int) -> list[list[tuple[int, float]]]:
        """Each token's ``top`` features with their values, strongest first (firing ones only)."""
        result = []
        for row in self.activations:
            order = np.argsort(-row, kind="stable")[:top]
            result.append([(int(index), float(row[index])) for index in order if row[index] > 0])
        return result

    def overall(self, top: int) -> list[dict[str, Any]]:
        """The ``top`` features by their highest value on any token: index, max, mean over the
        tokens, how many tokens they fire on, and the token where they peak."""
        if not len(self.activations):
            return []
        peak = self.activations.max(axis=0)
        order = np.argsort(-peak, kind="stable")[:top]
        return [
            {
                "index": int(index),
                "max": float(peak[index]),
                "mean": float(self.activations[:, index].mean()),
                "tokens_firing": int((self.activations[:, index] > 0).sum()),
                "peak_token": int(self.activations[:, index].argmax()),
            }
            for index in order
            if peak[index] > 0
        ]


def features_of_text(
    model: Any, tokenizer: Any, sae: Any, *, hook_name: str, text: str, max_length: int
) -> TextFeatures:
    """The SAE's feature activations on each token of ``text`` (tokenized and truncated as an
    extraction would), with the model read at ``hook_name`` in float32."""
    import torch

    ids = tokenize_samples(tokenizer, [text], max_length)[0]
    if not ids:
        return TextFeatures(token_ids=[], activations=np.zeros((0, sae.shape.d_sae), dtype=np.float32))
    batch = next(extract(model, [ids], [[0]], hooks=[hook_name], dtype="float32"))
    with torch.no_grad():
        activations = sae.encode(batch.activations[hook_name].float().to(sae.W_enc.device))
    return TextFeatures(token_ids=[int(token) for token in ids], activations=activations.cpu().numpy())


def auto_label(token_ids: Sequence[int], decode: Callable[[int], str], *, words: int = 3) -> str:
    """A short, deterministic summary of what a feature fires on: its most frequent activating
    tokens (``token_ids``, strongest example first; ties keep that order), joined by `` · ``;
    whitespace-only tokens and pieces of a UTF-8 character (decoded as U+FFFD) are skipped.
    ``""`` for a feature that never fires."""
    counts = Counter(token for token in token_ids if token >= 0)
    ranked = sorted(counts, key=lambda token: -counts[token])  # stable: first seen wins a tie
    labels: list[str] = []
    for token in ranked:
        text = decode(token).strip()
        if text and "\ufffd" not in text and text not in labels:  # not half a UTF-8 character
            labels.append(text)
        if len(labels) == words:
            break
    return " · ".join(labels)
