"""The engine on a CUDA device, against the same runs on the CPU (``pytest -m gpu``, scripts/gpu-check).

Every test here is marked ``gpu`` and skips where ``torch.cuda.is_available()`` is false (CI and
the development machines have no GPU); the yardsticks they compare with are tested on the CPU in
test_device_comparison.py. What a broken CUDA path would fail:

* **Loading** fp16 / bf16 / int8 / int4 (and fp32) onto ``cuda:0``: every parameter there in the
  requested dtype, the reported ``memory_usage_bytes`` matching what the CUDA allocator really
  holds (:func:`~engine.tests.device_comparison.allocation_bounds`) and the pre-load estimate,
  ``release`` giving all of it back; the logits within each quantization's error of the CPU's
  float32 model.
* **Extraction**: every hook point of mixed-length batches equals the CPU's (right and left
  padding); a bf16 model within bf16's error.
* **Generation** with capture, with an ``add`` steering vector and with an SAE ``clamp_feature``:
  the greedy tokens equal the CPU's on every step that was not a near tie, logprobs and captured
  activations equal within float32 rounding; a batch (left padding, a seeded sampler and
  interventions per row) equal to each prompt alone on the device.
* **SAE training**: finite losses that fall, the first step equal to the CPU's on the same
  batch, the work really done on the device.
"""

import dataclasses
import gc

import pytest
import torch

from engine.extraction import extract, plan_batches, tokenize_samples
from engine.generation import SamplingParams, generate
from engine.hooks import list_hook_points
from engine.inspection import inspect_folder, memory_estimates
from engine.interventions import Add, ClampFeature, Intervention
from engine.loading import load_weights, release
from engine.placement import DISK, Placement
from engine.sae import TrainingConfig, shuffled_batches, train
from engine.testing.tiny_models import build_tiny_model, local_corpus
from engine.testing.tiny_saes import random_sae
from engine.tests.device_comparison import (
    allocation_bounds,
    allocation_count,
    decisive_steps,
    min_cosine,
    relative_error,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda:0"
FAMILIES = ("gpt2", "llama")
QUANTIZATIONS = ("none", "fp16", "bf16", "int8", "int4")
# Logits of each quantization on the GPU against the CPU's float32 model: (max relative error,
# min cosine). The quantized bounds are test_loading.py's CPU bounds (2-3x the worst error
# measured there on these models: the same weights and the same quantization formats, so the GPU
# kernels have the same error budget). float32 differs only by summation order (~1e-6).
LOGIT_TOLERANCES = {
    "none": (1e-4, 0.99999),
    "fp16": (0.005, 0.9999),
    "bf16": (0.02, 0.999),
    "int8": (0.05, 0.998),
    "int4": (0.30, 0.95),
}
PARAMETER_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# float32 on the GPU against float32 on the CPU: summation order only.
FLOAT32_ATOL = 1e-4
# memory_estimates (what the product shows before a load) against the real allocation.
ESTIMATE_TOLERANCE = 0.25
# A model's release must bring memory_allocated back to the baseline; this much may stay for
# caches a library keeps across models (a 16-entry NF4 code table is one 512-byte block). The
# smallest model released here holds about 4 MB, so a model left behind is far above it.
RELEASE_SLACK_BYTES = 64 * 1024
# Greedy agreement: a step is a clear choice when the CPU's top token beats the runner-up by this
# much (float32 logits on the two devices differ by ~1e-5); the tiny models' gaps are mostly
# 1e-2..0.5, so a prompt of 24 tokens gives well over MIN_DECISIVE_STEPS clear steps.
DECISIVE_MARGIN = 1e-3
MIN_DECISIVE_STEPS = 8
PROMPT = "The module provides functions for working with"
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, top_logprobs=2)
STEERED_LAYER = 1
CAPTURED = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post", "module:lm_head"]
# Truncation lengths (in characters) giving samples of clearly different token counts.
_CUTS = (260, 14, 120, 45, 3, 170, 70)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, str], object]:
    """(family, size) -> a model folder: "tiny" for numerics (the CPU tests' models, whose
    tolerances are measured), "small" (4M parameters) for memory, where the allocator's rounding
    of each tensor is small against the footprint."""
    root = tmp_path_factory.mktemp("gpu-models")
    return {
        (family, size): build_tiny_model(family, root / f"{family}-{size}", size=size, seed=0)
        for family in FAMILIES
        for size in ("tiny", "small")
    }


