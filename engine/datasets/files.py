"""Datasets on disk: one file, a folder of text files, or a ``save_to_disk`` folder, read safely."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from engine.datasets.samples import (
    _LISTED_NAMES,
    DEFAULT_FIELD,
    DatasetError,
    ParsedDataset,
    _check_format,
    _check_size,
    _Collector,
    _finish,
    _listing,
)
from engine.datasets.text import (
    _FORMAT_BY_SUFFIX,
    GUESS_HEAD_BYTES,
    _decode,
    _parse_text,
    guess_format,
    parse_bytes,
)

# Files that deserialize to objects (and may run code when they do). Never opened, even as text.
_REFUSED_SUFFIXES = frozenset({".pkl", ".pickle", ".pt", ".pth", ".bin", ".joblib", ".npy", ".npz", ".dill"})
_SAVED_DATASET_FILES = ("state.json", "dataset_info.json")
_SAVED_DATASET_DICT_FILE = "dataset_dict.json"
_MAX_JSON_METADATA_BYTES = 1024 * 1024
_ARROW_STRING_TYPES = frozenset({"string", "large_string"})


def parse_path(
    path: Path,
    *,
    format: str | None,
    field: str | None,
    max_bytes: int,
    max_samples: int | None = None,
    max_sample_bytes: int | None = None,
    split: str | None = None,
    label_field: str | None = None,
) -> ParsedDataset:
    """Parse a file, or a folder: a ``save_to_disk`` folder or a folder of text files. Labels
    (``label_field``) are read from one JSONL, CSV or Parquet file only.

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
        if label_field is not None:
            raise DatasetError(
                "LABELS_UNSUPPORTED", "Labels are read from one JSONL, CSV or Parquet file, not a folder."
            )
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
        label_field=label_field,
    )


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
