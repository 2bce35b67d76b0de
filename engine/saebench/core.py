"""SAEBench's core metrics, computed as ``sae-bench`` 0.6.0 computes them (``sae_bench.evals.core``).

:func:`core_metrics` runs a causal LM over fixed-length token batches (``[prompts, context]``,
no padding; :func:`context_batches` makes them from texts) and measures an SAE or transcoder
spliced in at its hook point:

* model behaviour and performance: the KL divergence of the next-token distribution with the SAE
  spliced in, and with the hook point zero-ablated, from the clean run; the CE losses of the three
  runs; ``kl_div_score`` and ``ce_loss_score`` = (ablation - SAE) / (ablation - clean);
* reconstruction: SAEBench's ``explained_variance`` (its formula, which subtracts the square of
  the mean *squared* activation, not of the mean, from the mean squared norm: kept as it is so
  that the numbers compare with published ones), the per-token ``explained_variance_legacy``, its
  ``mse`` (a token's squared error divided by the tokens of its batch) and ``cossim``;
* shrinkage (L2 norms in and out, their ratio, the relative reconstruction bias), sparsity (L0, L1);
* per feature: density, the consistent-activation heuristic, and the weight-based statistics
  (encoder norm and bias, encoder-decoder cosine, the largest cosine with any other feature's
  encoder and decoder), summarised as ``misc_metrics``.

Tokens equal to the tokenizer's pad, EOS or BOS id are left out of every metric (SAEBench's
``ignore_tokens``); the splice still runs at every position, as SAEBench's default
(``exclude_special_tokens_from_reconstruction=False``) does.

Where SAEBench runs the model four times a batch (clean, spliced, ablated, and once more up to the
hook to read the activations), this runs it once up to the hook point, then the clean value, the
SAE's reconstruction and zeros stacked as three batches through the rest of the model (on the
residual stream; elsewhere, and for a family whose later layers are sized to the batch, three
passes: the clean one captures the hook point's value, the spliced one reuses its reconstruction).
Each run's log-probabilities give both its CE loss and its KL divergence.

Importing this module imports torch; it needs no Django (:mod:`engine.saebench.results`, the
settings, results and their SAEBench JSON, imports neither).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.budgets import SAEBENCH_LOGITS_BYTES
from engine.hooks import hook_sites
from engine.placement import input_device
from engine.runtime import HookRuntime, grad_free_mode
from engine.sae.evaluation import EvaluationCancelled, EvaluationError, edited_logits
from engine.sae.model import SparseAutoencoder
from engine.saebench.results import CoreConfig, CoreResult

__all__ = [
    "CoreConfig", "CoreResult", "context_batches", "core_metrics", "core_metrics_many", "misc_metrics",
    "weight_metrics",
]  # fmt: skip

# The logits one stacked pass may hold (three runs of a few prompts): engine.budgets counts them.
LOGITS_BYTES = SAEBENCH_LOGITS_BYTES


def context_batches(
    token_lists: Iterable[Sequence[int]],
    *,
    context_size: int,
    batch_size: int,
    batches: int,
    bos_token_id: int | None,
) -> list[torch.Tensor]:
    """``batches`` batches ``[batch_size, context_size]`` of the texts' tokens, concatenated in
    order and cut into rows as SAELens' activation store cuts them for SAEBench: each row begins
    with the BOS token (when the model has one) followed by ``context_size - 1`` tokens, and a
    document's tokens continue into the next row. Fewer batches when the tokens run out (an
    incomplete last row or batch is dropped); :class:`EvaluationError` when not one batch fills."""
    body = context_size - (1 if bos_token_id is not None else 0)
    rows: list[list[int]] = []
    pending: list[int] = []
    wanted = batches * batch_size
    for ids in token_lists:
        pending.extend(int(token) for token in ids)
        while len(pending) >= body and len(rows) < wanted:
            head = [bos_token_id] if bos_token_id is not None else []
            rows.append(head + pending[:body])
            del pending[:body]
        if len(rows) >= wanted:
            break
    full = len(rows) // batch_size
    if full == 0:
        raise EvaluationError(
            "NOT_ENOUGH_TOKENS",
            f"The texts give {len(rows)} rows of {context_size} tokens; one batch needs {batch_size}.",
            {"rows": len(rows), "batch_size_prompts": batch_size, "context_size": context_size},
        )
    table = torch.tensor(rows[: full * batch_size], dtype=torch.long)
    return list(table.split(batch_size))


class _Mean:
    """A running mean of many values (float64), SAEBench's ``torch.cat(values).mean()``."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def add(self, values: torch.Tensor) -> None:
        self.total += float(values.double().sum())
        self.count += values.numel()

    def value(self) -> float:
        return self.total / self.count if self.count else math.nan


