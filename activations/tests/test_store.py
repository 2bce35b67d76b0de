"""The activation cache on disk: write, read back, verify, resume after crashes, run out of disk.

No database: the store is plain files. Caches are small (a few hundred tokens, 3 hooks) but split
into several shards, so every shard-boundary path runs.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from safetensors.numpy import load_file

from activations.store import (
    ActivationStore,
    CacheError,
    CacheWriter,
    hook_directory_name,
    iter_files,
    verify,
)
from activations.store import format as cache_format

PROJECT_ROOT = Path(__file__).resolve().parents[2]
HOOKS = {"blocks.0.hook_resid_post": 8, "module:transformer.h.0.mlp": 12, "blocks.1.attn.hook_z": 5}
KEY = {"model": "tiny-gpt2", "revision": "abc123", "dataset": 7, "hooks": sorted(HOOKS)}
PROVENANCE = {"model_sha": "deadbeef", "dataset_sha256": "cafe"}
# Varied batch sizes, one of them empty; two samples per batch.
BATCH_TOKENS = [7, 13, 0, 21, 5, 17, 9, 30, 11, 4, 16, 8]
NUM_BATCHES = len(BATCH_TOKENS)
NUM_SAMPLES = 2 * NUM_BATCHES
SHARD_MAX_TOKENS = 25
DTYPES = ["float32", "bfloat16", "float16"]
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def xxh3_checksum(data: bytes) -> str:
    """A file's checksum as the manifest records it, computed here with xxhash itself."""
    return "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()


def make_batch(index: int, hooks: dict[str, int] = HOOKS, *, shuffle: bool = True) -> dict:
    """Batch ``index``: samples 2*index (positions 0..) and 2*index+1 (positions 1.., its BOS dropped),
    rows shuffled so that storage order is not position order."""
    generator = torch.Generator().manual_seed(1000 + index)
    count = BATCH_TOKENS[index]
    first = count // 2
    sample_index = torch.tensor([2 * index] * first + [2 * index + 1] * (count - first), dtype=torch.int64)
    positions = torch.cat([torch.arange(first), torch.arange(1, count - first + 1)])
    token_ids = torch.randint(0, 50_000, (count,), generator=generator)
    order = torch.randperm(count, generator=generator) if shuffle else torch.arange(count)
    activations = {name: torch.randn(count, width, generator=generator) * 3 for name, width in hooks.items()}
    return {
        "token_ids": token_ids[order],
        "sample_index": sample_index[order],
        "positions": positions[order],
        "activations": {name: values[order] for name, values in activations.items()},
    }


def expected_content(dtype: str, hooks: dict[str, int] = HOOKS) -> dict:
    """What a cache of all batches holds: token columns and, per hook, values as stored (as float32)."""
    batches = [make_batch(index, hooks) for index in range(NUM_BATCHES)]
    content = {
        "token_ids": torch.cat([batch["token_ids"] for batch in batches]).numpy(),
        "sample_index": torch.cat([batch["sample_index"] for batch in batches]).numpy(),
        "position": torch.cat([batch["positions"] for batch in batches]).numpy(),
    }
    for name in hooks:
        stored = torch.cat([batch["activations"][name] for batch in batches]).to(TORCH_DTYPES[dtype])
        content[name] = stored.float().numpy()
    return content


def open_writer(
    directory: Path, *, dtype: str = "float32", key: dict = KEY, hooks: dict = HOOKS
) -> CacheWriter:
    return CacheWriter.create_or_resume(
        directory, key=key, provenance=PROVENANCE, hooks=hooks, dtype=dtype, shard_max_tokens=SHARD_MAX_TOKENS
    )


def add_batches(writer: CacheWriter, indices, hooks: dict = HOOKS) -> None:
    for index in indices:
        writer.add_batch(index, **make_batch(index, hooks))


