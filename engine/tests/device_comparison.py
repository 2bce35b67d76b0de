"""Comparing a model's run on one device with the same run on another (the GPU suite's yardsticks).

The GPU tests (engine/tests/test_gpu.py) check CUDA results against the CPU's; what they compare
with lives here, so that it is tested on the CPU in every run (test_device_comparison.py), not
only on the machines that have a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# The CUDA caching allocator hands out blocks in multiples of 512 bytes: every tensor costs up
# to 511 bytes more than its elements.
CUDA_ALLOCATION_GRANULARITY = 512

# What bitsandbytes keeps beside a quantized layer's parameters, where ``get_memory_footprint``
# (parameters and buffers only) does not see it, as a fraction of the footprint at most:
# * int8: one float32 scale per output row (``SCB``): 4 bytes per ``in_features`` bytes of
#   int8 weights, 1.6 % at a width of 256 (the "small" kit models); 3 % leaves room.
# * int4: one float32 absmax per block of 64 weights (32 bytes packed), 12.5 % of the packed
#   weights, and a 16-entry code table per layer; the unquantized bf16 embeddings, head and
#   norms make the whole footprint larger, so 13 % is a bound.
UNCOUNTED_STATISTICS: dict[str, float] = {"none": 0.0, "fp16": 0.0, "bf16": 0.0, "int8": 0.03, "int4": 0.13}
# Statistics tensors per quantized layer (int8: SCB; int4: absmax and the code table).
STATISTICS_PER_QUANTIZED_MODULE = 2


def relative_error(output: Any, reference: Any) -> float:
    """‖output - reference‖ / ‖reference‖ over the whole tensor (Frobenius norms), in float32."""
    output, reference = output.float(), reference.float()
    return float((output - reference).norm() / reference.norm().clamp_min(1e-12))


def min_cosine(output: Any, reference: Any) -> float:
    """The smallest cosine similarity between ``output`` and ``reference`` at any position
    (over the last dimension)."""
    import torch

    width = reference.shape[-1]
    flat_output = output.float().reshape(-1, width)
    flat_reference = reference.float().reshape(-1, width)
    return float(torch.nn.functional.cosine_similarity(flat_output, flat_reference, dim=-1).min())


def allocation_bounds(footprint: int, *, allocations: int, quantization: str) -> tuple[int, int]:
    """The range the growth of ``torch.cuda.memory_allocated()`` must lie in when a model whose
    ``get_memory_footprint()`` is ``footprint`` bytes is loaded as ``allocations`` tensors.

    At least the footprint: each parameter and buffer is really on the device (a part left on
    the CPU, or counted but never allocated, shows as less). At most the footprint plus what
    bitsandbytes keeps outside it (:data:`UNCOUNTED_STATISTICS`) plus the allocator's rounding of
    each tensor (:data:`CUDA_ALLOCATION_GRANULARITY`): a second copy of any large tensor (fp32
    weights kept after a conversion or a quantization) shows as more.
    """
    if quantization not in UNCOUNTED_STATISTICS:
        raise ValueError(f"Unknown quantization {quantization!r}")
    if footprint < 0 or allocations < 0:
        raise ValueError("footprint and allocations must be >= 0")
    high = footprint * (1 + UNCOUNTED_STATISTICS[quantization]) + CUDA_ALLOCATION_GRANULARITY * allocations
    return footprint, math.ceil(high)


def allocation_count(model: Any, *, quantized_modules: int = 0) -> int:
    """How many separate tensors a loaded model holds: its parameters and buffers, and the
    statistics of each of its ``quantized_modules`` bitsandbytes layers
    (``LoadedWeights.quantized_module_count``); the allocations :func:`allocation_bounds` rounds."""
    tensors = len(list(model.parameters())) + len(list(model.buffers()))
    return tensors + STATISTICS_PER_QUANTIZED_MODULE * quantized_modules


def decisive_steps(events: Sequence[Any], *, margin: float) -> int:
    """How many leading greedy steps were clear choices: the chosen token's logprob beat the
    runner-up's by at least ``margin``.

    ``events`` are a reference run's :class:`~engine.generation.TokenEvent` with
    ``top_logprobs`` of at least 2. Another device computes the same logits up to rounding; while
    that rounding is far below ``margin``, it picks the same token, so two greedy runs must agree
    on these steps. After the first near tie either token is right and the runs may part.
    """
    count = 0
    for event in events:
        top = event.top_logprobs
        if top is None or len(top) < 2:
            raise ValueError("decisive_steps needs events with top_logprobs >= 2")
        if top[0].logprob - top[1].logprob < margin:
            break
        count += 1
    return count
