"""Training a group of SAEs, transcoders and a cross-layer transcoder from one stream
(engine.sae.group): from the model on the fly it equals training on the same activations read as a
cache would give them; a group killed after a checkpoint resumes to the uninterrupted result; two
gloo processes equal one."""

import dataclasses
import os
import socket

import pytest
import torch
import torch.multiprocessing as multiprocessing
from safetensors.torch import load_file, save_file

from engine.extraction import extract, plan_batches, tokenize_samples
from engine.sae import TrainingConfig
from engine.sae.clt_training import CltTrainingConfig
from engine.sae.group import GroupMember, group_hooks, latest_checkpoint, model_source, train_group

HOOKS = ("blocks.0.hook_resid_post", "blocks.1.hook_resid_post")
MLP_IN, MLP_OUT = "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out"
WIDTH = 64  # the tiny GPT-2's
BATCH, BUFFER, STEPS = 64, 256, 12


class Killed(Exception):
    """The process dying: nothing after it runs, nothing is saved."""


@pytest.fixture(scope="module")
def gpt2(load_tiny):
    return load_tiny("gpt2")


@pytest.fixture(scope="module")
def texts():
    from engine.testing.tiny_models import local_corpus

    return [text for text in local_corpus(40_000) if text.strip()][:120]


def _config(architecture="topk", **options):
    options.setdefault("k", 4 if architecture != "standard" else None)
    return TrainingConfig(
        architecture=architecture, d_sae=128, lr=3e-3, batch_size=BATCH, total_tokens=STEPS * BATCH,
        warmup_steps=2, dead_after_steps=3, **options,
    )  # fmt: skip


CLT_CONFIG = CltTrainingConfig(d_sae=64, k=4, lr=3e-3, batch_size=BATCH, steps=STEPS, warmup_steps=2)


def _members():
    return [
        GroupMember(HOOKS[0], _config()),
        GroupMember(HOOKS[1], _config(k=8)),
        GroupMember(MLP_IN, _config("batchtopk"), hook_out=MLP_OUT),
        GroupMember(HOOKS[1], _config("matryoshka_batchtopk", matryoshka_widths=(16, 64), skip=False)),
        GroupMember("blocks.0.ln2.hook_normalized", hook_out=MLP_OUT, n_layers=2, config=CLT_CONFIG),
    ]


# What the members read, in the group's order (the CLT adds layer 0's MLP input and output).
GROUP_HOOKS = group_hooks(_members())


def _live(gpt2, texts, hooks):
    def open_source(position):
        return model_source(
            gpt2.model, gpt2.tokenizer, lambda start, stop: texts[start:stop], hooks=hooks,
            train_samples=len(texts), max_length=32, batch_size=8, window_samples=len(texts),
            position=position,
        )  # fmt: skip

    return open_source


def _widths(hooks):
    return dict.fromkeys(hooks, WIDTH)


def _tensors(results):
    return {
        index: {name: tensor for name, tensor in result.sae.tensors().items()}
        for index, result in results.items()
    }


def _assert_same(first, second):
    assert first.keys() == second.keys()
    for index in first:
        for name, tensor in first[index].items():
            torch.testing.assert_close(second[index][name], tensor, atol=0, rtol=0, msg=f"{index} {name}")


def test_training_from_the_model_equals_training_on_the_same_activations_read_in_other_chunks(gpt2, texts):
    members = _members()
    hooks = GROUP_HOOKS
    live = train_group(
        members, widths=_widths(hooks), open_source=_live(gpt2, texts, hooks), buffer_rows=BUFFER
    )
    # The same activations as an extraction writes them into a cache, read back 100 rows at a time
    # (a cache's chunks), pass after pass.
    tokenized = tokenize_samples(gpt2.tokenizer, texts, 32)
    batches = extract(gpt2.model, tokenized, plan_batches([len(ids) for ids in tokenized], 8), hooks=hooks)
    cache = torch.cat([torch.cat([batch.activations[name] for name in hooks], dim=1) for batch in batches])

    def cache_source(position):
        while True:
            for start in range(0, len(cache), 100):
                yield cache[start : start + 100], {}

    cached = train_group(members, widths=_widths(hooks), open_source=cache_source, buffer_rows=BUFFER)
    _assert_same(_tensors(live), _tensors(cached))
    assert all(result.steps == STEPS for result in live.values())
    # The transcoder predicts the MLP's output from its input: decoder and bias are d_out wide.
    assert live[2].sae.W_dec.shape == (128, WIDTH) and live[2].sae.shape.d_out == WIDTH


