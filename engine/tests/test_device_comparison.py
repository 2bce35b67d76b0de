"""The GPU suite's parts that need no GPU, run everywhere: the yardsticks test_gpu.py compares
with (engine/tests/device_comparison.py), and bench/gpu.py's options and table."""

import argparse
import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.generation import TokenEvent, TopLogprob
from engine.tests.device_comparison import (
    CUDA_ALLOCATION_GRANULARITY,
    allocation_bounds,
    allocation_count,
    decisive_steps,
    min_cosine,
    relative_error,
)

ROOT = Path(__file__).resolve().parents[2]


# --- the yardsticks -----------------------------------------------------------------------------


def test_relative_error_and_min_cosine_by_hand():
    reference = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    output = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    # ‖(0, 0, -1, 1)‖ / ‖(3, 4, 1, 0)‖ = sqrt(2) / sqrt(26)
    assert relative_error(output, reference) == pytest.approx(2**0.5 / 26**0.5)
    assert relative_error(reference.to(torch.bfloat16), reference) == 0.0
    assert min_cosine(output, reference) == pytest.approx(0.0, abs=1e-7)  # the second row turned 90°
    assert min_cosine(2 * reference, reference) == pytest.approx(1.0)


def test_allocation_bounds_allow_rounding_and_bitsandbytes_statistics_only():
    footprint, allocations = 4_000_000, 50
    rounding = CUDA_ALLOCATION_GRANULARITY * allocations
    assert allocation_bounds(footprint, allocations=allocations, quantization="fp16") == (
        footprint,
        footprint + rounding,
    )
    low, high = allocation_bounds(footprint, allocations=allocations, quantization="int4")
    assert low == footprint
    # int4's absmax (4 bytes per 32 bytes of packed weights) fits; a second, fp16 copy does not.
    assert footprint * 1.125 < high < footprint * 1.2
    low, high = allocation_bounds(footprint, allocations=allocations, quantization="int8")
    assert footprint * 1.016 < high < footprint * 1.05
    with pytest.raises(ValueError, match="Unknown quantization"):
        allocation_bounds(footprint, allocations=allocations, quantization="int2")


def test_allocation_count_counts_parameters_buffers_and_quantization_statistics():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2, bias=False)
    )
    model.register_buffer("positions", torch.arange(4))
    model[2].weight = model[0].weight  # a tied weight is one tensor
    # 2 (the first Linear) + 2 (the LayerNorm) + 0 (the tied weight, already counted) + 1 (the buffer)
    assert allocation_count(model) == 5
    # Each bitsandbytes layer keeps 2 statistics tensors beside its parameters.
    assert allocation_count(model, quantized_modules=3) == 5 + 2 * 3


def _event(index: int, chosen: float, runner_up: float) -> TokenEvent:
    top = [
        TopLogprob(token_id=1, token="a", logprob=chosen),
        TopLogprob(token_id=2, token="b", logprob=runner_up),
    ]
    return TokenEvent(row=0, index=index, token_id=1, text="a", logprob=chosen, top_logprobs=top)


def test_decisive_steps_stop_at_the_first_near_tie():
    events = [_event(0, -0.1, -2.0), _event(1, -0.5, -0.6), _event(2, -1.0, -1.0005), _event(3, -0.1, -3.0)]
    assert decisive_steps(events, margin=1e-3) == 2
    assert decisive_steps(events, margin=0.2) == 1
    assert decisive_steps(events[3:], margin=1e-3) == 1
    assert decisive_steps([], margin=1e-3) == 0
    without = TokenEvent(row=0, index=0, token_id=1, text="a", logprob=-0.1, top_logprobs=None)
    with pytest.raises(ValueError, match="top_logprobs"):
        decisive_steps([without], margin=1e-3)


# --- bench/gpu.py ---------------------------------------------------------------------------------


