"""Training an SAE on batches of activations: initialisation, losses per architecture, the loop.

* **Initialisation** (SAELens'): ``W_dec`` Kaiming-uniform with rows of norm
  ``decoder_init_norm``, ``W_enc`` its transpose, ``b_enc`` zero, ``b_dec`` the geometric median
  (Weiszfeld) or the mean of a sample.
* **Normalisation**: activations are scaled by one factor so their mean norm is ``sqrt(d_in)``
  (SAELens' ``expected_average_only_in``); the factor is folded into the weights at the end, so
  the trained SAE takes raw activations, and it is recorded in the result.
* **Losses**: MSE summed over ``d_in``, averaged over rows, plus
  ``standard``: L1 of the activations weighted by their decoder rows' norms;
  ``topk`` / ``batchtopk``: AuxK (dead features predict the residual; ``k_aux = d_in / 2``,
  scaled down when few are dead, coefficient 1/32);
  ``jumprelu``: an L0 penalty through a straight-through step with a rectangle kernel, and
  ``log_threshold`` learnt through the same pseudo-derivative (Rajamanoharan et al. 2024).
* Decoder rows are renormalised to unit norm after every step except for ``standard``, whose
  penalty is weighted by the norms instead. Adam; learning rate warmed up linearly, then decayed
  linearly to zero over the last ``decay_fraction`` of the steps.
* A feature is dead when it has not fired for ``dead_after_steps`` steps
  (:func:`default_dead_after_steps`: a tenth of the run, at most 1,000).
* **Checkpoints** (:class:`engine.sae.checkpoint.TrainingCheckpoint`): all the state the loop
  carries, as safetensors + JSON, with the batch stream's position when the stream gives one
  (:func:`engine.sae.data.resumable_batches`). Resuming from one on the same batch stream, opened
  at that position or replayed from its beginning, ends with the very tensors an uninterrupted
  training gives.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.sae.checkpoint import SAE_PARAMETERS, TrainingCheckpoint
from engine.sae.data import StreamPosition
from engine.sae.model import SaeShape, SparseAutoencoder
from engine.sae_architectures import (
    DEFAULT_EXPANSION,
    DEFAULT_LIVE_EXPANSION,
    MIN_TOKENS_PER_FEATURE,
    default_dead_after_steps,
    default_expansion,
    default_k,
    default_live_k,
    default_live_tokens,
    default_total_tokens,
)

B_DEC_INITS: tuple[str, ...] = ("geometric_median", "mean", "zeros")


@dataclass(frozen=True)
class TrainingConfig:
    architecture: str
    d_sae: int
    k: int | None = None
    l1_coefficient: float = 1.0  # standard
    l0_coefficient: float = 1.0  # jumprelu
    lr: float = 3e-4
    batch_size: int = 4096
    total_tokens: int = 1_000_000
    warmup_steps: int = 100
    decay_fraction: float = 0.2
    b_dec_init: str = "geometric_median"
    normalize_activations: bool = True
    dead_after_steps: int = 1000
    aux_coefficient: float = 1 / 32
    jumprelu_bandwidth: float = 0.05
    jumprelu_init_threshold: float = 0.001
    # Decoder rows start at this norm, the encoder as their transpose. None: 0.1 for topk and
    # batchtopk (SAELens' default, after Anthropic's 2024 circuits update: the decoder is unit-norm
    # again after one step, what stays is a small encoder; +0.08 explained variance in
    # bench/sae.py), 1 for standard and jumprelu (their planted dictionaries are recovered better).
    decoder_init_norm: float | None = None
    seed: int = 0
    # Matryoshka: the nested dictionary sizes (None: engine.sae_architectures.matryoshka_widths).
    matryoshka_widths: tuple[int, ...] | None = None
    # A transcoder with a linear skip path (W_skip).
    skip: bool = False

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.total_tokens / self.batch_size))


@dataclass
class StepMetrics:
    step: int
    tokens: int
    mse: float
    sparsity_loss: float
    aux_loss: float
    l0: float
    explained_variance: float
    dead: int
    lr: float
    tokens_per_second: float


@dataclass
class TrainedSae:
    sae: SparseAutoencoder
    # The factor activations were multiplied by in training (folded into the weights now).
    scaling_factor: float
    steps: int
    tokens: int
    history: list[StepMetrics] = field(default_factory=list)
    # A transcoder's target scaling factor (folded in too).
    output_scaling_factor: float | None = None


def geometric_median(points: torch.Tensor, *, iterations: int = 100, tolerance: float = 1e-6) -> torch.Tensor:
    """The point minimising the summed distance to ``points`` [n, d] (Weiszfeld's algorithm)."""
    median = points.mean(0)
    for _ in range(iterations):
        distances = (points - median).norm(dim=1).clamp(min=1e-8)
        weights = 1 / distances
        updated = (weights[:, None] * points).sum(0) / weights.sum()
        if (updated - median).norm() < tolerance * max(1.0, float(median.norm())):
            return updated
        median = updated
    return median


def initialised_sae(shape: SaeShape, config: TrainingConfig, sample: torch.Tensor) -> SparseAutoencoder:
    """A new SAE with SAELens' initialisation, ``b_dec`` from ``sample`` (already scaled)."""
    generator = torch.Generator().manual_seed(config.seed)
    sae = SparseAutoencoder(shape)
    with torch.no_grad():
        bound = math.sqrt(6 / shape.d_in)  # kaiming_uniform_ on [d_sae, d_in]
        decoder = (torch.rand(shape.d_sae, shape.d_in, generator=generator) * 2 - 1) * bound
        norm = config.decoder_init_norm
        if norm is None:
            norm = shape.kind.decoder_init_norm
        if shape.is_transcoder:  # W_dec [d_sae, d_out]: its own draw, the encoder as in SAELens
            decoder = (torch.rand(shape.d_sae, shape.d_out, generator=generator) * 2 - 1) * bound
            encoder = (torch.rand(shape.d_sae, shape.d_in, generator=generator) * 2 - 1) * bound
            sae.W_enc.copy_((encoder / encoder.norm(dim=1, keepdim=True) * norm).T)
        sae.W_dec.copy_(decoder / decoder.norm(dim=1, keepdim=True) * norm)
        if not shape.is_transcoder:
            sae.W_enc.copy_(sae.W_dec.T)
        if config.b_dec_init == "geometric_median":
            sae.b_dec.copy_(geometric_median(sample.float()))
        elif config.b_dec_init == "mean":
            sae.b_dec.copy_(sample.float().mean(0))
        elif config.b_dec_init != "zeros":
            raise ValueError(f"b_dec_init must be one of {', '.join(B_DEC_INITS)}")
        if shape.kind.learns_threshold:
            sae.threshold.fill_(config.jumprelu_init_threshold)
    return sae


def _learning_rate(config: TrainingConfig, step: int) -> float:
    total = config.total_steps
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_start = int(total * (1 - config.decay_fraction))
    if config.decay_fraction > 0 and step >= decay_start:
        return config.lr * max(0.0, (total - step) / max(1, total - decay_start))
    return config.lr


class SaeTrainer:
    """One SAE (or transcoder) in training, stepped a batch at a time: what :func:`train` runs
    for one SAE and :mod:`engine.sae.group` for many fed by the same batches.

    ``sample`` (rows of the input activations; for a transcoder ``sample_out``, the same rows'
    targets) sets the scaling factors and ``b_dec``. ``resume`` continues a checkpoint of the
    same config and widths instead (the scaling and ``b_dec`` then come from it). The SAE lives
    on ``device``; the checkpoints and the result are on the CPU.
    """

    def __init__(
        self,
        config: TrainingConfig,
        *,
        d_in: int,
        sample: torch.Tensor,
        d_out: int | None = None,
        sample_out: torch.Tensor | None = None,
        resume: TrainingCheckpoint | None = None,
        device: str = "cpu",
    ) -> None:
        self.config, self.d_in, self.d_out, self.device = config, d_in, d_out, device
        architecture = self.architecture = config.architecture
        torch.manual_seed(config.seed)
        shape = SaeShape(
            architecture, d_in, config.d_sae, config.k, apply_b_dec_to_input=d_out is None,
            d_out=d_out, skip=config.skip,
        )  # fmt: skip
        self.kind = shape.kind
        self.widths = self.kind.training_widths(config)
        if resume is None:
            sample = sample.float()
            self.scaling = _scaling(config, sample)
            if d_out is None:
                self.output_scaling = None
                sae = initialised_sae(shape, config, sample * self.scaling)
            else:
                target = sample_out.float()
                self.output_scaling = _scaling(config, target)
                sae = initialised_sae(shape, config, target * self.output_scaling)
        else:
            resume.check_continues(config, d_in, d_out)
            self.scaling, self.output_scaling = resume.scaling, resume.output_scaling
            sae = SparseAutoencoder(shape)
            with torch.no_grad():
                for name in _trained_parameters(sae):
                    getattr(sae, name).copy_(resume.parameters[name])
        self.sae = sae = sae.to(device)
        self.log_threshold = None
        self.parameters = {name: getattr(sae, name) for name in _trained_parameters(sae)}
        if self.kind.learns_threshold:
            initial = resume.log_threshold if resume is not None else sae.threshold.detach().log()
            self.log_threshold = torch.nn.Parameter(initial.clone().to(device))
            self.parameters["log_threshold"] = self.log_threshold
        self.optimizer = torch.optim.Adam(list(self.parameters.values()), lr=config.lr, betas=(0.9, 0.999))
        self.steps_since_fired = torch.zeros(config.d_sae, dtype=torch.long, device=device)
        self.history: list[StepMetrics] = []
        self.tokens = self.step_count = 0
        self.elapsed_before = 0.0  # training seconds spent by the processes before this one
        self.seconds = 0.0  # spent stepping in this process
        if resume is not None:
            self.optimizer.load_state_dict(
                _adam_state_dict(self.optimizer, list(self.parameters), resume.optimizer_state)
            )
            self.steps_since_fired = resume.steps_since_fired.clone().to(device)
            self.history = [StepMetrics(**metrics) for metrics in resume.history]
            self.step_count, self.tokens = resume.step, resume.tokens
            self.elapsed_before = resume.elapsed_seconds

    @property
    def done(self) -> bool:
        return self.step_count >= self.config.total_steps

    def step(self, batch: torch.Tensor, target: torch.Tensor | None = None) -> StepMetrics:
        """One optimisation step on ``batch`` [rows, d_in] (a transcoder's ``target`` [rows, d_out]
        beside it); returns its metrics (also appended to ``history``)."""
        started = time.perf_counter()
        config, sae, kind = self.config, self.sae, self.kind
        x = batch.to(self.device, non_blocking=True).float() * self.scaling
        y = x if target is None else target.to(self.device, non_blocking=True).float() * self.output_scaling
        for group in self.optimizer.param_groups:
            group["lr"] = lr = _learning_rate(config, self.step_count)
        hidden_pre = sae.pre_activations(x)
        skip = sae.skip_path(x)
        forward = kind.training_forward(self, hidden_pre)
        recon = forward.recon if skip is None else forward.recon + skip
        mse = (recon - y).pow(2).sum(-1).mean()
        reconstruction_loss = kind.reconstruction_loss(self, forward, y, skip, mse)
        dead = self.steps_since_fired >= config.dead_after_steps
        sparsity = _or_zero(kind.sparsity_loss(self, forward), x)
        aux = _or_zero(kind.auxiliary_loss(self, y, recon, hidden_pre, dead), x)
        loss = reconstruction_loss + sparsity + aux
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

        with torch.no_grad():
            if kind.renormalises_decoder:
                sae.W_dec.div_(sae.W_dec.norm(dim=1, keepdim=True).clamp(min=1e-8))
            fired = kind.fired(forward, self.steps_since_fired)
            self.steps_since_fired = torch.where(fired, 0, self.steps_since_fired + 1)
            total_variance = float((y - y.mean(0)).pow(2).sum())
            residual = float((y - recon).pow(2).sum())
        self.step_count += 1
        self.tokens += len(batch)
        self.seconds += time.perf_counter() - started
        metrics = StepMetrics(
            step=self.step_count,
            tokens=self.tokens,
            mse=float(mse.detach()),
            sparsity_loss=float(sparsity.detach()),
            aux_loss=float(aux.detach()),
            l0=float(forward.active_per_row.float().mean()),
            explained_variance=1 - residual / total_variance if total_variance > 0 else 0.0,
            dead=int((self.steps_since_fired >= config.dead_after_steps).sum()),
            lr=lr,
            tokens_per_second=self.tokens / max(self.elapsed_seconds, 1e-9),
        )
        self.history.append(metrics)
        return metrics

    @property
    def elapsed_seconds(self) -> float:
        """Training time so far, over every process that trained this SAE."""
        return self.elapsed_before + self.seconds

    def checkpoint(self, stream: StreamPosition | None = None) -> TrainingCheckpoint:
        """The state carried to the next step, with ``stream``, the batch stream's position after
        this step's batch, if it has one."""
        adam_state = self.optimizer.state_dict()["state"]
        log_threshold = self.log_threshold
        return TrainingCheckpoint(
            config=asdict(self.config),
            d_in=self.d_in,
            step=self.step_count,
            tokens=self.tokens,
            scaling=self.scaling,
            elapsed_seconds=self.elapsed_seconds,
            parameters={
                name: getattr(self.sae, name).detach().cpu().clone() for name in _trained_parameters(self.sae)
            },
            log_threshold=log_threshold.detach().cpu().clone() if log_threshold is not None else None,
            optimizer_state={
                f"{name}.{key}": value.cpu().clone()
                for index, name in enumerate(self.parameters)
                for key, value in adam_state[index].items()
            },
            steps_since_fired=self.steps_since_fired.cpu().clone(),
            history=[asdict(metrics) for metrics in self.history],
            d_out=self.d_out,
            output_scaling=self.output_scaling,
            stream=stream,
        )

    def finish(self, sample: torch.Tensor) -> TrainedSae:
        """The trained SAE on the CPU, taking and giving raw activations: JumpReLU's threshold set,
        the batch-wide architectures' inference threshold taken on ``sample`` (input rows), the
        scaling folded in."""
        sae = self.sae
        with torch.no_grad():
            self.kind.finish_training(self, sample)
            fold_scaling(sae, self.scaling, self.output_scaling)
        return TrainedSae(
            sae=sae.cpu(),
            scaling_factor=self.scaling,
            steps=self.step_count,
            tokens=self.tokens,
            history=self.history,
            output_scaling_factor=self.output_scaling,
        )


def _or_zero(loss: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``loss``, or a zero scalar for an architecture without one (kept in the sum and metrics)."""
    return like.new_zeros(()) if loss is None else loss


def _scaling(config: TrainingConfig, sample: torch.Tensor) -> float:
    """The factor that gives ``sample``'s rows a mean norm of sqrt(width) (1 when not normalising)."""
    if not config.normalize_activations:
        return 1.0
    return math.sqrt(sample.shape[1]) / float(sample.norm(dim=1).mean())


def _trained_parameters(sae: SparseAutoencoder) -> list[str]:
    return [*SAE_PARAMETERS, *sae.shape.member.extra_parameters]


def train(
    batches: Iterable[torch.Tensor] | Iterable[tuple[torch.Tensor, StreamPosition]],
    *,
    d_in: int,
    config: TrainingConfig,
    sample: torch.Tensor,
    on_step: Callable[[StepMetrics], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    resume: TrainingCheckpoint | None = None,
    checkpoint_every_steps: int = 0,
    on_checkpoint: Callable[[TrainingCheckpoint], None] | None = None,
    checkpoint_due: Callable[[], bool] | None = None,
    device: str = "cpu",
) -> TrainedSae:
    """Train an SAE on ``batches`` (each [rows, d_in], shuffled already, e.g. by
    :func:`engine.sae.data.shuffled_batches`; or each with the stream's position after it, from
    :func:`engine.sae.data.resumable_batches`) until ``config.total_tokens`` rows are seen or the
    batches end. ``sample`` (rows of the same activations) sets the scaling factor and ``b_dec``,
    and at the end batchtopk's inference threshold (:func:`batch_topk_threshold`).
    ``on_step`` gets every step's metrics; ``should_cancel()`` is asked before each step and
    stops the loop (the SAE trained so far is returned).

    ``on_checkpoint`` gets a :class:`TrainingCheckpoint` every ``checkpoint_every_steps`` steps
    (0: never), and after any step where ``checkpoint_due()`` says so (a job yielding its worker
    saves its state first), except after the last step: the caller keeps the result itself. An
    exception it raises stops the training (the checkpoint is saved). The checkpoint carries the
    position of the step's batch when ``batches`` give positions. To continue from one, pass it
    as ``resume`` with the same config and the same stream, opened at ``resume.stream``
    (``resumable_batches(..., start=resume.stream)``: nothing before it is read again) or from its
    beginning (:func:`~engine.sae.data.shuffled_batches` repeats its order for a seed; the only
    way for a checkpoint without a position): then the first ``resume.step`` batches are read
    and skipped, not trained on. The scaling and ``b_dec`` come from the checkpoint (``sample``
    serves batchtopk's threshold only). The history returned then starts with the checkpoint's,
    and ``on_step`` is called for the new steps only.

    Training runs on ``device`` (``"cuda:0"``: each batch is moved there); the SAE returned and
    the checkpoints are on the CPU.

    ``tokens_per_second`` is every token trained so far over the training time so far, summed
    over the processes that trained them: time spent down, and skipping batches, is left out."""
    if checkpoint_every_steps < 0:
        raise ValueError("checkpoint_every_steps must be >= 0")
    if (checkpoint_every_steps or checkpoint_due is not None) and on_checkpoint is None:
        raise ValueError("checkpoints need an on_checkpoint to hand them to")
    trainer = SaeTrainer(config, d_in=d_in, sample=sample, resume=resume, device=device)
    items = _with_positions(batches)
    if resume is not None:
        items = _after_checkpoint(items, steps=resume.step, tokens=resume.tokens)
    for batch, position in items:
        if trainer.done or (should_cancel is not None and should_cancel()):
            break
        metrics = trainer.step(batch)
        if on_step is not None:
            on_step(metrics)
        step = trainer.step_count
        periodic = checkpoint_every_steps and step % checkpoint_every_steps == 0
        if not trainer.done and (periodic or (checkpoint_due is not None and checkpoint_due())):
            on_checkpoint(trainer.checkpoint(stream=position))
    return trainer.finish(sample)


def batch_topk_threshold(sae: SparseAutoencoder, x: torch.Tensor, k: int) -> float:
    """BatchTopK's inference threshold: the one value that keeps, on the rows ``x``, the ``k * rows``
    largest pre-activations a training batch would keep (JumpReLU fires strictly above it).

    Taken with the final weights on the sample, rather than SAELens' running mean of each batch's
    smallest kept value, which lags the weights: in a short training it kept L0 at 37 for k = 4."""
    with torch.no_grad():
        values = sae.pre_activations(x).relu().flatten()
        kept = min(k * len(x), values.numel() - 1)
        return float(values.topk(kept + 1, sorted=True).values[-1])


def _adam_state_dict(
    optimizer: torch.optim.Adam, names: list[str], flat: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the per-parameter state ``flat`` ("<name>.<key>") holds.

    Cloned, since Adam updates its state in place and the checkpoint may be used again."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for flat_name, tensor in flat.items():
        name, key = flat_name.rsplit(".", 1)
        state.setdefault(names.index(name), {})[key] = tensor.clone()
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


def _with_positions(
    batches: Iterable[torch.Tensor] | Iterable[tuple[torch.Tensor, StreamPosition]],
) -> Iterator[tuple[torch.Tensor, StreamPosition | None]]:
    """Each batch with the stream's position after it (None for a stream that gives none)."""
    for item in batches:
        yield item if isinstance(item, tuple) else (item, None)


def _after_checkpoint(
    items: Iterator[tuple[torch.Tensor, StreamPosition | None]], *, steps: int, tokens: int
) -> Iterator[tuple[torch.Tensor, StreamPosition | None]]:
    """``items`` from the batch after a checkpoint's ``steps`` batches on: a stream opened at its
    position starts there; one from its beginning (or further back) is read up to it and those
    batches skipped. Either way the batches before hold its ``tokens`` rows, or the stream is
    refused: another stream would train on the wrong rows without a word."""
    first = next(items, None)
    if first is None:
        raise ValueError(
            f"the batches end before the checkpoint's step {steps}: not the stream it was trained on"
        )
    batch, position = first
    # Batches and rows the stream gave before its first item (none unless it was opened midway).
    before, seen = (position.batches - 1, position.rows_given - len(batch)) if position else (0, 0)
    if before > steps:
        raise ValueError(
            f"the batches start after batch {before}, past the checkpoint's step {steps}: not its stream"
        )
    items = itertools.chain([first], items)
    for _ in range(steps - before):
        item = next(items, None)
        if item is None:
            raise ValueError(
                f"the batches end before the checkpoint's step {steps}: not the stream it was trained on"
            )
        seen += len(item[0])
    if seen != tokens:
        raise ValueError(
            f"the first {steps} batches hold {seen} rows, the checkpoint's {tokens}: not its stream"
        )
    return items


def fold_scaling(sae: SparseAutoencoder, scaling: float, output_scaling: float | None = None) -> None:
    """Make ``sae``, trained on activations times ``scaling``, take and give raw activations:
    ``h = (x s - b) W + c = (x - b/s)(s W) + c`` and ``(f V + b) / s = f (V/s) + b/s``. A
    transcoder's targets were scaled by ``output_scaling`` t instead: ``(f V + b + x s S) / t``
    gives ``V/t``, ``b/t`` and ``W_skip`` times ``s/t``."""
    out = scaling if output_scaling is None else output_scaling
    with torch.no_grad():
        sae.W_enc.mul_(scaling)
        sae.W_dec.div_(out)
        sae.b_dec.div_(out)
        if sae.W_skip is not None:
            sae.W_skip.mul_(scaling / out)


def explained_variance(sae: SparseAutoencoder, x: torch.Tensor) -> float:
    """``1 - sum((x - sae(x))^2) / sum((x - mean x)^2)`` over the rows of ``x``."""
    with torch.no_grad():
        x = x.float()
        residual = (x - sae(x)).pow(2).sum()
        total = (x - x.mean(0)).pow(2).sum()
    return float(1 - residual / total)


def l0(sae: SparseAutoencoder, x: torch.Tensor) -> float:
    """Features active per row, averaged."""
    with torch.no_grad():
        return float((sae.encode(x.float()) > 0).sum(-1).float().mean())


__all__ = [
    "B_DEC_INITS",
    "DEFAULT_EXPANSION",
    "DEFAULT_LIVE_EXPANSION",
    "MIN_TOKENS_PER_FEATURE",
    "SaeTrainer",
    "StepMetrics",
    "TrainedSae",
    "TrainingCheckpoint",
    "TrainingConfig",
    "default_dead_after_steps",
    "default_expansion",
    "default_k",
    "default_live_k",
    "default_live_tokens",
    "default_total_tokens",
    "explained_variance",
    "fold_scaling",
    "geometric_median",
    "initialised_sae",
    "l0",
    "train",
]
