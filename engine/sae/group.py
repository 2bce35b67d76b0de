"""Training many SAEs and transcoders at once, from one stream of activations: a cache read from
disk or the model run over a dataset on the fly, shuffled in a bounded buffer on the training
device, with checkpoints that resume a killed run to the very result of an uninterrupted one.

* A **group** is a list of :class:`GroupMember`: each an SAE (one hook point), a transcoder
  (an input and an output hook point) with its own :class:`~engine.sae.training.TrainingConfig`,
  or a cross-layer transcoder over the first ``n_layers`` layers (every layer's MLP input and
  output) with its :class:`~engine.sae.clt_training.CltTrainingConfig`.
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
from engine.sae.training import SaeTrainer, StepMetrics, TrainedSae

__all__ = [
    "GroupMember",
    "GroupRun",
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
    """One SAE (``hook_out`` None) or transcoder (``hook_in`` → ``hook_out``) of a group, or with
    ``n_layers`` a cross-layer transcoder (``config`` a CltTrainingConfig) reading every one of
    those layers' MLP inputs and predicting their outputs (``hook_in`` layer 0's input,
    ``hook_out`` the last one's output)."""

    hook_in: str
    config: Any  # TrainingConfig, or CltTrainingConfig for a cross-layer transcoder
    hook_out: str | None = None
    n_layers: int | None = None

    @property
    def hooks(self) -> list[str]:
        """What it reads: its hook(s), or a CLT's every layer's MLP input and output."""
        if self.n_layers is not None:
            from engine.hooks import every_transcoder_hook

            return every_transcoder_hook(self.n_layers)
        return [self.hook_in, *([self.hook_out] if self.hook_out is not None else [])]

    def layer_hooks(self) -> tuple[list[str], list[str]]:
        """A CLT's MLP inputs and outputs, layer 0 first."""
        return self.hooks[0::2], self.hooks[1::2]


def group_hooks(members: Sequence[GroupMember]) -> list[str]:
    """The hook points a group reads, each once, in the order members first name them."""
    hooks: dict[str, None] = {}
    for member in members:
        for name in member.hooks:
            hooks[name] = None
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


