"""SAEBench's sparse probing (``sae_bench.evals.sparse_probing`` 0.6.0) on a labelled dataset.

For each class, one against the rest: the texts' activations at the SAE's hook point are averaged
over their tokens (pad, EOS and BOS tokens left out, as SAEBench masks them), and so are the SAE's
features of each token; the ``k`` dimensions whose class means differ most are kept, and an L2
logistic regression (scikit-learn's, ``max_iter=1000``) is trained on them, then scored on the
held-out texts. Done for the model's activations and for the SAE's features, for each ``k``:
``llm_top_{k}_test_accuracy`` against ``sae_top_{k}_test_accuracy``, averaged over the classes.

The positive texts of a class are all its texts; its negatives are an equal number drawn from the
other classes (``ceil(n / classes)`` from each, then ``n`` of those), and the whole set is
shuffled: the same draws as SAEBench's ``prepare_probe_data``, from a generator seeded once per
(activations, k), so the same data and seed give the same splits and the same accuracies.

SAEBench also trains a probe on every dimension with its own torch trainer; that one is not part of
this (its numbers are not compared). Importing this module imports torch and scikit-learn.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.hooks import hook_sites
from engine.runtime import HookRuntime, grad_free_mode
from engine.sae.evaluation import EvaluationCancelled, EvaluationError
from engine.sae.model import SparseAutoencoder

__all__ = [
    "ProbingSplit",
    "meaned_activations",
    "probe_accuracies",
    "sparse_probing",
    "split_by_class",
]

POSITIVE, NEGATIVE = 1, 0


@dataclass(frozen=True)
class ProbingSplit:
    """Texts by class, for training and for testing the probes."""

    train: dict[str, list[str]]
    test: dict[str, list[str]]


def split_by_class(
    pairs: Sequence[tuple[str, str]], *, train_fraction: float, max_per_class: int, seed: int
) -> ProbingSplit:
    """Each class's texts shuffled with ``seed``, at most ``max_per_class`` of them, the first
    ``train_fraction`` for training and the rest for testing. Classes with fewer than two texts
    on either side are left out; :class:`EvaluationError` unless two classes remain."""
    by_class: dict[str, list[str]] = {}
    for text, label in pairs:
        by_class.setdefault(label, []).append(text)
    shuffler = random.Random(seed)  # noqa: S311  (a reproducible split, not a secret)
    train: dict[str, list[str]] = {}
    test: dict[str, list[str]] = {}
    for label in sorted(by_class):
        texts = list(by_class[label])
        shuffler.shuffle(texts)
        texts = texts[:max_per_class]
        cut = round(len(texts) * train_fraction)
        if cut >= 2 and len(texts) - cut >= 2:
            train[label], test[label] = texts[:cut], texts[cut:]
    if len(train) < 2:
        raise EvaluationError(
            "NOT_ENOUGH_CLASSES",
            "Sparse probing needs two classes with at least two texts each for training and for testing.",
            {"classes": {label: len(texts) for label, texts in by_class.items()}},
        )
    return ProbingSplit(train=train, test=test)


def padded_tokens(tokenizer: Any, texts: Sequence[str], context_length: int) -> torch.Tensor:
    """[texts, context_length]: each text's ids (special tokens as the tokenizer adds them), cut to
    ``context_length`` and padded on the right with the pad id (the EOS id for a tokenizer without
    one), as SAEBench's ``tokenize_data_dictionary`` pads."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = torch.full((len(texts), context_length), pad if pad is not None else 0, dtype=torch.long)
    for index, text in enumerate(texts):
        ids = tokenizer(text, truncation=True, max_length=context_length)["input_ids"]
        rows[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return rows


def value_at_hook(model: Any, sites: dict, batch: torch.Tensor, hook_name: str) -> torch.Tensor:
    """The value at ``hook_name`` (one of ``sites``) when the model reads ``batch``, the forward
    pass stopped there."""
    captured: dict[str, torch.Tensor] = {}

    def capture(name: str, value: torch.Tensor) -> None:
        captured[name] = value

    runtime = HookRuntime(model, sites, capture, purpose="probed")
    runtime.begin_pass(*batch.shape, stop_when_complete=True)
    with runtime.attached():
        runtime.run(model, input_ids=batch)
    return captured[hook_name]


def meaned_activations(
    model: Any,
    tokens: torch.Tensor,
    *,
    hook_name: str,
    ignored: set[int],
    saes: Sequence[SparseAutoencoder] = (),
    batch_size: int = 8,
    should_cancel: Callable[[], bool] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each row's mean activation at ``hook_name`` over its kept tokens ([rows, d]), and each of
    ``saes``' mean features ([rows, d_sae]) from the same pass, SAEBench's
    ``create_meaned_model_activations`` and ``get_sae_meaned_activations``: ignored tokens are
    zeroed, and a token counts where its activation does not sum to zero."""
    sites = hook_sites(model, [hook_name])
    device = next(model.parameters()).device
    means: list[torch.Tensor] = []
    feature_means: list[list[torch.Tensor]] = [[] for _ in saes]
    with grad_free_mode(model)(), torch.no_grad():
        for start in range(0, tokens.shape[0], batch_size):
            if should_cancel is not None and should_cancel():
                raise EvaluationCancelled
            batch = tokens[start : start + batch_size].to(device)
            kept = ~torch.isin(batch, torch.tensor(sorted(ignored), device=device, dtype=torch.long))
            acts = value_at_hook(model, sites, batch, hook_name).float() * kept.unsqueeze(-1)
            counted = (acts.sum(dim=-1) != 0).to(acts.dtype)
            counts = counted.sum(dim=-1, keepdim=True)
            means.append((acts.sum(dim=1) / counts).cpu())
            for sae, kept_means in zip(saes, feature_means, strict=True):
                on_sae = sae.W_enc.device
                features = sae.encode(acts.to(on_sae, sae.W_enc.dtype)) * counted.unsqueeze(-1).to(on_sae)
                kept_means.append((features.sum(dim=1) / counts.to(on_sae)).float().cpu())
    return torch.cat(means), [torch.cat(kept_means) for kept_means in feature_means]


def _balanced(
    activations: dict[str, torch.Tensor], label: str, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``label``'s rows and as many drawn from the others, shuffled, with 1/0 labels
    (SAEBench's ``prepare_probe_data``, its draws from ``generator``)."""
    positive = activations[label]
    count = len(positive)
    others = [name for name in activations if name != label]
    per_class = math.ceil(count / len(others))
    drawn = [
        activations[name][torch.randperm(len(activations[name]), generator=generator)[:per_class]]
        for name in others
    ]
    negative = torch.cat(drawn)
    negative = negative[torch.randperm(len(negative), generator=generator)[:count]]
    rows = torch.cat([positive, negative])
    labels = torch.empty(len(rows), dtype=torch.int)
    labels[:count], labels[count:] = POSITIVE, NEGATIVE
    order = torch.randperm(len(rows), generator=generator)
    return rows[order], labels[order]


def _top_k_columns(rows: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` columns whose class means differ most (SAEBench's ``get_top_k_mean_diff_mask``),
    in column order."""
    difference = (rows[labels == POSITIVE].mean(dim=0) - rows[labels == NEGATIVE].mean(dim=0)).abs()
    keep = torch.zeros(rows.shape[1], dtype=torch.bool)
    keep[torch.argsort(difference, descending=True)[:k]] = True
    return keep


def probe_accuracies(
    train: dict[str, torch.Tensor], test: dict[str, torch.Tensor], *, k: int, seed: int
) -> dict[str, float]:
    """Each class's test accuracy of a logistic probe on the ``k`` most different columns of
    ``train``'s rows (one class against the rest), all draws from one generator seeded ``seed``."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score

    generator = torch.Generator().manual_seed(seed)
    accuracies = {}
    for label in train:
        train_rows, train_labels = _balanced(train, label, generator)
        test_rows, test_labels = _balanced(test, label, generator)
        columns = _top_k_columns(train_rows, train_labels, k)
        probe = LogisticRegression(C=1.0, max_iter=1000)  # L2, as SAEBench asks
        probe.fit(train_rows[:, columns].float().numpy(), train_labels.numpy())
        predicted = probe.predict(test_rows[:, columns].float().numpy())
        accuracies[label] = float(accuracy_score(test_labels.numpy(), predicted))
    return accuracies


def sparse_probing(
    model: Any,
    tokenizer: Any,
    saes: Sequence[SparseAutoencoder],
    split: ProbingSplit,
    *,
    hook_name: str,
    k_values: Sequence[int],
    context_length: int,
    seed: int,
    batch_size: int = 8,
    should_cancel: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """SAEBench's sparse probing of each of ``saes`` (all reading ``hook_name``) on ``split``, one
    result per SAE: ``metrics`` in SAEBench's categories (``llm`` and ``sae``, each
    ``*_top_{k}_test_accuracy`` averaged over the classes) and ``per_class`` (each class's
    accuracies). The model runs once for all of them, and its own probes (``llm``, which do not
    depend on the SAE) are trained once; each SAE's result is the one it gets alone."""
    ignored = {token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id)}
    ignored.discard(None)
    model_means: dict[str, dict[str, torch.Tensor]] = {"train": {}, "test": {}}
    feature_means: list[dict[str, dict[str, torch.Tensor]]] = [{"train": {}, "test": {}} for _ in saes]
    parts = [(side, label) for side in ("train", "test") for label in getattr(split, side)]
    for done, (side, label) in enumerate(parts):
        tokens = padded_tokens(tokenizer, getattr(split, side)[label], context_length)
        model_means[side][label], per_sae = meaned_activations(
            model, tokens, hook_name=hook_name, ignored=ignored, saes=saes, batch_size=batch_size,
            should_cancel=should_cancel,
        )  # fmt: skip
        for means, sae_means in zip(feature_means, per_sae, strict=True):
            means[side][label] = sae_means
        if progress is not None:
            progress(done + 1, len(parts))
    llm_metrics, llm_per_class = _probed("llm", model_means, k_values=k_values, seed=seed)
    results = []
    for means in feature_means:
        sae_metrics, sae_per_class = _probed("sae", means, k_values=k_values, seed=seed)
        per_class = {label: {**llm_per_class[label], **sae_per_class[label]} for label in split.train}
        results.append({"metrics": {"llm": llm_metrics, "sae": sae_metrics}, "per_class": per_class})
    return results


def _probed(
    source: str, means: dict[str, dict[str, torch.Tensor]], *, k_values: Sequence[int], seed: int
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """``{source}_top_{k}_test_accuracy`` averaged over the classes, and per class, for each ``k``."""
    metrics: dict[str, float] = {}
    per_class: dict[str, dict[str, float]] = {label: {} for label in means["train"]}
    for k in k_values:
        accuracies = probe_accuracies(means["train"], means["test"], k=k, seed=seed)
        name = f"{source}_top_{k}_test_accuracy"
        metrics[name] = sum(accuracies.values()) / len(accuracies)
        for label, accuracy in accuracies.items():
            per_class[label][name] = accuracy
    return metrics, per_class