def write_cache(directory: Path, *, dtype: str = "float32", hooks: dict = HOOKS) -> Path:
    writer = open_writer(directory, dtype=dtype, hooks=hooks)
    add_batches(writer, range(NUM_BATCHES), hooks)
    writer.finalize(num_samples=NUM_SAMPLES)
    return directory


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted caches, one per dtype, written on first use. Read-only: copy before damaging."""
    made: dict[str, Path] = {}

    def get(dtype: str) -> Path:
        if dtype not in made:
            made[dtype] = write_cache(tmp_path_factory.mktemp(f"reference-{dtype}") / "cache", dtype=dtype)
        return made[dtype]

    return get


@pytest.fixture(scope="module", params=DTYPES)
def cache(request, reference):
    dtype = request.param
    return ActivationStore.open(reference(dtype)), expected_content(dtype)


def copy_of(reference_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "cache"
    shutil.copytree(reference_dir, target)
    return target


def temp_files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.name.endswith(".tmp")]


def shard_files_on_disk(directory: Path) -> set[str]:
    return {
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*.safetensors")
        if path.parent != directory
    }


def listed_files(directory: Path) -> set[str]:
    manifest = json.loads((directory / "manifest.json").read_text())
    return {relative for shard in manifest["shards"] for relative in shard["files"]}


def assert_same_cache(directory: Path, reference_dir: Path) -> None:
    """Byte-identical shards and token table, so no batch was duplicated or lost."""
    ours = json.loads((directory / "manifest.json").read_text())
    theirs = json.loads((reference_dir / "manifest.json").read_text())
    assert ours["status"] == theirs["status"] == "complete"
    assert ours["shards"] == theirs["shards"]
    assert ours["tokens_file"] == theirs["tokens_file"]
    assert ours["num_tokens"] == theirs["num_tokens"] == sum(BATCH_TOKENS)
    assert verify(directory) == []
    store_ours, store_theirs = ActivationStore.open(directory), ActivationStore.open(reference_dir)
    for hook in HOOKS:
        np.testing.assert_array_equal(store_ours.get(hook), store_theirs.get(hook))


# --- Reading back what was written -----------------------------------------------------------------


def test_read_back_equals_what_was_written(cache):
    opened, expected = cache
    assert opened.hooks == list(HOOKS)
    assert opened.num_tokens == sum(BATCH_TOKENS)
    assert opened.num_samples == NUM_SAMPLES
    numpy_dtype = np.float16 if opened.dtype == "float16" else np.float32  # bf16 widens to float32
    for hook, width in HOOKS.items():
        assert opened.shape(hook) == (sum(BATCH_TOKENS), width)
        values = opened.get(hook)
        assert values.dtype == numpy_dtype
        np.testing.assert_array_equal(values.astype(np.float32), expected[hook])  # exact, after the cast
        tensor = opened.get(hook, as_torch=True)
        assert tensor.dtype == TORCH_DTYPES[opened.dtype]
        np.testing.assert_array_equal(tensor.float().numpy(), expected[hook])


def test_shards_end_on_batch_boundaries(cache):
    opened, _expected = cache
    shards = opened.manifest["shards"]
    assert len(shards) >= 4
    for shard in shards:
        batch_tokens = BATCH_TOKENS[shard["first_batch"] : shard["last_batch"] + 1]
        assert shard["num_tokens"] == sum(batch_tokens)
        if shard is not shards[-1]:  # full shards: the last batch pushed it over the threshold
            assert sum(batch_tokens) >= SHARD_MAX_TOKENS > sum(batch_tokens[:-1])
    assert [shard["first_batch"] for shard in shards[1:]] == [
        shard["last_batch"] + 1 for shard in shards[:-1]
    ]
    assert shards[-1]["last_batch"] == NUM_BATCHES - 1


def test_token_table(cache):
    opened, expected = cache
    table = opened.tokens()
    for column in ("token_ids", "sample_index", "position"):
        assert isinstance(table[column], np.memmap)  # mapped, not loaded
        np.testing.assert_array_equal(table[column], expected[column])
    plain = load_file(opened.directory / "tokens.safetensors")
    np.testing.assert_array_equal(plain["token_ids"], expected["token_ids"])


@pytest.mark.parametrize(
    ("start", "stop"), [(0, None), (3, 60), (24, 26), (20, 89), (50, 50), (-10, None), (140, 999)]
)
def test_get_across_shard_boundaries(cache, start, stop):
    opened, expected = cache
    for hook in HOOKS:
        np.testing.assert_array_equal(
            opened.get(hook, start, stop).astype(np.float32), expected[hook][start:stop]
        )


def test_gather_reads_rows_by_number_in_any_order_as_get_does(cache):
    """Rows scattered over every shard, out of order and repeated: the values and dtypes of
    ``get``, as numpy and as torch (a bf16 cache's bits, a resumed training's buffer)."""
    opened, expected = cache
    rows = np.random.default_rng(0).permutation(opened.num_tokens)[: opened.num_tokens // 2]
    rows = np.concatenate([rows, rows[:5], [0, opened.num_tokens - 1]])
    for hook in HOOKS:
        everything = opened.get(hook)
        gathered = opened.gather(hook, rows)
        assert gathered.dtype == everything.dtype
        np.testing.assert_array_equal(gathered, everything[rows])
        np.testing.assert_array_equal(gathered.astype(np.float32), expected[hook][rows])
        tensor = opened.gather(hook, torch.from_numpy(rows), as_torch=True)
        assert tensor.dtype == TORCH_DTYPES[opened.dtype]
        assert torch.equal(tensor, opened.get(hook, as_torch=True)[torch.from_numpy(rows)])
    assert opened.gather(hook, []).shape == (0, HOOKS[hook])
    with pytest.raises(IndexError):
        opened.gather(hook, [opened.num_tokens])


def test_sample_in_position_order(cache):
    opened, expected = cache
    hook = "module:transformer.h.0.mlp"
    for sample in range(NUM_SAMPLES):
        rows = np.flatnonzero(expected["sample_index"] == sample)
        rows = rows[np.argsort(expected["position"][rows], kind="stable")]
        np.testing.assert_array_equal(opened.sample(hook, sample).astype(np.float32), expected[hook][rows])
        token_ids, positions = opened.sample_tokens(sample)
        np.testing.assert_array_equal(token_ids, expected["token_ids"][rows])
        np.testing.assert_array_equal(positions, expected["position"][rows])
        assert list(positions) == sorted(positions)
    assert opened.sample(hook, 4).shape == (0, 12)  # batch 2 is empty: its samples have no tokens
    assert opened.sample(hook, 10_000).shape == (0, 12)


def test_stats_match_numpy(cache):
    opened, expected = cache
    for hook in HOOKS:
        values = expected[hook].astype(np.float64)
        stats = opened.stats(hook, chunk_tokens=17)  # chunks that straddle nothing: they stop at shards
        assert stats["count"] == len(values)
        np.testing.assert_allclose(stats["mean"], values.mean(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats["std"], values.std(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(stats["max"], values.max(axis=0).astype(np.float32))
        np.testing.assert_array_equal(stats["min"], values.min(axis=0).astype(np.float32))
        assert stats["mean_l2_norm"] == pytest.approx(np.linalg.norm(values, axis=1).mean(), rel=1e-9)


def test_top_k_matches_numpy_with_context(cache):
    opened, expected = cache
    hook, neuron, k, context = "blocks.0.hook_resid_post", 3, 15, 2
    column = expected[hook][:, neuron]
    rows = np.argsort(-column, kind="stable")[:k]  # ties: lower row first, as the store promises
    results = opened.top_k(hook, neuron, k=k, context=context)
    assert [result["row"] for result in results] == list(rows)
    for result, row in zip(results, rows, strict=True):
        sample = expected["sample_index"][row]
        sample_rows = np.flatnonzero(expected["sample_index"] == sample)
        sample_rows = sample_rows[np.argsort(expected["position"][sample_rows])]
        center = int(np.flatnonzero(sample_rows == row)[0])
        window = sample_rows[max(0, center - context) : center + context + 1]
        assert result["value"] == column[row]
        assert result["sample_index"] == sample
        assert result["position"] == expected["position"][row]
        assert result["token_id"] == expected["token_ids"][row]
        assert result["context_token_ids"] == list(expected["token_ids"][window])
        assert result["context_positions"] == list(expected["position"][window])
        assert result["context_token_ids"][result["center"]] == result["token_id"]
        assert len(result["context_token_ids"]) <= 2 * context + 1
    assert len(opened.top_k(hook, 0, k=10_000)) == opened.num_tokens
    with pytest.raises(IndexError):
        opened.top_k(hook, 8)


def test_histogram_counts_every_value(cache):
    opened, expected = cache
    for hook, width in HOOKS.items():
        histogram = opened.histogram(hook, bins=20)
        assert len(histogram["counts"]) == 20 and len(histogram["edges"]) == 21
        assert histogram["counts"].sum() == histogram["count"] == opened.num_tokens * width
        np.testing.assert_array_equal(
            histogram["counts"], np.histogram(expected[hook], bins=histogram["edges"])[0]
        )
        assert histogram["min"] == expected[hook].min() and histogram["max"] == expected[hook].max()
    assert opened.histogram("blocks.1.attn.hook_z", bins=7, max_tokens=30)["count"] == 30 * 5


def test_readable_with_plain_safetensors_and_numpy(reference):
    directory = reference("float32")
    expected = expected_content("float32")
    manifest = json.loads((directory / "manifest.json").read_text())
    shard = manifest["shards"][1]
    hook_dir = hook_directory_name("module:transformer.h.0.mlp")
    relative = f"{hook_dir}/00001.safetensors"
    plain = load_file(directory / relative)
    start = shard["token_start"]
    np.testing.assert_array_equal(
        plain["activations"], expected["module:transformer.h.0.mlp"][start : start + shard["num_tokens"]]
    )
    assert shard["files"][relative] == xxh3_checksum((directory / relative).read_bytes())
    tokens = load_file(directory / "tokens" / "00001.safetensors")
    np.testing.assert_array_equal(
        tokens["position"], expected["position"][start : start + shard["num_tokens"]]
    )


def test_iter_files_and_size(reference):
    directory = reference("float16")
    files = iter_files(directory)
    assert directory / "manifest.json" in files and directory / "tokens.safetensors" in files
    assert {
        path.relative_to(directory).as_posix() for path in files if path.parent != directory
    } == listed_files(directory)
    assert ActivationStore.open(directory).size_bytes == sum(path.stat().st_size for path in files)


# --- Verification ----------------------------------------------------------------------------------


def test_verify_sound_cache(reference):
    assert verify(reference("bfloat16")) == []


def test_verify_detects_a_flipped_byte(reference, tmp_path):
    directory = copy_of(reference("float32"), tmp_path)
    shard = directory / "blocks.1.attn.hook_z" / "00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # in the values, so the header and size stay valid
    shard.write_bytes(bytes(data))
    problems = verify(directory)
    assert problems == ["CACHE_CORRUPT: blocks.1.attn.hook_z/00002.safetensors: checksum mismatch"]
    ActivationStore.open(directory)  # shapes and sizes still agree: only hashing sees it
    with pytest.raises(CacheError) as caught:
        ActivationStore.open(directory, verify_hashes=True)
    assert caught.value.code == "CACHE_CORRUPT"


def test_verify_detects_a_missing_file(reference, tmp_path):
    directory = copy_of(reference("float32"), tmp_path)
    (directory / "tokens" / "00001.safetensors").unlink()
    assert verify(directory) == ["CACHE_CORRUPT: tokens/00001.safetensors: missing"]
    with pytest.raises(CacheError) as caught:
        ActivationStore.open(directory)
    assert caught.value.code == "CACHE_CORRUPT"


def test_verify_detects_a_shape_that_disagrees_with_the_manifest(reference, tmp_path):
    directory = copy_of(reference("float32"), tmp_path)
    relative = "blocks.1.attn.hook_z/00000.safetensors"
    from safetensors.torch import save_file

    save_file({"activations": torch.zeros(25, 4)}, directory / relative)  # one column short
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["shards"][0]["files"][relative] = xxh3_checksum((directory / relative).read_bytes())
    (directory / "manifest.json").write_text(json.dumps(manifest))
    problems = verify(directory)
    assert len(problems) == 1 and "the manifest implies F32 [" in problems[0]


def test_verify_and_open_an_unfinished_cache(tmp_path):
    writer = open_writer(tmp_path / "cache")
    add_batches(writer, range(5))
    writer.flush()
    writer.close()
    assert verify(tmp_path / "cache") == ["CACHE_INCOMPLETE: status is 'writing', not complete"]
    with pytest.raises(CacheError) as caught:
        ActivationStore.open(tmp_path / "cache")
    assert caught.value.code == "CACHE_INCOMPLETE"
    partial = ActivationStore.open(tmp_path / "cache", require_complete=False)
    expected = expected_content("float32")
    assert partial.num_tokens == sum(BATCH_TOKENS[:5])
    np.testing.assert_array_equal(
        partial.get("blocks.0.hook_resid_post"), expected["blocks.0.hook_resid_post"][: partial.num_tokens]
    )
    np.testing.assert_array_equal(partial.tokens()["token_ids"], expected["token_ids"][: partial.num_tokens])


# --- Writer rules ----------------------------------------------------------------------------------


def test_add_batch_is_idempotent_and_ordered(tmp_path, reference):
    writer = open_writer(tmp_path / "cache")
    add_batches(writer, range(4))
    assert writer.next_batch == 4
    assert writer.add_batch(1, **make_batch(1)) is False  # stored already: ignored, not duplicated
    assert writer.add_batch(3, **make_batch(3)) is False  # buffered already: ignored too
    with pytest.raises(ValueError, match="before batch 4"):
        writer.add_batch(6, **make_batch(6))
    bad = make_batch(4)
    bad["activations"]["blocks.1.attn.hook_z"] = torch.zeros(BATCH_TOKENS[4], 6)
    with pytest.raises(ValueError, match="expected"):
        writer.add_batch(4, **bad)
    add_batches(writer, range(4, NUM_BATCHES))
    manifest = writer.finalize(num_samples=NUM_SAMPLES)
    assert writer.finalize(num_samples=NUM_SAMPLES) == manifest
    assert_same_cache(tmp_path / "cache", reference("float32"))

    again = open_writer(tmp_path / "cache")  # a retried job finds the cache complete
    assert again.complete and again.next_batch == NUM_BATCHES
    assert again.add_batch(0, **make_batch(0)) is False
    assert again.finalize(num_samples=NUM_SAMPLES) == manifest


def test_a_shard_of_empty_batches(tmp_path):
    writer = open_writer(tmp_path / "cache")
    add_batches(writer, range(2))
    writer.flush()
    add_batches(writer, [2])  # no tokens at all: still recorded, so batch 2 counts as done
    writer.flush()
    shards = writer.manifest["shards"]
    assert [shard["num_tokens"] for shard in shards] == [20, 0]
    assert writer.durable_next_batch == 3
    add_batches(writer, range(3, NUM_BATCHES))
    writer.finalize(num_samples=NUM_SAMPLES)
    assert verify(tmp_path / "cache") == []
    opened, expected = ActivationStore.open(tmp_path / "cache"), expected_content("float32")
    np.testing.assert_array_equal(
        opened.get("blocks.1.attn.hook_z", 15, 30), expected["blocks.1.attn.hook_z"][15:30]
    )
    assert load_file(tmp_path / "cache" / "blocks.1.attn.hook_z" / "00001.safetensors")[
        "activations"
    ].shape == (0, 5)


def test_a_notebook_reads_float32_without_django_or_torch(reference):
    code = (
        "import sys; from activations.store import ActivationStore, verify; "
        f"store = ActivationStore.open({str(reference('float32'))!r}); "
        "hook = 'module:transformer.h.0.mlp'; "
        "store.get(hook, 10, 90); store.stats(hook); store.top_k(hook, 2); store.histogram(hook); "
        "store.sample(hook, 3); store.sample_tokens(3); assert verify(store.directory) == []; "
        "assert 'django' not in sys.modules and 'torch' not in sys.modules"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_samples_of_a_cache_stored_in_position_order(tmp_path):
    writer = open_writer(tmp_path / "cache")
    for index in range(NUM_BATCHES):
        writer.add_batch(index, **make_batch(index, shuffle=False))
    writer.finalize(num_samples=NUM_SAMPLES)
    opened = ActivationStore.open(tmp_path / "cache")
    samples, positions = opened.tokens()["sample_index"], opened.tokens()["position"]
    for sample in (0, 1, 7, 23):
        rows = np.flatnonzero(samples == sample)
        assert list(positions[rows]) == sorted(positions[rows])
        np.testing.assert_array_equal(
            opened.sample("blocks.1.attn.hook_z", sample), opened.get("blocks.1.attn.hook_z")[rows]
        )
    top = opened.top_k("blocks.1.attn.hook_z", 0, k=1, context=100)[0]  # the context is its whole sample
    assert top["context_positions"] == list(positions[samples == top["sample_index"]])
    assert opened._sample_order is None  # no index was needed


def test_finalize_rejects_samples_beyond_num_samples(tmp_path):
    writer = open_writer(tmp_path / "cache")
    add_batches(writer, range(3))  # samples 0-3 hold tokens (batch 2 is empty)
    with pytest.raises(ValueError, match="beyond num_samples"):
        writer.finalize(num_samples=3)
    assert not (tmp_path / "cache" / "tokens.safetensors").exists()
    assert writer.finalize(num_samples=6)["status"] == "complete"


def test_a_second_writer_is_refused(tmp_path):
    writer = open_writer(tmp_path / "cache")
    with pytest.raises(CacheError) as caught:
        open_writer(tmp_path / "cache")
    assert caught.value.code == "CACHE_LOCKED"
    writer.close()
    open_writer(tmp_path / "cache").close()


@pytest.mark.parametrize(
    "change", [{"key": {**KEY, "revision": "other"}}, {"hooks": {**HOOKS, "extra": 3}}, {"dtype": "float16"}]
)
def test_a_different_cache_in_the_directory_is_a_mismatch(tmp_path, change):
    open_writer(tmp_path / "cache").close()
    with pytest.raises(CacheError) as caught:
        open_writer(tmp_path / "cache", **change)
    assert caught.value.code == "CACHE_MISMATCH"


def test_a_directory_with_foreign_files_is_refused(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "notes.txt").write_text("mine")
    with pytest.raises(CacheError) as caught:
        open_writer(tmp_path / "cache")
    assert caught.value.code == "CACHE_CORRUPT"
    assert (tmp_path / "cache" / "notes.txt").exists()


def test_hook_names_map_to_safe_directories(tmp_path):
    assert hook_directory_name("blocks.6.hook_resid_post") == "blocks.6.hook_resid_post"
    assert hook_directory_name("module:transformer.h.0.mlp").startswith("module_transformer.h.0.mlp-")
    assert hook_directory_name("a:b") != hook_directory_name("a/b")
    assert hook_directory_name("tokens") != "tokens"
    hooks = {
        "../../x": 3,
        "module:transformer.h.0.mlp": 4,
        "blocks.6.hook_resid_post": 2,
        "tokens": 2,
        "/etc/y": 2,
    }
    directory = tmp_path / "inner" / "cache"
    writer = open_writer(directory, hooks=hooks)
    add_batches(writer, range(4), hooks)
    writer.finalize(num_samples=8)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["inner"]
    assert sorted(path.name for path in (tmp_path / "inner").iterdir()) == ["cache"]
    for path in iter_files(directory):
        assert path.resolve().is_relative_to(directory.resolve())
        assert ".." not in path.relative_to(directory).parts
    opened = ActivationStore.open(directory)
    batch = make_batch(0, hooks)
    np.testing.assert_array_equal(
        opened.get("../../x", 0, BATCH_TOKENS[0]), batch["activations"]["../../x"].numpy()
    )
    assert {hook["name"]: hook["directory"] for hook in opened.manifest["hooks"]}[
        "/etc/y"
    ] == hook_directory_name("/etc/y")


def test_a_tampered_manifest_cannot_point_outside(reference, tmp_path):
    directory = copy_of(reference("float32"), tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["hooks"][0]["directory"] = "../outside"
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheError) as caught:
        ActivationStore.open(directory)
    assert caught.value.code == "CACHE_CORRUPT"
    assert verify(directory)[0].startswith("CACHE_CORRUPT")


# --- Resume after a crash --------------------------------------------------------------------------


def crash_after_three_shards(directory: Path, dtype: str) -> CacheWriter:
    """Writes until three shards are durable, buffers one more batch, then 'crashes' (no flush)."""
    writer = open_writer(directory, dtype=dtype)
    index = 0
    while len(writer.manifest["shards"]) < 3:
        writer.add_batch(index, **make_batch(index))
        index += 1
    writer.add_batch(index, **make_batch(index))  # buffered only: lost in the crash
    writer.close()
    return writer


@pytest.mark.parametrize("damaged_shard", [2, 1])
def test_resume_drops_a_bad_shard_and_what_follows(tmp_path, reference, damaged_shard):
    directory = tmp_path / "cache"
    crashed = crash_after_three_shards(directory, "bfloat16")
    shards = crashed.manifest["shards"]
    hook_dir = directory / hook_directory_name("module:transformer.h.0.mlp")
    (hook_dir / ".00003.safetensors.123.abcd.tmp").write_bytes(b"partial")  # a stray temp file
    (directory / ".manifest.json.123.abcd.tmp").write_bytes(b"{")
    shutil.copy(
        directory / "tokens" / "00000.safetensors", directory / "tokens" / "00003.safetensors"
    )  # orphan
    damaged = directory / "blocks.0.hook_resid_post" / f"{damaged_shard:05d}.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-20])  # truncated, yet listed in the manifest

    writer = open_writer(directory, dtype="bfloat16")
    assert len(writer.manifest["shards"]) == damaged_shard
    assert writer.manifest["shards"] == shards[:damaged_shard]
    assert writer.next_batch == writer.durable_next_batch == shards[damaged_shard]["first_batch"]
    assert writer.num_tokens == shards[damaged_shard]["token_start"]
    assert temp_files(directory) == []
    assert shard_files_on_disk(directory) == listed_files(directory)

    assert writer.add_batch(0, **make_batch(0)) is False  # a replayed batch is not stored twice
    add_batches(writer, range(writer.next_batch, NUM_BATCHES))
    writer.finalize(num_samples=NUM_SAMPLES)
    assert_same_cache(directory, reference("bfloat16"))


def test_resume_of_sound_shards_keeps_them(tmp_path, reference):
    directory = tmp_path / "cache"
    crashed = crash_after_three_shards(directory, "float32")
    writer = open_writer(directory)
    assert writer.manifest["shards"] == crashed.manifest["shards"]
    assert writer.next_batch == crashed.manifest["shards"][-1]["last_batch"] + 1
    add_batches(writer, range(writer.next_batch, NUM_BATCHES))
    writer.finalize(num_samples=NUM_SAMPLES)
    assert_same_cache(directory, reference("float32"))


def test_resume_of_a_complete_cache_with_a_damaged_token_table(reference, tmp_path):
    directory = copy_of(reference("float32"), tmp_path)
    (directory / "tokens.safetensors").write_bytes(b"garbage")
    writer = open_writer(directory)
    assert not writer.complete and writer.next_batch == NUM_BATCHES
    assert not (directory / "tokens.safetensors").exists()
    writer.finalize(num_samples=NUM_SAMPLES)
    assert_same_cache(directory, reference("float32"))


CRASH_SCRIPT = """
import os, signal, sys
from activations.store import format as cache_format
assert "django" not in sys.modules, "activations.store must not import Django"
from activations.tests.test_store import NUM_BATCHES, make_batch, open_writer

