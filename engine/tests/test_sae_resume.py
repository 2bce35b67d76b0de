"""Resumable SAE training: a training killed after a checkpoint and resumed from the saved folder
ends with exactly the tensors and curves of one never interrupted; checkpoints are safetensors
and JSON only, complete or absent, and refused by a training of another config. A training from a
stream that can be opened in the middle (a cache's) resumes at the stream's position, reading a
buffer's worth of rows, not every batch it trained on before."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from engine.prefetch import prefetched
from engine.sae import TrainingCheckpoint, TrainingConfig, shuffled_batches, train
from engine.sae.data import RowSource, resumable_batches

D_IN, D_SAE, BATCH, STEPS = 8, 24, 32, 20
ARCHITECTURES = [
    ("standard", {"l1_coefficient": 0.1}),
    ("topk", {"k": 3}),
    ("batchtopk", {"k": 3}),
    ("jumprelu", {"l0_coefficient": 0.1, "jumprelu_init_threshold": 0.1}),
]


class Killed(Exception):
    """The process dying: nothing after it runs, nothing is saved."""


def _rows(rows=STEPS * BATCH, seed=0):
    """Sparse non-negative combinations of a few directions, so features fire and some die."""
    generator = torch.Generator().manual_seed(seed)
    atoms = torch.randn(16, D_IN, generator=generator)
    codes = torch.rand(rows, 16, generator=generator) * (torch.rand(rows, 16, generator=generator) < 0.2)
    return codes @ atoms + 0.01 * torch.randn(rows, D_IN, generator=generator)


DATA = _rows()
SAMPLE = _rows(256, seed=1)


def _config(architecture, **options):
    # dead_after_steps small enough that AuxK and the dead counts take part before the checkpoint.
    return TrainingConfig(
        architecture=architecture,
        d_sae=D_SAE,
        lr=1e-2,
        batch_size=BATCH,
        total_tokens=STEPS * BATCH,
        warmup_steps=4,
        dead_after_steps=3,
        **options,
    )


def _stream():
    """The batch stream, the same every time it is made (the shuffle is seeded)."""
    chunks = [DATA[start : start + 48] for start in range(0, len(DATA), 48)]
    return shuffled_batches(chunks, batch_size=BATCH, buffer_rows=4 * BATCH, seed=0)


def _curves(history):
    """The history without the throughput, which depends on the clock."""
    return [{**dataclasses.asdict(metrics), "tokens_per_second": None} for metrics in history]


def _killed_after_a_checkpoint(config, folder, *, checkpoint_at, killed_at):
    """Train with a checkpoint saved in ``folder`` every ``checkpoint_at`` steps, dying at step
    ``killed_at``: the steps past the last checkpoint are lost, as after a SIGKILL."""

    def on_step(metrics):
        if metrics.step == killed_at:
            raise Killed

    with pytest.raises(Killed):
        train(
            _stream(),
            d_in=D_IN,
            config=config,
            sample=SAMPLE,
            on_step=on_step,
            checkpoint_every_steps=checkpoint_at,
            on_checkpoint=lambda checkpoint: checkpoint.save(folder),
        )


@pytest.mark.parametrize("architecture, options", ARCHITECTURES)
def test_a_training_resumed_from_its_saved_checkpoint_ends_as_an_uninterrupted_one(
    architecture, options, tmp_path
):
    config = _config(architecture, **options)
    straight = train(_stream(), d_in=D_IN, config=config, sample=SAMPLE)
    _killed_after_a_checkpoint(config, tmp_path, checkpoint_at=STEPS // 2, killed_at=STEPS // 2 + 3)
    checkpoint = TrainingCheckpoint.load(tmp_path)
    assert checkpoint is not None and checkpoint.step == STEPS // 2 and checkpoint.elapsed_seconds > 0
    if architecture in ("topk", "batchtopk"):  # the AuxK state is part of what is carried over
        assert int((checkpoint.steps_since_fired >= config.dead_after_steps).sum()) > 0

    seen = []
    resumed = train(
        _stream(), d_in=D_IN, config=config, sample=SAMPLE, resume=checkpoint, on_step=seen.append
    )

    assert [metrics.step for metrics in seen] == list(range(STEPS // 2 + 1, STEPS + 1))  # new steps only
    assert (resumed.steps, resumed.tokens, resumed.scaling_factor) == (
        straight.steps,
        straight.tokens,
        straight.scaling_factor,
    )
    assert resumed.steps == STEPS
    for name, tensor in straight.sae.tensors().items():
        torch.testing.assert_close(resumed.sae.tensors()[name], tensor, rtol=0, atol=0, msg=name)
    assert _curves(resumed.history) == _curves(straight.history)
    assert all(0 < metrics.tokens_per_second < float("inf") for metrics in resumed.history)


def test_checkpoints_come_every_n_steps_but_not_after_the_last_and_the_latest_is_kept(tmp_path):
    steps = []

    def on_checkpoint(checkpoint):
        checkpoint.save(tmp_path)
        steps.append(checkpoint.step)

    config = _config("topk", k=3)
    train(
        _stream(),
        d_in=D_IN,
        config=config,
        sample=SAMPLE,
        checkpoint_every_steps=5,
        on_checkpoint=on_checkpoint,
    )
    assert steps == [5, 10, 15]
    latest = TrainingCheckpoint.load(tmp_path)
    assert (latest.step, latest.tokens, len(latest.history)) == (15, 15 * BATCH, 15)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint.json", "checkpoint.safetensors"]


def test_a_checkpoint_is_safetensors_and_json_with_no_pickle(tmp_path):
    config = _config("jumprelu", l0_coefficient=0.1)
    _killed_after_a_checkpoint(config, tmp_path, checkpoint_at=5, killed_at=6)
    tensors_bytes = (tmp_path / "checkpoint.safetensors").read_bytes()
    # torch.save writes a zip ("PK") or a bare pickle (protocol byte 0x80); safetensors neither.
    assert not tensors_bytes.startswith((b"PK", b"\x80"))
    tensors = load_file(tmp_path / "checkpoint.safetensors")
    assert {"sae.W_enc", "sae.W_dec", "sae.b_enc", "sae.b_dec", "log_threshold", "steps_since_fired"} <= set(
        tensors
    )
    for parameter in ("W_enc", "W_dec", "b_enc", "b_dec", "log_threshold"):
        assert {f"adam.{parameter}.{key}" for key in ("exp_avg", "exp_avg_sq", "step")} <= set(tensors)
    description = json.loads((tmp_path / "checkpoint.json").read_text())
    assert (description["format"], description["step"], description["config"]) == (
        1,
        5,
        dataclasses.asdict(config),
    )
    assert [point["step"] for point in description["history"]] == [1, 2, 3, 4, 5]


def test_a_checkpoint_of_another_config_is_refused(tmp_path):
    config = _config("topk", k=3)
    _killed_after_a_checkpoint(config, tmp_path, checkpoint_at=5, killed_at=6)
    checkpoint = TrainingCheckpoint.load(tmp_path)
    with pytest.raises(ValueError, match="differs in: lr"):
        train(
            _stream(),
            d_in=D_IN,
            config=dataclasses.replace(config, lr=1e-3),
            sample=SAMPLE,
            resume=checkpoint,
        )
    with pytest.raises(ValueError, match="d_in"):
        train(_stream(), d_in=D_IN + 1, config=config, sample=SAMPLE, resume=checkpoint)


def test_a_stream_shorter_than_the_checkpoint_is_refused(tmp_path):
    config = _config("topk", k=3)
    _killed_after_a_checkpoint(config, tmp_path, checkpoint_at=10, killed_at=11)
    checkpoint = TrainingCheckpoint.load(tmp_path)
    with pytest.raises(ValueError, match="not the stream"):
        train(iter(list(_stream())[:4]), d_in=D_IN, config=config, sample=SAMPLE, resume=checkpoint)


def test_a_folder_without_the_json_holds_no_checkpoint(tmp_path):
    assert TrainingCheckpoint.load(tmp_path / "never-written") is None
    _killed_after_a_checkpoint(_config("standard"), tmp_path, checkpoint_at=5, killed_at=6)
    (tmp_path / "checkpoint.json").unlink()  # as if killed between the tensors and the json
    assert (tmp_path / "checkpoint.safetensors").exists()
    assert TrainingCheckpoint.load(tmp_path) is None


def test_tensors_not_of_the_json_step_are_refused(tmp_path):
    config = _config("standard")
    _killed_after_a_checkpoint(config, tmp_path / "early", checkpoint_at=5, killed_at=6)
    _killed_after_a_checkpoint(config, tmp_path / "late", checkpoint_at=10, killed_at=11)
    (tmp_path / "early" / "checkpoint.safetensors").replace(tmp_path / "late" / "checkpoint.safetensors")
    with pytest.raises(ValueError, match="step 5"):
        TrainingCheckpoint.load(tmp_path / "late")


# --- A cache's stream, resumed at its position ----------------------------------------------------

# An epoch of 300 rows read 48 at a time, three epochs: 28 batches of 32 and one of 4.
EPOCH_ROWS, CHUNK, EPOCHS, BUFFER = 300, 48, 3, 4 * BATCH
CACHE_ROWS = _rows(EPOCH_ROWS, seed=2)
CACHE_STEPS = -(-EPOCHS * EPOCH_ROWS // BATCH)


class Yielded(Exception):
    """The job gives its worker up after a checkpoint (``JobContext.checkpoint_saved``)."""


class CountingCache:
    """The rows of a cache, counting those read (in order or by number): what a resume costs."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows, self.rows_read = rows, 0
        self.source = RowSource(count=len(rows), read=self.read, gather=self.gather)

    def read(self, low: int, high: int) -> torch.Tensor:
        self.rows_read += high - low
        return self.rows[low:high]

    def gather(self, numbers: torch.Tensor) -> torch.Tensor:
        self.rows_read += len(numbers)
        return self.rows[numbers]


