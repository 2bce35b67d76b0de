"""What a model is, before any weight is loaded: family, geometry, exact size, memory per option.

:func:`describe` is the shared core. It takes a ``config.json`` dict, the tensor shapes and
dtypes from the safetensors headers, and the file names, so the same rules apply to a local
folder (:func:`inspect_folder`) and to a hub repository (whose headers are fetched remotely).
Nothing here loads weight data or unpickles anything, and nothing imports torch, transformers
or Django: the web process calls it on every registration.

Refusals are :class:`InspectionError` with a stable ``code``:

* ``INVALID_MODEL``: no or unreadable ``config.json``, no loadable weights, absurd sizes;
* ``UNSUPPORTED_ARCHITECTURE``: a ``model_type`` outside :data:`SUPPORTED_MODEL_TYPES`;
* ``UNSAFE_WEIGHTS``: only pickle-based weights (``.bin``, ``.pt``, ...), no safetensors;
* ``REMOTE_CODE_NOT_ALLOWED``: the config (or tokenizer config) asks for custom code;
* ``UNSAFE_PATH``: an entry of a local folder links to a place outside the allowed roots
  (see :func:`confined_folder_entries`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EngineError

QUANTIZATIONS: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "int4")
BITSANDBYTES_QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")

# HF config ``model_type`` -> architecture family (ARCHITECTURE.md). Llama, Mistral and Qwen2
# share one module layout but stay separate families, as they are separate model types.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "gpt2": "gpt2",
    "gpt_neo": "gpt_neo",
    "gptj": "gptj",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "gpt_neox": "gpt_neox",
    "falcon": "falcon",
    "bloom": "bloom",
    "bert": "bert",
}
ENCODER_MODEL_TYPES: frozenset[str] = frozenset({"bert"})

# transformers 5 swaps in bitsandbytes layers only for modules whose type is exactly
# ``nn.Linear`` (or GPT-2's ``Conv1D``). Falcon's layers are ``FalconLinear``, a subclass, so
# an int8/int4 load of Falcon would silently give an unquantized bf16 model: not offered.
BITSANDBYTES_UNSUPPORTED_FAMILIES: frozenset[str] = frozenset({"falcon"})
# Device types bitsandbytes 0.50 runs int8 / nf4 on (no MPS backend).
BITSANDBYTES_DEVICE_TYPES: frozenset[str] = frozenset({"cpu", "cuda", "xpu"})

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
MAX_CONFIG_BYTES = 10 * 1024 * 1024
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# Per family: config keys for hidden size, layer count and context length, first match wins
# (legacy spellings included); the model class Auto* gives when "architectures" is missing;
# whether the output head is tied to the input embedding when the config does not say.
_HIDDEN_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_embd", "hidden_size"),
    "gptj": ("n_embd", "hidden_size"),
    "bloom": ("hidden_size", "n_embed"),
}
_LAYER_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_layer", "num_hidden_layers"),
    "gpt_neo": ("num_layers", "num_hidden_layers"),
    "gptj": ("n_layer", "num_hidden_layers"),
    "falcon": ("num_hidden_layers", "n_layer"),
    "bloom": ("n_layer", "num_hidden_layers"),
}
_CONTEXT_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_positions", "n_ctx", "max_position_embeddings"),
    "gptj": ("n_positions", "max_position_embeddings"),
    # BLOOM uses ALiBi and has no position limit of its own; some configs record the
    # training length as seq_length.
    "bloom": ("seq_length",),
}
_HEAD_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_head", "num_attention_heads"),
    "gptj": ("n_head", "num_attention_heads"),
    "gpt_neo": ("num_heads", "num_attention_heads"),
}
DEFAULT_ARCHITECTURES: dict[str, str] = {
    "gpt2": "GPT2LMHeadModel",
    "gpt_neo": "GPTNeoForCausalLM",
    "gptj": "GPTJForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "falcon": "FalconForCausalLM",
    "bloom": "BloomForCausalLM",
    "bert": "BertModel",
}
_TIED_BY_DEFAULT: dict[str, bool] = {
    "gpt2": True,
    "gpt_neo": True,
    "gptj": False,
    "llama": False,
    "mistral": False,
    "qwen2": False,
    "gpt_neox": False,
    "falcon": True,
    "bloom": True,
    "bert": True,
}
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


def _is_quantizable_weight(name: str, shape: list[int]) -> bool:
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
    if family in ("llama", "mistral", "qwen2", "gpt_neox", "falcon"):
        return 2 * (head_dim // 2) * 4  # inv_freq and original_inv_freq, float32
    return 0


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

    # The token embedding: the one named so, else the embedding matrix with the most rows
    # (position and token-type tables are smaller than any real vocabulary).
    embeddings = [
        (name, shape)
        for name, shape in parameters
        if len(shape) == 2 and _is_embedding(name) and not _is_output_head(name)
    ]
    named = [item for item in embeddings if _module_name(item[0]) in _TOKEN_EMBEDDING_MODULES]
    input_embedding = max(named or embeddings, key=lambda item: item[1][0], default=None)

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

    if config.get("tie_word_embeddings", _TIED_BY_DEFAULT[family]) and input_embedding is not None:
        # A checkpoint that stores the tied head anyway loads it into the same parameter.
        parameters = [
            (name, shape)
            for name, shape in parameters
            if not (_is_output_head(name) and shape == input_embedding[1])
        ]
    parameter_count = sum(_element_count(shape) for _, shape in parameters)
    quantizable = sum(
        _element_count(shape) for name, shape in parameters if _is_quantizable_weight(name, shape)
    )
    architectures = config.get("architectures")
    architecture = (
        str(architectures[0])[:100]
        if isinstance(architectures, list) and architectures
        else DEFAULT_ARCHITECTURES[family]
    )
    return ModelInfo(
        model_type=model_type,
        family=family,
        architecture=architecture,
        hidden_size=hidden,
        num_layers=layers,
        vocab_size=vocab,
        context_length=context,
        parameter_count=parameter_count,
        weight_bytes=weight_bytes,
        is_encoder=model_type in ENCODER_MODEL_TYPES,
        config=config,
        quantizable_parameter_count=quantizable,
        buffer_bytes=_buffer_bytes(family, config, hidden, layers, context),
    )


def read_safetensors_header(path: Path, *, name: str | None = None) -> dict[str, tuple[list[int], str]]:
    """Tensor names, shapes and dtypes from a safetensors file's JSON header; no tensor data is read.

    The format is an 8-byte little-endian header length, the JSON header, then the data. The
    header is checked against the file size, so a truncated download is caught here. ``path`` is
    a real path (a link there is not followed); ``name`` is how messages call the file.
    """
    name = name or path.name
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(descriptor, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _invalid(f"{name} is not a safetensors file.")
            header_size = int.from_bytes(prefix, "little")
            if not 2 <= header_size <= min(MAX_SAFETENSORS_HEADER_BYTES, file_size - 8):
                raise _invalid(f"{name} has an invalid safetensors header.")
            header = json.loads(handle.read(header_size))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise _invalid(f"{name} has an unreadable safetensors header.") from None
    if not isinstance(header, dict):
        raise _invalid(f"{name} has an invalid safetensors header.")
    data_size = file_size - 8 - header_size
    tensors: dict[str, tuple[list[int], str]] = {}
    for tensor_name, entry in header.items():
        if tensor_name == "__metadata__":
            continue
        try:
            shape = [int(size) for size in entry["shape"]]
            dtype = str(entry["dtype"])
            end = int(entry["data_offsets"][1])
        except (TypeError, KeyError, IndexError, ValueError):
            raise _invalid(f"{name} has an invalid safetensors header.") from None
        if end > data_size:
            raise _invalid(f"{name} is truncated.")
        tensors[tensor_name] = (shape, dtype)
    return tensors


def _read_json(path: Path, *, what: str) -> Any:
    try:
        # O_NOFOLLOW: ``path`` is a checked real path, so a link put there since is not followed.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(descriptor, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise _invalid(f"{what} is too large.")
        return json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise _invalid(f"{what} is not valid JSON.") from None


def confined_folder_entries(folder: Path, roots: Sequence[Path | str] | None = None) -> dict[str, Path]:
    """The real path of every top-level entry of a local model folder, by name.

    transformers reads a local model from the folder's top level (config, generation config,
    tokenizer files, the weights, the shards index and the shards it names) and follows links
    there, so every entry's real path (all links resolved) must lie inside one of ``roots``
    (default: the folder itself), or ``UNSAFE_PATH`` is raised, naming the entry, before any
    file is read. A link that stays inside the roots (as in a Hugging Face cache, whose snapshot
    files link to its blobs) is fine. Entries are checked whatever they are, dangling links too.
    """
    folder = Path(folder)
    allowed = [Path(os.path.realpath(root)) for root in (roots if roots is not None else [folder])]
    real_paths: dict[str, Path] = {}
    try:
        with os.scandir(folder) as entries:
            names = sorted(entry.name for entry in entries)
    except OSError as error:
        raise _invalid(f"The model folder cannot be listed ({error.strerror}).") from None
    for name in names:
        real = Path(os.path.realpath(folder / name))
        if not any(real == root or real.is_relative_to(root) for root in allowed):
            raise InspectionError(
                "UNSAFE_PATH",
                f"{name!r} in the model folder links to a location outside the allowed model folders.",
                {"file": name},
            )
        real_paths[name] = real
    return real_paths


def inspect_folder(folder: Path, *, roots: Sequence[Path | str] | None = None) -> ModelInfo:
    """:func:`describe` a local model folder from its config and safetensors headers only.

    Every file is read through its real path, checked by :func:`confined_folder_entries` to lie
    inside ``roots`` (default: the folder itself).
    """
    entries = confined_folder_entries(folder, roots)
    file_names = sorted(name for name, real in entries.items() if real.is_file())
    if "config.json" not in file_names:
        raise _invalid("The folder has no config.json.")
    config = _read_json(entries["config.json"], what="config.json")
    tokenizer_config = None
    if "tokenizer_config.json" in file_names:
        tokenizer_config = _read_json(entries["tokenizer_config.json"], what="tokenizer_config.json")
        if not isinstance(tokenizer_config, dict):
            raise _invalid("tokenizer_config.json is not a JSON object.")
    tensor_shapes: dict[str, tuple[list[int], str]] = {}
    if isinstance(config, dict) and not _find_remote_code(config, tokenizer_config):
        # Headers are read only for a model that passes the cheap checks; describe() then
        # reports the first problem in a fixed order.
        index = None
        if SAFETENSORS_INDEX_FILE in file_names:
            index = _read_json(entries[SAFETENSORS_INDEX_FILE], what=SAFETENSORS_INDEX_FILE)
        if config.get("model_type") in SUPPORTED_MODEL_TYPES:
            for weight_file in safetensors_weight_files(file_names, index):
                tensor_shapes.update(read_safetensors_header(entries[weight_file], name=weight_file))
    return describe(config, tensor_shapes, file_names, tokenizer_config=tokenizer_config)


def memory_estimates(info: ModelInfo, *, device: str = "cpu") -> dict[str, int]:
    """Predicted ``model.get_memory_footprint()`` in bytes after ``load_weights`` per option.

    Mirrors loading.py: ``none`` is float32; ``fp16``/``bf16`` are 2 bytes per parameter; for
    ``int8``/``int4`` bitsandbytes stores the Linear weights in 1 byte / half a byte per
    element and everything else (embeddings, output head, norms, biases) stays in 16-bit
    (bf16). Buffers keep their own dtype. Like ``get_memory_footprint()``, the quantization
    constants (per-row scales for int8, one float32 absmax per 64 weights for nf4, about 12 %
    on top of the 4-bit weights) are not counted. Only applicable options are listed.
    """
    parameters = info.parameter_count
    quantizable = info.quantizable_parameter_count
    rest = parameters - quantizable
    estimates = {
        "none": parameters * 4,
        "fp16": parameters * 2,
        "bf16": parameters * 2,
        "int8": quantizable + rest * 2,
        "int4": (quantizable + 1) // 2 + rest * 2,
    }
    options = applicable_quantizations(info, device=device)
    return {option: estimates[option] + info.buffer_bytes for option in options}


def applicable_quantizations(info: ModelInfo, *, device: str = "cpu") -> list[str]:
    """The options of :data:`QUANTIZATIONS` that ``load_weights`` can honour for ``info`` on ``device``.

    Half precision works everywhere torch runs. int8 and int4 (nf4) need a bitsandbytes
    backend for the device type and a family whose layers transformers can swap.
    """
    options = ["none", "fp16", "bf16"]
    device_type = device.split(":", 1)[0]
    if (
        device_type in BITSANDBYTES_DEVICE_TYPES
        and info.family not in BITSANDBYTES_UNSUPPORTED_FAMILIES
        and info.quantizable_parameter_count > 0
    ):
        options.extend(BITSANDBYTES_QUANTIZATIONS)
    return options
