"""describe(): check a model and measure it from its config, safetensors headers and file names."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError
from engine.inspection.families import (
    _CONTEXT_KEYS,
    _HEAD_KEYS,
    _HIDDEN_KEYS,
    _LAYER_KEYS,
    _TIED_BY_DEFAULT,
    DEFAULT_ARCHITECTURES,
    ENCODER_MODEL_TYPES,
    ROTARY_FAMILIES,
    ROTARY_TABLE_PER_LAYER_TYPE,
    SCALED_EMBEDDING_FAMILIES,
    SUPPORTED_MODEL_TYPES,
)

PICKLE_WEIGHT_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".ckpt", ".pth", ".pkl")
SAFETENSORS_SINGLE_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# Bytes per element of each safetensors dtype (F4 and F6 pack below one byte).
SAFETENSORS_DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "F4": 0.5,
    "F6_E2M3": 0.75,
    "F6_E3M2": 0.75,
}

# Sanity bounds: a config beyond these is corrupt or hostile, not a real model.
MAX_HIDDEN_SIZE = 1_000_000
MAX_LAYERS = 1_000_000
MAX_VOCAB_SIZE = 10_000_000
MAX_CONTEXT_LENGTH = 1_000_000_000

# Name fragments of the weights bitsandbytes leaves alone although they are 2-D: input
# embeddings (not Linear layers) and the output head (transformers skips it on purpose).
_EMBEDDING_MARKERS: tuple[str, ...] = ("embed", "wte", "wpe")
_OUTPUT_HEAD_NAMES: tuple[str, ...] = ("lm_head.weight", "embed_out.weight")
_TOKEN_EMBEDDING_MODULES: frozenset[str] = frozenset({"wte", "embed_tokens", "embed_in", "word_embeddings"})


class InspectionError(EngineError):
    """A model refused before loading (``INVALID_MODEL``, ``UNSUPPORTED_ARCHITECTURE``, …)."""


@dataclass
class ModelInfo:
    """What :func:`describe` learns from a config and safetensors headers."""

    model_type: str
    family: str
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    context_length: int | None
    # Exactly what ``model.num_parameters()`` reports after loading (tied weights once).
    parameter_count: int
    # Bytes of tensor data in the weight files (the download size of the weights).
    weight_bytes: int
    is_encoder: bool
    config: dict[str, Any]
    # Elements of the 2-D Linear weights bitsandbytes quantizes (not embeddings nor the head).
    quantizable_parameter_count: int = 0
    # Bytes of the buffers the loaded model registers (masks, rotary tables, position ids).
    buffer_bytes: int = 0


def _invalid(message: str, **details: Any) -> InspectionError:
    return InspectionError("INVALID_MODEL", message, details)


def _find_remote_code(config: dict[str, Any], tokenizer_config: dict[str, Any] | None) -> str | None:
    """The first config key that would make transformers import code shipped with the model."""
    for source, mapping in (("config.json", config), ("tokenizer_config.json", tokenizer_config or {})):
        for key in ("auto_map", "custom_pipelines"):
            if mapping.get(key):
                return f"{source}: {key}"
        # Composite configs (text_config, vision_config, ...) may carry their own auto_map.
        for key, value in mapping.items():
            for inner in ("auto_map", "custom_pipelines"):
                if isinstance(value, dict) and value.get(inner):
                    return f"{source}: {key}.{inner}"
    return None


def safetensors_weight_files(file_names: list[str], index: dict[str, Any] | None = None) -> list[str]:
    """The safetensors files transformers reads for a model, as names relative to its folder.

    A sharded checkpoint is described by ``model.safetensors.index.json`` (pass its parsed
    content as ``index``); otherwise the weights are ``model.safetensors``. Other
    ``.safetensors`` files (``consolidated.safetensors``, adapters) are not part of the model.
    """
    top_level = {name for name in file_names if "/" not in name}
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise _invalid(f"{SAFETENSORS_INDEX_FILE} has no weight_map.")
        shards = sorted({str(shard) for shard in weight_map.values()})
        for shard in shards:
            if "/" in shard or "\\" in shard or shard.startswith(".") or not shard.endswith(".safetensors"):
                raise _invalid(f"{SAFETENSORS_INDEX_FILE} names an invalid shard file.")
            if shard not in top_level:
                raise _invalid(f"The shard {shard} named in {SAFETENSORS_INDEX_FILE} is missing.")
        return shards
    if SAFETENSORS_SINGLE_FILE in top_level:
        return [SAFETENSORS_SINGLE_FILE]
    return []


def _check_weight_files(file_names: list[str]) -> None:
    top_level = [name for name in file_names if "/" not in name]
    if any(name in (SAFETENSORS_SINGLE_FILE, SAFETENSORS_INDEX_FILE) for name in top_level):
        return
    if any(name.endswith(".safetensors") for name in top_level):
        raise _invalid(
            f"The model has .safetensors files but neither {SAFETENSORS_SINGLE_FILE} nor "
            f"{SAFETENSORS_INDEX_FILE}, so transformers cannot load it."
        )
    if any(name.lower().endswith(PICKLE_WEIGHT_SUFFIXES) for name in top_level):
        raise InspectionError(
            "UNSAFE_WEIGHTS",
            "The model has only pickle-based weights (.bin/.pt/.ckpt/.pth/.pkl); only .safetensors "
            "weights are loaded, because unpickling can run arbitrary code.",
        )
    raise _invalid("The model has no weight files.")


def _config_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` present in ``config``; present but not a whole number is invalid."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_number or not math.isfinite(value) or value != int(value):
            raise _invalid(f"config.json: {key} is not a whole number.", field=key)
        return int(value)
    return None


def _check_bounds(name: str, value: int, upper: int) -> int:
    if not 0 < value <= upper:
        raise _invalid(f"config.json: {name} = {value} is outside 1..{upper}.", field=name)
    return value


def _element_count(shape: list[int]) -> int:
    return math.prod(shape)


def _is_saved_buffer(name: str, shape: list[int]) -> bool:
    """Buffers some checkpoints store beside the weights (they are not parameters).

    Older GPT-2/GPT-J/GPT-Neo(X) checkpoints saved each layer's causal mask (``attn.bias``, a
    4-D tensor, not to be confused with ``attn.c_attn.bias``) and ``masked_bias``; old Llama
    and NeoX ones ``rotary_emb.inv_freq``; BERT ones ``position_ids``.
    """
    if name.endswith((".masked_bias", ".inv_freq", "position_ids")):
        return True
    return name.endswith((".attn.bias", ".attention.bias")) and len(shape) >= 4


def _module_name(name: str) -> str:
    """``wte`` for ``transformer.wte.weight``: the last part of the owning module's path."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else name


