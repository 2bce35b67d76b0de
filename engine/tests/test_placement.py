"""Split placement (``--device auto``): parsing the worker's options, and a model spread over the
CPU and disk by a tight ``max_memory`` giving the same extraction, generation, capture and
steering as the same model loaded whole."""

from pathlib import Path

import pytest
import torch

from engine.extraction import extract
from engine.generation import SamplingParams, generate
from engine.interventions import Add
from engine.loading import LoadError, load_weights, release, warm_up
from engine.placement import (
    DISK,
    Placement,
    PlacementError,
    bytes_by_device,
    format_size,
    input_device,
    parse_device,
    parse_max_memory,
    parse_size,
)
from engine.testing.tiny_models import build_tiny_model

HOOKS = ["blocks.0.hook_resid_post", "blocks.1.mlp.hook_post", "blocks.1.hook_resid_post"]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0, logprobs=True, ignore_eos=True)


def test_sizes_and_budgets_parse():
    assert parse_size("20GiB") == 20 * 2**30
    assert parse_size("64GB") == 64 * 10**9
    assert parse_size("1.5 MiB") == int(1.5 * 2**20)
    assert parse_size("4096") == 4096
    assert parse_max_memory("cuda:0=20GiB, cpu=64GiB") == {"cuda:0": 20 * 2**30, "cpu": 64 * 2**30}
    assert parse_device(" CUDA:1 ") == "cuda:1"
    assert parse_device("auto") == "auto"
    assert format_size(20 * 2**30) == "20GiB"
    assert format_size(1000) == "1000B"


@pytest.mark.parametrize(
    "text",
    ["", "cuda:0", "gpu=1GiB", "cpu=", "cpu=-1GiB", "cpu=0", "cpu=1GiB,cpu=2GiB", "cpu=twelve"],
)
def test_bad_budgets_are_refused_with_a_code(text):
    with pytest.raises(PlacementError) as raised:
        parse_max_memory(text)
    assert raised.value.code == "INVALID_PLACEMENT"


def test_bad_devices_and_budgets_without_auto_are_refused():
    for device in ("gpu", "cuda", "cuda:x", "mps:0"):
        with pytest.raises(PlacementError):
            parse_device(device)
    with pytest.raises(PlacementError, match="auto only"):
        Placement(device="cpu", max_memory={"cpu": 2**30})


def test_placement_arguments_and_compute_device():
    placement = Placement(device="auto", max_memory={"cpu": 8 * 2**30, "cuda:1": 2**30}, offload_folder="/o")
    assert placement.compute_device == "cuda:1"
    assert placement.memory_devices() == ["cuda:1", "cpu"]
    arguments = placement.from_pretrained_arguments(free={"cpu": 4 * 2**30, "cuda:1": 2**31})
    # A budget above what is free now is lowered to it; accelerate names GPUs by index.
    assert arguments == {
        "device_map": "auto",
        "offload_folder": "/o",
        "max_memory": {"cpu": 4 * 2**30, 1: 2**30},
    }
    assert Placement(device="cuda:0").from_pretrained_arguments() == {"device_map": {"": "cuda:0"}}
    assert placement.describe() == "auto (cpu=8GiB, cuda:1=1GiB, rest on disk)"


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("placement") / "llama")


@pytest.fixture(scope="module")
def whole(llama_folder):
    weights = load_weights(llama_folder, model_type="llama", quantization="none", device="cpu")
    yield weights
    release(weights)


@pytest.fixture(scope="module")
def split(llama_folder, whole, tmp_path_factory):
    """The same model with a CPU budget of 90 % of its size: the embedding and the first block
    stay in memory, every later module is read from disk for each forward pass."""
    budget = int(0.9 * whole.memory_usage_bytes)
    placement = Placement(
        device="auto", max_memory={"cpu": budget}, offload_folder=str(tmp_path_factory.mktemp("offload"))
    )
    weights = load_weights(llama_folder, model_type="llama", quantization="none", device=placement)
    warm_up(weights)
    yield weights
    release(weights)


def test_a_tight_budget_splits_the_model_between_memory_and_disk(split, whole):
    placed = split.bytes_by_device
    assert placed["cpu"] > 0
    assert placed[DISK] > 0
    assert placed["cpu"] + placed[DISK] == sum(bytes_by_device(whole.model).values())
    # What the model holds in memory is its CPU part only, within the budget.
    assert split.memory_usage_bytes == placed["cpu"] <= int(0.9 * whole.memory_usage_bytes)
    assert split.device == "auto"
    assert str(input_device(split.model)) == "cpu"
    assert {parameter.device.type for parameter in split.model.parameters()} == {"cpu", "meta"}


