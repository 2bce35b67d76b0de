"""GGUF files (llama.cpp's format): the header read without the tensor data, described as a model.

Only the header is parsed, by hand: magic, version, the metadata key/values and the tensor
infos. The tokenizer's large arrays are skipped (their lengths kept), so a 262k-token
vocabulary costs a fraction of a second, where the ``gguf`` package's reader parses every
string. Nothing here imports torch or transformers' model code, so the web process can
inspect a GGUF at registration. Every length read is bounded: a hostile file is refused as
``INVALID_MODEL`` before it can make this allocate much.

The config is built as transformers builds it when it loads a GGUF
(``load_gguf_checkpoint``): the architecture's metadata renamed through transformers'
``GGUF_CONFIG_MAPPING``. The weights will be a converted float32 copy, so the tensor shapes
are described as float32 safetensors with transformers' names for the embedding and the head.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from engine.inspection.description import InspectionError, ModelInfo, _invalid, describe
from engine.inspection.families import SUPPORTED_MODEL_TYPES

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
MAX_METADATA_ENTRIES = 100_000
MAX_TENSORS = 1_000_000
MAX_STRING_BYTES = 1 << 20
MAX_ARRAY_LENGTH = 1 << 24
MAX_DIMENSIONS = 8

# GGUF value types: the struct format of each fixed-size one.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

# llama.cpp's architecture name -> transformers' model_type, where they differ (the Gemma 3 GGUF
# holds only the text model, as transformers' loader also decides).
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# Architecture -> (a word in general.name, model_type): llama.cpp writes Mistral models as llama.
_MODEL_TYPES_BY_NAME = {"llama": ("mistral", "mistral")}
# GGUF tensor names with a transformers meaning that inspection needs: the token embedding and
# the untied output head (the rest are counted under their GGUF names).
_TENSOR_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


@dataclass
class GGUFHeader:
    """What a GGUF file says before its tensor data."""

    version: int
    # Metadata by key; an array of more than 64 items is kept as its length only.
    metadata: dict[str, Any] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)
    # (name, shape in transformers' order, ggml type number) per tensor.
    tensors: list[tuple[str, list[int], int]] = field(default_factory=list)


class _Reader:
    def __init__(self, handle: BinaryIO, size: int, name: str) -> None:
        self.handle, self.size, self.name = handle, size, name

    def unpack(self, fmt: str) -> Any:
        width = struct.calcsize("<" + fmt)
        data = self.handle.read(width)
        if len(data) < width:
            raise _invalid(f"{self.name} is truncated.")
        return struct.unpack("<" + fmt, data)[0]

    def count(self, upper: int, what: str) -> int:
        value = self.unpack("Q")
        if value > upper:
            raise _invalid(f"{self.name} has an absurd {what} ({value}).")
        return value

    def string(self) -> str:
        length = self.count(MAX_STRING_BYTES, "string length")
        data = self.handle.read(length)
        if len(data) < length:
            raise _invalid(f"{self.name} is truncated.")
        return data.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[kind])
        raise _invalid(f"{self.name} has an unknown metadata type {kind}.")

    def array(self) -> tuple[list[Any] | None, int]:
        """A short array's items, or (None, length) for a long one, skipped without decoding."""
        kind = self.unpack("I")
        length = self.count(MAX_ARRAY_LENGTH, "array length")
        if length <= 64:
            return [self.value(kind) for _ in range(length)], length
        if kind in _SCALAR_FORMATS:
            self.handle.seek(length * struct.calcsize("<" + _SCALAR_FORMATS[kind]), os.SEEK_CUR)
        elif kind == _STRING:
            for _ in range(length):
                self.handle.seek(self.count(MAX_STRING_BYTES, "string length"), os.SEEK_CUR)
        else:
            raise _invalid(f"{self.name} has a nested or unknown array type {kind}.")
        if self.handle.tell() > self.size:
            raise _invalid(f"{self.name} is truncated.")
        return None, length


