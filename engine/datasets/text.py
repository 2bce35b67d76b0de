"""Bytes to samples: strict UTF-8 decoding, format guessing, and the text, JSONL and CSV formats."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.datasets.samples import (
    DEFAULT_FIELD,
    FORMATS,
    DatasetError,
    ParsedDataset,
    _check_format,
    _check_size,
    _Collector,
    _finish,
    _listing,
)

# How much of a file's beginning guess_format looks at; callers sniffing an upload pass as much.
GUESS_HEAD_BYTES = 64 * 1024

_FORMAT_BY_SUFFIX: dict[str, str] = {
    ".txt": "text_lines",
    ".text": "text_lines",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
}
_UTF8_BOM = b"\xef\xbb\xbf"
_OTHER_BOMS: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)
# A paragraph guess needs short paragraphs: a long list of one-line prompts with a stray blank
# line in it is still a list of lines.
_MAX_GUESSED_PARAGRAPH_LINES = 40


def parse_bytes(
    data: bytes,
    *,
    format: str,
    field: str | None = None,
    max_bytes: int,
    max_samples: int | None = None,
    max_sample_bytes: int | None = None,
    label_field: str | None = None,
) -> ParsedDataset:
    """Parse the bytes of one file in ``format`` (any format but ``hf_disk``, which is a folder).

    ``field`` is the JSON key or CSV column (default ``"text"``) and is ignored for text formats.
    ``label_field`` names the key or column holding each sample's class (a labelled dataset:
    JSONL, CSV or Parquet only; a JSON number or boolean is read as its text).
    ``max_sample_bytes`` bounds the UTF-8 size of each sample (``SAMPLE_TOO_LARGE``). Raises
    :class:`DatasetError`.
    """
    _check_format(format)
    if format == "hf_disk":
        raise DatasetError(
            "INVALID_FORMAT",
            "The hf_disk format is a save_to_disk folder, not a single file.",
            {"format": format},
        )
    _check_size(len(data), max_bytes)
    if label_field is not None and format not in LABELLED_FORMATS:
        raise DatasetError(
            "LABELS_UNSUPPORTED",
            f"Labels are read from JSONL, CSV or Parquet files, not {format}.",
            {"format": format, "label_field": label_field},
        )
    collector = _Collector(max_samples, max_sample_bytes, labelled=label_field is not None)
    if format == "parquet":
        used_field = _parse_parquet(data, field or DEFAULT_FIELD, collector, label_field)
    else:
        used_field = _parse_text(_decode(data), format, field, collector, label_field)
    return _finish(collector, format=format, field=used_field, size_bytes=len(data), label_field=label_field)


# The formats a labelled dataset may come in (its label is a key or column beside the text).
LABELLED_FORMATS = ("jsonl", "csv", "parquet")


def _label_text(value: Any) -> str | None:
    """A class name from a JSON or Arrow value: text, a number or a boolean as its text."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float | str):
        return str(value)
    return None


# Arrow's text column types (Parquet's BYTE_ARRAY with a UTF8 annotation reads as one of them).
_ARROW_TEXT_TYPES = ("string", "large_string", "string_view")


def _parse_parquet(data: bytes, field: str, collector: _Collector, label_field: str | None = None) -> str:
    """The ``field`` column of a Parquet file, a row group at a time (pyarrow; nothing in it is
    unpickled: pyarrow does not load pickled extension types)."""
    import pyarrow as pa  # lazily: only this format needs it
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(
            "INVALID_FORMAT", "Not a Parquet file this can read.", {"error": type(error).__name__}
        ) from None
    for wanted in (field, label_field):
        if wanted is not None and wanted not in schema.names:
            listed, details = _listing("fields", list(schema.names))
            raise DatasetError(
                "FIELD_NOT_FOUND",
                f"The Parquet file has no column {wanted!r}; it has {listed}.",
                {"field": wanted, **details},
            )
    kind = str(schema.field(field).type)
    if kind not in _ARROW_TEXT_TYPES:
        raise DatasetError("INVALID_FORMAT", f"Column {field!r} holds {kind}, not text.", {"field": field})
    row = 0
    try:
        columns = [field] if label_field is None else [field, label_field]
        for batch in parquet.iter_batches(columns=columns):
            labels = batch.column(1).to_pylist() if label_field is not None else None
            for number, value in enumerate(batch.column(0).to_pylist()):
                label = _label_text(labels[number]) if labels is not None else None
                collector.add(value if value is not None else "", row=row, label=label)
                row += 1
    except pa.ArrowException as error:
        raise DatasetError(
            "INVALID_FORMAT", "The Parquet file is damaged.", {"error": type(error).__name__}
        ) from None
    return field


