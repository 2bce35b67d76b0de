"""SAEBench's torch probe trainer (``sae_bench.evals.absorption.probing.train_multi_probe`` 0.6.0),
with its randomness drawn from a ``torch.Generator`` of its own: the same numbers SAEBench draws
from torch's global generator (a ``DataLoader``'s shuffles, ``nn.Linear``'s initialisation), so the
same seed trains the same probe, and a worker's other work cannot move it. Imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["train_multi_probe"]


def _shuffled_batches(count: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """One epoch's batches as a ``DataLoader(shuffle=True)`` without a generator of its own draws
    them from the global one: a base seed for its workers, then the sampler's seed."""
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return list(order.split(batch_size))


def _linear(inputs: int, outputs: int, generator: torch.Generator) -> torch.nn.Linear:
    """``nn.Linear(inputs, outputs)`` initialised from ``generator`` as from the global one."""
    probe = torch.nn.Linear(inputs, outputs)
    with torch.no_grad():
        torch.nn.init.kaiming_uniform_(probe.weight, a=math.sqrt(5), generator=generator)
        bound = 1 / math.sqrt(inputs) if inputs > 0 else 0
        probe.bias.uniform_(-bound, bound, generator=generator)
    return probe


def train_multi_probe(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    generator: torch.Generator,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    end_lr: float = 1e-5,
    l1_decay: float = 0.0,
    map_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    probe_dim: int | None = None,
) -> torch.nn.Linear:
    """SAEBench's ``train_multi_probe``: one logistic probe per column of ``y`` (0/1), Adam with
    ``weight_decay``, BCE with each column's negatives/positives as its positive weight, the rate
    decaying exponentially from ``lr`` to ``end_lr`` over the epochs, plus ``l1_decay`` times the
    mean over probes of their weights' L1 norms; ``map_rows`` (an SAE's encoder) applied to each
    batch's rows. All randomness from ``generator``."""
    y = y.to(x.dtype)
    probe = _linear(probe_dim or x.shape[-1], y.shape[-1], generator).to(x.device, dtype=x.dtype)
    positives = y.sum(dim=0)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=(len(y) - positives) / positives)
    optimizer = torch.optim.Adam(probe.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(
        optimizer, gamma=math.exp(math.log(end_lr / lr) / epochs)
    )
    probe.train()
    for _ in range(epochs):
        for rows in _shuffled_batches(len(x), batch_size, generator):
            batch = x[rows] if map_rows is None else map_rows(x[rows])
            optimizer.zero_grad()
            loss = loss_fn(probe(batch), y[rows])
            if l1_decay:
                loss = loss + l1_decay * probe.weight.abs().sum(dim=-1).mean()
            loss.backward()
            optimizer.step()
        scheduler.step()
    return probe.eval()
