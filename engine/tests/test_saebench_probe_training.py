"""SAEBench's probe trainer on our side: the draws it copies from torch's DataLoader and nn.Linear
(sae-bench itself is the reference for the probes in test_saebench.py)."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from engine.saebench.probe_training import _linear, _shuffled_batches


def test_probe_draws_are_a_dataloaders_and_a_linear_layers():
    """SAEBench shuffles with a DataLoader and builds its probes with nn.Linear, drawing from torch's
    global generator; ours draws the same numbers from a generator of its own."""
    rows = torch.arange(50).float().unsqueeze(1)
    torch.manual_seed(3)
    layer = torch.nn.Linear(7, 3)
    loader = DataLoader(TensorDataset(rows), batch_size=16, shuffle=True)
    theirs = [batch[0].squeeze(1).long().tolist() for _ in range(3) for batch in loader]
    generator = torch.Generator().manual_seed(3)
    ours = _linear(7, 3, generator)
    assert torch.equal(ours.weight, layer.weight) and torch.equal(ours.bias, layer.bias)
    assert [batch.tolist() for _ in range(3) for batch in _shuffled_batches(50, 16, generator)] == theirs