@pytest.fixture(scope="module")
def cpu_models(folders):
    """The float32 CPU model of each family (tiny): the reference every test compares with."""
    loaded = {
        family: load_weights(folders[family, "tiny"], model_type=family, quantization="none", device="cpu")
        for family in FAMILIES
    }
    yield loaded
    for weights in loaded.values():
        release(weights)


@pytest.fixture(scope="module")
def cuda_models(folders):
    """``cuda_models(family, quantization="none")``: the tiny model loaded onto the GPU, once."""
    loaded = {}

    def load(family: str, quantization: str = "none"):
        if (family, quantization) not in loaded:
            loaded[family, quantization] = load_weights(
                folders[family, "tiny"], model_type=family, quantization=quantization, device=DEVICE
            )
        return loaded[family, quantization]

    yield load
    for weights in loaded.values():
        release(weights)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    paragraphs = [paragraph for paragraph in local_corpus(20_000) if len(paragraph) > 300]
    return [paragraph[:cut] for paragraph, cut in zip(paragraphs, _CUTS, strict=False)]


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize(DEVICE)
    return torch.cuda.memory_allocated(DEVICE)


# --- loading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_load_reports_the_memory_it_allocates_and_release_returns_it(folders, family, quantization):
    """No forward pass here: cuBLAS keeps a workspace after its first matmul, which would stay
    allocated after the release and blur the baseline."""
    folder = folders[family, "small"]
    torch.empty(1, device=DEVICE)  # the CUDA context exists before the baseline
    baseline = _allocated()

    weights = load_weights(folder, model_type=family, quantization=quantization, device=DEVICE)
    growth = _allocated() - baseline

    footprint = weights.memory_usage_bytes
    assert {parameter.device for parameter in weights.model.parameters()} == {torch.device(DEVICE)}
    floating = {
        parameter.dtype for parameter in weights.model.parameters() if parameter.dtype.is_floating_point
    }
    if quantization in PARAMETER_DTYPES:
        assert floating == {PARAMETER_DTYPES[quantization]}
    else:
        # The unquantized parts in bf16 (fp16 on a GPU without bf16), the Linear weights packed.
        assert floating == {torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16}
        assert weights.quantized_module_count > 0
        packed = {torch.int8} if quantization == "int8" else {torch.uint8}
        assert packed <= {parameter.dtype for parameter in weights.model.parameters()}
    allocations = allocation_count(weights.model, quantized_modules=weights.quantized_module_count)
    low, high = allocation_bounds(footprint, allocations=allocations, quantization=quantization)
    assert low <= growth <= high, f"{family} {quantization}: allocated {growth:,} B, reported {footprint:,} B"
    estimate = memory_estimates(inspect_folder(folder))[quantization]
    assert abs(estimate - growth) <= ESTIMATE_TOLERANCE * growth, (estimate, growth)

    release(weights)

    assert weights.model is None
    left = _allocated() - baseline
    assert left <= RELEASE_SLACK_BYTES, f"{family} {quantization}: {left:,} B still allocated after release"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_logits_on_the_gpu_match_the_cpu_float32_model(cpu_models, cuda_models, family, quantization):
    input_ids = torch.randint(5, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = cpu_models[family].model(input_ids=input_ids).logits.float()
    weights = cuda_models(family, quantization)

    with torch.no_grad():
        logits = weights.model(input_ids=input_ids.to(DEVICE)).logits

    assert logits.device == torch.device(DEVICE)
    output = logits.float().cpu()
    max_relative, smallest_cosine = LOGIT_TOLERANCES[quantization]
    relative, cosine = relative_error(output, reference), min_cosine(output, reference)
    assert relative <= max_relative, f"{family} {quantization}: relative error {relative:.5f}"
    assert cosine >= smallest_cosine, f"{family} {quantization}: min cosine {cosine:.6f}"


# --- extraction ---------------------------------------------------------------------------------


def _extract_all(weights, tokenized, **options):
    names = [point.name for point in list_hook_points(weights.model)]
    plan = plan_batches([len(ids) for ids in tokenized], 3)
    return names, list(extract(weights.model, tokenized, plan, hooks=names, **options))


def _per_sample(batches, name) -> dict[int, torch.Tensor]:
    rows = {}
    for batch in batches:
        for sample in batch.sample_indices:
            rows[sample] = batch.activations[name][batch.sample_index == sample]
    return rows


@pytest.mark.parametrize("family", FAMILIES)
def test_extraction_on_the_gpu_equals_the_cpu(cpu_models, cuda_models, texts, family):
    cpu, gpu = cpu_models[family], cuda_models(family)
    tokenized = tokenize_samples(cpu.tokenizer, texts, 32)
    assert len({len(ids) for ids in tokenized}) > 3, "the samples must have mixed lengths"
    names, reference = _extract_all(cpu, tokenized)
    expected = {name: _per_sample(reference, name) for name in names}

    for padding_side in ("right", "left"):
        _, batches = _extract_all(gpu, tokenized, padding_side=padding_side)
        for got, want in zip(batches, reference, strict=True):
            assert got.sample_indices == want.sample_indices
            assert torch.equal(got.token_ids, want.token_ids)
            assert torch.equal(got.sample_index, want.sample_index)
            assert torch.equal(got.positions, want.positions)
            for name in names:
                assert got.activations[name].device.type == "cpu"
                assert got.activations[name].dtype == torch.float32
        for name in names:
            for sample, rows in _per_sample(batches, name).items():
                torch.testing.assert_close(
                    rows,
                    expected[name][sample],
                    atol=FLOAT32_ATOL,
                    rtol=FLOAT32_ATOL,
                    msg=f"{padding_side} {name}",
                )


@pytest.mark.parametrize("family", FAMILIES)
def test_extraction_of_a_bf16_model_on_the_gpu_is_within_bf16_error(cpu_models, cuda_models, texts, family):
    cpu, gpu = cpu_models[family], cuda_models(family, "bf16")
    tokenized = tokenize_samples(cpu.tokenizer, texts, 32)
    names, reference = _extract_all(cpu, tokenized)
    _, batches = _extract_all(gpu, tokenized, dtype="bfloat16")

    max_relative = LOGIT_TOLERANCES["bf16"][0]
    for name in names:
        got = torch.cat([batch.activations[name] for batch in batches])
        want = torch.cat([batch.activations[name] for batch in reference])
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        relative = relative_error(got, want)
        assert relative <= max_relative, f"{family} {name}: relative error {relative:.5f}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_split_between_the_gpu_the_cpu_and_disk_equals_the_cpu(
    cpu_models, folders, texts, tmp_path, family
):
    """``--device auto`` with budgets below the model (3/4 of it on the GPU, 3/20 on the CPU:
    accelerate also keeps room for the largest layer) puts the layers on cuda:0 and on the CPU
    or disk; hooks on all of them, and generation, give the CPU model's values."""
    cpu = cpu_models[family]
    size = cpu.memory_usage_bytes
    placement = Placement(
        device="auto", max_memory={DEVICE: 3 * size // 4, "cpu": 3 * size // 20}, offload_folder=str(tmp_path)
    )
    split = load_weights(folders[family, "tiny"], model_type=family, quantization="none", device=placement)
    try:
        places = set(split.bytes_by_device)
        assert DEVICE in places and places - {DEVICE}, split.model.hf_device_map
        assert split.memory_usage_bytes == sum(
            size for name, size in split.bytes_by_device.items() if name != DISK
        )
        tokenized = tokenize_samples(cpu.tokenizer, texts, 32)
        names, reference = _extract_all(cpu, tokenized)
        _, batches = _extract_all(split, tokenized)
        for got, want in zip(batches, reference, strict=True):
            for name in names:
                torch.testing.assert_close(
                    got.activations[name],
                    want.activations[name],
                    atol=FLOAT32_ATOL,
                    rtol=FLOAT32_ATOL,
                    msg=name,
                )
        ids = _prompt(cpu.tokenizer)
        (want,) = generate(cpu.model, cpu.tokenizer, [ids], [GREEDY], capture=CAPTURED)
        (got,) = generate(split.model, split.tokenizer, [ids], [GREEDY], capture=CAPTURED)
        _assert_same_run(got, want, len(ids))
    finally:
        release(split)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_model_split_between_the_gpu_and_the_cpu_loads_and_computes(folders, quantization):
    """int8/int4 with --device auto and a GPU budget below the model: the device map is the one
    engine.loading.quantized_device_map computes for the budgets (transformers' own "auto" put
    everything on the GPU); the modules on the GPU are quantized, those on the CPU stay
    unquantized in the compute dtype (bitsandbytes' CPU offload); logits within the
    quantization's error of the float32 model. The 4M-parameter model: the tiny one is too
    small for a budget that holds its embedding and the largest layer but not all of it."""
    from transformers import AutoModelForCausalLM

    from engine.loading import quantized_device_map, torch_dtype_for

    folder = folders["llama", "small"]
    budget = int(0.9 * memory_estimates(inspect_folder(folder), device=DEVICE)[quantization])
    gpu_index = int(DEVICE.split(":")[1])
    compute_dtype = torch_dtype_for(quantization, DEVICE)
    expected = quantized_device_map(
        AutoModelForCausalLM, folder, quantization, {gpu_index: budget, "cpu": 2**30}, compute_dtype
    )
    assert set(expected.values()) == {gpu_index, "cpu"}, expected
    reference_weights = load_weights(folder, model_type="llama", quantization="none", device="cpu")
    placement = Placement(device="auto", max_memory={DEVICE: budget, "cpu": 2**30})
    split = load_weights(folder, model_type="llama", quantization=quantization, device=placement)
    try:
        assert dict(split.model.hf_device_map) == dict(expected)
        assert split.bytes_by_device.get(DEVICE, 0) > 0 and split.bytes_by_device.get("cpu", 0) > 0
        import bitsandbytes

        quantized = [
            module
            for module in split.model.modules()
            if isinstance(module, (bitsandbytes.nn.Linear8bitLt, bitsandbytes.nn.Linear4bit))
        ]
        assert len(quantized) == split.quantized_module_count > 0
        assert {module.weight.device.type for module in quantized} == {"cuda"}
        offloaded = [name for name, device in expected.items() if device == "cpu"]
        for name, parameter in split.model.named_parameters():
            if any(name == prefix or name.startswith(prefix + ".") for prefix in offloaded):
                assert parameter.dtype == compute_dtype, (name, parameter.dtype)
        input_ids = torch.randint(5, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            reference = reference_weights.model(input_ids=input_ids).logits.float()
        with torch.no_grad():
            output = split.model(input_ids=input_ids.to(DEVICE)).logits.float().cpu()
        max_relative, smallest_cosine = LOGIT_TOLERANCES[quantization]
        assert relative_error(output, reference) <= max_relative
        assert min_cosine(output, reference) >= smallest_cosine
    finally:
        release(split)
        release(reference_weights)


# --- generation ---------------------------------------------------------------------------------


def _prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPT, add_special_tokens=True).input_ids


def _assert_same_run(got, want, prompt_length: int, *, min_clear: int = MIN_DECISIVE_STEPS) -> int:
    """Greedy run ``got`` agrees with the reference run ``want`` on every clear step of
    ``want`` (at least ``min_clear``, or the comparison would say little); returns how many
    tokens both share (their logprobs and any captured rows are compared up to there)."""
    clear = decisive_steps(want.logprobs, margin=DECISIVE_MARGIN)
    assert clear >= min_clear, f"only {clear} clear greedy steps"
    assert got.token_ids[:clear] == want.token_ids[:clear]
    shared = clear
    while (
        shared < min(len(got.token_ids), len(want.token_ids))
        and got.token_ids[shared] == want.token_ids[shared]
    ):
        shared += 1
    for mine, theirs in zip(got.logprobs[:shared], want.logprobs[:shared], strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=FLOAT32_ATOL)
    if want.activations is not None:
        rows = prompt_length + shared
        assert set(got.activations) == set(want.activations)
        for name, tensor in got.activations.items():
            assert tensor.device.type == "cpu"
            torch.testing.assert_close(
                tensor[:rows], want.activations[name][:rows], atol=FLOAT32_ATOL, rtol=FLOAT32_ATOL, msg=name
            )
    return shared


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_capture_on_the_gpu_equals_the_cpu(cpu_models, cuda_models, family):
    cpu, gpu = cpu_models[family], cuda_models(family)
    ids = _prompt(cpu.tokenizer)

    (want,) = generate(cpu.model, cpu.tokenizer, [ids], [GREEDY], capture=CAPTURED)
    (got,) = generate(gpu.model, gpu.tokenizer, [ids], [GREEDY], capture=CAPTURED)

    _assert_same_run(got, want, len(ids))
    assert got.activations["module:lm_head"].shape == (
        len(ids) + len(got.token_ids),
        gpu.model.config.vocab_size,
    )


def _random_vector(width: int, *, seed: int, scale: float = 4.0) -> torch.Tensor:
    return scale * torch.randn(width, generator=torch.Generator().manual_seed(seed))


def _steering(kind: str, width: int, device: str) -> Intervention:
    """A steering intervention whose tensors are on ``device`` as the apps put them: a vector
    stays on the CPU (the engine moves it), an SAE is moved to the model's device."""
    hook = f"blocks.{STEERED_LAYER}.hook_resid_post"
    if kind == "add":
        return Add(hook, vector=_random_vector(width, seed=0), coefficient=0.75)
    sae = random_sae(width).to(device)
    return ClampFeature(hook, sae=sae, features=(3,), value=25.0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["add", "clamp_feature"])
def test_steered_generation_on_the_gpu_equals_the_cpu(cpu_models, cuda_models, family, kind):
    cpu, gpu = cpu_models[family], cuda_models(family)
    ids = _prompt(cpu.tokenizer)
    width = cpu.model.config.hidden_size
    hooks = [f"blocks.{STEERED_LAYER}.hook_resid_post"]

    (want,) = generate(
        cpu.model,
        cpu.tokenizer,
        [ids],
        [GREEDY],
        capture=hooks,
        interventions=[[_steering(kind, width, "cpu")]],
    )
    (got,) = generate(
        gpu.model,
        gpu.tokenizer,
        [ids],
        [GREEDY],
        capture=hooks,
        interventions=[[_steering(kind, width, DEVICE)]],
    )
    (plain,) = generate(gpu.model, gpu.tokenizer, [ids], [GREEDY], capture=hooks)

    _assert_same_run(got, want, len(ids))
    # The intervention really ran on the GPU: the steered stream differs from the plain one there.
    moved = (got.activations[hooks[0]][: len(ids)] - plain.activations[hooks[0]][: len(ids)]).abs().max()
    assert moved > 1.0
    if kind == "add":  # a vector this large changes the greedy text (as on the CPU)
        assert got.token_ids != plain.token_ids


def test_a_batch_on_the_gpu_equals_each_prompt_alone(cuda_models):
    """Left padding, a seeded sampler per row and interventions per row, all on the device."""
    weights = cuda_models("llama")
    model, tokenizer = weights.model, weights.tokenizer
    prompts = [_prompt(tokenizer), tokenizer("A queue is a list").input_ids, tokenizer("Return").input_ids]
    assert len({len(ids) for ids in prompts}) == 3
    add = _steering("add", model.config.hidden_size, DEVICE)
    per_row = [[add], [], [dataclasses.replace(add, coefficient=-1.0, positions="generated")]]
    params = [GREEDY, dataclasses.replace(GREEDY, temperature=1.2, seed=11), GREEDY]

    batched = generate(model, tokenizer, prompts, params, interventions=per_row)

    for ids, row_params, items, result in zip(prompts, params, per_row, batched, strict=True):
        (alone,) = generate(model, tokenizer, [ids], [row_params], interventions=[items])
        if row_params.temperature == 0:
            _assert_same_run(result, alone, len(ids), min_clear=0)
        else:  # the row's own generator draws the same numbers in the batch and alone
            assert result.token_ids == alone.token_ids
    (plain,) = generate(model, tokenizer, [prompts[0]], [GREEDY])
    assert batched[0].token_ids != plain.token_ids  # row 0's vector applied, to row 0


# --- SAE training -------------------------------------------------------------------------------


def _planted(rows: int, d_in: int = 32, atoms: int = 64, active: int = 3, seed: int = 0) -> torch.Tensor:
    """Rows that are sparse combinations of unit atoms (test_sae.py's planted dictionary)."""
    generator = torch.Generator().manual_seed(seed)
    dictionary = torch.randn(atoms, d_in, generator=generator)
    dictionary /= dictionary.norm(dim=1, keepdim=True)
    chosen = torch.rand(rows, atoms, generator=generator).argsort(dim=1)[:, :active]
    codes = torch.zeros(rows, atoms).scatter(1, chosen, torch.rand(rows, active, generator=generator) + 0.5)
    return codes @ dictionary


@pytest.mark.parametrize(
    ("architecture", "options"),
    [
        ("topk", {"k": 3}),
        ("batchtopk", {"k": 3}),
        ("jumprelu", {"l0_coefficient": 0.5, "jumprelu_init_threshold": 0.5, "jumprelu_bandwidth": 0.2}),
        ("standard", {"l1_coefficient": 1.0}),
    ],
)
def test_sae_training_steps_on_the_gpu(architecture, options):
    data = _planted(16_384)
    config = TrainingConfig(
        architecture=architecture,
        d_sae=128,
        lr=4e-3,
        batch_size=256,
        total_tokens=len(data),
        warmup_steps=4,
        dead_after_steps=50,
        **options,
    )

    def batches():
        return shuffled_batches(
            [data[i : i + 4096] for i in range(0, len(data), 4096)], batch_size=256, buffer_rows=2048
        )

    on_cpu = train(
        batches(),
        d_in=data.shape[1],
        config=dataclasses.replace(config, total_tokens=256),
        sample=data[:2048],
    )
    torch.cuda.reset_peak_memory_stats(DEVICE)
    before = _allocated()
    trained = train(batches(), d_in=data.shape[1], config=config, sample=data[:2048], device=DEVICE)

    history = trained.history
    assert trained.steps == len(history) == config.total_steps
    losses = [step.mse + step.sparsity_loss + step.aux_loss for step in history]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    early, late = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    # Measured on the CPU: late / early = 0.41 (topk), 0.47 (batchtopk), 0.18 (jumprelu), 0.17 (standard).
    assert late < 0.75 * early, f"{architecture}: loss {early:.4f} -> {late:.4f}"
    # Same initialisation, same first batch: the first step's losses are the CPU's.
    assert history[0].mse == pytest.approx(on_cpu.history[0].mse, rel=1e-4)
    assert history[0].sparsity_loss == pytest.approx(on_cpu.history[0].sparsity_loss, rel=1e-4, abs=1e-6)
    # The weights and Adam's two moments lived on the device; the result comes back to the CPU.
    sae_bytes = sum(parameter.numel() * parameter.element_size() for parameter in trained.sae.parameters())
    assert torch.cuda.max_memory_allocated(DEVICE) - before >= 3 * sae_bytes
    assert {parameter.device.type for parameter in trained.sae.parameters()} == {"cpu"}
    assert all(torch.isfinite(parameter).all() for parameter in trained.sae.parameters())
