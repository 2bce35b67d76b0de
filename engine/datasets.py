"""Researcher-provided text datasets parsed into a list of samples (strings).

Importable without Django; the Hugging Face ``datasets`` package is imported only to read a
``save_to_disk`` folder. Every refusal is a :class:`DatasetError` whose message is safe to show
(it never names a path on this machine; errors inside a folder name the file relative to it).

Formats (:data:`FORMATS`):

* ``text_lines``: one sample per line, whitespace-trimmed; blank lines are skipped.
* ``text_paragraphs``: samples separated by blank (whitespace-only) lines; the newlines inside a
  paragraph are kept (as ``\\n``) and each paragraph is whitespace-trimmed.
* ``jsonl``: one JSON object per line; ``field`` (default ``"text"``) must hold a string. Blank
  lines are skipped; extra keys are ignored.
* ``csv``: a header row, then one record per row; ``field`` names the column (default ``"text"``).
  Standard quoting (commas, quotes and newlines inside quoted cells); every row must have as many
  cells as the header, so an unquoted comma is an error rather than a silently cut sample.
* ``hf_disk``: a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``; the
  ``field`` column (default ``"text"``) must be a string column. A ``DatasetDict`` is read from its
  ``split`` argument, else its ``"train"`` split, else its first split.

Text is strict UTF-8 (a UTF-8 byte-order mark is dropped). Values from ``jsonl``, ``csv`` and
``hf_disk`` are kept verbatim; values that are empty or whitespace-only (and nulls in an Arrow
column) are skipped and counted in :attr:`ParsedDataset.skipped_empty`, as are whitespace-only lines
of ``text_lines``. Line endings may be LF or CRLF.

Size is checked before anything is parsed: :func:`parse_bytes` checks ``len(data)``,
:func:`parse_path` the sizes on disk (and never reads more than ``max_bytes + 1`` bytes of a file).

Error codes: ``EMPTY_DATASET``, ``BAD_ENCODING`` (details: ``byte_offset``, ``line``, ``byte``),
``INVALID_FORMAT`` (details name the ``line`` where one applies), ``FIELD_NOT_FOUND`` (details:
``available_fields``, the first 50, and ``available_fields_count``), ``DATASET_TOO_LARGE``
(details: ``max_bytes``, ``size_bytes``), ``TOO_MANY_SAMPLES`` (details: ``max_samples``),
``SAMPLE_TOO_LARGE`` (details: ``sample``, its number among the samples kept; ``line`` where it
starts, or ``row`` of an Arrow column; ``size_bytes``, ``max_bytes``), ``SPLIT_NOT_FOUND``
(details: ``available_splits``, the first 50, and ``available_splits_count``), ``UNSAFE_PATH`` (a
link whose target leaves the folder), ``NOT_FOUND`` and ``UNREADABLE``. Errors
raised while reading a file of a folder carry its name in ``details["file"]``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EngineError

FORMATS: tuple[str, ...] = ("text_lines", "text_paragraphs", "jsonl", "csv", "hf_disk")
DEFAULT_FIELD = "text"
# How much of a file's beginning guess_format looks at; callers sniffing an upload pass as much.
GUESS_HEAD_BYTES = 64 * 1024

_FORMAT_BY_SUFFIX: dict[str, str] = {
    ".txt": "text_lines",
    ".text": "text_lines",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
}
# Files that deserialize to objects (and may run code when they do). Never opened, even as text.
_REFUSED_SUFFIXES = frozenset({".pkl", ".pickle", ".pt", ".pth", ".bin", ".joblib", ".npy", ".npz", ".dill"})
_UTF8_BOM = b"\xef\xbb\xbf"
_OTHER_BOMS: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)
_SAVED_DATASET_FILES = ("state.json", "dataset_info.json")
_SAVED_DATASET_DICT_FILE = "dataset_dict.json"
_MAX_JSON_METADATA_BYTES = 1024 * 1024
_ARROW_STRING_TYPES = frozenset({"string", "large_string"})
# A paragraph guess needs short paragraphs: a long list of one-line prompts with a stray blank
# line in it is still a list of lines.
_MAX_GUESSED_PARAGRAPH_LINES = 40
# An error listing the fields, columns or splits a file has shows this many, each this long at most.
_LISTED_NAMES = 50
_LISTED_NAME_CHARS = 200


class DatasetError(EngineError):
    """A dataset refused while parsing; the codes are listed in the module docstring."""


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


class _Collector:
    """Accumulates samples across files; enforces ``max_samples`` as soon as it is passed and
    ``max_sample_bytes`` (the UTF-8 size of one sample) on every sample."""

    def __init__(self, max_samples: int | None, max_sample_bytes: int | None = None) -> None:
        self.samples: list[str] = []
        self.skipped_empty = 0
        self.max_samples = max_samples
        self.max_sample_bytes = max_sample_bytes

    def add(self, value: str, *, line: int | None = None, row: int | None = None) -> None:
        """Add one sample; ``line`` (where it starts in its file) or ``row`` (of an Arrow column)
        locate it in a refusal."""
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


# --- public API ----------------------------------------------------------------------------------


def parse_bytes(
    data: bytes,
    *,
    format: str,
    field: str | None = None,
    max_bytes: int,
    max_samples: int | None = None,
    max_sample_bytes: int | None = None,
) -> ParsedDataset:
    """Parse the bytes of one file in ``format`` (any format but ``hf_disk``, which is a folder).

    ``field`` is the JSON key or CSV column (default ``"text"``) and is ignored for text formats.
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
    collector = _Collector(max_samples, max_sample_bytes)
    used_field = _parse_text(_decode(data), format, field, collector)
    return _finish(collector, format=format, field=used_field, size_bytes=len(data))


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


