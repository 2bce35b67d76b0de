"""Dataset workflows: create from texts, uploads or local files; samples, update, delete."""

import json
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from activations.models import Dataset, ExtractionJob
from activations.store import write_durably
from engine.datasets import GUESS_HEAD_BYTES, content_hash, guess_format, parse_bytes, parse_path, preview
from engine.errors import EngineError
from mistudio.access import check_may_change
from mistudio.errors import ApplicationError
from mistudio.local_paths import path_inside_roots, path_shown
from mistudio.text import check_label_text

logger = logging.getLogger(__name__)


DATASET_ERROR_STATUS = {"DATASET_TOO_LARGE": 413}
# A labelled dataset's classes (each probed one against the rest).
MAX_CLASSES = 100


def dataset_error(error: EngineError) -> ApplicationError:
    return ApplicationError(
        error.code, error.message, status=DATASET_ERROR_STATUS.get(error.code, 400), details=error.details
    )


def local_data_path(raw_path: str) -> Path:
    """The real file or folder behind ``raw_path`` if it lies inside ``LOCAL_DATA_ROOTS``."""
    return path_inside_roots(raw_path, settings.LOCAL_DATA_ROOTS, setting="LOCAL_DATA_ROOTS")


def dataset_create_from_texts(
    *,
    name: str,
    texts: Iterable[str],
    owner,
    source: str,
    original_name: str = "",
    format: str = "",
    field: str = "",
    shared: bool = False,
    labels: list[str] | None = None,
    label_field: str = "",
) -> Dataset:
    """Store the non-empty samples as JSON Lines and register them as a dataset; with ``labels``
    (one class per text), a labelled dataset (each line's ``label``)."""
    check_label_text(name, field="name")

    texts = list(texts)
    if labels is not None and len(labels) != len(texts):
        raise ValueError("one label per text")
    rows = [
        {"text": text, **({"label": labels[index]} if labels is not None else {})}
        for index, text in enumerate(texts)
        if text.strip()
    ]
    samples = [row["text"] for row in rows]
    if not samples:
        raise ApplicationError("EMPTY_DATASET", "The dataset has no non-empty samples.")
    classes = dict(Counter(row["label"] for row in rows)) if labels is not None else {}
    if labels is not None and len(classes) > MAX_CLASSES:
        raise ApplicationError(
            "TOO_MANY_CLASSES",
            f"The labels name {len(classes)} classes; a labelled dataset may have at most {MAX_CLASSES}.",
            details={"classes": len(classes), "max_classes": MAX_CLASSES},
        )
    payload = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
    settings.DATASET_DIR.mkdir(parents=True, exist_ok=True)
    with transaction.atomic():
        dataset = Dataset(
            name=name,
            source=source,
            original_name=original_name,
            format=format,
            field=field,
            label_field=label_field if labels is not None else "",
            classes=classes,
            sample_count=len(samples),
            size_bytes=len(payload),
            content_hash=content_hash(samples),
            preview=preview(samples),
            owner=owner,
            shared=shared,
        )
        write_durably(dataset.storage_path, [payload])
        dataset.save()
    return dataset


def dataset_create_from_upload(
    *,
    name: str,
    data: bytes,
    filename: str,
    owner,
    format: str | None = None,
    field: str | None = None,
    shared: bool = False,
    label_field: str | None = None,
) -> Dataset:
    """Parse an uploaded file (plain text, JSONL, CSV, Parquet) into a dataset; with
    ``label_field``, a labelled one (each sample's class from that key or column)."""

    try:
        chosen = format or guess_format(filename, data[:GUESS_HEAD_BYTES])
        parsed = parse_bytes(
            data,
            format=chosen,
            field=field,
            max_bytes=settings.DATASET_MAX_UPLOAD_BYTES,
            max_sample_bytes=settings.DATASET_MAX_SAMPLE_BYTES,
            label_field=label_field or None,
        )
    except EngineError as error:
        raise dataset_error(error) from None
    return dataset_create_from_texts(
        name=name or filename,
        texts=parsed.samples,
        owner=owner,
        source=Dataset.Source.UPLOAD,
        original_name=filename,
        format=parsed.format,
        field=parsed.field or "",
        shared=shared,
        labels=parsed.labels,
        label_field=parsed.label_field or "",
    )


