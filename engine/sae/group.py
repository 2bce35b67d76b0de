"""Training many SAEs and transcoders at once, from one stream of activations: a cache read from
disk or the model run over a dataset on the fly, shuffled in a bounded buffer on the training
device, with checkpoints that resume a killed run to the very result of an uninterrupted one.

* A **group** is a list of :class:`GroupMember`: each an SAE (one hook point) or a transcoder
  (an input and an output hook point) with its own :class:`~engine.sae.training.TrainingConfig`.
  Every member sees every batch (same rows, same order); members differ in hooks and
  hyper-parameters. They share ``batch_size``; a member whose ``total_tokens`` are reached stops
  while the others go on.
* A **source** yields ``(rows, position)``: ``rows`` [n, sum of the hooks' widths], the group's
  hook points side by side (in :func:`group_hooks` order), and ``position``, a JSON-able dict
  saying where the source stands after these rows, from which ``open_source(position)`` starts
  again. :func:`model_source` runs a model over texts (:mod:`engine.extraction`: it stops after
  the deepest hook, and writes nothing to disk); a cache's chunks make another.
* **Memory** is the buffer (``buffer_rows`` rows), one forward batch, the SAEs and their
  optimiser state: it does not grow with the number of tokens.
* **Checkpoints** (``checkpoint_folder/step-<n>/``) hold every member's
  :class:`~engine.sae.checkpoint.TrainingCheckpoint`, the buffer's rows and generator state, the
  initialisation sample and the source's position; ``source.json``, written last, marks one
  complete. A run started on a folder with a complete checkpoint continues from it.
* **Several processes** (``torch.distributed``, any backend: gloo on CPUs, NCCL on GPUs) share a
  group as sparsify's ``distribute_modules`` does: rank 0 runs the source and the buffer and
  broadcasts each batch; rank ``r`` trains members ``r, r + world, ...``. The SAEs equal a
  single-process run's.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.sae.checkpoint import TrainingCheckpoint, fsync_directory, replace_durably
from engine.sae.data import ShuffleBuffer
from engine.sae.training import SaeTrainer, StepMetrics, TrainedSae, TrainingConfig

__all__ = [
    "GroupMember",
    "Source",
    "group_hooks",
    "latest_checkpoint",
    "model_source",
    "train_group",
]

INIT_SAMPLE_ROWS = 8192  # rows of the first shuffled buffer that set scaling and b_dec
SOURCE_STATE = "source.safetensors"
SOURCE_DESCRIPTION = "source.json"  # written last: the checkpoint is complete once it exists
GROUP_CHECKPOINT_FORMAT = 1

# (rows, position after them); open_source(position or None) starts a source there.
Source = Iterator[tuple[torch.Tensor, dict[str, Any]]]


@dataclass(frozen=True)
class GroupMember:
    """One SAE (``hook_out`` None) or transcoder (``hook_in`` → ``hook_out``) of a group."""

    hook_in: str
    config: TrainingConfig
    hook_out: str | None = None


def group_hooks(members: Sequence[GroupMember]) -> list[str]:
    """The hook points a group reads, each once, in the order members first name them."""
    hooks: dict[str, None] = {}
    for member in members:
        hooks[member.hook_in] = None
        if member.hook_out is not None:
            hooks[member.hook_out] = None
    return list(hooks)


def model_source(
    model: Any,
    tokenizer: Any,
    read_texts: Callable[[int, int], list[str]],
    *,
    hooks: Sequence[str],
    train_samples: int,
    max_length: int,
    batch_size: int,
    window_samples: int = 1024,
    position: dict[str, Any] | None = None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    passes: int | None = None,
) -> Source:
    """The activations of ``model`` at ``hooks`` over samples ``[0, train_samples)``, pass after
    pass (``passes`` of them; None: until the consumer stops).

    ``read_texts(start, stop)`` gives samples ``start..stop-1`` (a dataset read streaming, a
    window of ``window_samples`` at a time, so a dataset larger than memory is never held
    whole): texts, or with ``tokenizer`` None token-id lists already. Each window is tokenized
    (at most ``max_length`` tokens a sample) and run ``batch_size`` samples a forward pass in
    :func:`engine.extraction.plan_batches` order; pad positions are dropped. The rows stay on
    the hooks' device (moved to ``device``), in ``dtype``. ``position`` (epoch, window start,
    batch in the window) resumes where a checkpoint left off.
    """
    from engine.extraction import extract, plan_batches, tokenize_samples

    if train_samples < 1:
        raise ValueError("no sample to train on")
    at = dict(position or {"epoch": 0, "window": 0, "batch": 0})
    while passes is None or at["epoch"] < passes:
        rows_this_pass = 0
        while at["window"] < train_samples:
            stop = min(train_samples, at["window"] + window_samples)
            window = read_texts(at["window"], stop)
            if tokenizer is None:
                tokenized = [list(ids)[:max_length] for ids in window]
            else:
                tokenized = tokenize_samples(tokenizer, window, max_length)
            plan = plan_batches([len(ids) for ids in tokenized], batch_size)
            for batch in extract(
                model, tokenized, plan, hooks=list(hooks), dtype=dtype, start_batch=at["batch"], to_host=False
            ):
                at["batch"] = batch.batch_index + 1
                activations = batch.activations
                rows = torch.cat([activations[name] for name in hooks], dim=1).to(device)
                rows_this_pass += len(rows)
                yield rows, dict(at)
            at["window"], at["batch"] = stop, 0
        if not rows_this_pass and not position:
            raise ValueError("the training samples hold no token")
        at = {"epoch": at["epoch"] + 1, "window": 0, "batch": 0}
        position = None


def latest_checkpoint(folder: Path | None) -> Path | None:
    """The newest complete checkpoint folder under ``folder`` (its ``step-*`` with a source.json)."""
    if folder is None or not Path(folder).is_dir():
        return None
    complete = [path for path in Path(folder).glob("step-*") if (path / SOURCE_DESCRIPTION).exists()]
    return max(complete, key=lambda path: int(path.name.removeprefix("step-")), default=None)


class _Distribution:
    """Who trains what, and how batches reach every process (one process: nothing to send)."""

    def __init__(self, members: int) -> None:
        import torch.distributed as dist

        active = dist.is_available() and dist.is_initialized()
        self.dist = dist if active else None
        self.rank = dist.get_rank() if active else 0
        self.world = dist.get_world_size() if active else 1
        self.mine = [index for index in range(members) if index % self.world == self.rank]

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, rows: torch.Tensor | None, width: int, *, like: torch.Tensor) -> torch.Tensor | None:
        """Rank 0's ``rows`` (None: no more) on every rank; ``like`` gives the dtype and device."""
        if self.dist is None:
            return rows
        device = like.device
        header = torch.tensor([len(rows) if rows is not None else -1], device=device)
        self.dist.broadcast(header, src=0)
        count = int(header[0])
        if count < 0:
            return None
        if not self.leader:
            rows = torch.empty((count, width), dtype=like.dtype, device=device)
        self.dist.broadcast(rows, src=0)
        return rows

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()

    def agree(self, flag: bool, *, like: torch.Tensor) -> bool:
        """Rank 0's ``flag`` on every rank."""
        if self.dist is None:
            return flag
        value = torch.tensor([int(flag)], device=like.device)
        self.dist.broadcast(value, src=0)
        return bool(value[0])