def read_gguf_header(path: Path, *, name: str | None = None) -> GGUFHeader:
    """The metadata and tensor infos of the GGUF file at ``path`` (a real path; a link there is
    not followed). ``INVALID_MODEL`` for anything that is not a well-formed GGUF header."""
    name = name or path.name
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(descriptor, "rb", buffering=1 << 20) as handle:
            reader = _Reader(handle, os.fstat(handle.fileno()).st_size, name)
            if handle.read(4) != GGUF_MAGIC:
                raise _invalid(f"{name} is not a GGUF file.")
            header = GGUFHeader(version=reader.unpack("I"))
            if header.version not in (2, 3):
                raise _invalid(f"{name} is GGUF version {header.version}; versions 2 and 3 are read.")
            tensor_count = reader.count(MAX_TENSORS, "tensor count")
            for _ in range(reader.count(MAX_METADATA_ENTRIES, "metadata count")):
                key = reader.string()
                kind = reader.unpack("I")
                if kind == _ARRAY:
                    items, header.array_lengths[key] = reader.array()
                    if items is not None:
                        header.metadata[key] = items
                else:
                    header.metadata[key] = reader.value(kind)
            for _ in range(tensor_count):
                tensor_name = reader.string()
                dimensions = reader.unpack("I")
                if dimensions > MAX_DIMENSIONS:
                    raise _invalid(f"{name} has a tensor with {dimensions} dimensions.")
                # GGUF lists the fastest-varying dimension first; transformers' shapes are reversed.
                shape = [reader.unpack("Q") for _ in range(dimensions)][::-1]
                kind = reader.unpack("I")
                reader.unpack("Q")  # data offset
                header.tensors.append((tensor_name, shape, kind))
    except OSError as error:
        raise _invalid(f"{name} cannot be read ({error.strerror}).") from None
    return header


def gguf_file_type(header: GGUFHeader) -> str:
    """The quantization the file was made with (``general.file_type``), e.g. ``Q4_K_M``."""
    from gguf.constants import LlamaFileType

    value = header.metadata.get("general.file_type")
    if not isinstance(value, int):
        return "unknown"
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"type {value}"


def gguf_model_type(header: GGUFHeader) -> str:
    """transformers' model_type for the file's ``general.architecture`` (as its GGUF loader maps it)."""
    architecture = header.metadata.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise _invalid("The GGUF file names no general.architecture.")
    model_name = str(header.metadata.get("general.name", "")).lower()
    renamed = _MODEL_TYPES_BY_NAME.get(architecture)
    if renamed is not None and renamed[0] in model_name:
        return renamed[1]
    return _MODEL_TYPES.get(architecture, architecture)


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """The config.json transformers would build from this header, plus a ``gguf`` entry
    (architecture, file type, tensor count) that says where it came from."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architecture = str(header.metadata.get("general.architecture", ""))
    model_type = gguf_model_type(header)
    renames = GGUF_CONFIG_MAPPING.get(architecture)
    if model_type not in SUPPORTED_MODEL_TYPES or renames is None:
        raise InspectionError(
            "UNSUPPORTED_ARCHITECTURE",
            f"GGUF architecture {architecture[:100]!r} is not supported.",
            {"architecture": architecture[:100], "model_type": model_type[:100]},
        )
    config: dict[str, Any] = {"model_type": model_type}
    for key, config_key in renames.items():
        value = header.metadata.get(f"{architecture}.{key}")
        if config_key and value is not None:
            config[config_key] = value
    names = {tensor_name for tensor_name, _, _ in header.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    tokens = header.array_lengths.get("tokenizer.ggml.tokens")
    if tokens is not None:
        config.setdefault("vocab_size", tokens)
    config["gguf"] = {
        "architecture": architecture,
        "file_type": gguf_file_type(header),
        "tensor_count": len(header.tensors),
    }
    return config


def inspect_gguf(path: Path, *, name: str | None = None) -> ModelInfo:
    """:func:`describe` a GGUF file from its header: the config transformers would build, and
    its tensors as the float32 weights of the converted copy."""
    header = read_gguf_header(path, name=name)
    config = gguf_config(header)
    tensor_shapes = {
        _TENSOR_NAMES.get(tensor_name, f"gguf.{tensor_name}"): (shape, "F32")
        for tensor_name, shape, _ in header.tensors
    }
    return describe(config, tensor_shapes, ["model.safetensors"])
