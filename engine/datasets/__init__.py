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
* ``parquet``: a Parquet file (pyarrow, a row group at a time); ``field`` (default ``"text"``)
  names a string column; nulls are skipped like empty values.
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

from engine.datasets.files import parse_path
from engine.datasets.samples import DEFAULT_FIELD, FORMATS, DatasetError, ParsedDataset, content_hash, preview
from engine.datasets.text import GUESS_HEAD_BYTES, guess_format, parse_bytes

__all__ = [
    "DEFAULT_FIELD",
    "FORMATS",
    "GUESS_HEAD_BYTES",
    "DatasetError",
    "ParsedDataset",
    "content_hash",
    "guess_format",
    "parse_bytes",
    "parse_path",
    "preview",
]