def parse_path(
    path: Path,
    *,
    format: str | None,
    field: str | None,
    max_bytes: int,
    max_samples: int | None = None,
    max_sample_bytes: int | None = None,
    split: str | None = None,
) -> ParsedDataset:
    """Parse a file, or a folder: a ``save_to_disk`` folder or a folder of text files.

    A file's format is guessed from its name when ``format`` is None. A folder is an ``hf_disk``
    dataset when ``format`` says so or (``format`` None) when it holds ``state.json`` and
    ``dataset_info.json`` or ``dataset_dict.json``. Otherwise its top-level ``.txt``, ``.text``,
    ``.jsonl``, ``.ndjson`` and ``.csv`` files (not hidden ones, not subfolders) are read in name
    order and their samples concatenated; they must all be of one format (``format``, or guessed
    from the extensions and, for text, from the first file). Other files are ignored, and nothing
    but Arrow, JSON and text is ever opened.

    Links are followed only while they stay inside the folder: a file or split whose real path
    leaves it raises ``UNSAFE_PATH`` before anything is read. ``path`` itself is the caller's to
    check. ``max_bytes`` bounds the total size of what is read, ``max_sample_bytes`` the size of
    one sample; ``split`` picks a ``DatasetDict`` split.
    """
    if format is not None:
        _check_format(format)
    try:
        path_stat = os.stat(path)
    except FileNotFoundError:
        raise DatasetError("NOT_FOUND", "The dataset path does not exist.") from None
    except OSError as error:
        raise DatasetError("UNREADABLE", f"The dataset path cannot be read ({error.strerror}).") from None
    if stat.S_ISDIR(path_stat.st_mode):
        root = Path(os.path.realpath(path))
        if format == "hf_disk" or (format is None and _is_saved_dataset(root)):
            return _parse_saved_dataset(
                root,
                field=field,
                split=split,
                max_bytes=max_bytes,
                collector=_Collector(max_samples, max_sample_bytes),
            )
        return _parse_text_folder(
            root,
            format=format,
            field=field,
            max_bytes=max_bytes,
            collector=_Collector(max_samples, max_sample_bytes),
        )
    if not stat.S_ISREG(path_stat.st_mode):
        raise DatasetError("NOT_FOUND", "The dataset path is neither a regular file nor a folder.")
    path = Path(path)
    _refuse_serialized_objects(path.name)
    if format == "hf_disk":
        raise DatasetError("INVALID_FORMAT", "The hf_disk format is a save_to_disk folder, not a file.")
    _check_size(path_stat.st_size, max_bytes)
    data = _read_bounded(path, max_bytes, follow_symlinks=True)
    return parse_bytes(
        data,
        format=format or guess_format(path.name, data[:GUESS_HEAD_BYTES]),
        field=field,
        max_bytes=max_bytes,
        max_samples=max_samples,
        max_sample_bytes=max_sample_bytes,
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


# --- bytes to text -------------------------------------------------------------------------------


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


def _parse_text(text: str, format: str, field: str | None, collector: _Collector) -> str | None:
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
        _parse_jsonl(text, field, collector)
    else:
        _parse_csv(text, field, collector)
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


def _parse_jsonl(text: str, field: str, collector: _Collector) -> None:
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
        if field not in record:
            listed, details = _listing("fields", sorted(record))
            raise DatasetError(
                "FIELD_NOT_FOUND",
                f"Line {number} has no field {field!r}; it has {listed}.",
                {"line": number, "field": field, **details},
            )
        value = record[field]
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
        collector.add(value, line=number)


def _parse_csv(text: str, field: str, collector: _Collector) -> None:
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
        if field not in header:
            listed, details = _listing("fields", header)
            raise DatasetError(
                "FIELD_NOT_FOUND",
                f"The CSV has no column {field!r}; it has {listed}.",
                {"field": field, **details},
            )
        column = header.index(field)
        row_start = reader.line_num + 1
        for row in reader:
            if len(row) == len(header):
                collector.add(row[column], line=row_start)
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


def _is_encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
        **extra,
    )


