"""Dataset and extraction workflows, and activation cache management.

Every front door (REST API, pages, admin, management commands) calls these; the modules
hold datasets, extractions and caches, and this package is where callers import them from.
"""

from activations.services.caches import (
    cache_cleanup,
    cache_cleanup_daily,
    cache_delete,
    cache_delete_files,
    cache_files_follow_row,
    cache_store_completed,
    cache_store_failed,
    cache_store_open,
    cache_touch,
    reading_lease_key,
)
from activations.services.datasets import (
    DATASET_ERROR_STATUS,
    DatasetReader,
    dataset_create_from_local,
    dataset_create_from_texts,
    dataset_create_from_upload,
    dataset_delete,
    dataset_error,
    dataset_samples,
    dataset_update,
    local_data_path,
)
from activations.services.extractions import (
    STORAGE_DTYPES,
    cache_key,
    cache_key_hash,
    cache_size_estimate,
    extraction_cancel,
    extraction_memory,
    extraction_request,
    hook_names_for,
    job_state,
    joined,
    key_hash,
    storage_dtype_for,
)

__all__ = [
    "DATASET_ERROR_STATUS",
    "STORAGE_DTYPES",
    "DatasetReader",
    "cache_cleanup",
    "cache_cleanup_daily",
    "cache_delete",
    "cache_delete_files",
    "cache_files_follow_row",
    "cache_key",
    "cache_key_hash",
    "cache_size_estimate",
    "cache_store_completed",
    "cache_store_failed",
    "cache_store_open",
    "cache_touch",
    "dataset_create_from_local",
    "dataset_create_from_texts",
    "dataset_create_from_upload",
    "dataset_delete",
    "dataset_error",
    "dataset_samples",
    "dataset_update",
    "extraction_cancel",
    "extraction_memory",
    "extraction_request",
    "hook_names_for",
    "job_state",
    "joined",
    "key_hash",
    "local_data_path",
    "reading_lease_key",
    "storage_dtype_for",
]
