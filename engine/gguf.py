"""A GGUF file converted once into a safetensors model folder (config, tokenizer, float32 weights).

transformers dequantizes a GGUF into a float32 model on every ``from_pretrained(gguf_file=...)``,
which for Gemma 3 270M takes ~40 s against ~2 s for reading safetensors. So the first load
converts the file into a folder of the model store named by the file's sha256, and later loads
read that folder by the ordinary safetensors path (with its quantization options).

The folder is written under a temporary name in the store and renamed into place, so a reader
never sees half a folder, and two workers converting the same file at once both succeed (the
second rename loses, its copy is removed). Hashing reads the file once (~0.6 s for 253 MB on
this machine), so a changed file is never served its old conversion.

Importable without torch or transformers (they are imported inside the functions).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from engine.errors import EngineError

CONVERSION_MARKER = "gguf_source.json"
_HASH_BLOCK_BYTES = 4 << 20

ProgressCallback = Callable[[float], None]


class ConversionError(EngineError):
    """The GGUF could not be converted (``GGUF_CONVERSION_FAILED``)."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def converted_folder_name(sha256: str) -> str:
    return f"gguf-{sha256}"


def converted_folder(store: Path, sha256: str) -> Path | None:
    """The store's finished conversion of the file with this sha256, if there is one."""
    folder = Path(store) / converted_folder_name(sha256)
    return folder if (folder / CONVERSION_MARKER).is_file() else None


def _identity(gguf_path: Path) -> dict[str, object]:
    """What names the file without reading it: its real path, size and modification time."""
    stat = gguf_path.stat()
    return {"path": os.path.realpath(gguf_path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def find_converted(store: Path, gguf_path: Path) -> Path | None:
    """The store's conversion of ``gguf_path`` as the file is now, found without hashing it (by
    real path, size and modification time), for readers that need only the tokenizer and cannot
    afford to read the file (the web process). None when there is none, or the file changed."""
    try:
        identity = _identity(Path(gguf_path))
    except OSError:
        return None
    for marker in sorted(Path(store).glob(f"gguf-*/{CONVERSION_MARKER}")):
        try:
            recorded = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(recorded, dict) and all(recorded.get(key) == value for key, value in identity.items()):
            return marker.parent
    return None


def convert_gguf(
    gguf_path: Path, store: Path, *, on_progress: ProgressCallback | None = None, sha256: str | None = None
) -> Path:
    """The safetensors folder of ``gguf_path`` in ``store``, converting it first if needed.

    ``on_progress(fraction)`` is called at 0.0, after the GGUF is read (0.7) and at 1.0; an
    exception it raises aborts the conversion and leaves nothing behind. Raises
    :class:`ConversionError` when transformers cannot read or save the model.
    """
    report = on_progress or (lambda fraction: None)
    gguf_path = Path(gguf_path)
    store = Path(store)
    sha256 = sha256 or file_sha256(gguf_path)
    existing = converted_folder(store, sha256)
    if existing is not None:
        return existing
    report(0.0)
    store.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=store))
    try:
        _write_converted(gguf_path, staging, report)
        (staging / CONVERSION_MARKER).write_text(json.dumps({"sha256": sha256, **_identity(gguf_path)}))
        target = store / converted_folder_name(sha256)
        try:
            os.rename(staging, target)
        except OSError:
            # Another worker finished the same conversion first: its copy is as good as ours.
            if converted_folder(store, sha256) is None:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report(1.0)
    return target


def _write_converted(gguf_path: Path, folder: Path, report: Callable[[float], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}
    try:
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(**source, trust_remote_code=False)
    except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as error:
        raise ConversionError(
            "GGUF_CONVERSION_FAILED",
            f"transformers could not read the GGUF file: {type(error).__name__}: {str(error)[:300]}",
        ) from None
    report(0.7)
    # The dequantized weights are plain float32 tensors: the GGUF "quantizer" transformers
    # attached only describes the file they came from, and must not be saved as the
    # copy's quantization.
    model.hf_quantizer = None
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    try:
        model.save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
    except (ValueError, OSError, RuntimeError) as error:
        raise ConversionError(
            "GGUF_CONVERSION_FAILED", f"Saving the converted model failed: {type(error).__name__}."
        ) from None
    finally:
        del model
