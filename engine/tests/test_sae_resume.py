"""Resumable SAE training: a training killed after a checkpoint and resumed from the saved folder
ends with exactly the tensors and curves of one never interrupted; checkpoints are safetensors
and JSON only, complete or absent, and refused by a training of another config."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from engine.sae import TrainingCheckpoint, TrainingConfig, shuffled_batches, train

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