# --- files and folders ---------------------------------------------------------------------------


def _refuse_serialized_objects(name: str) -> None:
    if Path(name).suffix.lower() in _REFUSED_SUFFIXES:
        raise DatasetError(
            "INVALID_FORMAT",
            "Pickled or serialized-object files are never loaded; provide text, JSONL, CSV or a "
            "save_to_disk folder.",
            {"filename": name},
        )


def _read_bounded(path: Path, max_bytes: int, *, follow_symlinks: bool) -> bytes:
    """At most ``max_bytes`` bytes of the regular file ``path`` (more means DATASET_TOO_LARGE).

    O_NONBLOCK keeps a FIFO from blocking the open; O_NOFOLLOW (for files inside a folder, whose
    real path was checked) keeps a link swapped in after the check from being followed.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as error:
        raise DatasetError("UNREADABLE", f"A dataset file cannot be read ({error.strerror}).") from None
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise DatasetError("UNREADABLE", "A dataset file is not a regular file.")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since its size was checked
        _check_size(len(data), max_bytes)
    return data


def _inside(root: Path, candidate: Path, name: str) -> Path:
    """The real path of ``candidate``, refused unless it lies inside ``root`` (itself a real path)."""
    real = Path(os.path.realpath(candidate))
    if real != root and not real.is_relative_to(root):
        raise DatasetError(
            "UNSAFE_PATH", f"{name!r} links to a location outside the dataset folder.", {"file": name}
        )
    return real


def _text_files(root: Path) -> list[tuple[str, Path, int]]:
    """(name, real path, size) of the folder's dataset files, in name order."""
    files = []
    try:
        entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    except OSError as error:
        raise DatasetError("UNREADABLE", f"The dataset folder cannot be listed ({error.strerror}).") from None
    for entry in entries:
        if entry.name.startswith(".") or Path(entry.name).suffix.lower() not in _FORMAT_BY_SUFFIX:
            continue
        real = _inside(root, Path(entry.path), entry.name)
        try:
            real_stat = os.stat(real)
        except OSError:
            continue  # a dangling link
        if stat.S_ISREG(real_stat.st_mode):
            files.append((entry.name, real, real_stat.st_size))
    return files


