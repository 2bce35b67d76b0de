"""Hook points: one vocabulary of activation sites, mapped onto each architecture family's modules.

Canonical names (ARCHITECTURE.md, "Hook points"):

* ``hook_embed``: the token (+ position) embedding, i.e. the input of block 0;
* ``blocks.{i}.hook_resid_pre`` / ``blocks.{i}.hook_resid_post``: the residual stream entering /
  leaving block ``i`` (input / output of the block module);
* ``blocks.{i}.hook_attn_out`` / ``blocks.{i}.hook_mlp_out``: the attention / MLP sub-layer output
  before it is added to the residual stream (also in parallel-attention blocks);
* ``blocks.{i}.ln2.hook_normalized``: the MLP's input, after the block's second norm (a
  transcoder's usual input; TransformerLens' name);
* ``blocks.{i}.mlp.hook_post``: the MLP neurons, i.e. the input of the MLP's down projection
  (``act(x W_in)`` or, for gated MLPs, ``act(gate(x)) * up(x)``);
* ``ln_final.hook_normalized``: the output of the final norm (absent for BERT, which has none);
* ``module:<dotted.path>``: the output (first tensor of a tuple) of any module of
  ``model.named_modules()``, looked up by name in that mapping and never evaluated.

Each name resolves to a :class:`HookSite`: a module path and whether its forward *output* or
its forward *input* (a pre-hook) is read. Nothing here imports torch, transformers or Django.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError
from engine.inspection import SUPPORTED_MODEL_TYPES

__all__ = [
    "HOOK_EMBED",
    "LN_FINAL",
    "MODULE_PREFIX",
    "READ_INPUT",
    "READ_OUTPUT",
    "HookError",
    "HookPointInfo",
    "HookSite",
    "base_model_path",
    "family_of",
    "hook_depth",
    "hook_site",
    "hook_sites",
    "layer_of_transcoder_hooks",
    "list_hook_points",
    "norm_weight_offset",
    "num_layers",
    "resolve_hook_names",
    "transcoder_hooks",
]

HOOK_EMBED = "hook_embed"
LN_FINAL = "ln_final.hook_normalized"
MODULE_PREFIX = "module:"
RESID_PRE = "hook_resid_pre"
RESID_POST = "hook_resid_post"
ATTN_OUT = "hook_attn_out"
MLP_OUT = "hook_mlp_out"
MLP_POST = "mlp.hook_post"
MLP_IN = "ln2.hook_normalized"
# In the order a block computes them.
BLOCK_HOOKS: tuple[str, ...] = (RESID_PRE, ATTN_OUT, MLP_IN, MLP_POST, MLP_OUT, RESID_POST)
_BLOCK_HOOK_NAME = re.compile(r"blocks\.(0|[1-9][0-9]*)\.(" + "|".join(map(re.escape, BLOCK_HOOKS)) + r")")

READ_OUTPUT = "output"
READ_INPUT = "input"

# Above this many canonical names an error lists name patterns instead of every name.
_MAX_LISTED_NAMES = 64


class HookError(EngineError):
    """A hook point request that cannot be served; ``INVALID_HOOK`` lists the bad and valid names."""


@dataclass(frozen=True)
class HookPointInfo:
    name: str
    # The block the point belongs to; None for hook_embed and ln_final.hook_normalized.
    layer: int | None
    # The size of the last dimension stored: the hidden size, or the MLP width for mlp.hook_post.
    width: int


@dataclass(frozen=True)
class HookSite:
    """Where a hook point is read: the module's forward ``output`` or its forward ``input``."""

    module_path: str
    reads: str


@dataclass(frozen=True)
class _Layout:
    """Where a family keeps its parts: ``blocks`` and ``final_norm`` relative to the base model,
    the others relative to one block."""

    blocks: str
    final_norm: str | None
    # A module whose output (first element) is the attention sub-layer's contribution.
    attention: str
    # A module whose output is the MLP sub-layer's contribution.
    mlp: str
    # The MLP's down projection, whose input is the neurons.
    down_projection: str
    # A module whose input (first tensor) is the MLP's input, after the block's second norm.
    mlp_input: str = "mlp"
    # Added to a norm's weight to give its elementwise scale: Gemma's RMSNorm multiplies by (1 + w).
    norm_weight_offset: float = 0.0