def _cache_stream(cache: CountingCache | None = None, *, start=None):
    return resumable_batches(
        (cache or CountingCache(CACHE_ROWS)).source, epochs=EPOCHS, batch_size=BATCH, buffer_rows=BUFFER,
        chunk_rows=CHUNK, start=start,
    )  # fmt: skip


def _cache_config():
    return dataclasses.replace(_config("topk", k=3), total_tokens=EPOCHS * EPOCH_ROWS)


def test_the_resumable_stream_gives_the_shuffled_batches_of_its_chunks_and_opens_again_anywhere():
    """The batches are those of ``shuffled_batches`` over the epochs' chunks (trainings from a
    cache before positions are unchanged), and opened at any position the rest come out equal."""
    chunks = [CACHE_ROWS[low : low + CHUNK] for _ in range(EPOCHS) for low in range(0, EPOCH_ROWS, CHUNK)]
    expected = list(shuffled_batches(chunks, batch_size=BATCH, buffer_rows=BUFFER))
    items = list(_cache_stream())
    assert len(items) == len(expected) == CACHE_STEPS
    for (batch, _position), reference in zip(items, expected, strict=True):
        torch.testing.assert_close(batch, reference, rtol=0, atol=0)
    assert [position.batches for _batch, position in items] == list(range(1, CACHE_STEPS + 1))
    assert items[-1][1].rows_given == items[-1][1].rows_taken == EPOCHS * EPOCH_ROWS
    for stop in range(CACHE_STEPS):
        rest = [batch for batch, _position in _cache_stream(start=items[stop][1])]
        assert len(rest) == CACHE_STEPS - stop - 1
        for batch, (reference, _position) in zip(rest, items[stop + 1 :], strict=True):
            torch.testing.assert_close(batch, reference, rtol=0, atol=0)


