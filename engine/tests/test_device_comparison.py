"""The GPU suite's parts that need no GPU, run everywhere: the yardsticks test_gpu.py compares
with (engine/tests/device_comparison.py), and bench/gpu.py's options and table."""

import argparse
import importlib
import json
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


@pytest.fixture
def table(bench):
    """bench/gpu_table.py, bench/gpu.py's table."""
    return importlib.import_module("gpu_table")


def test_options_default_to_the_first_gpu_and_quick_shrinks_every_size(bench, tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    options = bench.parse_options([])
    assert (options.device, options.model, options.quantization) == ("cuda:0", "gpt2-small", "none")
    assert options.sizes == bench.FULL and options.peers and options.output_dir is None
    assert options.tmpfs == Path("/dev/shm")
    assert bench.parse_options(["--model", "llama-1b"]).quantization == "bf16"

    python = tmp_path / "python"
    quick = bench.parse_options(
        ["--device", "cpu", "--quick", "--repeats", "2", "--no-peers", "--bench-python", str(python)]
    )
    assert (quick.device, quick.bench_python, quick.peers) == ("cpu", python, False)
    assert quick.sizes.repeats == 2 and quick.sizes.samples == bench.QUICK.samples
    sizes = (
        "samples",
        "max_length",
        "prompt_tokens",
        "new_tokens",
        "sae_tokens",
        "sae_batch_size",
        "bandwidth_bytes",
    )
    for name in sizes:
        assert getattr(quick.sizes, name) < getattr(bench.FULL, name), name


def test_the_cache_directory_and_the_output_folder_follow_the_environment(bench, tmp_path, monkeypatch):
    for name in ("ACTIVATION_CACHE_DIR", "MISTUDIO_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    options = bench.parse_options([])
    assert options.cache_dir == ROOT / "data" / "activations"  # where the worker writes caches
    assert options.output_dir == tmp_path / "out"
    monkeypatch.setenv("MISTUDIO_DATA_DIR", str(tmp_path / "data"))
    assert bench.parse_options([]).cache_dir == tmp_path / "data" / "activations"
    monkeypatch.setenv("ACTIVATION_CACHE_DIR", str(tmp_path / "caches"))
    assert bench.parse_options([]).cache_dir == tmp_path / "caches"
    chosen = bench.parse_options(["--cache-dir", str(tmp_path / "x"), "--output-dir", str(tmp_path / "y")])
    assert (chosen.cache_dir, chosen.output_dir) == (tmp_path / "x", tmp_path / "y")


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


def _costs(table, **changes):
    """100,000 tokens: forward 1 s, dropped 1.25 s, tmpfs 2 s, cache directory 4 s; a disk of
    1 GB/s at 20,000 bytes per token (50,000 tokens/s)."""
    values = {
        "tokens": 100_000,
        "forward": 1.0,
        "dropped": 1.25,
        "tmpfs": 2.0,
        "tmpfs_note": "/dev/shm",
        "cache_directory": 4.0,
        "cache_directory_path": "/data/activations",
        "bandwidth": 1e9,
        "bandwidth_bytes": 2**30,
        "bytes_per_token": 20_000.0,
    }
    return table.ExtractionCosts(**{**values, **changes})


def test_the_table_shows_where_extraction_time_goes_with_each_goal_judged(table):
    rows = table.table_rows(
        _costs(table),
        deepest=11,
        hooks=3,
        peers={"TransformerLens": "not installed", "nnsight": 5.0},
        decode=850.0,
        generate=1_000.0,
        sae=1_234_567.8,
        sae_shape="TopK 8 x 768, k 32",
    )
    assert table.markdown_table(rows).splitlines() == [
        "| measurement | seconds | tokens/s | x bare forward | against | ratio | goal |",
        "|---|---:|---:|---:|---|---:|---|",
        "| bare forward to block 11 | 1.000 | 100,000 | 1.00 | - | - | - |",
        "| extract(), batches dropped (forward + device-to-host copies) | 1.250 | 80,000 | 0.80 | - | - "
        "| - |",
        "| extraction, 3 hooks, cache on tmpfs (/dev/shm) | 2.000 | 50,000 | 0.50 | bare forward: 100,000 "
        "| 0.50 | ≥ 0.70: MISSED |",
        "| write + fsync of 1.00 GiB in the cache directory: 1.00 GB/s ÷ 20,000 B/token | 1.074 | 50,000 "
        "| 0.50 | - | - | - |",
        "| extraction, 3 hooks, cache directory (/data/activations) | 4.000 | 25,000 | 0.25 "
        "| min(bare forward, disk): 50,000 | 0.50 | ≥ 0.85: MISSED |",
        "| TransformerLens run_with_cache, to host memory | - | - | - | not installed | - | - |",
        "| nnsight trace + save, to host memory | 5.000 | 20,000 | 0.20 | - | - | - |",
        "| extraction, 3 hooks, cache directory, against the peers | - | 25,000 | - "
        "| better of TransformerLens not installed, nnsight 20,000 | 1.25 | ≥ 1.50: MISSED |",
        "| decode, greedy | - | 850 | - | model.generate: 1,000 | 0.85 | ≥ 0.90: MISSED |",
        "| SAE training, TopK 8 x 768, k 32 | - | 1,234,568 | - | - | - | - |",
    ]


def test_the_cache_directory_is_judged_against_the_slower_of_the_forward_and_the_disk(table):
    fast_disk = _costs(table, bandwidth=4e9, cache_directory=1.1)  # the disk allows 200,000 tokens/s
    assert fast_disk.disk_bound == 200_000 and fast_disk.bound == 100_000
    rows = table.table_rows(
        fast_disk, deepest=11, hooks=3, peers={}, decode=1.0, generate=1.0, sae=1.0, sae_shape="x"
    )
    on_disk = rows[4]
    assert on_disk.against == "min(bare forward, disk): 100,000"
    assert on_disk.ratio == pytest.approx(1 / 1.1)
    assert table.verdict(on_disk.ratio, on_disk.goal) == "≥ 0.85: met"


def test_rows_that_did_not_run_say_why_and_their_goals_are_not_applicable(table):
    rows = table.table_rows(
        _costs(table, tmpfs=None, tmpfs_note="skipped: no tmpfs mounted"),
        deepest=15,
        hooks=3,
        peers={"TransformerLens": "n/a (GPT-2 only here)", "nnsight": "not installed"},
        decode=None,
        generate=None,
        sae=None,
        sae_shape="batch 4096",
    )
    lines = table.markdown_table(rows).splitlines()
    assert (
        "| extraction, 3 hooks, cache on tmpfs | - | - | - | skipped: no tmpfs mounted | - | ≥ 0.70: n/a |"
        in lines
    )
    versus_peers = rows[7]
    assert versus_peers.ratio is None
    assert table.verdict(versus_peers.ratio, versus_peers.goal) == "≥ 1.50: n/a"
    assert "TransformerLens n/a (GPT-2 only here), nnsight not installed" in versus_peers.against
    assert lines[-2:] == [
        "| decode, greedy | - | - | - | failed | - | ≥ 0.90: n/a |",
        "| SAE training, batch 4096 | - | - | - | failed | - | - |",
    ]
    assert table.verdict(1.0, 1.0) == "≥ 1.00: met"


def test_the_table_and_its_numbers_are_written_to_the_output_folder(bench, tmp_path):
    bench.write_outputs(tmp_path / "out", "llama-1b", "| a |", {"costs": {"forward": 1.0}})
    assert (tmp_path / "out" / "bench-gpu-llama-1b.md").read_text() == "| a |\n"
    assert json.loads((tmp_path / "out" / "bench-gpu-llama-1b.json").read_text()) == {
        "costs": {"forward": 1.0}
    }


# --- bench/extraction_costs.py ----------------------------------------------------------------------


@pytest.fixture
def costs_module(bench):
    return importlib.import_module("extraction_costs")


def test_a_cache_takes_its_hooks_rows_in_its_dtype_and_the_token_table_twice(costs_module):
    widths = {"blocks.0.hook_resid_post": 768, "blocks.6.hook_resid_post": 768}
    # 1,536 bf16 values (2 bytes) and 3 int64 columns, per shard and again at finalize.
    assert costs_module.estimated_cache_bytes(10, widths, "bfloat16") == 10 * (1536 * 2 + 2 * 24)
    assert costs_module.estimated_cache_bytes(10, widths, "float32") == 10 * (1536 * 4 + 2 * 24)


def test_a_tmpfs_is_used_only_with_room_for_the_cache(costs_module, tmp_path):
    assert costs_module.tmpfs_folder(1, tmp_path) == (tmp_path, str(tmp_path))  # the chosen one first
    folder, why = costs_module.tmpfs_folder(2**60, tmp_path)
    assert folder is None and why.startswith("skipped: ")


def test_the_write_bandwidth_is_measured_on_a_file_it_removes(costs_module, tmp_path):
    bandwidth = costs_module.write_bandwidth(tmp_path, total=3 * 2**20 + 5, chunk=2**20)
    assert bandwidth > 0
    assert list(tmp_path.iterdir()) == []


def test_extraction_into_a_cache_stores_what_extract_gives_in_the_dtype_asked(costs_module, tmp_path):
    from safetensors.torch import load_file

    from engine.extraction import extract, plan_batches
    from engine.loading import load_weights, release
    from engine.testing.tiny_models import build_tiny_model

    folder = build_tiny_model("gpt2", tmp_path / "model", seed=0)
    weights = load_weights(folder, model_type="gpt2", quantization="none", device="cpu")
    try:
        tokenized = [list(range(5, 5 + length)) for length in (7, 3, 12, 5, 9)] * 4
        hooks = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]

        manifest = costs_module.extract_into_cache(
            weights.model, tokenized, hooks, tmp_path / "cache", dtype="bfloat16"
        )

        assert manifest["dtype"] == "bfloat16" and manifest["num_tokens"] == sum(map(len, tokenized))
        plan = plan_batches([len(ids) for ids in tokenized], costs_module.BATCH_SIZE)
        expected = list(extract(weights.model, tokenized, plan, hooks=hooks, dtype="bfloat16"))
        # Read with safetensors itself, shard by shard as the manifest lists them (engine is app-free).
        for entry in manifest["hooks"]:
            hook = entry["name"]
            stored = torch.cat(
                [
                    load_file(tmp_path / "cache" / relative)["activations"]
                    for shard in manifest["shards"]
                    for relative in shard["files"]
                    if relative.startswith(entry["directory"] + "/")
                ]
            )
            assert stored.dtype == torch.bfloat16 and torch.equal(
                stored.float(), torch.cat([batch.activations[hook] for batch in expected]).float()
            )

        (tmp_path / "timed").mkdir()
        seconds, size = costs_module.time_cache(
            weights.model, tokenized, hooks, tmp_path / "timed", dtype="float32", repeats=1
        )
        assert seconds > 0 and size > manifest["num_tokens"] * 2 * 64 * 4  # two float32 hooks of width 64
        assert list((tmp_path / "timed").iterdir()) == []  # each timed cache removed
    finally:
        release(weights)


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
