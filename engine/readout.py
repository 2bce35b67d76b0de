"""Logits from the residual stream: the final norm, the unembedding and the final-logit soft-cap.

Every reading of the residual stream as next-token logits goes through here (the logit lens, a
feature's logit effects), so a family's differences are handled once:

* the final norm is the model's own module (LayerNorm, RMSNorm, Gemma's ``(1 + w)`` RMSNorm);
* its elementwise scale, folded into ``W_U`` for direction-only readings, adds the family's
  :func:`engine.hooks.norm_weight_offset` to the weight;
* Gemma 2's ``config.final_logit_softcapping`` bends the logits to ``cap * tanh(logits / cap)``,
  as the model's own forward pass does.

torch is imported by the callers that hand tensors in; nothing here imports Django.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.errors import EngineError
from engine.hooks import LN_FINAL, HookError, hook_site, norm_weight_offset
from engine.placement import execution_device

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "ReadoutError",
    "final_logit_cap",
    "final_norm",
    "final_norm_scale",
    "logits_from_residual",
    "soft_cap",
]


class ReadoutError(EngineError):
    """The model has no way to turn a residual stream into logits (no output embedding)."""


def final_norm(model: Any) -> Any | None:
    """The module applied to the last residual stream before the unembedding; None when the
    family has none (BERT)."""
    try:
        return model.get_submodule(hook_site(model, LN_FINAL).module_path)
    except (HookError, AttributeError):
        return None


def final_norm_scale(model: Any) -> Tensor | None:
    """The final norm's elementwise scale as float32 on the CPU: its weight plus the family's
    offset (``1 + w`` for Gemma). None when the norm has no weight or the model has no norm."""
    norm = final_norm(model)
    weight = getattr(norm, "weight", None) if norm is not None else None
    if weight is None:
        return None
    return weight.detach().float().cpu() + norm_weight_offset(model)


def final_logit_cap(model: Any) -> float | None:
    """The cap of the final-logit soft-capping (Gemma 2), None when the model has none."""
    config = getattr(model, "config", None)
    # A multimodal config keeps its language model's settings in its text config.
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text_config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(logits / cap)``; the logits unchanged when ``cap`` is None."""
    if cap is None:
        return logits
    return (logits / cap).tanh() * cap


def logits_from_residual(model: Any, residual: Tensor) -> Tensor:
    """The model's logits (float32) for residual stream vectors ``residual`` [..., d_model], as its
    forward pass computes them after the last block: final norm, unembedding, soft-cap."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ReadoutError("NO_UNEMBEDDING", "The model has no output embedding to read logits with.")
    dtype = next(head.parameters()).dtype
    norm = final_norm(model)
    hidden = residual.to(dtype=dtype)
    if norm is not None:
        hidden = norm(hidden.to(execution_device(norm)))
    logits = head(hidden.to(execution_device(head)))
    return soft_cap(logits.float(), final_logit_cap(model))