_LLAMA_LAYOUT = _Layout("layers", "norm", "self_attn", "mlp", "mlp.down_proj")
# Gemma 2 and 3 normalise each sub-layer's output before the residual add: what is added is the
# output of post_attention_layernorm / post_feedforward_layernorm, and the MLP reads
# pre_feedforward_layernorm's output.
_GEMMA_LAYOUT = _Layout("layers", "norm", "self_attn", "mlp", "mlp.down_proj", norm_weight_offset=1.0)
_GEMMA2_LAYOUT = _Layout(
    "layers",
    "norm",
    "post_attention_layernorm",
    "post_feedforward_layernorm",
    "mlp.down_proj",
    norm_weight_offset=1.0,
)
_LAYOUTS: dict[str, _Layout] = {
    "gpt2": _Layout("h", "ln_f", "attn", "mlp", "mlp.c_proj"),
    "gpt_neo": _Layout("h", "ln_f", "attn", "mlp", "mlp.c_proj"),
    "gptj": _Layout("h", "ln_f", "attn", "mlp", "mlp.fc_out"),
    "llama": _LLAMA_LAYOUT,
    "mistral": _LLAMA_LAYOUT,
    "qwen2": _LLAMA_LAYOUT,
    "qwen3": _LLAMA_LAYOUT,
    "gemma": _GEMMA_LAYOUT,
    "gemma2": _GEMMA2_LAYOUT,
    "gemma3_text": _GEMMA2_LAYOUT,
    "gpt_neox": _Layout("layers", "final_layer_norm", "attention", "mlp", "mlp.dense_4h_to_h"),
    "falcon": _Layout("h", "ln_f", "self_attention", "mlp", "mlp.dense_4h_to_h"),
    # BloomAttention and BloomMLP add the residual inside their forward, so their outputs are
    # residual streams; the sub-layer contributions are their output projections' outputs.
    "bloom": _Layout("h", "ln_f", "self_attention.dense", "mlp.dense_4h_to_h", "mlp.dense_4h_to_h"),
    # BERT is post-LN: each sub-layer ends in projection -> dropout -> LayerNorm(x + residual);
    # the contribution before the residual add is the projection's output (dropout is off in eval).
    "bert": _Layout(
        "encoder.layer", None, "attention.output.dense", "output.dense", "output.dense", "intermediate.dense"
    ),
}


def family_of(model: Any) -> str:
    """The architecture family of a loaded transformers model (``config.model_type`` mapped)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = SUPPORTED_MODEL_TYPES.get(model_type or "")
    if family is None or family not in _LAYOUTS:
        raise HookError(
            "UNSUPPORTED_ARCHITECTURE",
            f"Hook points are not defined for model type {model_type!r}.",
            {"model_type": model_type, "supported": sorted(_LAYOUTS)},
        )
    return family


def base_model_path(model: Any) -> str:
    """The path of the base model (the transformer without its LM head) in ``named_modules()``;
    "" when ``model`` is itself the base model (e.g. ``BertModel``)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    inner = getattr(model, prefix, None) if prefix else None
    return prefix if inner is not None and inner is not model and hasattr(inner, "forward") else ""


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _blocks_path(model: Any) -> str:
    return _join(base_model_path(model), _LAYOUTS[family_of(model)].blocks)


def num_layers(model: Any) -> int:
    """How many blocks the model has."""
    return len(model.get_submodule(_blocks_path(model)))


def norm_weight_offset(model: Any) -> float:
    """What the family's norms add to their weight to scale a normalised vector: 0 for ``x * w``,
    1 for Gemma's ``x * (1 + w)``."""
    return _LAYOUTS[family_of(model)].norm_weight_offset


def _has_sublayer_sites(model: Any) -> bool:
    # BLOOM's "slow but exact" tensor-parallel emulation applies slices of the projection
    # weights with F.linear, so the projection modules never run and cannot be hooked.
    config = model.config
    if family_of(model) == "bloom":
        return not (getattr(config, "slow_but_exact", False) and getattr(config, "pretraining_tp", 1) > 1)
    return True


def _mlp_width(model: Any) -> int:
    down = model.get_submodule(_join(_blocks_path(model), "0", _LAYOUTS[family_of(model)].down_projection))
    # nn.Linear (and bitsandbytes' subclasses) say in_features; GPT-2's Conv1D says nx.
    for attribute in ("in_features", "nx"):
        width = getattr(down, attribute, None)
        if isinstance(width, int):
            return width
    config = model.config
    for key in ("intermediate_size", "n_inner", "ffn_hidden_size"):
        width = getattr(config, key, None)
        if isinstance(width, int):
            return width
    return 4 * int(config.hidden_size)


