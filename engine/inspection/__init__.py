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

from engine.inspection.description import (
    MAX_CONTEXT_LENGTH,
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_VOCAB_SIZE,
    PICKLE_WEIGHT_SUFFIXES,
    SAFETENSORS_DTYPE_BYTES,
    SAFETENSORS_INDEX_FILE,
    SAFETENSORS_SINGLE_FILE,
    InspectionError,
    ModelInfo,
    describe,
    is_quantizable_weight,
    safetensors_weight_files,
)
from engine.inspection.families import DEFAULT_ARCHITECTURES, ENCODER_MODEL_TYPES, SUPPORTED_MODEL_TYPES
from engine.inspection.folders import (
    MAX_CONFIG_BYTES,
    MAX_SAFETENSORS_HEADER_BYTES,
    confined_folder_entries,
    inspect_folder,
    read_safetensors_header,
)
from engine.inspection.memory import (
    BITSANDBYTES_DEVICE_TYPES,
    BITSANDBYTES_QUANTIZATIONS,
    BITSANDBYTES_UNSUPPORTED_FAMILIES,
    QUANTIZATIONS,
    applicable_quantizations,
    memory_estimates,
)

__all__ = [
    "BITSANDBYTES_DEVICE_TYPES",
    "BITSANDBYTES_QUANTIZATIONS",
    "BITSANDBYTES_UNSUPPORTED_FAMILIES",
    "DEFAULT_ARCHITECTURES",
    "ENCODER_MODEL_TYPES",
    "MAX_CONFIG_BYTES",
    "MAX_CONTEXT_LENGTH",
    "MAX_HIDDEN_SIZE",
    "MAX_LAYERS",
    "MAX_SAFETENSORS_HEADER_BYTES",
    "MAX_VOCAB_SIZE",
    "PICKLE_WEIGHT_SUFFIXES",
    "QUANTIZATIONS",
    "SAFETENSORS_DTYPE_BYTES",
    "SAFETENSORS_INDEX_FILE",
    "SAFETENSORS_SINGLE_FILE",
    "SUPPORTED_MODEL_TYPES",
    "InspectionError",
    "ModelInfo",
    "applicable_quantizations",
    "confined_folder_entries",
    "describe",
    "inspect_folder",
    "is_quantizable_weight",
    "memory_estimates",
    "read_safetensors_header",
    "safetensors_weight_files",
]