def _tokenized(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 17, (count,), generator=generator).tolist()
    return [torch.randint(5, 900, (length,), generator=generator).tolist() for length in lengths]


def test_extraction_on_the_split_model_equals_the_whole_model(split, whole):
    tokenized = _tokenized(6)
    plan = [[0, 1, 2], [3, 4, 5]]
    expected = list(extract(whole.model, tokenized, plan, hooks=HOOKS))
    got = list(extract(split.model, tokenized, plan, hooks=HOOKS))
    for reference, batch in zip(expected, got, strict=True):
        assert torch.equal(batch.token_ids, reference.token_ids)
        for hook in HOOKS:
            expected_values = reference.activations[hook]
            torch.testing.assert_close(batch.activations[hook], expected_values, rtol=0, atol=1e-6)


def test_stopping_after_the_deepest_hook_leaves_offloaded_weights_on_disk(split):
    disk_modules = [name for name, device in split.model.hf_device_map.items() if device == DISK]
    assert disk_modules
    # blocks.1.mlp.hook_post stops the pass inside an offloaded block, between its modules.
    list(extract(split.model, _tokenized(2), [[0, 1]], hooks=["blocks.1.mlp.hook_post"]))
    offloaded = [
        parameter for name in disk_modules for parameter in split.model.get_submodule(name).parameters()
    ]
    assert offloaded
    assert {parameter.device.type for parameter in offloaded} == {"meta"}


def test_generation_with_capture_and_steering_on_the_split_model_equals_the_whole_model(split, whole):
    prompt = _tokenized(1, seed=3)[0]
    width = whole.model.config.hidden_size
    vector = torch.randn(width, generator=torch.Generator().manual_seed(1))
    steer = [[Add("blocks.1.hook_resid_post", vector=vector, coefficient=2.0)]]
    for interventions in (None, steer):
        (reference,) = generate(
            whole.model, whole.tokenizer, [prompt], [GREEDY], capture=HOOKS, interventions=interventions
        )
        (result,) = generate(
            split.model, split.tokenizer, [prompt], [GREEDY], capture=HOOKS, interventions=interventions
        )
        assert result.token_ids == reference.token_ids
        for event, expected in zip(result.logprobs, reference.logprobs, strict=True):
            assert event.logprob == pytest.approx(expected.logprob, abs=1e-5)
        for hook in HOOKS:
            expected_values = reference.activations[hook]
            torch.testing.assert_close(result.activations[hook], expected_values, rtol=0, atol=1e-5)
    # The steering changed something, so the equality above is not of two unsteered runs.
    (plain,) = generate(split.model, split.tokenizer, [prompt], [GREEDY], capture=HOOKS)
    assert not torch.equal(plain.activations[HOOKS[-1]], result.activations[HOOKS[-1]])


def test_a_quantized_model_is_not_split_without_a_gpu(llama_folder, tmp_path):
    placement = Placement(device="auto", max_memory={"cpu": 2**20}, offload_folder=str(tmp_path))
    with pytest.raises(LoadError) as raised:
        load_weights(llama_folder, model_type="llama", quantization="int8", device=placement)
    assert raised.value.code == "UNSUPPORTED_QUANTIZATION"
    assert "bf16" in raised.value.message


@pytest.fixture(scope="module")
def small_llama_folder(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("quantized-map") / "llama", size="small")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_split_quantized_model_gets_a_device_map_that_fills_the_gpu_budget_then_the_cpu(
    small_llama_folder, quantization
):
    """A split int8/int4 map is computed here (no GPU needed to compute it) with the quantized
    Linear weights at 1 or 0.5 bytes and the rest in the compute dtype: with 90 % of the load's
    estimate on the GPU, the embedding and the first decoder layers go there and the rest to the
    CPU (transformers' own "auto" put the whole model on the GPU); the whole estimate, all of it."""
    from transformers import AutoModelForCausalLM

    from engine.inspection import inspect_folder, memory_estimates
    from engine.loading import quantized_device_map

    folder = small_llama_folder
    estimate = memory_estimates(inspect_folder(folder), device="cuda:0")[quantization]

    def device_map(gpu_budget: int) -> dict:
        return dict(
            quantized_device_map(
                AutoModelForCausalLM, folder, quantization, {0: gpu_budget, "cpu": 2**30}, torch.bfloat16
            )
        )

    split = device_map(int(0.9 * estimate))
    assert split["model.embed_tokens"] == 0 and split["lm_head"] == "cpu", split
    on_gpu = [name for name, device in split.items() if name.startswith("model.layers.") and device == 0]
    assert on_gpu and on_gpu[0] == "model.layers.0", split
    assert device_map(estimate) == {"": 0}