def _block_hooks(model: Any) -> tuple[str, ...]:
    if _has_sublayer_sites(model):
        return BLOCK_HOOKS
    return (RESID_PRE, RESID_POST)


def list_hook_points(model: Any) -> list[HookPointInfo]:
    """Every canonical hook point of ``model``, in the order the forward pass produces them.

    ``module:`` names are accepted by :func:`resolve_hook_names` but not listed.
    """
    layout = _LAYOUTS[family_of(model)]
    hidden = int(model.config.hidden_size)
    block_hooks = _block_hooks(model)
    mlp_width = _mlp_width(model) if MLP_POST in block_hooks else hidden
    points = [HookPointInfo(HOOK_EMBED, None, hidden)]
    for layer in range(num_layers(model)):
        points.extend(
            HookPointInfo(f"blocks.{layer}.{hook}", layer, mlp_width if hook == MLP_POST else hidden)
            for hook in block_hooks
        )
    if layout.final_norm is not None:
        points.append(HookPointInfo(LN_FINAL, None, hidden))
    return points


def _module_names(model: Any) -> set[str]:
    return {name for name, _ in model.named_modules() if name}


def _valid_names_description(model: Any, canonical: list[str]) -> list[str]:
    if len(canonical) <= _MAX_LISTED_NAMES:
        return [*canonical, f"{MODULE_PREFIX}<a name from named_modules()>"]
    patterns = [HOOK_EMBED, *(f"blocks.{{i}}.{hook}" for hook in _block_hooks(model))]
    if LN_FINAL in canonical:
        patterns.append(LN_FINAL)
    return [*patterns, f"{MODULE_PREFIX}<a name from named_modules()>"]


def resolve_hook_names(
    model: Any, names: list[str] | None = None, layers: list[int] | None = None
) -> list[str]:
    """Validate hook point names for ``model``; return them with ``layers`` expanded, without repeats.

    ``layers=[0, 6]`` is shorthand for ``blocks.0.hook_resid_post`` and ``blocks.6.hook_resid_post``,
    appended after ``names``. Order is kept (first occurrence wins). Raises :class:`HookError`
    (``INVALID_HOOK``) listing every invalid name at once, or when nothing is requested.
    """
    canonical = [point.name for point in list_hook_points(model)]
    known = set(canonical)
    module_names: set[str] | None = None
    resolved: list[str] = []
    invalid: list[str] = []
    for name, well_typed in _requested_hooks(names, layers):
        valid = well_typed
        if valid and name.startswith(MODULE_PREFIX):
            module_names = _module_names(model) if module_names is None else module_names
            valid = name[len(MODULE_PREFIX) :] in module_names
        elif valid:
            valid = name in known
        chosen = resolved if valid else invalid
        if name not in chosen:
            chosen.append(name)

    if invalid or not resolved:
        message = (
            f"Unknown hook point{'s' if len(invalid) > 1 else ''}: {', '.join(invalid)}."
            if invalid
            else "At least one hook point (or layer) is required."
        )
        raise HookError(
            "INVALID_HOOK",
            message,
            {
                "invalid": invalid,
                "valid": _valid_names_description(model, canonical),
                "num_layers": num_layers(model),
            },
        )
    return resolved


def _requested_hooks(names: list[str] | None, layers: list[int] | None) -> list[tuple[str, bool]]:
    """(name, whether its type is valid) in request order, so that invalid names are reported in
    the order given: ``names``, then each of ``layers`` as its residual stream's hook point."""
    requested: list[tuple[str, bool]] = [
        (name, True) if isinstance(name, str) else (repr(name), False) for name in names or []
    ]
    for layer in layers or []:
        if isinstance(layer, int) and not isinstance(layer, bool):
            requested.append((f"blocks.{layer}.{RESID_POST}", True))
        else:
            requested.append((f"layers: {layer!r}", False))
    return requested


MAX_HOOK_NAME_LENGTH = 300  # what a row's hook_name column holds
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