class GroupRun:
    """One group's training, shaped like SAELens' ``SAETrainer.fit``: :meth:`fit` validates,
    resumes from the newest checkpoint, draws the initialisation sample, sets up one
    :class:`~engine.sae.training.SaeTrainer` a member this process trains, then loops (next batch,
    a step of every member, a checkpoint when one is due) and finishes each trainer.

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

    def __init__(
        self,
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
    ) -> None:
        self.members = list(members)
        self.widths, self.open_source, self.device = widths, open_source, device
        self.on_step, self.should_cancel = on_step, should_cancel
        self.checkpoint_folder, self.checkpoint_every_steps = checkpoint_folder, checkpoint_every_steps
        self.checkpoint_due, self.on_checkpoint, self.rows_dtype = checkpoint_due, on_checkpoint, rows_dtype
        self.validate()
        self.batch_size = self.members[0].config.batch_size
        self.total_steps = max(member.config.total_steps for member in self.members)
        self.hooks = group_hooks(self.members)
        self.offsets, self.width = _columns(self.hooks, widths)
        self.spread = _Distribution(len(self.members))
        # What the run reads and where it stands; resume() and the loop move them on.
        self.source: Source | None = None
        self.position: dict[str, Any] | None = None
        self.ended = False
        self.step = 0
        self.elapsed_before = 0.0
        self.started = time.perf_counter()
        self.sample: torch.Tensor | None = None
        self.trainers: dict[int, SaeTrainer] = {}
        self.buffer = ShuffleBuffer(
            batch_size=self.batch_size, buffer_rows=buffer_rows, seed=self.members[0].config.seed
        )

    def validate(self) -> None:
        """Refuse a group that cannot train as one stream before anything is read."""
        if not self.members:
            raise ValueError("a group needs at least one member")
        batch_size = self.members[0].config.batch_size
        if any(member.config.batch_size != batch_size for member in self.members):
            raise ValueError("the members of a group share one batch_size")
        checkpoints_wanted = self.checkpoint_every_steps or self.checkpoint_due is not None
        if checkpoints_wanted and self.checkpoint_folder is None:
            raise ValueError("checkpoints need a checkpoint_folder")

    def fit(self) -> dict[int, TrainedSae]:
        """Train to the end (or a cancel); ``{member index: result}`` for this process's members."""
        resume = self.resume()
        if self.spread.leader:
            self.source = self.open_source(self.position)
        pending = self.draw_sample()
        self.set_up_trainers(resume)
        self.loop(pending)
        return self.finish()

    def resume(self) -> Path | None:
        """Continue from the newest complete checkpoint, if any: its step, position and clock,
        and (rank 0) the buffer's rows and the initialisation sample."""
        resume = latest_checkpoint(self.checkpoint_folder)
        if resume is None:
            return None
        description = json.loads((resume / SOURCE_DESCRIPTION).read_text())
        if description.get("format") != GROUP_CHECKPOINT_FORMAT or description.get("hooks") != self.hooks:
            raise ValueError(f"{resume} was written by another group")
        if self.spread.leader:
            state = load_file(resume / SOURCE_STATE)
            self.buffer.load_state_dict(state, device=self.device)
            self.sample = state["sample"].to(self.device)
        self.position = description.get("position")
        self.step = int(description.get("step", 0))
        self.elapsed_before = float(description.get("elapsed_seconds", 0.0))
        return resume

    def refill(self) -> torch.Tensor | None:
        """The next batch on rank 0, reading the source as needed (None: the source has ended).

        The buffer takes the stream's first ``total_steps x batch_size`` rows and no more: once
        it holds all the remaining steps need, the source is read no further and the buffer is
        drained, so a run ends without a buffer's worth of forward passes wasted (and which rows
        train depends on the stream alone, not on how it is chunked)."""
        while (batch := self.buffer.next_batch()) is None:
            if self.ended:
                return None
            room = (self.total_steps - self.step) * self.batch_size - self.buffer.held_rows
            item = next(self.source, None) if room > 0 else None
            if item is None:
                self.ended = True
                self.buffer.end()
            else:
                rows, self.position = item
                self.buffer.add(rows[:room])
        return batch

    def draw_sample(self) -> torch.Tensor | None:
        """The initialisation sample on every rank: rank 0 draws it (unless resumed) from the first
        shuffled buffer. Returns the first batch drawn on the way, which the loop trains first."""
        pending: torch.Tensor | None = None
        sample = self.sample
        if self.spread.leader and sample is None:
            pending = self.refill()  # the first buffer is shuffled: the sample is its first rows
            queued = self.buffer.queued()
            sample = torch.cat([pending, queued]) if queued is not None and pending is not None else pending
            if sample is None:
                raise ValueError("the source gave no rows")
            sample = sample[:INIT_SAMPLE_ROWS].clone()
        like = sample if sample is not None else _like(self.rows_dtype, self.device)
        self.sample = self.spread.share(sample, self.width, like=like)
        return pending

    def set_up_trainers(self, resume: Path | None) -> None:
        """One trainer a member of this process, initialised from the sample or its checkpoint;
        each counts the group's clock (the forward passes included) from the checkpoint's."""
        cpu_sample = self.sample.float().cpu()
        for index in self.spread.mine:
            member = self.members[index]
            checkpoint = TrainingCheckpoint.load(resume / f"member-{index}") if resume is not None else None
            if member.n_layers is not None:
                from engine.sae.clt_training import CltTrainer

                inputs, outputs = self.layer_rows(member, cpu_sample)
                self.trainers[index] = CltTrainer(
                    member.config, sample_inputs=inputs, sample_outputs=outputs, resume=checkpoint,
                    device=self.device,
                )  # fmt: skip
                continue
            transcoder = member.hook_out is not None
            self.trainers[index] = SaeTrainer(
                member.config,
                d_in=self.widths[member.hook_in],
                sample=cpu_sample[:, self.offsets[member.hook_in]],
                d_out=self.widths[member.hook_out] if transcoder else None,
                sample_out=cpu_sample[:, self.offsets[member.hook_out]] if transcoder else None,
                resume=checkpoint,
                device=self.device,
            )
        for trainer in self.trainers.values():
            trainer.elapsed_before = self.elapsed_before

    def loop(self, pending: torch.Tensor | None) -> None:
        """Batches until the longest member is done, the source ends or rank 0 cancels."""
        self.started = time.perf_counter()
        while self.step < self.total_steps:
            batch = self.next_batch(pending)
            pending = None
            if batch is None:
                break
            self.train_step(batch)
            self.step += 1
            self.checkpoint_if_due()

    def seconds(self) -> float:
        """Seconds this process has trained (the loop's clock; a checkpoint's adds to it)."""
        return time.perf_counter() - self.started

    def next_batch(self, pending: torch.Tensor | None) -> torch.Tensor | None:
        """Rank 0's next batch (``pending`` first) on every rank; None once cancelled or ended."""
        batch = None
        if self.spread.leader:
            cancel = self.should_cancel is not None and self.should_cancel()
            batch = None if cancel else pending if pending is not None else self.refill()
        return self.spread.share(batch, self.width, like=self.sample)

    def train_step(self, batch: torch.Tensor) -> None:
        """One step of every member still training; ``on_step`` follows each."""
        for index, trainer in self.trainers.items():
            if trainer.done:
                continue
            member = self.members[index]
            trainer.seconds = self.seconds()
            if member.n_layers is not None:
                metrics = trainer.step(*self.layer_rows(member, batch))
            else:
                metrics = trainer.step(
                    batch[:, self.offsets[member.hook_in]],
                    batch[:, self.offsets[member.hook_out]] if member.hook_out is not None else None,
                )
            if self.on_step is not None:
                self.on_step(index, metrics)

    def checkpoint_if_due(self) -> None:
        """A checkpoint every ``checkpoint_every_steps`` steps and whenever rank 0's
        ``checkpoint_due()`` asks (not after the last step: the results follow at once)."""
        due = self.checkpoint_due is not None and self.spread.agree(
            self.spread.leader and self.checkpoint_due(), like=self.sample
        )
        periodic = self.checkpoint_every_steps and self.step % self.checkpoint_every_steps == 0
        if not (periodic or due) or self.step >= self.total_steps:
            return
        description = {
            "format": GROUP_CHECKPOINT_FORMAT,
            "step": self.step,
            "hooks": self.hooks,
            "position": self.position,
            "elapsed_seconds": self.elapsed_before + self.seconds(),
        }
        _save_checkpoint(
            self.checkpoint_folder, step=self.step, trainers=self.trainers, spread=self.spread,
            buffer=self.buffer, sample=self.sample, description=description,
        )  # fmt: skip
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.step)

    def finish(self) -> dict[int, TrainedSae]:
        """Each trainer's SAE, its scaling measured on the initialisation sample."""
        cpu_sample = self.sample.float().cpu()
        results = {}
        for index, trainer in self.trainers.items():
            member = self.members[index]
            if member.n_layers is not None:
                results[index] = trainer.finish(self.layer_rows(member, cpu_sample)[0])
            else:
                results[index] = trainer.finish(cpu_sample[:, self.offsets[member.hook_in]])
        return results

    def layer_rows(self, member: GroupMember, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A CLT's inputs and outputs in ``rows`` of the group's hooks: two [rows, layers, d]."""
        inputs, outputs = member.layer_hooks()
        return (
            torch.stack([rows[:, self.offsets[name]] for name in inputs], 1),
            torch.stack([rows[:, self.offsets[name]] for name in outputs], 1),
        )


def train_group(members: Sequence[GroupMember], **options: Any) -> dict[int, TrainedSae]:
    """``GroupRun(members, **options).fit()``: the group trained in one call."""
    return GroupRun(members, **options).fit()


def _columns(hooks: Sequence[str], widths: dict[str, int]) -> tuple[dict[str, slice], int]:
    """Each hook's columns in a row of the hooks side by side, and the row's width."""
    offsets, start = {}, 0
    for name in hooks:
        offsets[name] = slice(start, start + widths[name])
        start += widths[name]
    return offsets, start


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
