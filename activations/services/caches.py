"""Activation cache rows and files: the one writer path, touch, delete, cleanup."""

import logging
import shutil
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from activations.models import ActivationCache
from activations.store import CacheWriter, shard_tokens_for, verify
from mistudio.errors import ApplicationError
from mistudio.redis_client import get_redis

logger = logging.getLogger(__name__)


def cache_store_open(
    cache: ActivationCache,
    *,
    provenance: dict[str, Any],
    hooks: dict[str, int],
    extra_token_columns: tuple[str, ...] = (),
):
    """The writer of ``cache``'s files (started, or resumed after a crash), shards sized by settings.

    The one way extraction and generation capture write a cache: open here, ``add_batch`` and
    ``finalize`` on the writer, then :func:`cache_store_completed` or :func:`cache_store_failed`.
    """

    return CacheWriter.create_or_resume(
        cache.directory,
        key=cache.key,
        provenance=provenance,
        hooks=hooks,
        dtype=cache.dtype,
        shard_max_tokens=min(
            settings.ACTIVATION_SHARD_MAX_TOKENS,
            shard_tokens_for(hooks, cache.dtype, max_bytes=settings.ACTIVATION_SHARD_MAX_BYTES),
        ),
        extra_token_columns=extra_token_columns,
    )


def cache_store_completed(cache: ActivationCache, *, manifest: dict[str, Any], size_bytes: int) -> None:
    """The row says ``completed``, with the sizes of the finalized files (never before they are)."""
    cache.save(update_fields=cache.mark_completed(manifest=manifest, size_bytes=size_bytes))


def cache_store_failed(
    cache: ActivationCache, *, code: str, message: str, remove_files: bool = False
) -> None:
    """The row says ``failed`` with a code and message; ``remove_files`` deletes what was written."""
    cache.save(update_fields=cache.mark_failed(code=code, message=message))
    if remove_files:
        cache_delete_files(cache)


def cache_delete_files(cache: ActivationCache) -> None:
    shutil.rmtree(cache.directory, ignore_errors=True)


def cache_files_follow_row(sender, instance: ActivationCache, **kwargs) -> None:
    """pre_delete of a cache row, however it goes (a model's deletion cascades to its caches):
    its files are removed once the deletion commits, never while it could still roll back."""
    directory = instance.directory  # read now: a deleted row has no id
    transaction.on_commit(lambda: shutil.rmtree(directory, ignore_errors=True))


def reading_lease_key(cache_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:reading:{cache_id}"


def cache_touch(cache: ActivationCache, *, lease_seconds: int = 300) -> None:
    """Note a read: last_accessed for LRU, and a short lease so eviction leaves it alone meanwhile."""
    cache.last_accessed_at = timezone.now()
    cache.save(update_fields=["last_accessed_at"])
    get_redis().set(reading_lease_key(cache.id), "1", ex=lease_seconds)


def cache_delete(*, cache_id: str) -> None:
    cache = ActivationCache.objects.get(pk=cache_id)
    if cache.status == ActivationCache.Status.WRITING:
        raise ApplicationError(
            "CACHE_BUSY", "The cache is being written; cancel its extraction first.", status=409
        )
    cache.delete()  # its files follow on commit (cache_files_follow_row)


def cache_cleanup(*, dry_run: bool = False, verify_checksums: bool = False) -> dict[str, list[str]]:
    """Expire, evict (LRU under ACTIVATION_CACHE_MAX_BYTES), remove orphan files, fail broken rows.

    Never touches a cache being written or read (a reading lease in Redis).
    """

    report: dict[str, list[str]] = {"expired": [], "evicted": [], "orphans": [], "failed": []}
    connection = get_redis()

    def removable(cache: ActivationCache) -> bool:
        return cache.status != ActivationCache.Status.WRITING and not connection.exists(
            reading_lease_key(cache.id)
        )

    def remove(cache: ActivationCache, bucket: str) -> None:
        report[bucket].append(cache.id)
        if not dry_run:
            cache.delete()  # its files follow on commit (cache_files_follow_row)

    completed = ActivationCache.objects.filter(status=ActivationCache.Status.COMPLETED)
    for cache in completed:
        missing = not (cache.directory / "manifest.json").exists()
        problems = ["missing files"] if missing else (verify(cache.directory) if verify_checksums else [])
        if problems:
            report["failed"].append(cache.id)
            if not dry_run:
                cache_store_failed(cache, code="CACHE_CORRUPT", message="; ".join(problems)[:2000])

    expiry = timezone.now() - timedelta(days=settings.ACTIVATION_CACHE_EXPIRY_DAYS)
    for cache in ActivationCache.objects.filter(last_accessed_at__lt=expiry).exclude(status="writing"):
        if removable(cache):
            remove(cache, "expired")

    remaining = ActivationCache.objects.exclude(pk__in=report["expired"]).order_by("last_accessed_at")
    total = sum(cache.file_size_bytes for cache in remaining)
    for cache in remaining:
        if total <= settings.ACTIVATION_CACHE_MAX_BYTES:
            break
        if cache.status == ActivationCache.Status.COMPLETED and removable(cache):
            total -= cache.file_size_bytes
            remove(cache, "evicted")

    known = set(ActivationCache.objects.values_list("pk", flat=True))
    for path in sorted(settings.ACTIVATION_CACHE_DIR.iterdir()):
        if path.is_dir() and path.name.startswith("act_") and path.name not in known:
            report["orphans"].append(path.name)
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)
    return report


def cache_cleanup_daily() -> dict[str, list[str]] | None:
    """Run the cleanup at most once a day across all workers (the first to take the Redis key)."""
    if not get_redis().set(f"{settings.REDIS_KEY_PREFIX}:cache-cleanup-daily", "1", nx=True, ex=24 * 3600):
        return None
    report = cache_cleanup()
    logger.info("daily cache cleanup: %s", {bucket: len(ids) for bucket, ids in report.items()})
    return report
