"""The background cache writer: the same cache as writing inline, the caller running ahead while a
shard is written (checked by ordering, not by timing), bounded, and the writer's errors raised in
the caller."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from activations.store import DISK_FULL, ActivationStore, BackgroundWriter, CacheError, CacheWriter
from models_app.tests.live_stack import wait_until

from .test_store import HOOKS, NUM_BATCHES, NUM_SAMPLES, make_batch, open_writer, write_cache


def extracted(index: int) -> SimpleNamespace:
    """Batch ``index`` shaped as ``engine.extraction.extract`` yields it."""
    return SimpleNamespace(batch_index=index, **make_batch(index))


def test_the_same_cache_as_writing_inline(tmp_path):
    inline = write_cache(tmp_path / "inline")
    writer = open_writer(tmp_path / "background")
    with BackgroundWriter(writer) as background:
        for index in range(NUM_BATCHES):
            background.add_extracted(extracted(index))
    writer.finalize(num_samples=NUM_SAMPLES)
    writer.close()

    a, b = ActivationStore.open(inline), ActivationStore.open(tmp_path / "background")
    assert a.num_tokens == b.num_tokens and len(a.manifest["shards"]) == len(b.manifest["shards"])
    for column in ("token_ids", "sample_index", "position"):
        np.testing.assert_array_equal(a.tokens()[column], b.tokens()[column])
    for hook in HOOKS:
        np.testing.assert_array_equal(a.get(hook), b.get(hook))


class GatedWriter(CacheWriter):
    """A real writer whose shard writes wait until the test opens the gate."""

    gate: threading.Event
    writing: threading.Event

    def flush(self) -> None:
        if self._pending:
            self.writing.set()
            assert self.gate.wait(timeout=30)
        super().flush()


def gated_writer(directory) -> GatedWriter:
    writer = open_writer(directory)
    writer.__class__ = GatedWriter
    writer.gate, writer.writing = threading.Event(), threading.Event()
    return writer


def test_the_caller_runs_ahead_of_a_shard_write_up_to_the_queue_depth(tmp_path):
    writer = gated_writer(tmp_path / "cache")
    background = BackgroundWriter(writer, depth=2)
    added = []

    def produce() -> None:
        for index in range(NUM_BATCHES):
            background.add_extracted(extracted(index))
            added.append(index)

    producer = threading.Thread(target=produce)
    producer.start()
    assert writer.writing.wait(timeout=30)  # a shard write has started and is held
    producer.join(timeout=1)
    # While the first shard is being written, the caller went on: the batches after it were
    # produced and queued, but no more than the queue holds (back-pressure, not growth).
    assert producer.is_alive()
    held = len(added)
    assert writer.next_batch + 2 <= held <= writer.next_batch + 3
    writer.gate.set()
    producer.join(timeout=30)
    background.finish()
    writer.finalize(num_samples=NUM_SAMPLES)
    assert ActivationStore.open(tmp_path / "cache").num_tokens == sum(
        len(make_batch(index)["token_ids"]) for index in range(NUM_BATCHES)
    )


class FullDiskWriter(CacheWriter):
    def flush(self) -> None:
        if self._pending:
            raise CacheError(DISK_FULL, "The disk is full; the shard was not written.")


def test_a_writer_error_is_raised_in_the_caller(tmp_path):
    writer = open_writer(tmp_path / "cache")
    writer.__class__ = FullDiskWriter
    with pytest.raises(CacheError) as raised, BackgroundWriter(writer) as background:
        for index in range(NUM_BATCHES):
            background.add_extracted(extracted(index))
    assert raised.value.code == DISK_FULL
    assert writer.manifest["shards"] == []  # nothing was recorded


def test_abandoning_finishes_the_shard_being_written_and_drops_the_queue(tmp_path):
    writer = gated_writer(tmp_path / "cache")
    background = BackgroundWriter(writer, depth=4)
    for index in range(8):  # 0-3 reach the writer (its first shard is written at batch 3), 4-7 wait
        background.add_extracted(extracted(index))
    assert writer.writing.wait(timeout=30)
    abandoning = threading.Thread(target=background.abandon)
    abandoning.start()  # asks first, then waits for the shard being written
    wait_until(background._abandon.is_set, timeout=30, what="the abandon request")
    writer.gate.set()
    abandoning.join(timeout=30)
    assert not abandoning.is_alive()
    assert writer.durable_next_batch == 4 and writer.next_batch == 4