def train_group(
    members: Sequence[GroupMember],
    *,
    widths: dict[str, int],
    open_source: Callable[[dict[str, Any] | None], Source] | None,
    buffer_rows: int,
    device: str = "cpu",
    on_step: Callable[[int, StepMetrics], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    checkpoint_folder: Path | None = None,
    checkpoint_every_steps: int = 0,
    checkpoint_due: Callable[[], bool] | None = None,
    on_checkpoint: Callable[[int], None] | None = None,
    rows_dtype: torch.dtype = torch.float32,
) -> dict[int, TrainedSae]:
    """Train ``members`` on the batches of one shuffled stream; returns ``{member index: result}``
    for the members this process trains (all of them in a single process).

    ``widths`` gives each hook's width; ``open_source(position)`` the rows (rank 0 only; the
    other ranks pass None). The shuffle buffer holds ``buffer_rows`` rows on ``device`` (in the
    source's dtype; ``rows_dtype`` is what the other ranks receive). The first shuffled rows
    (:data:`INIT_SAMPLE_ROWS`) set each member's scaling and ``b_dec``. ``on_step(index, metrics)``
    follows every step of every member; ``should_cancel()`` (rank 0's) stops all between steps,
    returning the SAEs trained so far. With ``checkpoint_folder``, a checkpoint is written every
    ``checkpoint_every_steps`` steps, and after any step where ``checkpoint_due()`` (rank 0's)
    says so, and the newest complete one there is continued from; ``on_checkpoint(step)`` follows
    each complete checkpoint (an exception it raises stops the training: a job yielding its worker).
    """
    if not members:
        raise ValueError("a group needs at least one member")
    batch_size = members[0].config.batch_size
    if any(member.config.batch_size != batch_size for member in members):
        raise ValueError("the members of a group share one batch_size")
    if (checkpoint_every_steps or checkpoint_due is not None) and checkpoint_folder is None:
        raise ValueError("checkpoints need a checkpoint_folder")
    hooks = group_hooks(members)
    offsets, start = {}, 0
    for name in hooks:
        offsets[name] = slice(start, start + widths[name])
        start += widths[name]
    width = start
    spread = _Distribution(len(members))
    resume = latest_checkpoint(checkpoint_folder)
    buffer = ShuffleBuffer(batch_size=batch_size, buffer_rows=buffer_rows, seed=members[0].config.seed)
    description: dict[str, Any] = {}
    sample: torch.Tensor | None = None
    if resume is not None:
        description = json.loads((resume / SOURCE_DESCRIPTION).read_text())
        if description.get("format") != GROUP_CHECKPOINT_FORMAT or description.get("hooks") != hooks:
            raise ValueError(f"{resume} was written by another group")
        if spread.leader:
            state = load_file(resume / SOURCE_STATE)
            buffer.load_state_dict(state, device=device)
            sample = state["sample"].to(device)
    source = open_source(description.get("position")) if spread.leader else None
    position = description.get("position")
    ended = False
    step = int(description.get("step", 0))
    total_steps = max(member.config.total_steps for member in members)

    def refill() -> torch.Tensor | None:
        """The next batch on rank 0, reading the source as needed (None: the source has ended).

        The buffer takes the stream's first ``total_steps x batch_size`` rows and no more: once
        it holds all the remaining steps need, the source is read no further and the buffer is
        drained, so a run ends without a buffer's worth of forward passes wasted (and which rows
        train depends on the stream alone, not on how it is chunked)."""
        nonlocal ended, position
        while (batch := buffer.next_batch()) is None:
            if ended:
                return None
            room = (total_steps - step) * batch_size - buffer.held_rows
            item = next(source, None) if room > 0 else None
            if item is None:
                ended = True
                buffer.end()
            else:
                rows, position = item
                buffer.add(rows[:room])
        return batch

    pending: torch.Tensor | None = None
    if spread.leader and sample is None:
        pending = refill()  # the first buffer is shuffled: the sample is its first rows
        queued = buffer.queued()
        sample = torch.cat([pending, queued]) if queued is not None and pending is not None else pending
        if sample is None:
            raise ValueError("the source gave no rows")
        sample = sample[:INIT_SAMPLE_ROWS].clone()
    sample = spread.share(sample, width, like=sample if sample is not None else _like(rows_dtype, device))
    cpu_sample = sample.float().cpu()

    trainers: dict[int, SaeTrainer] = {}
    for index in spread.mine:
        member = members[index]
        checkpoint = TrainingCheckpoint.load(resume / f"member-{index}") if resume is not None else None
        trainers[index] = SaeTrainer(
            member.config,
            d_in=widths[member.hook_in],
            sample=cpu_sample[:, offsets[member.hook_in]],
            d_out=widths[member.hook_out] if member.hook_out is not None else None,
            sample_out=cpu_sample[:, offsets[member.hook_out]] if member.hook_out is not None else None,
            resume=checkpoint,
            device=device,
        )
    elapsed_before = float(description.get("elapsed_seconds", 0.0))
    for trainer in trainers.values():  # the group's clock: every member's rate counts the forward passes
        trainer.elapsed_before = elapsed_before
    started = time.perf_counter()
    while step < total_steps:
        cancel = spread.leader and should_cancel is not None and should_cancel()
        batch = None if cancel else (pending if pending is not None else refill()) if spread.leader else None
        pending = None
        batch = spread.share(batch, width, like=sample)
        if batch is None:
            break
        for index, trainer in trainers.items():
            if trainer.done:
                continue
            member = members[index]
            trainer.seconds = time.perf_counter() - started
            metrics = trainer.step(
                batch[:, offsets[member.hook_in]],
                batch[:, offsets[member.hook_out]] if member.hook_out is not None else None,
            )
            if on_step is not None:
                on_step(index, metrics)
        step += 1
        due = checkpoint_due is not None and spread.agree(spread.leader and checkpoint_due(), like=sample)
        periodic = checkpoint_every_steps and step % checkpoint_every_steps == 0
        if (periodic or due) and step < total_steps:
            _save_checkpoint(
                checkpoint_folder, step=step, trainers=trainers, spread=spread, buffer=buffer, sample=sample,
                description={
                    "format": GROUP_CHECKPOINT_FORMAT, "step": step, "hooks": hooks, "position": position,
                    "elapsed_seconds": elapsed_before + time.perf_counter() - started,
                },
            )  # fmt: skip
            if on_checkpoint is not None:
                on_checkpoint(step)
    return {
        index: trainer.finish(cpu_sample[:, offsets[members[index].hook_in]])
        for index, trainer in trainers.items()
    }


def _like(dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def _save_checkpoint(
    folder: Path, *, step: int, trainers: dict[int, SaeTrainer], spread: _Distribution,
    buffer: ShuffleBuffer, sample: torch.Tensor, description: dict[str, Any],
) -> None:  # fmt: skip
    """Every member's state, then (rank 0, once all ranks have written) the buffer, the sample
    and the position; older checkpoints go once this one is complete."""
    target = Path(folder) / f"step-{step:09d}"
    for index, trainer in trainers.items():
        trainer.checkpoint().save(target / f"member-{index}")
    spread.barrier()
    if spread.leader:
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in buffer.state_dict().items()}
        state["sample"] = sample.detach().cpu().contiguous()
        replace_durably(target / SOURCE_STATE, lambda path: save_file(state, path))
        replace_durably(target / SOURCE_DESCRIPTION, lambda path: path.write_text(json.dumps(description)))
        for older in Path(folder).glob("step-*"):
            if older != target:
                shutil.rmtree(older, ignore_errors=True)
        fsync_directory(Path(folder))
    spread.barrier()