def guess_format(filename: str, data_head: bytes) -> str:
    """The format of a file from its name, and for ``.txt``/``.text`` from its first bytes.

    ``.jsonl``/``.ndjson`` → ``jsonl``; ``.csv`` → ``csv``; ``.json`` → ``jsonl`` when it starts with
    an object; ``.txt``/``.text`` → ``text_paragraphs`` when blank-line separated paragraphs
    dominate (at least two paragraphs, more than half of them spanning several lines, at most
    40 lines on average), else ``text_lines``. Anything else raises ``DatasetError('INVALID_FORMAT')``.
    """
    suffix = Path(filename).suffix.lower()
    if suffix == ".json" and data_head.removeprefix(_UTF8_BOM).lstrip().startswith(b"{"):
        return "jsonl"
    guessed = _FORMAT_BY_SUFFIX.get(suffix)
    if guessed is None:
        raise DatasetError(
            "INVALID_FORMAT",
            "The format of this file cannot be guessed from its name; choose one.",
            {
                "filename": Path(filename).name,
                "known_extensions": sorted(_FORMAT_BY_SUFFIX),
                "formats": FORMATS,
            },
        )
    if guessed == "text_lines" and _paragraphs_dominate(data_head):
        return "text_paragraphs"
    return guessed


def _decode(data: bytes) -> str:
    """Strict UTF-8 text of ``data``, without a UTF-8 byte-order mark."""
    for bom, encoding in _OTHER_BOMS:
        if data.startswith(bom):
            raise DatasetError(
                "BAD_ENCODING",
                f"The file is {encoding}-encoded; save it as UTF-8.",
                {"byte_offset": 0, "line": 1, "encoding": encoding},
            )
    # A NUL never occurs in text people write, and is the surest sign of a binary file.
    nul_offset = data.find(b"\x00")
    if nul_offset >= 0:
        raise DatasetError(
            "INVALID_FORMAT",
            "The file holds NUL bytes: it is a binary file, not text.",
            {"byte_offset": nul_offset, "line": data.count(b"\n", 0, nul_offset) + 1},
        )
    start = len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = start + error.start
        line = data.count(b"\n", 0, offset) + 1
        raise DatasetError(
            "BAD_ENCODING",
            f"The file is not valid UTF-8: byte 0x{data[offset]:02x} at offset {offset} (line {line}).",
            {"byte_offset": offset, "line": line, "byte": f"0x{data[offset]:02x}"},
        ) from None


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """(1-based number, line without its LF or CRLF) — only ``\\n`` ends a line, unlike ``splitlines``."""
    pieces = text.split("\n")
    if pieces and pieces[-1] == "":
        pieces.pop()  # the empty piece after a final newline is not a line
    for number, piece in enumerate(pieces, start=1):
        yield number, piece.removesuffix("\r")


# --- formats ------------------------------------------------------------------------------------


def _parse_text(
    text: str, format: str, field: str | None, collector: _Collector, label_field: str | None = None
) -> str | None:
    """Add the samples of ``text`` to ``collector``; returns the field used (None for text formats)."""
    if format == "text_lines":
        for number, line in _lines(text):
            collector.add(line.strip(), line=number)
        return None
    if format == "text_paragraphs":
        for first_line, paragraph in _paragraphs(text):
            collector.add("\n".join(paragraph).strip(), line=first_line)
        return None
    field = field or DEFAULT_FIELD
    if format == "jsonl":
        _parse_jsonl(text, field, collector, label_field)
    else:
        _parse_csv(text, field, collector, label_field)
    return field


def _paragraphs(text: str) -> Iterator[tuple[int, list[str]]]:
    """The runs of non-blank lines of ``text``, each with the number of its first line."""
    paragraph: list[str] = []
    first_line = 0
    for number, line in _lines(text):
        if line.strip():
            if not paragraph:
                first_line = number
            paragraph.append(line)
        elif paragraph:
            yield first_line, paragraph
            paragraph = []
    if paragraph:
        yield first_line, paragraph