def _stops():
    """Steps to stop at, each of the kind its name says (checked against the stream itself)."""
    positions = [position for _batch, position in _cache_stream()]
    mid_epoch = next(p.batches for p in positions if p.rows_taken < EPOCH_ROWS and p.batches > 2)
    # The buffer holds rows of the first and the second epoch.
    across = next(p.batches for p in positions if p.rows_given < EPOCH_ROWS < p.rows_taken)
    last_epoch = next(p.batches for p in positions if p.rows_given > 2 * EPOCH_ROWS)
    draining = next(p.batches for p in positions if p.rows_taken == EPOCHS * EPOCH_ROWS)  # source read
    return {"first step": 1, "mid-epoch": mid_epoch, "across an epoch boundary": across,
            "last epoch": last_epoch, "source ended": draining}  # fmt: skip


def _stopped_at(stop, folder, stream):
    """Train on ``stream`` with a checkpoint due at step ``stop``, saved in ``folder``, where the
    job yields its worker (raising :class:`Yielded`, as ``checkpoint_saved`` does)."""

    def on_checkpoint(checkpoint):
        checkpoint.save(folder)
        raise Yielded

    steps = iter(range(1, CACHE_STEPS + 1))
    with pytest.raises(Yielded):
        train(
            stream, d_in=D_IN, config=_cache_config(), sample=SAMPLE,
            checkpoint_due=lambda: next(steps) >= stop, on_checkpoint=on_checkpoint,
        )  # fmt: skip
    return TrainingCheckpoint.load(folder)


