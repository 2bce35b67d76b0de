"""The local replacement model's frozen parts, on the hook runtime.

Attribution (Ameisen et al. 2025) linearises a model around one prompt: attention patterns and
normalisation scales are taken from the real forward pass and held constant, and each MLP is
replaced by its transcoder plus an error term. What is left between the token embeddings, the
transcoder features, the errors and the logits is linear, so a backward pass gives direct effects.

:class:`FrozenRun` sets this up on a loaded transformers model, without changing or copying it:

* **Attention patterns** come from an attention function registered with transformers
  (``AttentionInterface``, with the eager mask), selected on the model for the run and restored
  after. The first pass *records* each layer's pattern (of the first row of the batch: every row
  of an attribution batch is the same prompt) and uses it detached; later passes *replay* it.
* **Norm scales**: each norm's output is recomputed from its input with the scale detached
  (LayerNorm: ``(x - mean) / sd``; RMSNorm: ``x / rms``), recorded in the first pass and replayed.
* **MLPs** are left to the caller (:mod:`engine.attribution.attribute` and
  :mod:`engine.attribution.intervention`), which sees each MLP's input and replaces its output.

The patterns and scales of a recorded pass stay on the object, so an intervention or the bias
pass re-runs the same frozen model. Families: gpt2, the llama layout (llama, mistral, qwen2,
qwen3, gemma) and gemma2 / gemma3_text. What differs between them is data: the norms around each
sub-layer (Gemma 2 and 3 have four: before and after attention, before and after the MLP, each
frozen), Gemma's ``(1 + w)`` norm weight (:func:`engine.hooks.norm_weight_offset`), and the
attention function's keyword arguments (Gemma 2's ``softcap`` of the scores; sliding windows come
in the mask transformers builds per layer). Gemma's embedding scale (``sqrt(d)``, inside the
scaled embedding module or after it) is linear, so attributing to the embedding module's output
gives the same products as attributing to block 0's input. Queries and keys (and Qwen 3's and
Gemma 3's q/k norms) meet only the frozen pattern, so they carry no gradient.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from engine.hooks import (
    READ_INPUT,
    READ_OUTPUT,
    HookError,
    HookSite,
    base_model_path,
    family_of,
    norm_weight_offset,
)
from engine.runtime import HookRuntime

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel

__all__ = ["FROZEN_ATTENTION", "FrozenRun", "ModelParts", "model_parts"]

FROZEN_ATTENTION = "mistudio_frozen_pattern"


@dataclass(frozen=True)
class _Family:
    blocks: str
    # The norms inside a block, in the order the block applies them.
    block_norms: tuple[str, ...]
    final_norm: str
    mlp: str
    token_embedding: str
    # "layer" (mean-centred, with a bias) or "rms"
    norm_kind: str
    # A projection whose output is queries, keys and values side by side (GPT-2's Conv1D c_attn).
    fused_qkv: str | None = None


_LLAMA = _Family(
    "layers", ("input_layernorm", "post_attention_layernorm"), "norm", "mlp", "embed_tokens", "rms"
)
# Gemma 2 and 3: a norm before and after each sub-layer.
_GEMMA2 = _Family(
    "layers",
    (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "norm",
    "mlp",
    "embed_tokens",
    "rms",
)
_FAMILIES = {
    "gpt2": _Family("h", ("ln_1", "ln_2"), "ln_f", "mlp", "wte", "layer", fused_qkv="attn.c_attn"),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma": _LLAMA,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA2,
}


@dataclass(frozen=True)
class ModelParts:
    """Module paths (in ``named_modules()``) of what attribution touches, and the unembedding."""

    n_layers: int
    block_norms: tuple[tuple[str, ...], ...]
    final_norm: str
    mlps: tuple[str, ...]
    token_embedding: str
    norm_kind: str
    fused_qkv: tuple[str, ...] = ()
    # Added to each norm's weight: 1 for Gemma's (1 + w) RMSNorm.
    norm_weight_offset: float = 0.0


def model_parts(model: PreTrainedModel) -> ModelParts:
    """The :class:`ModelParts` of a loaded model; ``UNSUPPORTED_ARCHITECTURE`` for other families."""
    family = family_of(model)
    if family not in _FAMILIES:
        raise HookError(
            "UNSUPPORTED_ARCHITECTURE",
            f"Attribution graphs are computed for {', '.join(sorted(_FAMILIES))} models, not {family}.",
            {"supported": sorted(_FAMILIES)},
        )
    parts = _FAMILIES[family]
    base = base_model_path(model)
    blocks = ".".join(p for p in (base, parts.blocks) if p)
    n_layers = len(model.get_submodule(blocks))
    return ModelParts(
        n_layers=n_layers,
        block_norms=tuple(
            tuple(f"{blocks}.{i}.{norm}" for norm in parts.block_norms) for i in range(n_layers)
        ),
        final_norm=".".join(p for p in (base, parts.final_norm) if p),
        mlps=tuple(f"{blocks}.{i}.{parts.mlp}" for i in range(n_layers)),
        token_embedding=".".join(p for p in (base, parts.token_embedding) if p),
        norm_kind=parts.norm_kind,
        fused_qkv=tuple(f"{blocks}.{i}.{parts.fused_qkv}" for i in range(n_layers))
        if parts.fused_qkv
        else (),
        norm_weight_offset=norm_weight_offset(model),
    )


# The run whose attention the registered function serves (one per thread or task).
_CURRENT: contextvars.ContextVar[FrozenRun | None] = contextvars.ContextVar("frozen_run", default=None)


class _AttentionModule(Protocol):
    """What the attention function reads of the attention module transformers passes it (each
    family's own class: they share no base but ``nn.Module``)."""

    layer_idx: int


def _frozen_attention(
    module: _AttentionModule,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor]:
    """Eager attention whose pattern is recorded detached on the first pass and replayed after.

    ``query`` [batch, heads, queries, head_dim]; ``key`` and ``value`` [batch, kv_heads, keys,
    head_dim]; ``attention_mask`` additive, broadcast to [batch, heads, queries, keys]. Returns
    the output [batch, queries, heads, head_dim] and the pattern [batch, heads, queries, keys], as
    transformers' attention functions do. ``softcap`` (Gemma 2) bends the scores to
    ``softcap * tanh(scores / softcap)`` before the mask, as the model's eager attention does
    (``dropout`` and the other keyword arguments are ignored)."""
    import torch

    run = _CURRENT.get()
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        value = value.repeat_interleave(groups, dim=1)
    layer = module.layer_idx
    pattern = None if run is None or run.recording else run.patterns.get(layer)
    if pattern is None:
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask
        pattern = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype).detach()
        if run is not None:
            run.patterns[layer] = pattern[:1]
    output = torch.matmul(pattern.to(value.dtype), value).transpose(1, 2).contiguous()
    return output, pattern