def dataset_create_from_local(
    *,
    name: str,
    path: str,
    owner,
    format: str | None = None,
    field: str | None = None,
    shared: bool = False,
    label_field: str | None = None,
) -> Dataset:
    """A file or folder under LOCAL_DATA_ROOTS: text / JSONL / CSV files or a ``save_to_disk`` folder
    (with ``label_field``, one labelled JSONL, CSV or Parquet file)."""

    resolved = local_data_path(path)
    try:
        parsed = parse_path(
            resolved,
            format=format,
            field=field,
            max_bytes=settings.DATASET_MAX_LOCAL_BYTES,
            max_sample_bytes=settings.DATASET_MAX_SAMPLE_BYTES,
            label_field=label_field or None,
        )
    except EngineError as error:
        raise dataset_error(error) from None
    return dataset_create_from_texts(
        name=name or resolved.name,
        texts=parsed.samples,
        owner=owner,
        source=Dataset.Source.LOCAL,
        original_name=path_shown(resolved, settings.LOCAL_DATA_ROOTS),
        format=parsed.format,
        field=parsed.field or "",
        shared=shared,
        labels=parsed.labels,
        label_field=parsed.label_field or "",
    )


def dataset_labelled_samples(dataset: Dataset) -> list[tuple[str, str]]:
    """A labelled dataset's (text, class) pairs, in order."""
    pairs = []
    with open(dataset.storage_path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            pairs.append((row["text"], row["label"]))
    return pairs


def dataset_samples(dataset: Dataset, *, limit: int | None = None) -> list[str]:
    samples = []
    with open(dataset.storage_path, encoding="utf-8") as handle:
        for line in handle:
            samples.append(json.loads(line)["text"])
            if limit is not None and len(samples) >= limit:
                break
    return samples


class DatasetReader:
    """The samples of a stored dataset by index range, read streaming from its JSON Lines file:
    a range that starts where the last one stopped continues the open file, so a dataset larger
    than memory is read once per pass, never held whole. Close it (or use it as a context)."""

    def __init__(self, dataset: Dataset) -> None:
        self.path = dataset.storage_path
        self._handle = None
        self._next = 0  # index of the sample the open file is at

    def __call__(self, start: int, stop: int) -> list[str]:
        if self._handle is None or start < self._next:
            self.close()
            self._handle = open(self.path, encoding="utf-8")  # noqa: SIM115  (kept open across calls)
            self._next = 0
        samples = []
        for line in self._handle:
            index = self._next
            self._next += 1
            if index >= start:
                samples.append(json.loads(line)["text"])
            if self._next >= stop:
                break
        return samples

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "DatasetReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def dataset_update(*, dataset_id: str, actor, **changes: Any) -> Dataset:
    """Rename or share / unshare a dataset (``Dataset.OWNER_FIELDS``): ``actor`` must own it (or be
    an admin or the ``OPERATOR``), else 403 ``NOT_OWNER``."""
    dataset = Dataset.objects.get(pk=dataset_id)
    check_may_change(dataset, actor, what="dataset")
    if "name" in changes:
        check_label_text(changes["name"], field="name")
    fields = [field for field in Dataset.OWNER_FIELDS if field in changes]
    for field in fields:
        setattr(dataset, field, changes[field])
    dataset.save(update_fields=fields)
    return dataset


def dataset_delete(*, dataset_id: str) -> None:
    dataset = Dataset.objects.get(pk=dataset_id)
    if dataset.extractions.filter(status__in=ExtractionJob.ACTIVE).exists():
        raise ApplicationError("DATASET_IN_USE", "An extraction over this dataset is running.", status=409)
    path = dataset.storage_path
    dataset.delete()
    path.unlink(missing_ok=True)