def is_hook_name(name: Any) -> bool:
    """Whether ``name`` is shaped like a hook point name (canonical, or ``module:`` and a dotted
    path), of at most ``MAX_HOOK_NAME_LENGTH`` characters: what may be stored without a model to
    check it against."""
    if not isinstance(name, str) or len(name) > MAX_HOOK_NAME_LENGTH:
        return False
    if name.startswith(MODULE_PREFIX):
        return bool(_MODULE_PATH.fullmatch(name[len(MODULE_PREFIX) :]))
    return name in (HOOK_EMBED, LN_FINAL) or _BLOCK_HOOK_NAME.fullmatch(name) is not None


def transcoder_hooks(layer: int) -> tuple[str, str]:
    """The hook pair a layer's MLP transcoder reads and writes: the MLP's input after the block's
    second norm, and the MLP's output (what circuit-tracer's per-layer transcoders stand in for)."""
    return f"blocks.{layer}.{MLP_IN}", f"blocks.{layer}.{MLP_OUT}"


def every_transcoder_hook(n_layers: int) -> list[str]:
    """Every layer's :func:`transcoder_hooks`, layer 0 first, input before output: what a
    cross-layer transcoder (or one transcoder per layer) reads and writes."""
    return [name for layer in range(n_layers) for name in transcoder_hooks(layer)]


def layer_of_transcoder_hooks(hook_in: Any, hook_out: Any) -> int | None:
    """The layer whose MLP a transcoder reading ``hook_in`` and writing ``hook_out`` stands in
    for; None when the pair is not :func:`transcoder_hooks` of any layer."""
    parsed = _parse_block_name(hook_in) if isinstance(hook_in, str) else None
    if parsed is None or parsed[1] != MLP_IN or hook_out != transcoder_hooks(parsed[0])[1]:
        return None
    return parsed[0]


def _parse_block_name(name: str) -> tuple[int, str] | None:
    match = _BLOCK_HOOK_NAME.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def _check_known(model: Any, name: str) -> None:
    resolve_hook_names(model, [name])


def hook_site(model: Any, name: str) -> HookSite:
    """The module and reading (output or input) that produce hook point ``name``."""
    _check_known(model, name)
    return _site(model, name)


def hook_sites(model: Any, names: list[str]) -> dict[str, HookSite]:
    """:func:`hook_site` of each name (validated once, together), in the order given."""
    return {name: _site(model, name) for name in resolve_hook_names(model, names)}


def _site(model: Any, name: str) -> HookSite:
    if name.startswith(MODULE_PREFIX):
        return HookSite(name[len(MODULE_PREFIX) :], READ_OUTPUT)
    layout = _LAYOUTS[family_of(model)]
    blocks = _blocks_path(model)
    if name == HOOK_EMBED:
        # The block's input is the embedding output after any embedding dropout or norm
        # (BLOOM's word_embeddings_layernorm), i.e. exactly what block 0 receives.
        return HookSite(_join(blocks, "0"), READ_INPUT)
    if name == LN_FINAL:
        return HookSite(_join(base_model_path(model), layout.final_norm or ""), READ_OUTPUT)
    parsed = _parse_block_name(name)
    assert parsed is not None  # the name was validated by the caller
    layer, hook = parsed
    block = _join(blocks, str(layer))
    sites = {
        RESID_PRE: HookSite(block, READ_INPUT),
        RESID_POST: HookSite(block, READ_OUTPUT),
        ATTN_OUT: HookSite(_join(block, layout.attention), READ_OUTPUT),
        MLP_OUT: HookSite(_join(block, layout.mlp), READ_OUTPUT),
        MLP_IN: HookSite(_join(block, layout.mlp_input), READ_INPUT),
        MLP_POST: HookSite(_join(block, layout.down_projection), READ_INPUT),
    }
    return sites[hook]


def hook_depth(model: Any, name: str) -> int:
    """The index of the last block that must run to produce ``name``.

    -1 for ``hook_embed``; ``num_layers`` for ``ln_final.hook_normalized`` and for ``module:``
    paths outside the blocks (they may need the whole model); a ``module:`` path inside block
    ``i`` gives ``i``.
    """
    _check_known(model, name)
    total = num_layers(model)
    if name == HOOK_EMBED:
        return -1
    if name == LN_FINAL:
        return total
    if name.startswith(MODULE_PREFIX):
        blocks = _blocks_path(model) + "."
        path = name[len(MODULE_PREFIX) :]
        if path.startswith(blocks):
            index = path[len(blocks) :].split(".", 1)[0]
            if index.isdigit():
                return int(index)
        return total
    parsed = _parse_block_name(name)
    assert parsed is not None
    return parsed[0]
