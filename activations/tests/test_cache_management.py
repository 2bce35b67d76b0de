"""Cache management: LRU eviction under the byte budget, expiry, orphans, broken files, leases, dry runs."""

import io
from datetime import timedelta

import numpy as np
import pytest
from django.core.management import call_command
from django.utils import timezone

from activations.models import ActivationCache, Dataset
from activations.services import cache_cleanup, cache_touch, dataset_create_from_texts
from activations.store import CacheWriter
from models_app.services import model_register

pytestmark = pytest.mark.django_db


@pytest.fixture
def make_cache(tiny_gpt2_folder, settings):
    """Real caches on disk (written with the real writer), each 64 tokens of a 16-wide hook."""
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None)
    dataset = dataset_create_from_texts(name="d", texts=["x"], owner=None, source=Dataset.Source.BUILTIN)
    counter = iter(range(1000))

    def build(*, accessed_days_ago: float = 0, status: str = "completed") -> ActivationCache:
        number = next(counter)
        cache = ActivationCache.objects.create(
            key_hash=f"{number:064d}", key={"n": number}, model=model, dataset=dataset, hooks=["h"],
            max_length=8, dtype="float32", status=status,
        )  # fmt: skip
        writer = CacheWriter.create_or_resume(
            cache.directory, key=cache.key, provenance={}, hooks={"h": 16}, dtype="float32"
        )
        tokens = 64
        writer.add_batch(
            0,
            token_ids=np.arange(tokens),
            sample_index=np.zeros(tokens, dtype=np.int64),
            positions=np.arange(tokens),
            activations={"h": np.random.default_rng(number).standard_normal((tokens, 16), dtype=np.float32)},
        )
        if status == "completed":
            writer.finalize(num_samples=1)
        else:
            writer.flush()
            writer.close()
        cache.file_size_bytes = sum(
            path.stat().st_size for path in cache.directory.rglob("*") if path.is_file()
        )
        cache.last_accessed_at = timezone.now() - timedelta(days=accessed_days_ago)
        cache.save()
        return cache

    return build


def test_least_recently_used_caches_are_evicted_down_to_the_budget(
    make_cache, settings, django_capture_on_commit_callbacks
):
    oldest, middle, newest = make_cache(accessed_days_ago=3), make_cache(accessed_days_ago=2), make_cache()
    settings.ACTIVATION_CACHE_MAX_BYTES = newest.file_size_bytes + middle.file_size_bytes
    with django_capture_on_commit_callbacks(execute=True):  # a deleted row's files go on commit
        report = cache_cleanup()
    assert report["evicted"] == [oldest.id]
    assert not oldest.directory.exists() and middle.directory.exists() and newest.directory.exists()
    assert set(ActivationCache.objects.values_list("pk", flat=True)) == {middle.id, newest.id}


def test_caches_being_written_or_read_are_never_evicted(make_cache, settings):
    writing = make_cache(accessed_days_ago=9, status="writing")
    read = make_cache(accessed_days_ago=8)
    cache_touch(read)  # a reading lease (and a fresh last_accessed)
    read.last_accessed_at = timezone.now() - timedelta(days=8)
    read.save()
    other = make_cache(accessed_days_ago=1)
    settings.ACTIVATION_CACHE_MAX_BYTES = 1
    report = cache_cleanup()
    assert report["evicted"] == [other.id]
    assert writing.directory.exists() and read.directory.exists()


def test_inactive_caches_expire(make_cache, settings):
    settings.ACTIVATION_CACHE_EXPIRY_DAYS = 30
    stale, fresh = make_cache(accessed_days_ago=31), make_cache(accessed_days_ago=29)
    assert cache_cleanup()["expired"] == [stale.id]
    assert ActivationCache.objects.filter(pk=fresh.id).exists()


def test_orphans_removed_broken_caches_failed_and_dry_run_changes_nothing(make_cache, settings):
    sound, missing, corrupt = make_cache(), make_cache(), make_cache()
    orphan = settings.ACTIVATION_CACHE_DIR / "act_orphanfolder"
    orphan.mkdir()
    (orphan / "leftover.safetensors").write_bytes(b"x")
    import shutil

    shutil.rmtree(missing.directory)
    shard = next(path for path in corrupt.directory.rglob("00000.safetensors") if "token" not in str(path))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))

    out = io.StringIO()
    call_command("cleanup_caches", "--dry-run", "--verify", stdout=out)
    assert "act_orphanfolder" in out.getvalue() and orphan.exists()
    assert ActivationCache.objects.get(pk=corrupt.id).status == "completed"

    report = cache_cleanup(verify_checksums=True)
    assert "act_orphanfolder" in report["orphans"] and not orphan.exists()
    assert set(report["failed"]) == {missing.id, corrupt.id}
    assert ActivationCache.objects.get(pk=corrupt.id).error_code == "CACHE_CORRUPT"
    assert ActivationCache.objects.get(pk=sound.id).status == "completed"


def test_the_daily_cleanup_runs_once_a_day_across_workers(make_cache, settings):
    from activations.services import cache_cleanup_daily
    from mistudio.redis_client import get_redis

    get_redis().delete(f"{settings.REDIS_KEY_PREFIX}:cache-cleanup-daily")
    settings.ACTIVATION_CACHE_EXPIRY_DAYS = 30
    stale = make_cache(accessed_days_ago=40)
    assert cache_cleanup_daily()["expired"] == [stale.id]
    assert cache_cleanup_daily() is None  # already done today
