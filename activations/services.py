"""Dataset workflows."""

import hashlib
import json
import os
from collections.abc import Iterable

from django.conf import settings
from django.db import transaction

from activations.models import Dataset
from mistudio.errors import ApplicationError


def write_atomically(path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename: a crash never leaves a half-written file."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def dataset_create_from_texts(
    *, name: str, texts: Iterable[str], owner, source: str, original_name: str = ""
) -> Dataset:
    """Store the non-empty samples as JSON Lines and register them as a dataset."""
    samples = [text for text in texts if text.strip()]
    if not samples:
        raise ApplicationError("EMPTY_DATASET", "The dataset has no non-empty samples.")
    payload = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in samples).encode()
    settings.DATASET_DIR.mkdir(parents=True, exist_ok=True)
    with transaction.atomic():
        dataset = Dataset(
            name=name, source=source, original_name=original_name, sample_count=len(samples),
            size_bytes=len(payload), content_hash=hashlib.sha256(payload).hexdigest(), owner=owner,
        )  # fmt: skip
        write_atomically(dataset.storage_path, payload)
        dataset.save()
    return dataset