def _parse_text_folder(
    root: Path, *, format: str | None, field: str | None, max_bytes: int, collector: _Collector
) -> ParsedDataset:
    files = _text_files(root)
    if not files:
        raise DatasetError(
            "INVALID_FORMAT",
            "The folder is not a save_to_disk dataset and holds no .txt, .jsonl or .csv files.",
            {"known_extensions": sorted(_FORMAT_BY_SUFFIX)},
        )
    size_bytes = sum(size for _, _, size in files)
    _check_size(size_bytes, max_bytes)
    if format is None:
        families = {_FORMAT_BY_SUFFIX[Path(name).suffix.lower()] for name, _, _ in files}
        if len(families) > 1:
            raise DatasetError(
                "INVALID_FORMAT",
                "The folder mixes file formats; keep one kind of file (.txt, .jsonl or .csv) per folder.",
                {"files": [name for name, _, _ in files][:50]},
            )
        format = families.pop()
        guess_text_layout = format == "text_lines"
    else:
        guess_text_layout = False
    used_field: str | None = None
    remaining = max_bytes
    for index, (name, real, _) in enumerate(files):
        try:
            data = _read_bounded(real, remaining, follow_symlinks=False)
            remaining -= len(data)
            if index == 0 and guess_text_layout:
                format = guess_format(name, data[:GUESS_HEAD_BYTES])
            used_field = _parse_text(_decode(data), format, field, collector)
        except DatasetError as error:
            error.details.setdefault("file", name)
            raise
    return _finish(collector, format=format, field=used_field, size_bytes=size_bytes)


def _is_saved_dataset(folder: Path) -> bool:
    return (
        all((folder / name).is_file() for name in _SAVED_DATASET_FILES)
        or (folder / _SAVED_DATASET_DICT_FILE).is_file()
    )


def _read_metadata(root: Path, folder: Path, name: str) -> Any:
    """A small JSON file of a saved dataset, checked to lie inside ``root``."""
    relative = str((folder / name).relative_to(root))
    real = _inside(root, folder / name, relative)
    try:
        data = _read_bounded(real, _MAX_JSON_METADATA_BYTES, follow_symlinks=False)
        return json.loads(data.decode("utf-8"))
    except DatasetError as error:
        if error.code == "DATASET_TOO_LARGE":
            raise DatasetError("INVALID_FORMAT", f"{relative} is too large for dataset metadata.") from None
        raise DatasetError(
            "INVALID_FORMAT",
            f"{relative} is missing or unreadable: not a save_to_disk folder.",
            {"file": relative},
        ) from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise DatasetError("INVALID_FORMAT", f"{relative} is not valid JSON.", {"file": relative}) from None


