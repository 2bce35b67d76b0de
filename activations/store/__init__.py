"""The activation cache on disk: a resumable writer, a verifier and a memory-mapped reader.

Importable without Django, so a researcher can read a cache from a notebook::

    from activations.store import ActivationStore

    store = ActivationStore.open("/data/activation_cache/act_123")
    block = store.get("blocks.6.hook_resid_post", 0, 4096)

Layout of one cache directory (safetensors only, no pickle anywhere)::

    manifest.json                          # key, provenance, hooks, dtype, status, shards with checksums
    tokens/00000.safetensors               # per shard: token_ids, sample_index, position (int64)
    <hook directory>/00000.safetensors     # per shard: "activations" [tokens_in_shard, width]
    tokens.safetensors                     # at finalize: the whole token table, one row per token

Durability: every file is written to a temporary name in its own directory, fsynced and renamed,
and the directory is fsynced after the renames. The manifest is rewritten (the same way) only
after a shard's files are durable, so a crash at any moment leaves the previous manifest or the
new one, never one that lists a missing or partial file. Files a crash leaves behind that no
manifest lists are removed when the writer resumes.

torch is imported lazily: writing needs it, reading float32/float16 caches does not.

Modules: ``format`` (names, constants, errors, safetensors headers and streams, the manifest,
durable writes), ``writer`` (``CacheWriter``), ``pipeline`` (``BackgroundWriter``: the writer on a
thread), ``integrity`` (``verify``), ``reader``
(``ActivationStore``) and ``analysis`` (its statistics). Import from this package; the format
itself is pinned by ``activations/tests/fixtures/cache_format_v1`` (a cache written before the split).
"""

from activations.store.format import (
    ACTIVATIONS_TENSOR,
    CACHE_CORRUPT,
    CACHE_INCOMPLETE,
    CACHE_LOCKED,
    CACHE_MISMATCH,
    DEFAULT_SHARD_MAX_BYTES,
    DISK_FULL,
    DTYPES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    STATUS_COMPLETE,
    STATUS_WRITING,
    TOKEN_COLUMNS,
    TOKENS_DIR,
    TOKENS_FILE,
    CacheError,
    cache_bytes_per_token,
    hook_directory_name,
    iter_files,
    normalize_dtype,
    shard_tokens_for,
    token_columns,
    write_durably,
)
from activations.store.integrity import verify
from activations.store.pipeline import BackgroundWriter
from activations.store.reader import ActivationStore
from activations.store.writer import CacheWriter

__all__ = [
    "ACTIVATIONS_TENSOR",
    "CACHE_CORRUPT",
    "CACHE_INCOMPLETE",
    "CACHE_LOCKED",
    "CACHE_MISMATCH",
    "DEFAULT_SHARD_MAX_BYTES",
    "DISK_FULL",
    "DTYPES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "STATUS_COMPLETE",
    "STATUS_WRITING",
    "TOKENS_DIR",
    "TOKENS_FILE",
    "TOKEN_COLUMNS",
    "ActivationStore",
    "BackgroundWriter",
    "CacheError",
    "CacheWriter",
    "cache_bytes_per_token",
    "hook_directory_name",
    "iter_files",
    "normalize_dtype",
    "shard_tokens_for",
    "token_columns",
    "verify",
    "write_durably",
]
