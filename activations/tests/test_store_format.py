"""The on-disk cache format stays readable: a cache written by miStudio's store on 2026-11-25 (before
the store was split into modules) is checked in under ``fixtures/cache_format_v1`` and must keep
opening, verifying and reading back the values it was written with."""

import shutil
from pathlib import Path

import numpy as np

from activations.store import ActivationStore, verify

FIXTURE = Path(__file__).parent / "fixtures" / "cache_format_v1"
LENGTHS = [3, 2, 4, 2, 1]  # five samples, twelve tokens, in two shards (5 + 7 tokens)
RESID, FINAL = "blocks.0.hook_resid_post", "ln_final.hook_normalized"


def test_a_cache_written_before_the_store_split_still_opens_verifies_and_reads(tmp_path):
    cache = shutil.copytree(FIXTURE, tmp_path / "cache")  # reading must not need a writable fixture
    assert verify(cache) == []
    store = ActivationStore.open(cache)
    resid = np.arange(48, dtype=np.float32).reshape(12, 4) / 8
    final = -np.arange(36, dtype=np.float32).reshape(12, 3) / 4
    assert store.shape(RESID) == (12, 4) and store.shape(FINAL) == (12, 3)
    np.testing.assert_array_equal(store.get(RESID), resid)
    np.testing.assert_array_equal(store.get(FINAL, 3, 9), final[3:9])  # across the shard boundary
    np.testing.assert_array_equal(store.sample(RESID, 2), resid[5:9])
    tokens = store.tokens()
    np.testing.assert_array_equal(tokens["token_ids"], np.arange(12) + 100)
    np.testing.assert_array_equal(tokens["sample_index"], np.repeat(np.arange(5), LENGTHS))
    np.testing.assert_array_equal(tokens["position"], np.concatenate([np.arange(n) for n in LENGTHS]))
    assert store.manifest["provenance"] == {"note": "written before the store split"}


def test_its_sha256_checksums_are_still_checked(tmp_path):
    """Caches written before the xxh3 checksums record bare sha256 digests: a flipped byte in
    one of its files is still found."""
    cache = shutil.copytree(FIXTURE, tmp_path / "cache")
    shard = cache / RESID / "00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verify(cache) == [f"CACHE_CORRUPT: {RESID}/00001.safetensors: checksum mismatch"]
    tokens = cache / "tokens.safetensors"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 0x01
    tokens.write_bytes(bytes(data))
    assert "CACHE_CORRUPT: tokens.safetensors: checksum mismatch" in verify(cache)