def _choose_split(root: Path, split: str | None) -> tuple[Path, str | None]:
    """The folder of the ``Dataset`` to read, and the split name when ``root`` is a ``DatasetDict``."""
    if all((root / name).is_file() for name in _SAVED_DATASET_FILES):
        if split is not None:
            raise DatasetError(
                "SPLIT_NOT_FOUND",
                "This saved dataset is a single Dataset; it has no splits.",
                {"split": split},
            )
        return root, None
    if not (root / _SAVED_DATASET_DICT_FILE).is_file():
        raise DatasetError(
            "INVALID_FORMAT",
            "The folder is not a save_to_disk dataset "
            "(it has no state.json and dataset_info.json, nor dataset_dict.json).",
        )
    metadata = _read_metadata(root, root, _SAVED_DATASET_DICT_FILE)
    splits = metadata.get("splits") if isinstance(metadata, dict) else None
    if (
        not isinstance(splits, list)
        or not splits
        or not all(isinstance(name, str) and name not in ("", ".", "..") for name in splits)
        or any("/" in name or "\\" in name for name in splits)
    ):
        raise DatasetError("INVALID_FORMAT", "dataset_dict.json does not list valid splits.")
    if split is None:
        split = "train" if "train" in splits else splits[0]
    elif split not in splits:
        listed, details = _listing("splits", splits)
        raise DatasetError(
            "SPLIT_NOT_FOUND",
            f"The saved DatasetDict has no split {split!r}; it has {listed}.",
            {"split": split, **details},
        )
    folder = _inside(root, root / split, split)
    if not folder.is_dir():
        raise DatasetError("INVALID_FORMAT", f"The split folder {split!r} is missing.", {"split": split})
    return folder, split


def _parse_saved_dataset(
    root: Path, *, field: str | None, split: str | None, max_bytes: int, collector: _Collector
) -> ParsedDataset:
    """Read one column of a ``save_to_disk`` folder with ``datasets.load_from_disk``.

    Before ``datasets`` opens anything, the metadata is read here and every file it will open
    (``state.json``, ``dataset_info.json`` and the ``.arrow`` files ``state.json`` lists) is checked
    to be a plain name inside the folder, so the size limit holds and no link leads out.
    """
    folder, split = _choose_split(root, split)
    state = _read_metadata(root, folder, "state.json")
    _read_metadata(root, folder, "dataset_info.json")
    data_files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(data_files, list) or not data_files:
        raise DatasetError("INVALID_FORMAT", "state.json lists no data files.")
    size_bytes = 0
    for data_file in data_files:
        filename = data_file.get("filename") if isinstance(data_file, dict) else None
        if (
            not isinstance(filename, str)
            or not filename.endswith(".arrow")
            or "/" in filename
            or "\\" in filename
            or filename.startswith(".")
        ):
            raise DatasetError(
                "INVALID_FORMAT", "state.json lists a data file that is not a plain .arrow file."
            )
        relative = str((folder / filename).relative_to(root))
        real = _inside(root, folder / filename, relative)
        if not real.is_file():
            raise DatasetError("INVALID_FORMAT", f"The data file {relative} is missing.", {"file": relative})
        size_bytes += real.stat().st_size
    _check_size(size_bytes, max_bytes)

    import datasets  # lazily: a heavy import only this format needs

    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as error:  # Arrow, JSON and schema errors alike mean a damaged folder
        raise DatasetError(
            "INVALID_FORMAT",
            "The save_to_disk folder could not be loaded (damaged or written by an incompatible version).",
            {"error": type(error).__name__},
        ) from None
    field = field or DEFAULT_FIELD
    columns = {name: _feature_type(feature) for name, feature in dataset.features.items()}
    if field not in columns:
        listed, details = _listing("fields", list(columns))
        shown_types = {name: columns[name] for name in list(columns)[:_LISTED_NAMES]}
        raise DatasetError(
            "FIELD_NOT_FOUND",
            f"The dataset has no column {field!r}; it has {listed}.",
            {"field": field, **details, "column_types": shown_types},
        )
    if columns[field] not in _ARROW_STRING_TYPES:
        raise DatasetError(
            "INVALID_FORMAT", f"Column {field!r} holds {columns[field]}, not text.", {"field": field}
        )
    # A loaded dataset has no indices mapping, so its Arrow table is exactly its rows.
    for row, value in enumerate(dataset.data.column(field).to_pylist()):
        collector.add(value if value is not None else "", row=row)
    return _finish(collector, format="hf_disk", field=field, size_bytes=size_bytes, split=split)


def _feature_type(feature: Any) -> str:
    dtype = getattr(feature, "dtype", None)
    return dtype if isinstance(dtype, str) else type(feature).__name__