mode, directory = sys.argv[1], sys.argv[2]
real_write = cache_format._write_bytes

def dying_write(handle, data):
    name = os.path.basename(handle.name)
    in_hook_file = mode == "kill_in_hook_file" and "/blocks.1.attn.hook_z/.00003." in handle.name
    in_manifest = mode == "kill_in_manifest" and name.startswith(".manifest.json") and b'"index": 3' in data
    if in_hook_file or in_manifest:
        real_write(handle, data[: len(data) // 2])
        handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    real_write(handle, data)

cache_format._write_bytes = dying_write
writer = open_writer(directory, dtype="bfloat16")
for index in range(NUM_BATCHES):
    writer.add_batch(index, **make_batch(index))
    if mode == "exit_between_shards" and len(writer.manifest["shards"]) == 3:
        os._exit(1)
os._exit(3)  # never reached: every mode dies first
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "returncode"), [("exit_between_shards", 1), ("kill_in_hook_file", -9), ("kill_in_manifest", -9)]
)
def test_resume_after_a_real_crash(tmp_path, reference, mode, returncode):
    directory = tmp_path / "cache"
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, mode, str(directory)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
    )
    assert crashed.returncode == returncode, crashed.stderr
    manifest = json.loads((directory / "manifest.json").read_text())
    assert len(manifest["shards"]) == 3  # the fourth shard never made it into the manifest
    if mode != "exit_between_shards":
        assert temp_files(directory), "the kill should have left a partial temp file"
        # A shard's files are written side by side: others of the dying shard may be renamed
        # already (strays nobody lists) or not; every listed one is there.
        assert listed_files(directory) <= shard_files_on_disk(directory)

    writer = open_writer(directory, dtype="bfloat16")
    assert writer.next_batch == manifest["shards"][2]["last_batch"] + 1
    assert temp_files(directory) == []
    assert shard_files_on_disk(directory) == listed_files(directory)
    add_batches(writer, range(writer.next_batch, NUM_BATCHES))
    writer.finalize(num_samples=NUM_SAMPLES)
    assert_same_cache(directory, reference("bfloat16"))


