"""What a feature's decoder direction does, from the weights alone: its logit effects through the
unembedding, and its nearest features by decoder cosine similarity.

Both go ``block`` features at a time, so neither the [d_sae, vocab] logit matrix nor the
[d_sae, d_sae] similarity matrix is ever held whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.readout import final_norm_scale


def unembedding(model: Any):
    """``(W_U [d_model, vocab], scale [d_model] or None)`` of a causal LM: the output embedding,
    and the final norm's elementwise scale (``w``, or ``1 + w`` for Gemma's norms), which
    multiplies the residual stream before it (as TransformerLens folds it into ``W_U``). None for
    a model with no output embedding.

    A direction's logit weights are linear in it, so a final-logit soft-cap (which bends the
    model's whole logits, not one direction's share) is not applied here."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is None or getattr(output, "weight", None) is None:
        return None
    return output.weight.detach().float().cpu().T, final_norm_scale(model)


def logit_effects(
    W_dec, W_U, scale=None, *, top: int = 10, bins: int = 40, block: int = 256
) -> dict[str, np.ndarray]:
    """Per feature ``f``, the logit weights ``(W_dec[f] * scale) @ W_U``: the ``top`` most promoted
    and most suppressed tokens (ids and values, strongest first) and a histogram over ``bins``
    equal bins between that feature's own min and max."""
    import torch

    W_dec = W_dec.detach().float().cpu()
    W_U = W_U.float()
    if scale is not None:
        W_dec = W_dec * scale.float()
    d_sae, vocab = W_dec.shape[0], W_U.shape[1]
    top = min(top, vocab)
    out = {
        "logit_top_ids": np.zeros((d_sae, top), dtype=np.int32),
        "logit_top_values": np.zeros((d_sae, top), dtype=np.float32),
        "logit_bottom_ids": np.zeros((d_sae, top), dtype=np.int32),
        "logit_bottom_values": np.zeros((d_sae, top), dtype=np.float32),
        "logit_histogram": np.zeros((d_sae, bins), dtype=np.int32),
        "logit_range": np.zeros((d_sae, 2), dtype=np.float32),
    }
    with torch.no_grad():
        for low in range(0, d_sae, block):
            high = min(d_sae, low + block)
            logits = W_dec[low:high] @ W_U  # [block, vocab]
            values, ids = logits.topk(top, dim=1)
            out["logit_top_ids"][low:high], out["logit_top_values"][low:high] = ids.numpy(), values.numpy()
            values, ids = logits.topk(top, dim=1, largest=False)
            out["logit_bottom_ids"][low:high], out["logit_bottom_values"][low:high] = (
                ids.numpy(),
                values.numpy(),
            )
            smallest, largest = logits.min(dim=1).values, logits.max(dim=1).values
            width = (largest - smallest).clamp(min=1e-12)
            cells = ((logits - smallest[:, None]) / width[:, None] * bins).long().clamp(0, bins - 1)
            offsets = torch.arange(high - low)[:, None] * bins
            counts = torch.bincount((cells + offsets).reshape(-1), minlength=(high - low) * bins)
            out["logit_histogram"][low:high] = counts.reshape(high - low, bins).numpy()
            out["logit_range"][low:high] = torch.stack([smallest, largest], dim=1).numpy()
    return out


def decoder_neighbours(W_dec, *, top: int = 10, block: int = 1024) -> dict[str, np.ndarray]:
    """Per feature, the ``top`` other features whose decoder rows are most cosine-similar (indices
    and similarities, most similar first), ``block`` rows of the similarity matrix at a time."""
    import torch

    W_dec = W_dec.detach().float().cpu()
    d_sae = W_dec.shape[0]
    top = min(top, max(0, d_sae - 1))
    unit = W_dec / W_dec.norm(dim=1, keepdim=True).clamp(min=1e-12)
    indices = np.zeros((d_sae, top), dtype=np.int32)
    cosines = np.zeros((d_sae, top), dtype=np.float32)
    with torch.no_grad():
        for low in range(0, d_sae, block):
            high = min(d_sae, low + block)
            similarity = unit[low:high] @ unit.T  # [block, d_sae]
            similarity[torch.arange(high - low), torch.arange(low, high)] = -torch.inf  # not itself
            values, ids = similarity.topk(top, dim=1)
            indices[low:high], cosines[low:high] = ids.numpy(), values.numpy()
    return {"neighbour_ids": indices, "neighbour_cosines": cosines}