def _is_embedding(name: str) -> bool:
    return any(marker in _module_name(name) for marker in _EMBEDDING_MARKERS)


def _is_output_head(name: str) -> bool:
    return name in _OUTPUT_HEAD_NAMES or name.endswith(tuple("." + head for head in _OUTPUT_HEAD_NAMES))


def is_quantizable_weight(name: str, shape: list[int]) -> bool:
    """A Linear (or Conv1D) weight that bitsandbytes replaces: 2-D, not an embedding or the head."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    return not _is_embedding(name) and not _is_output_head(name)


def _validated_tensors(
    tensor_shapes: dict[str, tuple[list[int], str]],
) -> list[tuple[str, list[int], str]]:
    if not isinstance(tensor_shapes, dict) or not tensor_shapes:
        raise _invalid("The weight files hold no tensors.")
    tensors = []
    for name, entry in tensor_shapes.items():
        try:
            shape, dtype = entry
            shape = [int(size) for size in shape]
        except (TypeError, ValueError):
            raise _invalid("A safetensors header entry is malformed.", tensor=str(name)[:200]) from None
        if any(size < 0 for size in shape) or dtype not in SAFETENSORS_DTYPE_BYTES:
            raise _invalid("A safetensors header entry is malformed.", tensor=str(name)[:200])
        tensors.append((str(name), shape, dtype))
    return tensors


def _buffer_bytes(family: str, config: dict[str, Any], hidden: int, layers: int, context: int | None) -> int:
    """Bytes of the buffers transformers 5 registers, which ``get_memory_footprint()`` counts.

    They keep their own dtype whatever the quantization. Only GPT-Neo's boolean causal masks
    (context² bytes per layer) and GPT-J's sinusoid tables are large enough to matter.
    """
    positions = context or 0
    heads = _config_int(config, _HEAD_KEYS.get(family, ("num_attention_heads",))) or 1
    head_dim = max(hidden // max(heads, 1), 1)
    if family == "gpt_neo":
        return layers * positions * positions
    if family == "gptj":
        rotary_dim = _config_int(config, ("rotary_dim",)) or head_dim
        return layers * positions * rotary_dim * 4
    if family == "bert":
        return 2 * positions * 8  # position_ids and token_type_ids, int64
    if family in ROTARY_FAMILIES:
        return _rotary_bytes(family, config, head_dim) + (4 if family in SCALED_EMBEDDING_FAMILIES else 0)
    return 0


def _rotary_bytes(family: str, config: dict[str, Any], head_dim: int) -> int:
    """inv_freq and original_inv_freq (float32, head_dim / 2 each) per rotary table; the head
    width is the config's head_dim where it has one (Gemma's and Qwen3's differ from
    hidden / heads)."""
    head_dim = _config_int(config, ("head_dim",)) or head_dim
    tables = 1
    layer_types = config.get("layer_types")
    if family in ROTARY_TABLE_PER_LAYER_TYPE and isinstance(layer_types, list) and layer_types:
        tables = len({str(kind) for kind in layer_types})
    return tables * 2 * (head_dim // 2) * 4


def describe(
    config: dict[str, Any],
    tensor_shapes: dict[str, tuple[list[int], str]],
    file_names: list[str],
    *,
    tokenizer_config: dict[str, Any] | None = None,
) -> ModelInfo:
    """Check a model and describe it from its config, safetensors headers and file names.

    ``tensor_shapes`` maps each tensor name in the weight files to ``(shape, dtype)`` with the
    safetensors dtype string (``"F32"``, ``"BF16"``, ...). ``file_names`` are the paths in the
    model's folder or repository. Raises :class:`InspectionError` for a model miStudio will
    not load.
    """
    model_type, family = _checked_family(config, tokenizer_config)
    _check_weight_files(file_names)
    tensors = _validated_tensors(tensor_shapes)
    weight_bytes = int(
        sum(_element_count(shape) * SAFETENSORS_DTYPE_BYTES[dtype] for _, shape, dtype in tensors)
    )
    # BertModel (what AutoModel builds) has no pre-training heads; a BertForMaskedLM
    # checkpoint's "cls." tensors are not loaded.
    if family == "bert":
        tensors = [tensor for tensor in tensors if not tensor[0].startswith("cls.")]
    parameters = [(name, shape) for name, shape, _ in tensors if not _is_saved_buffer(name, shape)]
    input_embedding = _input_embedding(parameters)
    sizes = _sizes(config, family, input_embedding)
    parameters = _loaded_parameters(config, family, parameters, input_embedding)
    return ModelInfo(
        model_type=model_type,
        family=family,
        architecture=_architecture(config, family),
        hidden_size=sizes.hidden,
        num_layers=sizes.layers,
        vocab_size=sizes.vocab,
        context_length=sizes.context,
        parameter_count=sum(_element_count(shape) for _, shape in parameters),
        weight_bytes=weight_bytes,
        is_encoder=model_type in ENCODER_MODEL_TYPES,
        config=config,
        quantizable_parameter_count=sum(
            _element_count(shape) for name, shape in parameters if is_quantizable_weight(name, shape)
        ),
        buffer_bytes=_buffer_bytes(family, config, sizes.hidden, sizes.layers, sizes.context),
    )


def _checked_family(config: Any, tokenizer_config: dict[str, Any] | None) -> tuple[str, str]:
    """The config's model type and its family, refusing remote code and unsupported types first."""
    if not isinstance(config, dict):
        raise _invalid("config.json is not a JSON object.")
    remote_code = _find_remote_code(config, tokenizer_config)
    if remote_code:
        raise InspectionError(
            "REMOTE_CODE_NOT_ALLOWED",
            "The model asks to run its own Python code, which miStudio never does.",
            {"reference": remote_code},
        )
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise _invalid("config.json has no model_type.")
    family = SUPPORTED_MODEL_TYPES.get(model_type)
    if family is None:
        raise InspectionError(
            "UNSUPPORTED_ARCHITECTURE",
            f"Model type {model_type[:100]!r} is not supported.",
            {"model_type": model_type[:100], "supported": sorted(SUPPORTED_MODEL_TYPES)},
        )
    return model_type, family


