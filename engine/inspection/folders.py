"""Local model folders: links confined to the allowed roots, config and safetensors headers read."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.inspection.description import (
    SAFETENSORS_INDEX_FILE,
    InspectionError,
    ModelInfo,
    _find_remote_code,
    _invalid,
    describe,
    safetensors_weight_files,
)
from engine.inspection.families import SUPPORTED_MODEL_TYPES

# Sanity bounds on what is read: a file beyond these is corrupt or hostile, not a real model.
MAX_CONFIG_BYTES = 10 * 1024 * 1024
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


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
