"""Integrity: a cache checked against its manifest: files present, headers as listed, checksums right."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from activations.store.format import (
    ACTIVATIONS_TENSOR,
    CACHE_CORRUPT,
    CACHE_INCOMPLETE,
    DTYPES,
    FORMAT_VERSION,
    STATUS_COMPLETE,
    TOKENS_DIR,
    TOKENS_FILE,
    CacheError,
    _hook_table,
    _read_header,
    _read_manifest,
    _shard_file_name,
    checksum_matches,
    token_columns,
)


def _header_problems(path: Path, relative: str, expected: dict[str, tuple[str, list[int]]]) -> list[str]:
    """Checks tensor names, dtypes, shapes and the file size against what the manifest implies."""
    try:
        header, data_start = _read_header(path)
        if set(header) != set(expected):
            return [
                f"{CACHE_CORRUPT}: {relative}: holds tensors {sorted(header)}, expected {sorted(expected)}"
            ]
        problems = []
        data_end = 0
        for name, (dtype, shape) in expected.items():
            info = header[name]
            if info["dtype"] != dtype or list(info["shape"]) != shape:
                problems.append(
                    f"{CACHE_CORRUPT}: {relative}: {name} is {info['dtype']} {info['shape']}, "
                    f"the manifest implies {dtype} {shape}"
                )
            data_end = max(data_end, int(info["data_offsets"][1]))
        size = path.stat().st_size
        if size != data_start + data_end:
            problems.append(f"{CACHE_CORRUPT}: {relative}: {size} bytes, expected {data_start + data_end}")
        return problems
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        return [f"{CACHE_CORRUPT}: {relative}: unreadable safetensors file ({error})"]


def _shard_problems(
    root: Path, manifest: dict, shard: Any, *, position: int, token_start: int, first_batch: int, hashes: bool
) -> list[str]:
    """Everything wrong with one shard entry and its files (empty when it is sound)."""
    label = f"shard {position}"
    if not isinstance(shard, dict):
        return [f"{CACHE_CORRUPT}: {label}: malformed manifest entry"]
    num_tokens = shard.get("num_tokens")
    last_batch = shard.get("last_batch")
    problems = []
    if shard.get("index") != position:
        problems.append(f"{CACHE_CORRUPT}: {label}: index is {shard.get('index')!r}")
    if shard.get("token_start") != token_start:
        problems.append(
            f"{CACHE_CORRUPT}: {label}: token_start {shard.get('token_start')!r}, expected {token_start}"
        )
    if shard.get("first_batch") != first_batch:
        problems.append(
            f"{CACHE_CORRUPT}: {label}: first_batch {shard.get('first_batch')!r}, expected {first_batch}"
        )
    if not isinstance(last_batch, int) or last_batch < first_batch:
        problems.append(f"{CACHE_CORRUPT}: {label}: last_batch {last_batch!r} is before its first batch")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        return [*problems, f"{CACHE_CORRUPT}: {label}: num_tokens {num_tokens!r}"]

    name = _shard_file_name(position)
    expected = {f"{TOKENS_DIR}/{name}": {column: ("I64", [num_tokens]) for column in token_columns(manifest)}}
    for hook in manifest["hooks"]:
        expected[f"{hook['directory']}/{name}"] = {
            ACTIVATIONS_TENSOR: (DTYPES[manifest["dtype"]], [num_tokens, hook["width"]])
        }
    files = shard.get("files")
    if not isinstance(files, dict) or set(files) != set(expected):
        return [*problems, f"{CACHE_CORRUPT}: {label}: its file list is not the expected {sorted(expected)}"]
    for relative, tensors in expected.items():
        path = root / relative
        if not path.is_file():
            problems.append(f"{CACHE_CORRUPT}: {relative}: missing")
            continue
        header_problems = _header_problems(path, relative, tensors)
        if header_problems:
            problems.extend(header_problems)
        elif hashes and not checksum_matches(path, files[relative]):
            problems.append(f"{CACHE_CORRUPT}: {relative}: checksum mismatch")
    return problems


def tokens_file_checksum(entry: dict) -> Any:
    """The token table's recorded checksum (``checksum``; caches written before: ``sha256``)."""
    return entry.get("checksum", entry.get("sha256"))


def _tokens_file_problems(root: Path, manifest: dict, *, hashes: bool) -> list[str]:
    entry = manifest.get("tokens_file")
    if not isinstance(entry, dict) or entry.get("path") != TOKENS_FILE:
        return [f"{CACHE_CORRUPT}: the manifest does not record {TOKENS_FILE}"]
    path = root / TOKENS_FILE
    if not path.is_file():
        return [f"{CACHE_CORRUPT}: {TOKENS_FILE}: missing"]
    expected = {column: ("I64", [manifest["num_tokens"]]) for column in token_columns(manifest)}
    problems = _header_problems(path, TOKENS_FILE, expected)
    if not problems and hashes and not checksum_matches(path, tokens_file_checksum(entry)):
        problems.append(f"{CACHE_CORRUPT}: {TOKENS_FILE}: checksum mismatch")
    return problems


def _manifest_problems(root: Path, manifest: dict, *, hashes: bool) -> list[str]:
    """Structural problems of a cache (status aside); with ``hashes`` every file's checksum is checked."""
    try:
        if manifest.get("format_version") != FORMAT_VERSION:
            return [f"{CACHE_CORRUPT}: unsupported format_version {manifest.get('format_version')!r}"]
        if manifest.get("dtype") not in DTYPES:
            return [f"{CACHE_CORRUPT}: unsupported dtype {manifest.get('dtype')!r}"]
        _hook_table(manifest)
        shards = manifest.get("shards")
        if not isinstance(shards, list):
            return [f"{CACHE_CORRUPT}: the manifest has no shard list"]
        problems = []
        token_start = first_batch = 0
        for position, shard in enumerate(shards):
            problems += _shard_problems(
                root,
                manifest,
                shard,
                position=position,
                token_start=token_start,
                first_batch=first_batch,
                hashes=hashes,
            )
            if isinstance(shard, dict):
                token_start += shard.get("num_tokens") if isinstance(shard.get("num_tokens"), int) else 0
                first_batch = shard.get("last_batch", first_batch - 1) + 1
        if manifest.get("num_tokens") != token_start:
            problems.append(
                f"{CACHE_CORRUPT}: the manifest says {manifest.get('num_tokens')!r} tokens, "
                f"its shards hold {token_start}"
            )
        if manifest.get("status") == STATUS_COMPLETE:
            problems += _tokens_file_problems(root, manifest, hashes=hashes)
            if not isinstance(manifest.get("num_samples"), int):
                problems.append(f"{CACHE_CORRUPT}: a complete cache without num_samples")
        return problems
    except CacheError as error:
        return [f"{error.code}: {error.message}"]
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        return [f"{CACHE_CORRUPT}: the manifest is malformed ({error!r})"]


def verify(directory: Path | str) -> list[str]:
    """Every problem of the cache at ``directory``; ``[]`` when it is complete and sound.

    Reads every file to check its checksum. Each problem starts with the error code it amounts to:
    ``CACHE_CORRUPT`` (missing file, checksum or shape mismatch, bad manifest) or ``CACHE_INCOMPLETE``
    (status is not complete).
    """
    root = Path(directory)
    try:
        manifest = _read_manifest(root)
    except CacheError as error:
        return [f"{error.code}: {error.message}"]
    problems = _manifest_problems(root, manifest, hashes=True)
    if manifest.get("status") != STATUS_COMPLETE:
        problems.append(f"{CACHE_INCOMPLETE}: status is {manifest.get('status')!r}, not complete")
    return problems
