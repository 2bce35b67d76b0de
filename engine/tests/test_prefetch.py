"""engine.prefetch: the same items in the same order, a bounded read-ahead, errors where they
belong, and no thread left behind by a caller that stops early."""

import itertools
import threading
import time

import pytest
import torch

from engine.prefetch import prefetched


def test_the_same_items_in_the_same_order():
    items = [torch.full((3,), float(index)) for index in range(20)]
    got = list(prefetched(iter(items), depth=3))
    assert len(got) == 20 and all(a is b for a, b in zip(got, items, strict=True))
    assert list(prefetched([], depth=1)) == []


def test_the_thread_reads_at_most_depth_ahead():
    produced = []

    def source():
        for index in itertools.count():
            produced.append(index)
            yield index

    stream = prefetched(source(), depth=2)
    assert next(stream) == 0
    time.sleep(0.3)  # the thread runs ahead as far as it may
    # Taken: 0; queued: 1, 2; one more produced and waiting for room.
    assert len(produced) <= 4
    assert [next(stream) for _ in range(5)] == [1, 2, 3, 4, 5]
    stream.close()


def test_an_error_in_the_source_is_raised_after_the_items_before_it():
    def source():
        yield 1
        yield 2
        raise OSError("disk went away")

    stream = prefetched(source(), depth=4)
    assert next(stream) == 1 and next(stream) == 2
    with pytest.raises(OSError, match="disk went away"):
        next(stream)


def test_a_caller_that_stops_early_stops_the_thread():
    before = threading.active_count()
    stream = prefetched(itertools.count(), depth=2)
    assert [next(stream) for _ in range(3)] == [0, 1, 2]
    stream.close()
    assert threading.active_count() == before
    with pytest.raises(ValueError):
        next(prefetched([1], depth=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_batch_of_a_pair_is_page_locked_and_its_position_kept():
    """A training's (batch, stream position) pairs: the batch pinned for the copy to the GPU."""
    items = [(torch.full((4, 3), float(index)), {"batches": index + 1}) for index in range(5)]
    got = list(prefetched(iter(items), depth=2, pin_memory=True))
    assert len(got) == len(items)
    for (batch, position), (source_batch, source_position) in zip(got, items, strict=True):
        assert batch.is_pinned() and torch.equal(batch, source_batch) and position == source_position