def _paragraphs_dominate(head: bytes) -> bool:
    paragraphs = [lines for _, lines in _paragraphs(head.decode("utf-8", errors="replace"))]
    if len(paragraphs) < 2:
        return False
    multi_line = sum(1 for paragraph in paragraphs if len(paragraph) > 1)
    total_lines = sum(len(paragraph) for paragraph in paragraphs)
    return multi_line * 2 > len(paragraphs) and total_lines <= _MAX_GUESSED_PARAGRAPH_LINES * len(paragraphs)


def _parse_jsonl(text: str, field: str, collector: _Collector, label_field: str | None = None) -> None:
    for number, line in _lines(text):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(
                "INVALID_FORMAT",
                f"Line {number} is not valid JSON: {error.msg} (column {error.colno}).",
                {"line": number, "column": error.colno, "error": error.msg},
            ) from None
        except (ValueError, RecursionError) as error:  # huge integers, absurd nesting
            raise DatasetError(
                "INVALID_FORMAT",
                f"Line {number} is not usable JSON.",
                {"line": number, "error": type(error).__name__},
            ) from None
        if not isinstance(record, dict):
            raise DatasetError(
                "INVALID_FORMAT",
                f"Line {number} is a JSON {_json_type(record)}, not an object.",
                {"line": number},
            )
        value = _field_of(record, field, number, what="field")
        if not isinstance(value, str):
            raise DatasetError(
                "INVALID_FORMAT",
                f"Field {field!r} on line {number} is a JSON {_json_type(value)}, not a string.",
                {"line": number, "field": field},
            )
        if not _is_encodable(value):
            raise DatasetError(
                "INVALID_FORMAT",
                f"Field {field!r} on line {number} holds an unpaired surrogate escape (\\ud800-\\udfff).",
                {"line": number, "field": field},
            )
        label = None
        if label_field is not None:
            label = _label_text(_field_of(record, label_field, number, what="label field"))
        collector.add(value, line=number, label=label)


def _field_of(record: dict[str, Any], field: str, number: int, *, what: str) -> Any:
    """``record[field]``; ``FIELD_NOT_FOUND`` naming the line and the fields it has otherwise."""
    if field not in record:
        listed, details = _listing("fields", sorted(record))
        raise DatasetError(
            "FIELD_NOT_FOUND",
            f"Line {number} has no {what} {field!r}; it has {listed}.",
            {"line": number, "field": field, **details},
        )
    return record[field]


def _parse_csv(text: str, field: str, collector: _Collector, label_field: str | None = None) -> None:
    # The whole input is already bounded by max_bytes, so one cell may be as large as that; the
    # limit is process-wide and only ever raised here.
    csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    row_start = 1
    try:
        header = next((row for row in reader if any(cell.strip() for cell in row)), None)
        if header is None:  # nothing but blank lines
            return
        if header.count(field) > 1:
            raise DatasetError(
                "INVALID_FORMAT",
                f"The CSV header names column {field!r} twice.",
                {"line": reader.line_num, "field": field},
            )
        for wanted in (field, label_field):
            if wanted is not None and wanted not in header:
                listed, details = _listing("fields", header)
                raise DatasetError(
                    "FIELD_NOT_FOUND",
                    f"The CSV has no column {wanted!r}; it has {listed}.",
                    {"field": wanted, **details},
                )
        column = header.index(field)
        label_column = header.index(label_field) if label_field is not None else None
        row_start = reader.line_num + 1
        for row in reader:
            if len(row) == len(header):
                label = row[label_column] if label_column is not None else None
                collector.add(row[column], line=row_start, label=label)
            elif any(cell.strip() for cell in row):  # (a blank line is no record)
                raise DatasetError(
                    "INVALID_FORMAT",
                    f"The CSV row starting on line {row_start} has {len(row)} cells; the header has "
                    f"{len(header)} (a comma in an unquoted cell?).",
                    {"line": row_start, "cells": len(row), "header_cells": len(header)},
                )
            row_start = reader.line_num + 1
    except csv.Error as error:
        raise DatasetError(
            "INVALID_FORMAT",
            f"The CSV is malformed near line {row_start}: {error}.",
            {"line": row_start, "error": str(error)},
        ) from None


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _is_encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
