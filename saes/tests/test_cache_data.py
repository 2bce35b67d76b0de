"""A training's stream over a real cache on disk (``saes.cache_data.training_batches``): opened at a
late position it gives the batches an uninterrupted stream gives, bit for bit, reading the rows its
buffer held and the cache on from there, not every row trained on before."""

import pytest
import torch

from activations.store import ActivationStore, CacheWriter
from saes.cache_data import SHUFFLE_BUFFER_BATCHES, row_chunks, training_batches

HOOK = "blocks.0.hook_resid_post"
D_IN, ROWS, BATCH, EPOCHS = 16, 3000, 64, 8
BUFFER = SHUFFLE_BUFFER_BATCHES * BATCH


class CountingStore(ActivationStore):
    """The cache, counting the rows read from it (by range and by number)."""

    rows_read = 0

    def get(self, hook, start=0, stop=None, *, as_torch=False):
        values = super().get(hook, start, stop, as_torch=as_torch)
        self.rows_read += len(values)
        return values

    def gather(self, hook, rows, *, as_torch=False):
        values = super().gather(hook, rows, as_torch=as_torch)
        self.rows_read += len(values)
        return values


@pytest.fixture(scope="module")
def cache_folder(tmp_path_factory):
    """A bf16 cache in shards of 512 rows (the buffer's rows are gathered across several)."""
    folder = tmp_path_factory.mktemp("stream") / "cache"
    values = torch.randn(ROWS, D_IN, generator=torch.Generator().manual_seed(0))
    writer = CacheWriter.create_or_resume(
        folder, key={"stream test": 1}, provenance={}, hooks={HOOK: D_IN}, dtype="bfloat16",
        shard_max_tokens=512,
    )  # fmt: skip
    for index, start in enumerate(range(0, ROWS, 250)):
        count = min(250, ROWS - start)
        writer.add_batch(
            index, token_ids=torch.arange(count), sample_index=torch.full((count,), index),
            positions=torch.arange(count), activations={HOOK: values[start : start + count]},
        )  # fmt: skip
    writer.finalize(num_samples=-(-ROWS // 250))
    return folder


def stream(store, start=None):
    return training_batches(store, HOOK, ROWS, batch_size=BATCH, seed=3, epochs=EPOCHS, start=start)


def test_a_stream_opened_at_a_late_position_reads_a_buffer_and_gives_the_uninterrupted_batches(cache_folder):
    from engine.sae import shuffled_batches

    store = CountingStore.open(cache_folder)
    items = list(stream(store))
    # The batches of the chunks through the shuffle buffer, as trainings read them before positions.
    chunks = row_chunks(store, HOOK, 0, ROWS, epochs=EPOCHS)
    expected = list(shuffled_batches(chunks, batch_size=BATCH, buffer_rows=BUFFER, seed=3))
    assert len(items) == len(expected) == -(-EPOCHS * ROWS // BATCH)
    for (batch, _position), reference in zip(items, expected, strict=True):
        assert batch.dtype == torch.bfloat16 and torch.equal(batch, reference)

    stop = len(items) * 3 // 4  # in the seventh epoch
    position = items[stop - 1][1]
    assert position.rows_given > 5 * ROWS and len(position.buffer["rows"]) > BUFFER // 2
    resumed = CountingStore.open(cache_folder)
    rest = stream(resumed, start=position)
    first, _position = next(rest)
    # The rows the buffer held (gathered by number) and at most the rest of an epoch's chunk.
    assert resumed.rows_read <= BUFFER + ROWS < position.rows_given // 4
    assert torch.equal(first, items[stop][0])
    for (batch, _position), (reference, _reference_position) in zip(rest, items[stop + 1 :], strict=True):
        assert torch.equal(batch, reference)