@pytest.mark.parametrize("stop", list(_stops().values()), ids=list(_stops()))
def test_a_cache_training_resumed_at_its_stream_position_ends_as_an_uninterrupted_one(stop, tmp_path):
    config = _cache_config()
    straight = train(_cache_stream(), d_in=D_IN, config=config, sample=SAMPLE)
    checkpoint = _stopped_at(stop, tmp_path, _cache_stream())
    assert checkpoint.step == checkpoint.stream.batches == stop
    held = load_file(tmp_path / "checkpoint.safetensors")["stream.rows"]  # the rows' numbers, not rows
    assert held.dtype == torch.int64 and held.shape == (len(held),) and len(held) <= BUFFER + CHUNK

    resumed = train(
        _cache_stream(start=checkpoint.stream), d_in=D_IN, config=config, sample=SAMPLE, resume=checkpoint
    )
    assert resumed.steps == straight.steps == CACHE_STEPS
    for name, tensor in straight.sae.tensors().items():
        torch.testing.assert_close(resumed.sae.tensors()[name], tensor, rtol=0, atol=0, msg=name)
    assert _curves(resumed.history) == _curves(straight.history)


def test_a_training_sliced_many_times_through_a_read_ahead_ends_as_an_uninterrupted_one(tmp_path):
    """Time slices: stopped every few steps and resumed from the saved folder each time, with the
    batches read ahead on a thread (as the job reads them): the position saved is the step's, not
    the reader's, which is batches ahead."""
    config = _cache_config()
    straight = train(_cache_stream(), d_in=D_IN, config=config, sample=SAMPLE)
    checkpoint, slices = None, 0
    while True:
        due = iter(range(1, 4))  # a slice is 3 steps
        stream = prefetched(_cache_stream(start=checkpoint.stream if checkpoint else None), depth=3)

        def on_checkpoint(state):
            state.save(tmp_path)
            raise Yielded

        try:
            result = train(
                stream, d_in=D_IN, config=config, sample=SAMPLE, resume=checkpoint,
                checkpoint_due=lambda due=due: next(due, 3) >= 3, on_checkpoint=on_checkpoint,
            )  # fmt: skip
            break
        except Yielded:
            stream.close()
            checkpoint, slices = TrainingCheckpoint.load(tmp_path), slices + 1
    assert slices == (CACHE_STEPS - 1) // 3
    for name, tensor in straight.sae.tensors().items():
        torch.testing.assert_close(result.sae.tensors()[name], tensor, rtol=0, atol=0, msg=name)
    assert _curves(result.history) == _curves(straight.history)


def test_a_resume_reads_a_buffer_of_rows_not_every_batch_trained_on(tmp_path):
    """Opened at a late checkpoint, the stream reads the rows its buffer held and the chunk after
    them before training goes on; replaying the stream would read every row trained on so far."""
    stop = _stops()["last epoch"]
    checkpoint = _stopped_at(stop, tmp_path, _cache_stream())
    assert checkpoint.tokens > 3 * (BUFFER + CHUNK)  # a replay would read far more than the bound
    cache = CountingCache(CACHE_ROWS)
    read_before = []

    def on_step(metrics):
        if not read_before:
            read_before.append(cache.rows_read)

    train(
        _cache_stream(cache, start=checkpoint.stream), d_in=D_IN, config=_cache_config(), sample=SAMPLE,
        resume=checkpoint, on_step=on_step,
    )  # fmt: skip
    assert 0 < read_before[0] <= BUFFER + CHUNK


def test_a_checkpoint_without_a_stream_position_resumes_by_replaying_the_stream(tmp_path):
    """A checkpoint written before positions (or by a training fed plain batches) has none: the
    stream opened from its beginning is replayed to its step, as before."""
    config = _cache_config()
    straight = train(_cache_stream(), d_in=D_IN, config=config, sample=SAMPLE)
    plain = (batch for batch, _position in _cache_stream())
    checkpoint = _stopped_at(10, tmp_path, plain)
    assert checkpoint.stream is None and "stream" not in json.loads(
        (tmp_path / "checkpoint.json").read_text()
    )

    resumed = train(_cache_stream(), d_in=D_IN, config=config, sample=SAMPLE, resume=checkpoint)
    for name, tensor in straight.sae.tensors().items():
        torch.testing.assert_close(resumed.sae.tensors()[name], tensor, rtol=0, atol=0, msg=name)
    assert _curves(resumed.history) == _curves(straight.history)


def test_a_stream_that_is_not_the_checkpoints_is_refused(tmp_path):
    early = _stopped_at(5, tmp_path / "early", _cache_stream())
    late = _stopped_at(8, tmp_path / "late", _cache_stream())
    with pytest.raises(ValueError, match="not its stream"):  # opened past the checkpoint
        train(
            _cache_stream(start=late.stream), d_in=D_IN, config=_cache_config(), sample=SAMPLE, resume=early
        )
    smaller = CountingCache(CACHE_ROWS[: EPOCH_ROWS // 2])  # another cache: its rows are not the buffer's
    with pytest.raises(ValueError, match="not one of this stream"):
        next(_cache_stream(smaller, start=late.stream))