def _input_embedding(parameters: list[tuple[str, list[int]]]) -> tuple[str, list[int]] | None:
    """The token embedding: the one named so, else the embedding matrix with the most rows
    (position and token-type tables are smaller than any real vocabulary)."""
    embeddings = [
        (name, shape)
        for name, shape in parameters
        if len(shape) == 2 and _is_embedding(name) and not _is_output_head(name)
    ]
    named = [item for item in embeddings if _module_name(item[0]) in _TOKEN_EMBEDDING_MODULES]
    return max(named or embeddings, key=lambda item: item[1][0], default=None)


@dataclass(frozen=True)
class _Sizes:
    hidden: int
    layers: int
    vocab: int
    context: int | None


def _sizes(config: dict[str, Any], family: str, input_embedding: tuple[str, list[int]] | None) -> _Sizes:
    """The model's sizes from its config, the embedding's shape filling in what the config lacks,
    each within its sanity bound."""
    hidden = _config_int(config, _HIDDEN_KEYS.get(family, ("hidden_size",)))
    vocab = _config_int(config, ("vocab_size",))
    layers = _config_int(config, _LAYER_KEYS.get(family, ("num_hidden_layers",)))
    if hidden is None and input_embedding is not None:
        hidden = input_embedding[1][1]
    if vocab is None and input_embedding is not None:
        vocab = input_embedding[1][0]
    if hidden is None or vocab is None or layers is None:
        raise _invalid("config.json lacks the hidden size, vocabulary size or layer count.")
    hidden = _check_bounds("hidden_size", hidden, MAX_HIDDEN_SIZE)
    layers = _check_bounds("num_layers", layers, MAX_LAYERS)
    vocab = _check_bounds("vocab_size", vocab, MAX_VOCAB_SIZE)
    context = _config_int(config, _CONTEXT_KEYS.get(family, ("max_position_embeddings",)))
    if context is not None:
        context = _check_bounds("context_length", context, MAX_CONTEXT_LENGTH)
    return _Sizes(hidden=hidden, layers=layers, vocab=vocab, context=context)


def _loaded_parameters(
    config: dict[str, Any],
    family: str,
    parameters: list[tuple[str, list[int]]],
    input_embedding: tuple[str, list[int]] | None,
) -> list[tuple[str, list[int]]]:
    """The parameters the model holds once loaded: a checkpoint that stores the tied head anyway
    loads it into the embedding's parameter, so it is not counted twice."""
    if not config.get("tie_word_embeddings", _TIED_BY_DEFAULT[family]) or input_embedding is None:
        return parameters
    return [
        (name, shape)
        for name, shape in parameters
        if not (_is_output_head(name) and shape == input_embedding[1])
    ]


def _architecture(config: dict[str, Any], family: str) -> str:
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        return str(architectures[0])[:100]
    return DEFAULT_ARCHITECTURES[family]
