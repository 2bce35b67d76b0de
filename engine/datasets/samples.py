"""What every dataset format shares: the formats, DatasetError, ParsedDataset and the sample collector."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError

FORMATS: tuple[str, ...] = ("text_lines", "text_paragraphs", "jsonl", "csv", "parquet", "hf_disk")
DEFAULT_FIELD = "text"
# A class name (a labelled dataset's label) is at most this long.
MAX_LABEL_CHARS = 200
# An error listing the fields, columns or splits a file has shows this many, each this long at most.
_LISTED_NAMES = 50
_LISTED_NAME_CHARS = 200


class DatasetError(EngineError):
    """A dataset refused while parsing; the codes are listed in the docstring of engine.datasets."""


@dataclass
class ParsedDataset:
    """The samples of a dataset and how they were read.

    ``size_bytes`` is the size of the source (the bytes given, the files read, or the Arrow files of
    the split read); ``split`` is set for a ``DatasetDict`` only.
    """

    samples: list[str]
    format: str
    field: str | None
    size_bytes: int
    skipped_empty: int
    split: str | None = None
    # One class name per sample, where a label field was read (``label_field``); None otherwise.
    labels: list[str] | None = None
    label_field: str | None = None


class _Collector:
    """Accumulates samples across files; enforces ``max_samples`` as soon as it is passed and
    ``max_sample_bytes`` (the UTF-8 size of one sample) on every sample."""

    def __init__(
        self, max_samples: int | None, max_sample_bytes: int | None = None, *, labelled: bool = False
    ) -> None:
        self.samples: list[str] = []
        self.labels: list[str] | None = [] if labelled else None
        self.skipped_empty = 0
        self.max_samples = max_samples
        self.max_sample_bytes = max_sample_bytes

    def add(
        self, value: str, *, line: int | None = None, row: int | None = None, label: str | None = None
    ) -> None:
        """Add one sample (and its class, ``label``, for a labelled dataset); ``line`` (where it
        starts in its file) or ``row`` (of an Arrow column) locate it in a refusal."""
        if not value.strip():
            self.skipped_empty += 1
            return
        self._check_sample_size(value, line=line, row=row)
        if self.max_samples is not None and len(self.samples) >= self.max_samples:
            raise DatasetError(
                "TOO_MANY_SAMPLES",
                f"The dataset has more than {self.max_samples} samples.",
                {"max_samples": self.max_samples},
            )
        self.samples.append(value)
        if self.labels is not None:
            if label is None or not label.strip() or len(label) > MAX_LABEL_CHARS:
                where = f"line {line}" if line is not None else f"row {row}"
                raise DatasetError(
                    "INVALID_LABEL",
                    f"The sample on {where} has no label, or one over {MAX_LABEL_CHARS} characters.",
                    {"line": line, "row": row},
                )
            self.labels.append(label.strip())

    def _check_sample_size(self, value: str, *, line: int | None, row: int | None) -> None:
        limit = self.max_sample_bytes
        # A character is 1 to 4 bytes in UTF-8: most samples need no encoding to be measured.
        if limit is None or len(value) * 4 <= limit:
            return
        size = len(value.encode("utf-8", errors="surrogatepass"))
        if size <= limit:
            return
        number = len(self.samples) + 1
        details: dict[str, Any] = {"sample": number, "size_bytes": size, "max_bytes": limit}
        where = ""
        if line is not None:
            details["line"], where = line, f" (line {line})"
        elif row is not None:
            details["row"], where = row, f" (row {row})"
        raise DatasetError(
            "SAMPLE_TOO_LARGE",
            f"Sample {number}{where} is {size} bytes; one sample may hold at most {limit} bytes.",
            details,
        )


def content_hash(samples: list[str]) -> str:
    """Hex SHA-256 of the samples, in order, independent of the format they came from.

    Each sample is hashed as its UTF-8 length (8 bytes, big-endian) followed by its UTF-8 bytes, so
    no two different lists serialize alike (``["ab"]`` differs from ``["a", "b"]``).
    """
    digest = hashlib.sha256(b"mistudio-samples-v1\n")
    for sample in samples:
        encoded = sample.encode("utf-8", errors="surrogatepass")
        digest.update(len(encoded).to_bytes(8, "big"))
        digest.update(encoded)
    return digest.hexdigest()


def preview(samples: list[str], *, count: int = 5, max_chars: int = 300) -> list[str]:
    """The first ``count`` samples, each cut to at most ``max_chars`` characters (ending in "…" when cut)."""
    shown = []
    for sample in samples[: max(count, 0)]:
        if len(sample) > max_chars:
            sample = sample[: max(max_chars - 1, 0)] + "…"
        shown.append(sample)
    return shown


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise DatasetError(
            "INVALID_FORMAT", f"Unknown dataset format {format!r}.", {"format": format, "formats": FORMATS}
        )


def _check_size(size_bytes: int, max_bytes: int) -> None:
    if size_bytes > max_bytes:
        raise DatasetError(
            "DATASET_TOO_LARGE",
            f"The dataset is {size_bytes} bytes; the limit is {max_bytes} bytes.",
            {"max_bytes": max_bytes, "size_bytes": size_bytes},
        )


def _listing(kind: str, names: list[str]) -> tuple[str, dict[str, Any]]:
    """The names an error offers instead (columns, fields, splits), kept short whatever the file:
    the first :data:`_LISTED_NAMES`, each cut to :data:`_LISTED_NAME_CHARS` characters, and how
    many there are. Returns the text for the message and the ``available_<kind>`` details."""
    shown = [
        name if len(name) <= _LISTED_NAME_CHARS else name[: _LISTED_NAME_CHARS - 1] + "…"
        for name in names[:_LISTED_NAMES]
    ]
    text = ", ".join(repr(name) for name in shown) if shown else "nothing"
    if len(names) > len(shown):
        text += f" and {len(names) - len(shown)} more"
    return text, {f"available_{kind}": shown, f"available_{kind}_count": len(names)}


def _finish(
    collector: _Collector, *, format: str, field: str | None, size_bytes: int, **extra: Any
) -> ParsedDataset:
    if not collector.samples:
        raise DatasetError(
            "EMPTY_DATASET",
            "The dataset holds no samples (it is empty or only whitespace).",
            {"skipped_empty": collector.skipped_empty},
        )
    return ParsedDataset(
        samples=collector.samples,
        format=format,
        field=field,
        size_bytes=size_bytes,
        skipped_empty=collector.skipped_empty,
        labels=collector.labels,
        **extra,
    )