# --- Disk full -------------------------------------------------------------------------------------


def fill_disk_when_writing(monkeypatch, target: str) -> dict:
    """The first write into a temp file whose path contains ``target`` puts half its bytes down, then
    hits ENOSPC, and so does every write after it (the disk stays full). Returns the hit counter."""
    real_write = cache_format._write_bytes
    state = {"full": False, "hits": 0}

    def write(handle, data):
        if state["full"] or target in handle.name:
            state["full"] = True
            state["hits"] += 1
            real_write(handle, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(handle, data)

    monkeypatch.setattr(cache_format, "_write_bytes", write)
    return state


# A shard is the token table, then each hook's file (renamed one by one), then the manifest:
# the disk fills up in each of those places.
@pytest.mark.parametrize("target", ["/tokens/.00001.", "/blocks.1.attn.hook_z/.00001.", "/.manifest.json."])
def test_disk_full_leaves_no_partial_files(tmp_path, monkeypatch, target):
    directory = tmp_path / "cache"
    writer = open_writer(directory)
    add_batches(writer, range(4))  # 41 tokens: shard 0 is written
    add_batches(writer, range(4, 6))  # 22 tokens: buffered, below the shard size
    manifest_before = (directory / "manifest.json").read_bytes()
    pending = writer.pending_tokens

    disk = fill_disk_when_writing(monkeypatch, target)
    with pytest.raises(CacheError) as caught:
        add_batches(writer, range(6, 7))  # pushes the buffer over the threshold: shard 1 is written
    assert caught.value.code == "DISK_FULL"
    # A shard's files are written side by side: each meets the full disk once, then stops.
    assert 1 <= disk["hits"] <= len(HOOKS) + 1
    assert temp_files(directory) == []
    assert shard_files_on_disk(directory) == listed_files(directory)  # renamed files of shard 1 are gone
    assert len(json.loads(manifest_before)["shards"]) == 1
    assert (directory / "manifest.json").read_bytes() == manifest_before
    assert writer.pending_tokens == pending + BATCH_TOKENS[6]  # kept, to retry
    assert writer.next_batch == 7

    monkeypatch.undo()  # space freed
    writer.flush()
    add_batches(writer, range(7, NUM_BATCHES))
    writer.finalize(num_samples=NUM_SAMPLES)
    shards = json.loads((directory / "manifest.json").read_text())["shards"]
    assert sum(shard["num_tokens"] for shard in shards) == sum(BATCH_TOKENS)
    opened, expected = ActivationStore.open(directory), expected_content("float32")
    for hook in HOOKS:
        np.testing.assert_array_equal(opened.get(hook), expected[hook])
    assert verify(directory) == []


@pytest.mark.parametrize("target", ["/.tokens.safetensors.", "/.manifest.json."])
def test_disk_full_while_finalizing(tmp_path, monkeypatch, target):
    directory = tmp_path / "cache"
    writer = open_writer(directory)
    add_batches(writer, range(NUM_BATCHES))
    writer.flush()
    disk = fill_disk_when_writing(monkeypatch, target)
    with pytest.raises(CacheError) as caught:
        writer.finalize(num_samples=NUM_SAMPLES)
    assert caught.value.code == "DISK_FULL" and disk["hits"] == 1
    assert temp_files(directory) == []
    assert json.loads((directory / "manifest.json").read_text())["status"] == "writing"
    assert verify(directory) == ["CACHE_INCOMPLETE: status is 'writing', not complete"]
    monkeypatch.undo()
    assert writer.finalize(num_samples=NUM_SAMPLES)["status"] == "complete"
    assert verify(directory) == []


def test_shard_size_is_bounded_in_bytes_across_hooks():
    from activations.store import shard_tokens_for

    tokens = shard_tokens_for({"a": 768, "b": 768, "c": 3072}, "float32", max_bytes=64 * 2**20)
    assert tokens * (768 + 768 + 3072) * 4 <= 64 * 2**20 < (tokens + 1) * ((768 + 768 + 3072) * 4 + 24)
    assert shard_tokens_for({"a": 768}, "bfloat16") > shard_tokens_for({"a": 768}, "float32")
    assert shard_tokens_for({"a": 10**9}, "float32", max_bytes=1) == 1