class _Accumulator:
    """Everything SAEBench keeps across batches, by its metric names."""

    def __init__(self, d_sae: int, device: torch.device) -> None:
        self.means: dict[str, _Mean] = {}
        self.sum_of_squares: list[float] = []  # per batch: mean over tokens of |x|^2
        self.act_per_dimension: list[torch.Tensor] = []  # per batch: mean over tokens of x^2, [d]
        self.resid_squared: list[float] = []  # per batch: mean over tokens of |x - x_hat|^2
        self.feature_acts = torch.zeros(d_sae, dtype=torch.float64, device=device)
        self.feature_prompts = torch.zeros(d_sae, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, name: str, values: torch.Tensor) -> None:
        self.means.setdefault(name, _Mean()).add(values)

    def mean(self, name: str) -> float:
        return self.means[name].value()


def core_metrics(
    model: Any, sae: SparseAutoencoder, batches: Sequence[torch.Tensor], **options: Any
) -> CoreResult:
    """SAEBench's core metrics of ``sae`` spliced into ``model`` at ``hook_name`` over ``batches``:
    :func:`core_metrics_many` of one SAE (the same ``options``)."""
    return core_metrics_many(model, [sae], batches, **options)[0]


def core_metrics_many(
    model: Any,
    saes: Sequence[SparseAutoencoder],
    batches: Sequence[torch.Tensor],
    *,
    hook_name: str,
    input_hook: str | None = None,
    ignore_tokens: Iterable[int | None] = (),
    config: CoreConfig | None = None,
    should_cancel: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    stack: bool = True,
) -> list[CoreResult]:
    """SAEBench's core metrics of each of ``saes`` spliced into ``model`` at ``hook_name`` over
    ``batches`` (each ``[prompts, context]`` token ids), each result what it would be alone: the
    first ``n_eval_reconstruction_batches`` give the KL and CE metrics, the first
    ``n_eval_sparsity_variance_batches`` the rest, as in SAEBench.

    On the residual stream the SAEs share each batch's pass: up to the hook once, then the clean
    value, zeros and every SAE's reconstruction stacked through the rest, so the clean and ablated
    runs (which no SAE changes) are computed once for all of them. A transcoder names the hook
    point it reads, ``input_hook``: it is encoded from there, and its output, compared with (and
    spliced in place of) ``hook_name``'s value, is what is measured (three passes a batch: its
    point is off the residual stream). ``should_cancel()`` is asked before every batch;
    ``progress(done, total)`` after each. ``stack=False`` runs three passes a batch even where one
    stacked pass could do (each result's ``stacked`` says which ran).
    """
    config = config or CoreConfig()
    started = time.perf_counter()
    wanted = config.batches
    if len(batches) < wanted:
        raise EvaluationError(
            "NOT_ENOUGH_TOKENS",
            f"{wanted} batches are needed, {len(batches)} were given.",
            {"batches": len(batches), "needed": wanted},
        )
    reads = input_hook or hook_name
    sites = hook_sites(model, [reads] if reads == hook_name else [reads, hook_name])
    ignored = sorted({int(token) for token in ignore_tokens if token is not None})
    device = input_device(model)
    dtypes = [_at_least_float32(sae.W_enc.dtype) for sae in saes]
    totals = [_Accumulator(sae.shape.d_sae, sae.W_enc.device) for sae in saes]
    batch = _BatchJudge(
        model=model, saes=saes, dtypes=dtypes, totals=totals, config=config, sites=sites, reads=reads,
        hook_name=hook_name, stacked=stack and _residual(hook_name) and reads == hook_name,
    )  # fmt: skip
    with grad_free_mode(model)(), torch.no_grad():
        for number, tokens in enumerate(batches[:wanted]):
            if should_cancel is not None and should_cancel():
                raise EvaluationCancelled
            tokens = tokens.to(device)
            batch.judge(tokens, _kept(tokens, ignored), number=number)
            if progress is not None:
                progress(number + 1, wanted)
    results = []
    for sae, total in zip(saes, totals, strict=True):
        result = _finish(total, config, batches=min(len(batches), wanted))
        result.stacked = batch.stacked
        if config.compute_featurewise_weight_based_metrics:
            result.feature_metrics.update(weight_metrics(sae))
        if config.compute_featurewise_density_statistics or config.compute_featurewise_weight_based_metrics:
            result.metrics["misc_metrics"] = misc_metrics(result.feature_metrics)
        result.seconds = time.perf_counter() - started
        results.append(result)
    return results


