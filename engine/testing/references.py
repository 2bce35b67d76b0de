"""Reference computations for tests, written plainly against transformers' own forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def summed_next_token_loss(model: Any, sequences: Sequence[Sequence[int]]) -> tuple[float, int]:
    """(The summed next-token cross-entropy, the number of predicted tokens) of ``model`` over
    ``sequences``, each run alone and unpadded, with whatever hooks or replaced forwards the
    caller has put on the model."""
    import torch

    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids in sequences:
            logits = model(torch.tensor([list(ids)]), use_cache=False).logits[0, :-1]
            targets = torch.tensor(list(ids[1:]))
            total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            tokens += len(ids) - 1
    return total, tokens