def test_a_group_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(gpt2, texts, tmp_path):
    members = _members()
    hooks = GROUP_HOOKS
    arguments = dict(widths=_widths(hooks), open_source=_live(gpt2, texts, hooks), buffer_rows=BUFFER)
    whole = train_group(members, **arguments)

    def die_at_step_10(index, metrics):
        if metrics.step == 10:
            raise Killed

    with pytest.raises(Killed):
        train_group(
            members, **arguments, on_step=die_at_step_10, checkpoint_folder=tmp_path, checkpoint_every_steps=4
        )
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and newest.name == "step-000000008"  # step 4's is gone
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-000000008"]
    resumed = train_group(members, **arguments, checkpoint_folder=tmp_path, checkpoint_every_steps=4)
    _assert_same(_tensors(whole), _tensors(resumed))
    assert [m.step for m in resumed[0].history] == list(range(1, STEPS + 1))
    strip = lambda history: [{**dataclasses.asdict(m), "tokens_per_second": None} for m in history]  # noqa: E731
    assert strip(resumed[1].history) == strip(whole[1].history)


class Yielded(Exception):
    """A job giving its worker up once its checkpoint is saved."""


def test_a_group_that_yields_at_a_due_checkpoint_resumes_to_the_uninterrupted_result(gpt2, texts, tmp_path):
    """``checkpoint_due`` checkpoints off the periodic schedule (a job's time slice ending); an
    ``on_checkpoint`` that raises stops the run, which resumes from there."""
    members = _members()
    hooks = GROUP_HOOKS
    arguments = dict(widths=_widths(hooks), open_source=_live(gpt2, texts, hooks), buffer_rows=BUFFER)
    whole = train_group(members, **arguments)
    asked = iter(range(10**6))

    def every_fifth_step() -> bool:
        return next(asked) % 5 == 4

    def give_up(step: int) -> None:
        raise Yielded(step)

    stops = []
    for _ in range(STEPS):
        try:
            resumed = train_group(
                members, **arguments, checkpoint_folder=tmp_path, checkpoint_due=every_fifth_step,
                on_checkpoint=give_up,
            )  # fmt: skip
            break
        except Yielded as stop:
            stops.append(stop.args[0])
    assert stops == [5, 10]  # off the (absent) periodic schedule; none after the last step
    _assert_same(_tensors(whole), _tensors(resumed))
    assert [m.step for m in resumed[0].history] == list(range(1, STEPS + 1))


def test_a_group_refuses_members_with_different_batch_sizes(gpt2, texts):
    members = [
        GroupMember(HOOKS[0], _config()),
        GroupMember(HOOKS[1], dataclasses.replace(_config(), batch_size=32)),
    ]
    with pytest.raises(ValueError, match="batch_size"):
        train_group(
            members, widths=_widths(HOOKS), open_source=_live(gpt2, texts, list(HOOKS)), buffer_rows=BUFFER
        )


def _rank(rank, world, port, folder, texts, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from engine.loading import load_weights

        weights = (
            load_weights(folder, model_type="gpt2", quantization="none", device="cpu") if rank == 0 else None
        )
        hooks = GROUP_HOOKS
        results = train_group(
            _members(), widths=_widths(hooks), buffer_rows=BUFFER,
            open_source=_live(weights, texts, hooks) if rank == 0 else None,
        )  # fmt: skip
        for index, result in results.items():  # files, not a queue: the parent reads them after exit
            save_file(result.sae.tensors(), out / f"rank-{rank}-member-{index}.safetensors")
    finally:
        torch.distributed.destroy_process_group()


def test_two_gloo_processes_train_a_group_as_one_process_does(gpt2, texts, tmp_path):
    from engine.testing.tiny_models import build_tiny_model

    folder = build_tiny_model("gpt2", tmp_path / "gpt2", size="tiny", seed=0)
    hooks = GROUP_HOOKS
    single = train_group(
        _members(), widths=_widths(hooks), open_source=_live(gpt2, texts, hooks), buffer_rows=BUFFER
    )
    context = multiprocessing.get_context("spawn")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "results"
    out.mkdir()
    processes = [context.Process(target=_rank, args=(rank, 2, port, folder, texts, out)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
        assert process.exitcode == 0
    # Each rank trained its own half of the group: rank r the members r, r + 2, r + 4.
    assert sorted(path.name for path in out.iterdir()) == [
        "rank-0-member-0.safetensors", "rank-0-member-2.safetensors", "rank-0-member-4.safetensors",
        "rank-1-member-1.safetensors", "rank-1-member-3.safetensors",
    ]  # fmt: skip
    gathered = {int(path.stem.rsplit("-", 1)[1]): load_file(path) for path in out.iterdir()}
    _assert_same(_tensors(single), gathered)