def _register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    if FROZEN_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(FROZEN_ATTENTION, _frozen_attention)
        AttentionMaskInterface.register(FROZEN_ATTENTION, eager_mask)


# Called per MLP with (layer, mlp input, mlp output), each [batch, tokens, d]; returns the output to
# use, or None to keep it.
MlpVisitor: TypeAlias = "Callable[[int, Tensor, Tensor], Tensor | None]"
# Called with the token embeddings [batch, tokens, d]; returns the embeddings to use (or None).
EmbeddingVisitor: TypeAlias = "Callable[[Tensor], Tensor | None]"


class FrozenRun:
    """A model with frozen attention patterns and norm scales, for passes over one prompt.

    ``with run.attached(mlp=..., embedding=..., final=...)`` hooks the model; ``run.forward(ids)``
    then runs it, recording the patterns and scales on the first pass and replaying them on the
    next (the scales only with ``freeze_norms``; without, later passes recompute them, as
    circuit-tracer's interventions do by default). ``mlp`` replaces each MLP's output;
    ``embedding`` sees (and may replace) the token embeddings; ``final`` receives the final norm's
    output.
    """

    def __init__(self, model: PreTrainedModel, *, freeze_norms: bool = True) -> None:
        self.model = model
        self.freeze_norms = freeze_norms
        self.parts = model_parts(model)
        # Per layer: the recorded pattern [1, heads, tokens, tokens].
        self.patterns: dict[int, Tensor] = {}
        # Per norm's path: the recorded scale [1, tokens, 1].
        self.scales: dict[str, Tensor] = {}
        self.recording = True

    @contextlib.contextmanager
    def attached(
        self,
        *,
        mlp: MlpVisitor,
        embedding: EmbeddingVisitor | None = None,
        final: Callable[[Tensor], None] | None = None,
    ) -> Iterator[FrozenRun]:
        _register_attention()
        parts = self.parts
        norms = [*(path for block in parts.block_norms for path in block), parts.final_norm]
        mlp_layer = {path: layer for layer, path in enumerate(parts.mlps)}
        sites = {f"{path}:in": HookSite(path, READ_INPUT) for path in norms}
        sites.update({f"{path}:out": HookSite(path, READ_OUTPUT) for path in norms})
        sites.update({f"{path}:in": HookSite(path, READ_INPUT) for path in parts.mlps})
        sites.update({f"{path}:out": HookSite(path, READ_OUTPUT) for path in parts.mlps})
        sites[f"{parts.token_embedding}:out"] = HookSite(parts.token_embedding, READ_OUTPUT)
        sites.update({f"{path}:in": HookSite(path, READ_INPUT) for path in parts.fused_qkv})
        sites.update({f"{path}:out": HookSite(path, READ_OUTPUT) for path in parts.fused_qkv})
        fused = set(parts.fused_qkv)
        inputs: dict[str, Tensor] = {}

        def visit(name: str, tensor: Tensor) -> Tensor | None:
            path, _, side = name.rpartition(":")
            if side == "in":
                inputs[path] = tensor
                return None
            if path == parts.token_embedding:
                return None if embedding is None else embedding(tensor)
            if path in mlp_layer:
                return mlp(mlp_layer[path], inputs.pop(path), tensor)
            if path in fused:
                return self._values_only(path, inputs.pop(path), tensor)
            normalised = self._frozen_norm(path, inputs.pop(path))
            if path == parts.final_norm and final is not None:
                final(normalised)
            return normalised

        self._runtime = HookRuntime(self.model, sites, visit, purpose="attributed")
        config = self.model.config
        previous = config._attn_implementation
        token = _CURRENT.set(self)
        config._attn_implementation = FROZEN_ATTENTION
        try:
            with self._runtime.attached():
                yield self
        finally:
            config._attn_implementation = previous
            _CURRENT.reset(token)

    def forward(self, input_ids: Tensor) -> None:
        """One pass over ``input_ids`` [batch, tokens] as far as the final norm (no LM head)."""
        import torch

        base = base_model_path(self.model)
        runner = self.model.get_submodule(base) if base else self.model
        self._runtime.begin_pass(*input_ids.shape)
        self._runtime.run(
            runner, input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False
        )
        self.recording = False

    def _values_only(self, path: str, x: Tensor, qkv: Tensor) -> Tensor | None:
        """A fused projection's output ``qkv`` [batch, tokens, 3d] (of ``x`` [batch, tokens, d])
        with gradients through the values only (None, to keep it, when it needs none): the queries
        and keys meet only the frozen pattern, so their gradient is zero, and without this the
        backward pass would multiply by the whole [d, 3d] weight (three times the work)."""
        import torch

        if not qkv.requires_grad:
            return None
        module = self.model.get_submodule(path)
        width = qkv.shape[-1] // 3
        values = torch.addmm(
            module.bias[2 * width :], x.reshape(-1, x.shape[-1]), module.weight[:, 2 * width :]
        )
        return torch.cat([qkv[..., : 2 * width].detach(), values.view(*x.shape[:-1], width)], -1)

    def _frozen_norm(self, path: str, x: Tensor) -> Tensor:
        """The norm at ``path`` of ``x`` [batch, tokens, d], its scale recorded or replayed."""
        import torch

        module = self.model.get_submodule(path)
        weight = module.weight
        eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None)
        if self.parts.norm_kind == "layer":
            centred = x - x.mean(-1, keepdim=True)
            scale = self._scale(path, lambda: (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt())
            out = centred / scale * weight
            return out + module.bias if module.bias is not None else out
        as_float = x.to(torch.float32)
        scale = self._scale(path, lambda: (as_float.pow(2).mean(-1, keepdim=True) + eps).sqrt())
        if self.parts.norm_weight_offset:  # Gemma: (1 + w), applied in float32 before the cast
            gain = weight.to(torch.float32) + self.parts.norm_weight_offset
            return (gain * (as_float / scale)).to(x.dtype)
        return weight * (as_float / scale).to(x.dtype)

    def _scale(self, path: str, compute: Callable[[], Tensor]) -> Tensor:
        """The scale [1, tokens, 1] of the norm at ``path``: ``compute()``'s first row, detached,
        when recording, not freezing norms or not recorded yet; else the recorded one."""
        if self.recording or path not in self.scales or not self.freeze_norms:
            self.scales[path] = compute().detach()[:1]
        return self.scales[path]
