"""Training a cross-layer transcoder (:mod:`engine.sae.clt`) on every layer's MLP inputs and
outputs, and judging it the way the CLT papers do.

The published recipes (Anthropic's "Circuit Tracing", 2025):

* **JumpReLU with a tanh sparsity penalty**: features ``f = h * (h > θ)`` (θ learnt through a
  rectangle-kernel straight-through estimate, :class:`engine.sae.losses.JumpReLUFunction`), and a
  penalty ``λ Σ tanh(c · f · ‖W_dec,f‖)`` where a feature's decoder norm is taken over all the
  layers it writes into (its decoders concatenated).
* **TopK**: each layer keeps its ``k`` largest (ReLU'd) pre-activations per token; it is saved as
  the JumpReLU it is at inference (a layer's threshold: the mean ``k``-th largest pre-activation
  over a sample, as BatchTopK's), which circuit-tracer reads.

The reconstruction loss is each layer's squared error divided by its outputs' mean squared norm,
summed over layers, so that no layer's scale dominates. Rows are ``[batch, layers, d_model]``.

Judged by :func:`clt_explained_variance` (per layer) and :func:`ce_loss_recovered_all_mlps`: the
next-token loss with **every** MLP replaced at once (the replacement model attribution reads),
against the clean model and every MLP zeroed.

A trainer's :meth:`CltTrainer.checkpoint` (parameters, Adam's moments, the step and curves, in
the SAE trainer's checkpoint format) resumes a run to the result of an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.sae.checkpoint import TrainingCheckpoint
from engine.sae.clt import CltShape, CrossLayerTranscoder
from engine.sae.losses import JumpReLUFunction
from engine.sae.training import StepMetrics, TrainedSae, _adam_state_dict

__all__ = [
    "CltTrainer",
    "CltTrainingConfig",
    "ce_loss_recovered_all_mlps",
    "clt_explained_variance",
    "clt_l0",
    "layer_explained_variance",
    "mlp_rows",
]

SPARSITIES = ("topk", "jumprelu")


@dataclass(frozen=True)
class CltTrainingConfig:
    d_sae: int  # features per layer
    sparsity: str = "topk"
    k: int | None = 32  # TopK: features a layer keeps per token
    sparsity_coefficient: float = 1e-3  # JumpReLU: λ of the tanh penalty
    tanh_scale: float = 4.0  # JumpReLU: c
    threshold_init: float = 0.03
    bandwidth: float = 0.05
    lr: float = 2e-3
    batch_size: int = 256
    steps: int = 1000
    warmup_steps: int = 50
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return self.steps

    @property
    def total_tokens(self) -> int:
        return self.steps * self.batch_size

    def __post_init__(self) -> None:
        if self.sparsity not in SPARSITIES:
            raise ValueError(f"sparsity must be one of {', '.join(SPARSITIES)}")
        if self.sparsity == "topk" and not (self.k and 0 < self.k <= self.d_sae):
            raise ValueError("TopK needs 0 < k <= d_sae")


class CltTrainer:
    """Adam on a CLT's parameters, one batch of every layer's rows a step (see the module); the
    group trainer's interface (:class:`engine.sae.group.GroupRun`): ``step``, ``done``,
    ``checkpoint``, ``finish``, a run's clock. ``resume``: a :meth:`checkpoint` of the same config
    to continue from (its parameters, Adam's state, the step and the curves)."""

    def __init__(
        self,
        config: CltTrainingConfig,
        *,
        sample_inputs: torch.Tensor,
        sample_outputs: torch.Tensor,
        resume: TrainingCheckpoint | None = None,
        device: str = "cpu",
    ) -> None:
        self.config, self.device = config, device
        _, n_layers, d_model = sample_inputs.shape
        self.n_layers, self.d_model = n_layers, d_model
        generator = torch.Generator().manual_seed(config.seed)
        f = config.d_sae
        scale = 1 / math.sqrt(d_model)
        outputs = sample_outputs.float().cpu()
        output_scale = outputs.pow(2).sum(-1).mean(0).clamp_min(1e-8)  # [layers]
        self.output_scale = output_scale.to(device)
        tensors = {
            "W_enc": torch.randn(n_layers, d_model, f, generator=generator) * scale,
            "b_enc": torch.zeros(n_layers, f),
            "b_dec": outputs.mean(0).clone(),
            "log_threshold": torch.full((n_layers, f), math.log(config.threshold_init)),
        }
        # Decoder rows start at a tenth of each target layer's typical output norm, and shrink
        # with the layers they skip: a feature first writes locally.
        for layer in range(n_layers):
            reach = n_layers - layer
            decoder = torch.randn(f, reach, d_model, generator=generator)
            norms = 0.1 * output_scale[layer:, None].sqrt() / math.sqrt(reach)
            tensors[f"W_dec.{layer}"] = decoder / decoder.norm(dim=-1, keepdim=True) * norms
        if resume is not None:
            if resume.config != asdict(config) or resume.d_in != d_model:
                raise ValueError("the checkpoint was written with another configuration")
            tensors = {name: resume.parameters[name].clone() for name in tensors}
        self.tensors = {name: tensor.to(device).requires_grad_() for name, tensor in tensors.items()}
        self.optimizer = torch.optim.Adam(list(self.tensors.values()), lr=config.lr, betas=(0.9, 0.999))
        self.step_count = self.tokens = 0
        self.history: list[StepMetrics] = []
        self.elapsed_before = 0.0  # training seconds spent by the processes before this one
        self.seconds = 0.0
        if resume is not None:
            state = _adam_state_dict(self.optimizer, list(self.tensors), resume.optimizer_state)
            self.optimizer.load_state_dict(state)
            self.step_count, self.tokens = resume.step, resume.tokens
            self.history = [StepMetrics(**metrics) for metrics in resume.history]
            self.elapsed_before = resume.elapsed_seconds

    @property
    def W_enc(self) -> torch.Tensor:
        return self.tensors["W_enc"]

    @property
    def b_enc(self) -> torch.Tensor:
        return self.tensors["b_enc"]

    @property
    def b_dec(self) -> torch.Tensor:
        return self.tensors["b_dec"]

    @property
    def log_threshold(self) -> torch.Tensor:
        return self.tensors["log_threshold"]

    @property
    def W_dec(self) -> list[torch.Tensor]:
        return [self.tensors[f"W_dec.{layer}"] for layer in range(self.n_layers)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self.tensors.values())

    @property
    def done(self) -> bool:
        return self.step_count >= self.config.total_steps

    @property
    def elapsed_seconds(self) -> float:
        return self.elapsed_before + self.seconds

    def pre_activations(self, inputs: torch.Tensor) -> torch.Tensor:
        """[batch, layers, d_sae] pre-activations of ``inputs`` [batch, layers, d_model]."""
        return torch.einsum("bld,ldf->blf", inputs.to(self.device).float(), self.W_enc) + self.b_enc

    def encode(self, inputs: torch.Tensor) -> torch.Tensor:
        """[batch, layers, d_sae] features of ``inputs`` [batch, layers, d_model]."""
        pre = self.pre_activations(inputs)
        if self.config.sparsity == "topk":
            values, indices = pre.relu().topk(self.config.k, dim=-1)
            return torch.zeros_like(pre).scatter(-1, indices, values)
        threshold = self.log_threshold.exp()
        return torch.stack(
            [
                JumpReLUFunction.apply(pre[:, layer], threshold[layer], self.config.bandwidth)
                for layer in range(self.n_layers)
            ],
            dim=1,
        )

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        out = self.b_dec.expand(len(features), -1, -1)
        parts = [out]
        for layer in range(self.n_layers):
            written = torch.einsum("bf,fmd->bmd", features[:, layer], self.W_dec[layer])
            parts.append(torch.nn.functional.pad(written, (0, 0, layer, 0)))
        return torch.stack(parts).sum(0)

    def step(self, inputs: torch.Tensor, outputs: torch.Tensor) -> StepMetrics:
        """One Adam step on a batch (``inputs``, ``outputs`` [rows, layers, d_model]); its metrics:
        ``mse`` the normalised squared error summed over layers, ``l0`` the features a token uses
        over all layers, ``explained_variance`` the layers' mean (also appended to ``history``)."""
        started = time.perf_counter()
        config = self.config
        inputs = inputs.to(self.device).float()
        outputs = outputs.to(self.device).float()
        lr = config.lr * min(1.0, (self.step_count + 1) / max(1, config.warmup_steps))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        features = self.encode(inputs)
        reconstruction = self.decode(features)
        per_layer = (reconstruction - outputs).pow(2).sum(-1).mean(0) / self.output_scale
        loss = per_layer.sum()
        sparsity = torch.zeros((), device=inputs.device)
        if config.sparsity == "jumprelu":
            norms = torch.stack([decoder.norm(dim=(1, 2)) for decoder in self.W_dec])  # [layers, d_sae]
            penalty = torch.tanh(config.tanh_scale * features * norms).sum(-1).mean(0).sum()
            sparsity = config.sparsity_coefficient * penalty
            loss = loss + sparsity
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            explained = float(layer_explained_variance(outputs, reconstruction).mean())
        self.step_count += 1
        self.tokens += len(inputs)
        self.seconds += time.perf_counter() - started
        metrics = StepMetrics(
            step=self.step_count, tokens=self.tokens, mse=float(per_layer.sum().detach()),
            sparsity_loss=float(sparsity.detach()), aux_loss=0.0,
            l0=float((features > 0).float().sum((1, 2)).mean()), explained_variance=explained, dead=0, lr=lr,
            tokens_per_second=self.tokens / max(self.elapsed_seconds, 1e-9),
        )  # fmt: skip
        self.history.append(metrics)
        return metrics

    def checkpoint(self) -> TrainingCheckpoint:
        """The state a resumed run continues from (the SAE trainer's checkpoint format: nothing
        pickled)."""
        adam_state = self.optimizer.state_dict()["state"]
        return TrainingCheckpoint(
            config=asdict(self.config), d_in=self.d_model, step=self.step_count, tokens=self.tokens,
            scaling=1.0, elapsed_seconds=self.elapsed_seconds,
            parameters={name: tensor.detach().cpu().clone() for name, tensor in self.tensors.items()},
            log_threshold=None,
            optimizer_state={
                f"{name}.{key}": value.cpu().clone()
                for index, name in enumerate(self.tensors)
                for key, value in adam_state.get(index, {}).items()
            },
            steps_since_fired=torch.zeros(1, dtype=torch.long),
            history=[asdict(metrics) for metrics in self.history],
        )  # fmt: skip

    def finish(self, sample_inputs: torch.Tensor) -> TrainedSae:
        """The trained CLT on the CPU (``.sae``), as the JumpReLU it is at inference (see the
        module); ``sample_inputs`` [rows, layers, d_model] set a TopK one's thresholds."""
        clt = CrossLayerTranscoder(
            CltShape(
                n_layers=self.n_layers, d_model=self.d_model, d_sae=self.config.d_sae, activation="jumprelu"
            )
        )
        with torch.no_grad():
            clt.W_enc.copy_(self.W_enc)
            clt.b_enc.copy_(self.b_enc)
            clt.b_dec.copy_(self.b_dec)
            for layer, decoder in enumerate(self.W_dec):
                clt.W_dec[layer].copy_(decoder)
            if self.config.sparsity == "topk":
                pre = self.pre_activations(sample_inputs).relu()
                kth = pre.topk(self.config.k, dim=-1).values[..., -1]  # [rows, layers]
                clt.threshold.copy_(kth.mean(0)[:, None].expand(-1, self.config.d_sae))
            else:
                clt.threshold.copy_(self.log_threshold.exp())
        return TrainedSae(
            sae=clt.eval(),
            scaling_factor=1.0,
            steps=self.step_count,
            tokens=self.tokens,
            history=list(self.history),
        )


def clt_explained_variance(
    clt: CrossLayerTranscoder, inputs: torch.Tensor, outputs: torch.Tensor
) -> list[float]:
    """Each layer's explained variance of its MLP outputs ``outputs`` [rows, layers, d] from
    ``inputs`` (the same rows' MLP inputs)."""
    with torch.no_grad():
        predicted = torch.stack(clt([inputs[:, layer].float() for layer in range(clt.n_layers)]), 1)
        return [round(float(value), 5) for value in layer_explained_variance(outputs.float(), predicted)]


def layer_explained_variance(truth: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """[layers]: each layer's ``1 - sum((truth - predicted)^2) / sum((truth - mean truth)^2)`` over
    the rows of ``truth`` and ``predicted`` [rows, layers, d]."""
    residual = (truth - predicted).pow(2).sum((0, 2))
    return 1 - residual / (truth - truth.mean(0)).pow(2).sum((0, 2)).clamp_min(1e-12)


def clt_l0(clt: CrossLayerTranscoder, inputs: torch.Tensor) -> list[float]:
    """Each layer's features a row uses, averaged, from ``inputs`` [rows, layers, d]."""
    with torch.no_grad():
        return [
            float((clt.encode(layer, inputs[:, layer].float()) > 0).float().sum(-1).mean())
            for layer in range(clt.n_layers)
        ]


def mlp_rows(model: Any, token_batches: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's MLP inputs and outputs over ``token_batches`` ([batch, tokens] id tensors,
    unpadded): two [rows, layers, d_model] float32 tensors, rows in token order."""
    from engine.hooks import every_transcoder_hook, hook_sites
    from engine.runtime import HookRuntime

    names = every_transcoder_hook(int(model.config.num_hidden_layers))
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in names}

    def keep(name: str, tensor: torch.Tensor) -> None:
        rows[name].append(tensor.detach().flatten(0, 1).float())

    runtime = HookRuntime(model, hook_sites(model, names), keep, purpose="read")
    with torch.no_grad(), runtime.attached():
        for ids in token_batches:
            runtime.begin_pass(*ids.shape)
            runtime.run(model, input_ids=ids)
    inputs = torch.stack([torch.cat(rows[name]) for name in names[0::2]], 1)
    outputs = torch.stack([torch.cat(rows[name]) for name in names[1::2]], 1)
    return inputs, outputs


def ce_loss_recovered_all_mlps(
    model: Any,
    token_batches: Sequence[torch.Tensor],
    transcoders: Any,
    *,
    should_cancel: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Next-token loss over ``token_batches`` ([batch, tokens] id tensors, unpadded) clean, with
    **every** MLP replaced at once by ``transcoders`` (one per layer, or a CLT: each layer's
    features read from what that layer's MLP receives in the replaced run), and with every MLP
    zeroed; ``recovered`` = (zero - replaced) / (zero - clean)."""
    from engine.attribution.replacement import replacement_of

    replacement = replacement_of(transcoders)
    losses = {"clean": 0.0, "replaced": 0.0, "zero": 0.0}
    count = 0
    for ids in token_batches:
        if should_cancel is not None and should_cancel():
            raise InterruptedError("cancelled")
        for mode in losses:
            logits = _run_with_mlps(model, ids, replacement, mode)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"
            )
            losses[mode] += float(loss)
        count += ids[:, 1:].numel()
    result = {mode: total / count for mode, total in losses.items()}
    result["recovered"] = (result["zero"] - result["replaced"]) / max(1e-12, result["zero"] - result["clean"])
    return result


def _run_with_mlps(model: Any, ids: torch.Tensor, replacement: Any, mode: str) -> torch.Tensor:
    """The logits of ``ids`` with every MLP as it is (``clean``), zeroed, or ``replaced``."""
    from engine.hooks import every_transcoder_hook, hook_sites
    from engine.runtime import HookRuntime

    names = every_transcoder_hook(replacement.n_layers)
    layer_of = {name: divmod(at, 2) for at, name in enumerate(names)}  # (layer, 0 input / 1 output)
    features: list[torch.Tensor] = []
    inputs: dict[int, torch.Tensor] = {}

    def visit(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        layer, index = layer_of[name]
        if mode == "clean":
            return None
        if index == 0:  # the MLP's input: this layer's features
            inputs[layer] = tensor.float()
            features.append(replacement.encode(layer, tensor.float()))
            return None
        if mode == "zero":
            return torch.zeros_like(tensor)
        return replacement.reconstruct(layer, features, inputs[layer]).to(tensor.dtype)

    runtime = HookRuntime(model, hook_sites(model, names), visit, purpose="replaced")
    with torch.no_grad(), runtime.attached():
        runtime.begin_pass(*ids.shape)
        return runtime.run(model, input_ids=ids).logits.float()