@pytest.fixture
def bench(monkeypatch):
    """bench/gpu.py as a module (it imports its neighbours in bench/ by name, as a script does)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("gpu")


def test_options_default_to_the_first_gpu_and_quick_shrinks_every_size(bench, tmp_path):
    options = bench.parse_options([])
    assert (options.device, options.model, options.quantization) == ("cuda:0", "gpt2-small", "none")
    assert options.sizes == bench.FULL and options.peers
    assert bench.parse_options(["--model", "llama-1b"]).quantization == "bf16"

    python = tmp_path / "python"
    quick = bench.parse_options(
        ["--device", "cpu", "--quick", "--repeats", "2", "--no-peers", "--bench-python", str(python)]
    )
    assert (quick.device, quick.bench_python, quick.peers) == ("cpu", python, False)
    assert quick.sizes.repeats == 2 and quick.sizes.samples == bench.QUICK.samples
    for name in ("samples", "max_length", "prompt_tokens", "new_tokens", "sae_tokens", "sae_batch_size"):
        assert getattr(quick.sizes, name) < getattr(bench.FULL, name), name


def test_device_names(bench):
    assert [bench.device_name(text) for text in ("cpu", "cuda", "cuda:1", "cuda:01")] == [
        "cpu",
        "cuda:0",
        "cuda:1",
        "cuda:1",
    ]
    for bad in ("gpu", "cuda:", "cuda:x", "mps", "cuda:-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.device_name(bad)
    with pytest.raises(SystemExit):
        bench.parse_options(["--device", "gpu"])
    with pytest.raises(SystemExit):
        bench.parse_options(["--samples", "0"])


def test_hook_layers_are_the_first_middle_and_last_block(bench):
    assert bench.hook_layers(12) == [0, 6, 11]  # as bench/extraction.py's default
    assert bench.hook_layers(16) == [0, 8, 15]
    assert bench.hook_layers(2) == [0, 1]


def test_the_table_reads_as_markdown_with_each_goal_judged(bench):
    rows = bench.table_rows(
        deepest=11,
        hooks=3,
        limit=100_000.0,
        extraction=90_000.0,
        peers={"TransformerLens": "not installed", "nnsight": 50_000.0},
        decode=850.0,
        generate=1_000.0,
        sae=1_234_567.8,
        sae_shape="TopK 8 x 768, k 32",
    )
    assert bench.markdown_table(rows).splitlines() == [
        "| measurement | tokens/s | against | ratio | goal |",
        "|---|---:|---|---:|---|",
        "| extraction, 3 hooks to disk | 90,000 | bare forward to block 11: 100,000 | 0.90 | ≥ 0.85: met |",
        "| extraction, 3 hooks to disk | 90,000 | better of TransformerLens not installed, nnsight 50,000 "
        "| 1.80 | ≥ 2.00: MISSED |",
        "| decode, greedy | 850 | model.generate: 1,000 | 0.85 | ≥ 0.90: MISSED |",
        "| SAE training, TopK 8 x 768, k 32 | 1,234,568 | - | - | - |",
    ]


def test_without_any_peer_the_peer_goal_is_not_applicable(bench):
    rows = bench.table_rows(
        deepest=15,
        hooks=3,
        limit=10.0,
        extraction=9.0,
        peers={"TransformerLens": "n/a (GPT-2 only here)", "nnsight": "not installed"},
        decode=1.0,
        generate=1.0,
        sae=1.0,
        sae_shape="x",
    )
    versus_peers = rows[1]
    assert versus_peers.ratio is None
    assert bench.verdict(versus_peers.ratio, versus_peers.goal) == "≥ 2.00: n/a"
    assert "TransformerLens n/a (GPT-2 only here), nnsight not installed" in versus_peers.against
    assert bench.verdict(1.0, 1.0) == "≥ 1.00: met"


def test_a_peer_is_importable_only_where_its_interpreter_finds_it(bench, tmp_path):
    import sys

    assert bench.importable(Path(sys.executable), "json")
    assert not bench.importable(Path(sys.executable), "no_such_module_here")
    assert not bench.importable(tmp_path / "missing-python", "json")


def test_the_decode_streamer_notes_every_token_after_the_prompt(bench):
    streamer = bench.TokenTimes()
    for value in range(4):  # the prompt, then three tokens
        streamer.put(SimpleNamespace(value=value))
    streamer.end()
    assert len(streamer.times) == 3 and streamer.times == sorted(streamer.times)