@dataclass
class _BatchJudge:
    """What :func:`core_metrics_many` does with each batch: its runs (one stacked pass, or three
    passes where stacking cannot be), then each SAE's sparsity and variance terms."""

    model: Any
    saes: Sequence[SparseAutoencoder]
    dtypes: list[torch.dtype]
    totals: list[_Accumulator]
    config: CoreConfig
    sites: dict
    reads: str
    hook_name: str
    stacked: bool

    def judge(self, tokens: torch.Tensor, keep: torch.Tensor, *, number: int) -> None:
        config = self.config
        downstream = number < config.n_eval_reconstruction_batches and (
            config.compute_kl or config.compute_ce_loss
        )
        encoded = None
        if downstream and self.stacked:
            try:
                encoded = _shared_prefix_runs(
                    self.totals, config, self.model, self.sites[self.hook_name], self.saes, tokens, keep,
                    hook_name=self.hook_name, dtypes=self.dtypes,
                    splice_mask=keep if config.exclude_special_tokens_from_reconstruction else None,
                )  # fmt: skip
            except RuntimeError:  # a family whose later layers are sized to the batch: three passes
                self.stacked = False
        if encoded is None:
            encoded = self._three_passes(tokens, keep, downstream=downstream)
        if number < config.n_eval_sparsity_variance_batches:
            for total, (target, features, reconstruction) in zip(self.totals, encoded, strict=True):
                _measure(total, config, x=target, features=features, reconstruction=reconstruction, keep=keep)

    def _three_passes(
        self, tokens: torch.Tensor, keep: torch.Tensor, *, downstream: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The clean pass (capturing the hook points), the ablated one (no SAE changes it: once for
        all), and per SAE the spliced one."""
        captured, clean_logits = _clean_run(
            self.model, self.sites, tokens, self.reads, self.hook_name, full=downstream
        )
        ablated = self._edited_logits(tokens, keep, None) if downstream else None
        encoded = []
        for sae, dtype, total in zip(self.saes, self.dtypes, self.totals, strict=True):
            x = captured[self.reads].to(device=sae.W_enc.device, dtype=dtype)
            target = captured[self.hook_name].to(device=sae.W_enc.device, dtype=dtype)
            features = sae.encode(x)
            encoded.append((target, features, _output(sae, x, features)))
            if downstream:
                spliced = self._edited_logits(tokens, keep, encoded[-1][2])
                _losses([total], self.config, tokens, keep, clean_logits, ablated, [spliced])
        return encoded

    def _edited_logits(
        self, tokens: torch.Tensor, keep: torch.Tensor, reconstruction: torch.Tensor | None
    ) -> torch.Tensor:
        """The logits with ``reconstruction`` spliced in at the hook point (zeros there: None);
        SAEBench's ``get_recons_loss`` splices at every token unless told to keep the ignored ones."""
        keep_ignored = self.config.exclude_special_tokens_from_reconstruction

        def edit(name: str, value: torch.Tensor) -> torch.Tensor | None:
            if name != self.hook_name:
                return None
            if reconstruction is None:
                return torch.zeros_like(value)
            new = reconstruction.to(value.device, value.dtype)
            return torch.where(keep.to(value.device).unsqueeze(-1), new, value) if keep_ignored else new

        arguments = {"input_ids": tokens, **_forward_options(self.model)}
        return edited_logits(self.model, {self.hook_name: self.sites[self.hook_name]}, edit, arguments)


def _kept(tokens: torch.Tensor, ignored: list[int]) -> torch.Tensor:
    """[prompts, context]: True where the token is not one SAEBench ignores."""
    if not ignored:
        return torch.ones_like(tokens, dtype=torch.bool)
    return ~torch.isin(tokens, torch.tensor(ignored, device=tokens.device))


def _output(sae: SparseAutoencoder, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    reconstruction = sae.decode(features)
    skip = sae.skip_path(x)
    return reconstruction if skip is None else reconstruction + skip


def _clean_run(
    model: Any, sites: dict, tokens: torch.Tensor, reads: str, hook_name: str, *, full: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The values at the hook points and, when ``full``, the clean logits (otherwise the pass
    stops at the last hook point)."""
    captured: dict[str, torch.Tensor] = {}

    def capture(name: str, value: torch.Tensor) -> None:
        captured[name] = value.detach().clone()

    runtime = HookRuntime(model, sites, capture, purpose="evaluated")
    runtime.begin_pass(*tokens.shape, stop_when_complete=not full)
    with runtime.attached():
        output = runtime.run(model, input_ids=tokens, **_forward_options(model))
    missing = runtime.missing()
    if missing:
        raise EvaluationError("HOOK_NOT_REACHED", f"The forward pass never reached {', '.join(missing)}.")
    if reads == hook_name:
        captured.setdefault(hook_name, captured[reads])
    if not full:
        return captured, None
    logits = getattr(output, "logits", None)
    if logits is None:
        raise EvaluationError("NOT_A_CAUSAL_LM", "CE loss needs a language model that gives logits.")
    return captured, logits


def _forward_options(model: Any) -> dict[str, Any]:
    """No key-value cache: one pass, nothing to keep."""
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


def _measure(
    totals: _Accumulator, config: CoreConfig, *, x: torch.Tensor, features: torch.Tensor,
    reconstruction: torch.Tensor, keep: torch.Tensor,
) -> None:  # fmt: skip
    """One batch's sparsity, variance, shrinkage and density statistics (SAEBench's
    ``get_sparsity_and_variance_metrics``), on the kept tokens."""
    keep = keep.to(x.device)
    flat_keep = keep.flatten()
    x_in = x.flatten(0, 1)[flat_keep]
    acts = features.flatten(0, 1)[flat_keep]
    out = reconstruction.flatten(0, 1)[flat_keep]
    if config.compute_l2_norms:
        norm_in = x_in.norm(dim=-1)
        norm_out = out.norm(dim=-1)
        divisor = torch.where(norm_in.abs() < 0.0001, torch.ones_like(norm_in), norm_in)
        totals.add("l2_norm_in", norm_in)
        totals.add("l2_norm_out", norm_out)
        totals.add("l2_ratio", norm_out / divisor)
        bias = (out.norm(dim=-1) ** 2).mean() / (x_in * out).sum(dim=-1).mean()
        totals.add("relative_reconstruction_bias", bias.reshape(1))
    if config.compute_sparsity_metrics:
        totals.add("l0", (acts != 0).sum(dim=-1).float())
        totals.add("l1", acts.sum(dim=-1))
    if config.compute_variance_metrics:
        resid = (x_in - out).pow(2).sum(dim=-1)
        totals.add("mse", resid / flat_keep.sum())
        deviation = (x_in - x_in.mean(dim=0)).pow(2).sum(dim=-1)
        totals.add("explained_variance_legacy", 1 - resid / deviation)
        totals.sum_of_squares.append(float(x_in.pow(2).sum(dim=-1).mean(dim=0)))
        totals.act_per_dimension.append(x_in.pow(2).mean(dim=0))
        totals.resid_squared.append(float(resid.mean(dim=0)))
        cosine = (x_in / x_in.norm(dim=-1, keepdim=True) * (out / out.norm(dim=-1, keepdim=True))).sum(dim=-1)
        totals.add("cossim", cosine)
    if config.compute_featurewise_density_statistics:
        fired = ((features * keep.unsqueeze(-1)) > 0).double()
        totals.feature_acts += fired.sum(dim=1).sum(dim=0)
        totals.feature_prompts += (fired.sum(dim=1) > 0).sum(dim=0)
        totals.tokens += int(keep.sum())


def _residual(hook_name: str) -> bool:
    """Whether ``hook_name`` is on the residual stream between blocks (what a stacked batch can be
    handed to: the later blocks act on each row alone)."""
    return hook_name == "hook_embed" or hook_name.endswith((".hook_resid_post", ".hook_resid_pre"))


def _shared_prefix_runs(
    totals: list[_Accumulator], config: CoreConfig, model: Any, site: Any, saes: Sequence[SparseAutoencoder],
    tokens: torch.Tensor, keep: torch.Tensor, *, hook_name: str, dtypes: list[torch.dtype],
    splice_mask: torch.Tensor | None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """A batch's runs in one pass: up to ``hook_name`` once, then the clean value, zeros and each
    SAE's reconstruction stacked as batches through the rest of the model (a few prompts at a time,
    so that their logits stay under ``LOGITS_BYTES``). Adds the batch's CE and KL terms to each
    SAE's totals; returns each SAE's values at the hook, features and reconstructions."""
    vocabulary = int(model.get_output_embeddings().weight.shape[0])
    per_prompt = (2 + len(saes)) * tokens.shape[1] * vocabulary * 4
    step = max(1, min(tokens.shape[0], LOGITS_BYTES // per_prompt))
    parts: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
    for start in range(0, tokens.shape[0], step):
        rows = tokens[start : start + step]
        found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def stack(name: str, value: torch.Tensor, start=start, rows=rows, found=found) -> torch.Tensor:
            stacked = [value, torch.zeros_like(value)]
            mask = None if splice_mask is None else splice_mask[start : start + len(rows)].to(value.device)
            for sae, dtype in zip(saes, dtypes, strict=True):
                x = value.detach().to(device=sae.W_enc.device, dtype=dtype)
                features = sae.encode(x)
                reconstruction = _output(sae, x, features)
                found.append((x, features, reconstruction))
                spliced = reconstruction.to(value.device, value.dtype)
                stacked.append(spliced if mask is None else torch.where(mask.unsqueeze(-1), spliced, value))
            return torch.cat(stacked)

        runtime = HookRuntime(model, {hook_name: site}, stack, purpose="evaluated", widens=True)
        runtime.begin_pass(*rows.shape)
        with runtime.attached():
            output = runtime.run(model, input_ids=rows, **_forward_options(model))
        clean, ablated, *spliced = output.logits.split(len(rows))
        _losses(totals, config, rows, keep[start : start + len(rows)], clean, ablated, spliced)
        parts.append(found)
    return [
        tuple(torch.cat(column) for column in zip(*pieces, strict=True))
        for pieces in zip(*parts, strict=True)
    ]  # type: ignore[misc]


def _losses(
    totals: list[_Accumulator], config: CoreConfig, tokens: torch.Tensor, keep: torch.Tensor,
    clean_logits: torch.Tensor, ablated_logits: torch.Tensor, spliced_logits: list[torch.Tensor],
) -> None:  # fmt: skip
    """The CE losses of the clean, ablated and spliced runs and the KL divergences of the last two
    from the clean one, kept tokens only: the clean and ablated terms go to every SAE's totals, each
    spliced run's to its own. Log-probabilities are taken a prompt at a time, so beside the logits
    only a prompt's [context, vocabulary] floats are ever made."""
    for row in range(tokens.shape[0]):
        clean = torch.log_softmax(_widened(clean_logits[row]), dim=-1)
        prompt = _Prompt(config, tokens[row], keep[row], clean)
        ablation = prompt.terms(ablated_logits[row])
        for total, logits in zip(totals, spliced_logits, strict=True):
            for run, (losses, divergence) in (("ablation", ablation), ("sae", prompt.terms(logits[row]))):
                if losses is not None:
                    total.add(f"ce_loss_with_{run}", losses)
                if divergence is not None:
                    total.add(f"kl_div_with_{run}", divergence)
            if prompt.clean_losses is not None:
                total.add("ce_loss_without_sae", prompt.clean_losses)


class _Prompt:
    """One prompt's clean log-probabilities, and an edited run's CE and KL terms against them."""

    def __init__(self, config: CoreConfig, tokens: torch.Tensor, keep: torch.Tensor, clean: torch.Tensor):
        self.config, self.tokens, self.keep, self.clean = config, tokens, keep, clean
        self.probabilities = clean.exp() if config.compute_kl else None
        self.clean_losses = _token_losses(clean, tokens)[keep[:-1]] if config.compute_ce_loss else None

    def terms(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        log_probabilities = torch.log_softmax(_widened(logits), dim=-1)
        losses = None
        if self.config.compute_ce_loss:
            losses = _token_losses(log_probabilities, self.tokens)[self.keep[:-1]]
        divergence = None
        if self.probabilities is not None:
            divergence = (self.probabilities * (self.clean - log_probabilities)).sum(dim=-1)[self.keep]
        return losses, divergence


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _widened(values: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least (a float64 model keeps its precision)."""
    return values.to(_at_least_float32(values.dtype))


def _token_losses(log_probabilities: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[context - 1]: one prompt's next-token cross-entropies (TransformerLens' ``loss_per_token``)."""
    return -log_probabilities[:-1].gather(-1, tokens[1:].unsqueeze(-1)).squeeze(-1)


def _finish(totals: _Accumulator, config: CoreConfig, *, batches: int) -> CoreResult:
    mean = totals.mean
    metrics: dict[str, dict[str, float]] = {}
    if config.compute_kl:
        with_sae, with_ablation = mean("kl_div_with_sae"), mean("kl_div_with_ablation")
        metrics["model_behavior_preservation"] = {
            "kl_div_score": (with_ablation - with_sae) / with_ablation,
            "kl_div_with_ablation": with_ablation,
            "kl_div_with_sae": with_sae,
        }
    if config.compute_ce_loss:
        with_sae, with_ablation = mean("ce_loss_with_sae"), mean("ce_loss_with_ablation")
        without = mean("ce_loss_without_sae")
        metrics["model_performance_preservation"] = {
            "ce_loss_score": (with_ablation - with_sae) / (with_ablation - without),
            "ce_loss_with_ablation": with_ablation,
            "ce_loss_with_sae": with_sae,
            "ce_loss_without_sae": without,
        }
    if config.compute_variance_metrics:
        mean_squares = sum(totals.sum_of_squares) / len(totals.sum_of_squares)
        mean_act = float(torch.cat(totals.act_per_dimension).double().mean())
        residual = sum(totals.resid_squared) / len(totals.resid_squared)
        metrics["reconstruction_quality"] = {
            "explained_variance": 1 - residual / (mean_squares - mean_act**2),
            "explained_variance_legacy": mean("explained_variance_legacy"),
            "mse": mean("mse"),
            "cossim": mean("cossim"),
        }
    if config.compute_l2_norms:
        metrics["shrinkage"] = {
            name: mean(name)
            for name in ("l2_norm_in", "l2_norm_out", "l2_ratio", "relative_reconstruction_bias")
        }
    if config.compute_sparsity_metrics:
        metrics["sparsity"] = {"l0": mean("l0"), "l1": mean("l1")}
    tokens_per_batch = config.context_size * config.batch_size_prompts
    metrics["token_stats"] = {
        "total_tokens_eval_reconstruction": tokens_per_batch
        * min(batches, config.n_eval_reconstruction_batches),
        "total_tokens_eval_sparsity_variance": tokens_per_batch
        * min(batches, config.n_eval_sparsity_variance_batches),
    }
    features: dict[str, list[float]] = {}
    if config.compute_featurewise_density_statistics:
        features["feature_density"] = (totals.feature_acts / max(totals.tokens, 1)).tolist()
        features["consistent_activation_heuristic"] = (totals.feature_acts / totals.feature_prompts).tolist()
    return CoreResult(metrics=metrics, feature_metrics=features)


def weight_metrics(sae: SparseAutoencoder, chunk: int = 1024) -> dict[str, list[float]]:
    """Per feature: encoder bias and norm, the cosine of its encoder and decoder directions, and
    its largest cosine with any other feature's encoder and decoder (SAEBench's
    ``get_featurewise_weight_based_metrics``; a transcoder whose output width differs from its
    input's has no encoder-decoder cosine)."""
    dtype = _at_least_float32(sae.W_enc.dtype)
    with torch.no_grad():
        W_enc = sae.W_enc.to(dtype)
        W_dec = sae.W_dec.to(dtype).T  # [d_out, d_sae]
        encoders = W_enc / W_enc.norm(dim=0, keepdim=True)
        decoders = W_dec / W_dec.norm(dim=0, keepdim=True)
        metrics = {
            "encoder_bias": sae.b_enc.to(dtype).cpu().tolist(),
            "encoder_norm": W_enc.norm(dim=-2).cpu().tolist(),
            "max_encoder_cosine_sim": _max_cosine(W_enc, chunk).cpu().tolist(),
            "max_decoder_cosine_sim": _max_cosine(W_dec, chunk).cpu().tolist(),
        }
        if encoders.shape == decoders.shape:
            cosine = torch.nn.functional.cosine_similarity(decoders.T, encoders.T)
            metrics["encoder_decoder_cosine_sim"] = cosine.cpu().tolist()
    return metrics


def _max_cosine(directions: torch.Tensor, chunk: int) -> torch.Tensor:
    """[F]: each column's largest cosine with another column of ``directions`` [D, F], a chunk of
    columns at a time (never the whole F x F matrix)."""
    normalised = torch.nn.functional.normalize(directions, p=2, dim=0)
    count = normalised.shape[1]
    largest = torch.empty(count, dtype=normalised.dtype, device=normalised.device)
    for start in range(0, count, chunk):
        stop = min(start + chunk, count)
        similarities = normalised[:, start:stop].T @ normalised
        rows = torch.arange(stop - start, device=normalised.device)
        similarities[rows, rows + start] = -math.inf
        largest[start:stop] = similarities.max(dim=1).values
    return largest


def misc_metrics(feature_metrics: dict[str, list[float]]) -> dict[str, float]:
    """SAEBench's ``calculate_misc_metrics``: the average largest cosines, the fraction of live
    features, the fractions over 1 % and 10 % density and their share of all firing."""
    result: dict[str, float] = {}
    for name in ("encoder", "decoder"):
        values = feature_metrics.get(f"max_{name}_cosine_sim")
        if values is not None:
            result[f"average_max_{name}_cosine_sim"] = float(torch.tensor(values).mean())
    density = feature_metrics.get("feature_density")
    if density is None:
        return result
    densities = torch.tensor(density, dtype=torch.float32)
    total = densities.sum()
    result["frac_alive"] = float((densities > 0).float().mean())
    for percent, threshold in (("1", 0.01), ("10", 0.1)):
        over = densities > threshold
        result[f"freq_over_{percent}_percent"] = float(over.float().mean())
        result[f"normalized_freq_over_{percent}_percent"] = (
            float(densities[over].sum() / total) if total > 0 else 0.0
        )
    return result
