"""Hook points and the extraction engine on real tiny models of every family (no database).

Every canonical hook point is checked against a reference computed independently of the
engine: transformers' own ``output_hidden_states``, plain hooks written here, and the MLP
neurons recomputed by hand from each MLP's weights.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.extraction import (
    BatchActivations,
    ExtractionCancelled,
    ExtractionError,
    extract,
    plan_batches,
    tokenize_samples,
)
from engine.hooks import (
    HookError,
    family_of,
    hook_depth,
    hook_site,
    list_hook_points,
    num_layers,
    resolve_hook_names,
)
from engine.testing.tiny_models import FAMILIES, local_corpus

ATOL = 1e-5
# Batched vs batch-of-one on a bitsandbytes model: its bf16 compute and LLM.int8()'s
# batch-wide outlier columns make results depend on the batch. Measured worst case on the tiny
# models: 2.1 % of the tensor's largest magnitude (int8 llama hook_mlp_out).
QUANTIZED_RELATIVE_TOLERANCE = 5e-2

# Truncation lengths (in characters) giving samples of clearly different token counts.
_CUTS = (260, 14, 120, 45, 3, 170, 70)


def _texts() -> list[str]:
    paragraphs = [paragraph for paragraph in local_corpus(20_000) if len(paragraph) > 300]
    return [paragraph[:cut] for paragraph, cut in zip(paragraphs, _CUTS, strict=False)]


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return _texts()


def _run(model, tokenized, *, hooks, batch_size=4, **options) -> list[BatchActivations]:
    plan = plan_batches([len(ids) for ids in tokenized], batch_size)
    return list(extract(model, tokenized, plan, hooks=hooks, **options))


def _unpadded(model, ids: list[int], names: list[str]) -> dict[str, torch.Tensor]:
    """The hook points of one sample run alone (a batch of one, no padding)."""
    (batch,) = extract(model, [ids], [[0]], hooks=names)
    return batch.activations


def _per_sample(batches: list[BatchActivations], name: str) -> dict[int, torch.Tensor]:
    """hook point ``name`` of each sample, from batched results."""
    rows = {}
    for batch in batches:
        for sample in batch.sample_indices:
            selected = batch.sample_index == sample
            assert torch.equal(batch.positions[selected], torch.arange(int(selected.sum())))
            rows[sample] = batch.activations[name][selected]
    return rows


def _plain_inputs_and_outputs(model, module_paths: list[str], input_ids: torch.Tensor):
    """The first positional input and the output (first element) of each module, by plain hooks."""
    inputs, outputs, handles = {}, {}, []
    for path in module_paths:
        module = model.get_submodule(path)

        def pre_hook(module, args, kwargs, path=path):
            inputs.setdefault(path, args[0] if args else kwargs["hidden_states"])

        def hook(module, args, output, path=path):
            outputs.setdefault(path, output[0] if isinstance(output, tuple) else output)

        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            result = model(input_ids, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, outputs, result.hidden_states


def _hook_counts(model) -> dict[str, tuple[int, int]]:
    return {
        name: (len(module._forward_hooks), len(module._forward_pre_hooks))
        for name, module in model.named_modules()
    }


# --- hand-written references -------------------------------------------------------------------


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _linear(x, layer):
    return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0)


def _mlp_neurons_by_hand(family: str, block, x: torch.Tensor) -> torch.Tensor:
    """The MLP's hidden activation computed from its weights, given the MLP's input ``x``."""
    if family == "gpt2":  # Conv1D stores the weight as [in, out]
        return _gelu_tanh(x @ block.mlp.c_fc.weight + block.mlp.c_fc.bias)
    if family == "gpt_neo":
        return _gelu_tanh(_linear(x, block.mlp.c_fc))
    if family == "gptj":
        return _gelu_tanh(_linear(x, block.mlp.fc_in))
    if family in ("llama", "mistral", "qwen2", "qwen3"):
        gate = _linear(x, block.mlp.gate_proj)
        return gate * torch.sigmoid(gate) * _linear(x, block.mlp.up_proj)
    if family in ("gemma", "gemma2", "gemma3_text"):
        return _gelu_tanh(_linear(x, block.mlp.gate_proj)) * _linear(x, block.mlp.up_proj)
    if family in ("gpt_neox", "falcon"):
        return _gelu_erf(_linear(x, block.mlp.dense_h_to_4h))
    if family == "bloom":
        return _gelu_tanh(_linear(x, block.mlp.dense_h_to_4h))
    assert family == "bert"
    return _gelu_erf(_linear(x, block.intermediate.dense))


# Per family: the block's MLP module (whose input is the MLP input), the norm that produces that
# input, and whether the MLP reads the block input (parallel) or the post-attention stream.
_MLP_INPUT = {
    "gpt2": ("mlp", "ln_2", False),
    "gpt_neo": ("mlp", "ln_2", False),
    "gptj": ("mlp", "ln_1", True),
    "llama": ("mlp", "post_attention_layernorm", False),
    "mistral": ("mlp", "post_attention_layernorm", False),
    "qwen2": ("mlp", "post_attention_layernorm", False),
    "qwen3": ("mlp", "post_attention_layernorm", False),
    "gemma": ("mlp", "post_attention_layernorm", False),
    "gemma2": ("mlp", "pre_feedforward_layernorm", False),
    "gemma3_text": ("mlp", "pre_feedforward_layernorm", False),
    "gpt_neox": ("mlp", "post_attention_layernorm", True),
    "falcon": ("mlp", "input_layernorm", True),
    "bloom": ("mlp", "post_attention_layernorm", False),
    "bert": ("intermediate", None, False),
}


def _blocks_path(model) -> str:
    return hook_site(model, "blocks.0.hook_resid_post").module_path.rsplit(".", 1)[0]


@pytest.fixture(scope="session")
def family_runs(load_tiny, texts):
    """Per family: every canonical hook point over the mixed-length samples, right-padded in batches."""
    runs = {}

    def run(family: str):
        if family not in runs:
            weights = load_tiny(family)
            tokenized = tokenize_samples(weights.tokenizer, texts, 32)
            names = [point.name for point in list_hook_points(weights.model)]
            runs[family] = (weights, tokenized, names, _run(weights.model, tokenized, hooks=names))
        return runs[family]

    return run


# --- every family against independent references -----------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_residual_stream_matches_transformers_hidden_states(family, family_runs):
    weights, tokenized, names, batches = family_runs(family)
    model = weights.model
    layers = num_layers(model)
    last_block = f"{_blocks_path(model)}.{layers - 1}"
    for sample, ids in enumerate(tokenized):
        _, outputs, hidden = _plain_inputs_and_outputs(model, [last_block], torch.tensor([ids]))
        got = {name: _per_sample(batches, name)[sample] for name in names}
        torch.testing.assert_close(got["hook_embed"], hidden[0][0], atol=ATOL, rtol=0)
        for layer in range(layers):
            torch.testing.assert_close(
                got[f"blocks.{layer}.hook_resid_pre"], hidden[layer][0], atol=ATOL, rtol=0
            )
        for layer in range(layers - 1):
            torch.testing.assert_close(
                got[f"blocks.{layer}.hook_resid_post"], hidden[layer + 1][0], atol=ATOL, rtol=0
            )
        # transformers applies the final norm to its last hidden state (BERT has no final norm).
        last_post = got[f"blocks.{layers - 1}.hook_resid_post"]
        torch.testing.assert_close(last_post, outputs[last_block][0], atol=ATOL, rtol=0)
        if family == "bert":
            assert "ln_final.hook_normalized" not in got
            torch.testing.assert_close(last_post, hidden[-1][0], atol=ATOL, rtol=0)
        else:
            torch.testing.assert_close(got["ln_final.hook_normalized"], hidden[-1][0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_neurons_match_a_computation_by_hand(family, family_runs):
    weights, tokenized, _, batches = family_runs(family)
    model = weights.model
    mlp_name, _, _ = _MLP_INPUT[family]
    for layer in range(num_layers(model)):
        block_path = f"{_blocks_path(model)}.{layer}"
        block = model.get_submodule(block_path)
        neurons = _per_sample(batches, f"blocks.{layer}.mlp.hook_post")
        for sample, ids in enumerate(tokenized):
            inputs, _, _ = _plain_inputs_and_outputs(model, [f"{block_path}.{mlp_name}"], torch.tensor([ids]))
            with torch.no_grad():
                expected = _mlp_neurons_by_hand(family, block, inputs[f"{block_path}.{mlp_name}"][0])
            assert neurons[sample].shape[-1] == expected.shape[-1] != model.config.hidden_size
            torch.testing.assert_close(neurons[sample], expected, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_sublayer_outputs_add_up_to_the_residual_stream(family, family_runs):
    weights, tokenized, _, batches = family_runs(family)
    model = weights.model
    mlp_name, norm_name, parallel = _MLP_INPUT[family]
    for layer in range(num_layers(model)):
        block_path = f"{_blocks_path(model)}.{layer}"
        block = model.get_submodule(block_path)
        pre, attn, mlp_in, mlp, post = (
            _per_sample(batches, f"blocks.{layer}.{hook}")
            for hook in (
                "hook_resid_pre",
                "hook_attn_out",
                "ln2.hook_normalized",
                "hook_mlp_out",
                "hook_resid_post",
            )
        )
        for sample, ids in enumerate(tokenized):
            if family == "bert":
                # Post-LN: each sub-layer's output is added to its input, then normalised.
                with torch.no_grad():
                    middle = block.attention.output.LayerNorm(attn[sample] + pre[sample])
                    expected = block.output.LayerNorm(mlp[sample] + middle)
                torch.testing.assert_close(post[sample], expected, atol=ATOL, rtol=0)
                torch.testing.assert_close(mlp_in[sample], middle, atol=ATOL, rtol=0)
                continue
            torch.testing.assert_close(
                pre[sample] + attn[sample] + mlp[sample], post[sample], atol=ATOL, rtol=0
            )
            # What the MLP reads tells parallel blocks (the block input) from sequential ones.
            inputs, _, _ = _plain_inputs_and_outputs(model, [f"{block_path}.{mlp_name}"], torch.tensor([ids]))
            stream = pre[sample] if parallel else pre[sample] + attn[sample]
            with torch.no_grad():
                expected_input = block.get_submodule(norm_name)(stream)
            torch.testing.assert_close(
                inputs[f"{block_path}.{mlp_name}"][0], expected_input, atol=ATOL, rtol=0
            )
            # The MLP's input hook (a transcoder's usual input) is that normed stream.
            torch.testing.assert_close(mlp_in[sample], expected_input, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_and_right_padded_batches_equal_unpadded_runs(family, family_runs):
    weights, tokenized, names, right = family_runs(family)
    model = weights.model
    left = _run(model, tokenized, hooks=names, padding_side="left")
    alone = {sample: _unpadded(model, ids, names) for sample, ids in enumerate(tokenized)}
    lengths = [len(ids) for ids in tokenized]
    assert len(set(lengths)) > 3, "the samples must have mixed lengths"
    for batches in (right, left):
        assert sum(batch.token_count for batch in batches) == sum(lengths)  # no pad row stored
        for batch in batches:
            expected_ids = torch.cat([torch.tensor(tokenized[sample]) for sample in batch.sample_indices])
            assert torch.equal(batch.token_ids, expected_ids)
        for name in names:
            for sample, rows in _per_sample(batches, name).items():
                torch.testing.assert_close(rows, alone[sample][name], atol=ATOL, rtol=0)


# --- early stop, hook hygiene -------------------------------------------------------------------


def _count_calls(model, paths: list[str]):
    counts = dict.fromkeys(paths, 0)
    handles = []
    for path in paths:

        def hook(module, args, output, path=path):
            counts[path] += 1

        handles.append(model.get_submodule(path).register_forward_hook(hook))
    return counts, handles


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_forward_pass_stops_after_the_deepest_hook_point(family, load_tiny, texts):
    weights = load_tiny(family)
    model = weights.model
    tokenized = tokenize_samples(weights.tokenizer, texts, 16)
    blocks = _blocks_path(model)
    final_norm = hook_site(model, "ln_final.hook_normalized").module_path
    watched = [f"{blocks}.0", f"{blocks}.0.mlp", f"{blocks}.1", final_norm, "lm_head"]
    batch_count = len(plan_batches([len(ids) for ids in tokenized], 4))
    expectations = {
        # hook point -> modules that must run (once per batch); the others must not run at all
        "hook_embed": set(),
        "blocks.0.hook_attn_out": set(),
        "blocks.0.hook_resid_post": {f"{blocks}.0", f"{blocks}.0.mlp"},
        "ln_final.hook_normalized": {f"{blocks}.0", f"{blocks}.0.mlp", f"{blocks}.1", final_norm},
        "module:lm_head": set(watched),
    }
    for hook, must_run in expectations.items():
        counts, handles = _count_calls(model, watched)
        try:
            _run(model, tokenized, hooks=[hook])
        finally:
            for handle in handles:
                handle.remove()
        assert counts == {path: batch_count if path in must_run else 0 for path in watched}, hook


def test_hooks_are_removed_between_batches_after_errors_and_when_abandoned(load_tiny, texts):
    weights = load_tiny("bert")
    model = weights.model
    tokenized = tokenize_samples(weights.tokenizer, texts, 16)
    plan = plan_batches([len(ids) for ids in tokenized], 2)
    before = _hook_counts(model)

    running = extract(model, tokenized, plan, hooks=["blocks.1.hook_resid_post"])
    next(running)
    assert _hook_counts(model) == before  # nothing left on the model while the caller holds a batch
    running.close()
    assert _hook_counts(model) == before

    # The pooler gives one vector per sample, not per token: refused from inside the forward pass.
    with pytest.raises(HookError) as refused:
        _run(model, tokenized, hooks=["blocks.0.hook_resid_post", "module:pooler"])
    assert refused.value.code == "INVALID_HOOK" and refused.value.details["invalid"] == ["module:pooler"]
    assert _hook_counts(model) == before


def test_cancellation_is_checked_between_batches(load_tiny, texts):
    weights = load_tiny("gpt2")
    tokenized = tokenize_samples(weights.tokenizer, texts, 16)
    plan = plan_batches([len(ids) for ids in tokenized], 2)
    seen: list[int] = []
    running = extract(
        weights.model,
        tokenized,
        plan,
        hooks=["blocks.0.hook_resid_post"],
        should_cancel=lambda: len(seen) == 2,
    )
    with pytest.raises(ExtractionCancelled) as cancelled:
        for batch in running:
            seen.append(batch.batch_index)
    assert cancelled.value.code == "EXTRACTION_CANCELLED"
    assert seen == [0, 1]


def test_resuming_from_a_batch_index_gives_the_same_batches(load_tiny, texts):
    weights = load_tiny("llama")
    tokenized = tokenize_samples(weights.tokenizer, texts, 24)
    plan = plan_batches([len(ids) for ids in tokenized], 2)
    hooks = ["blocks.1.hook_resid_post"]
    everything = list(extract(weights.model, tokenized, plan, hooks=hooks))
    resumed = list(extract(weights.model, tokenized, plan, hooks=hooks, start_batch=2))
    assert [batch.batch_index for batch in resumed] == list(range(2, len(plan)))
    for full, again in zip(everything[2:], resumed, strict=True):
        assert full.sample_indices == again.sample_indices
        assert torch.equal(full.activations[hooks[0]], again.activations[hooks[0]])


# --- names -------------------------------------------------------------------------------------


def test_module_paths_are_looked_up_and_bad_names_are_all_listed(load_tiny, texts):
    weights = load_tiny("gpt2")
    model = weights.model
    tokenized = tokenize_samples(weights.tokenizer, texts, 16)
    batches = _run(model, tokenized, hooks=["module:transformer.h.0.mlp", "blocks.0.hook_mlp_out"])
    for batch in batches:
        assert torch.equal(
            batch.activations["module:transformer.h.0.mlp"], batch.activations["blocks.0.hook_mlp_out"]
        )

    bad = [
        "module:__import__('os')",
        "module:transformer.h.9",
        "module:",
        "blocks.2.hook_resid_post",
        "blocks.0.hook_nonsense",
        "blocks.01.hook_resid_post",
        "ln_final",
    ]
    with pytest.raises(HookError) as refused:
        resolve_hook_names(model, ["hook_embed", *bad])
    assert refused.value.code == "INVALID_HOOK"
    assert refused.value.details["invalid"] == bad
    assert "blocks.1.hook_resid_post" in refused.value.details["valid"]
    with pytest.raises(HookError):
        extract(model, tokenized, [[0]], hooks=["module:__import__('os')"])
    with pytest.raises(HookError, match="At least one"):
        resolve_hook_names(model, [])


def test_layers_shorthand_and_duplicates(load_tiny):
    model = load_tiny("gpt2").model
    assert resolve_hook_names(
        model, ["blocks.0.hook_resid_post", "hook_embed", "hook_embed"], layers=[1, 0]
    ) == [
        "blocks.0.hook_resid_post",
        "hook_embed",
        "blocks.1.hook_resid_post",
    ]
    assert resolve_hook_names(model, layers=[1]) == ["blocks.1.hook_resid_post"]
    with pytest.raises(HookError) as refused:
        resolve_hook_names(model, layers=[0, 7, True])
    assert refused.value.details["invalid"] == ["blocks.7.hook_resid_post", "layers: True"]


def test_hook_point_listing_and_depths(load_tiny):
    gpt2 = load_tiny("gpt2").model
    points = {point.name: point for point in list_hook_points(gpt2)}
    assert len(points) == 1 + 6 * 2 + 1
    assert points["blocks.1.mlp.hook_post"].width == 256 and points["blocks.1.mlp.hook_post"].layer == 1
    assert points["blocks.1.hook_attn_out"].width == 64 and points["hook_embed"].layer is None
    assert family_of(gpt2) == "gpt2" and family_of(load_tiny("mistral").model) == "mistral"
    assert "ln_final.hook_normalized" not in {
        point.name for point in list_hook_points(load_tiny("bert").model)
    }
    assert hook_depth(gpt2, "hook_embed") == -1
    assert hook_depth(gpt2, "blocks.1.hook_attn_out") == 1
    assert hook_depth(gpt2, "ln_final.hook_normalized") == 2
    assert hook_depth(gpt2, "module:transformer.h.0.mlp.c_fc") == 0
    assert hook_depth(gpt2, "module:transformer.wte") == 2
    assert hook_depth(gpt2, "module:lm_head") == 2


# --- quantized models, stored dtypes, tokenization, planning -----------------------------------


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_quantized_models_batched_equal_their_own_unpadded_runs(family, quantization, load_tiny, texts):
    weights = load_tiny(family, quantization)
    assert weights.quantized_module_count > 0
    tokenized = tokenize_samples(weights.tokenizer, texts, 32)
    names = [point.name for point in list_hook_points(weights.model)]
    for side in ("right", "left"):
        batches = _run(weights.model, tokenized, hooks=names, padding_side=side)
        assert sum(batch.token_count for batch in batches) == sum(map(len, tokenized))
        for sample, ids in enumerate(tokenized):
            alone = _unpadded(weights.model, ids, names)
            for name in names:
                got, expected = _per_sample(batches, name)[sample], alone[name]
                assert got.dtype == torch.float32 and torch.isfinite(got).all()
                error = (got - expected).abs().max().item()
                assert error <= QUANTIZED_RELATIVE_TOLERANCE * expected.abs().max().item(), (
                    name,
                    side,
                    error,
                )


@pytest.mark.parametrize(("dtype", "mantissa_bits"), [("bfloat16", 8), ("float16", 11)])
def test_activations_are_stored_in_the_requested_dtype(dtype, mantissa_bits, family_runs):
    weights, tokenized, names, reference = family_runs("llama")
    stored = _run(weights.model, tokenized, hooks=names, dtype=dtype)
    for got, expected in zip(stored, reference, strict=True):
        for name in names:
            value = got.activations[name]
            assert value.dtype == getattr(torch, dtype) and value.device.type == "cpu"
            exact = expected.activations[name]
            # Round-to-nearest: within half a unit in the last place.
            assert ((value.float() - exact).abs() <= exact.abs() * 2.0**-mantissa_bits + 1e-7).all(), name


def test_tokenization_truncates_and_keeps_special_tokens(load_tiny, texts):
    bert = load_tiny("bert").tokenizer
    tokenized = tokenize_samples(bert, texts, 6)
    assert max(map(len, tokenized)) == 6
    assert all(ids[0] == bert.cls_token_id and ids[-1] == bert.sep_token_id for ids in tokenized)
    gpt2 = load_tiny("gpt2")
    tokenized = tokenize_samples(gpt2.tokenizer, [*texts, ""], 5)
    assert [len(ids) for ids in tokenized][-1] == 0 and max(map(len, tokenized)) == 5
    batches = _run(gpt2.model, tokenized, hooks=["blocks.0.hook_resid_post"], batch_size=3)
    assert sum(batch.token_count for batch in batches) == sum(map(len, tokenized))
    assert sorted(sample for batch in batches for sample in batch.sample_indices) == list(
        range(len(tokenized))
    )
    with pytest.raises(ExtractionError):
        tokenize_samples(gpt2.tokenizer, texts, 0)
    # Below its special tokens, a tokenizer would return whole texts: refused instead.
    with pytest.raises(ExtractionError, match="at least 2"):
        tokenize_samples(bert, texts, 1)


def test_plan_batches_covers_every_sample_once_grouped_by_length():
    lengths = [5, 40, 7, 39, 6, 41, 0, 38]
    plan = plan_batches(lengths, 3)
    assert plan == plan_batches(lengths, 3)
    assert sorted(index for batch in plan for index in batch) == list(range(len(lengths)))
    assert all(len(batch) <= 3 for batch in plan)
    assert [sorted(lengths[index] for index in batch) for batch in plan] == [[39, 40, 41], [6, 7, 38], [0, 5]]
    assert plan_batches([], 4) == []
    with pytest.raises(ExtractionError):
        plan_batches(lengths, 0)


def test_refusals_before_the_model_runs(load_tiny):
    weights = load_tiny("gpt2")
    model = weights.model
    with pytest.raises(ExtractionError) as too_long:
        extract(model, [[1] * 200], [[0]], hooks=["hook_embed"])
    assert too_long.value.code == "SEQUENCE_TOO_LONG"
    with pytest.raises(ExtractionError) as bad_dtype:
        extract(model, [[1, 2]], [[0]], hooks=["hook_embed"], dtype="float64")
    assert bad_dtype.value.code == "INVALID_DTYPE"
    with pytest.raises(ExtractionError) as bad_tokens:
        list(extract(model, [[1, 10**6]], [[0]], hooks=["hook_embed"]))
    assert bad_tokens.value.code == "INVALID_TOKENS"


def test_the_engine_imports_without_django_or_torch():
    code = (
        "import sys, engine.extraction, engine.hooks; "
        "assert not {'django', 'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def _tokenizers_of_every_kind() -> dict[str, object]:
    """Real trained tokenizers: byte-level BPE, Qwen2's (NFC, digits split), BERT's WordPiece
    (``[CLS] ... [SEP]``), Gemma's (``<bos>``, byte fallback), a BPE that adds a BOS, and one
    that truncates on the left."""
    import copy

    from tokenizers import processors

    from engine.testing.tiny_models import END_OF_TEXT, build_tokenizer

    kinds = {kind: build_tokenizer(kind=kind) for kind in ("bpe", "qwen2", "wordpiece", "gemma")}
    with_bos = build_tokenizer(kind="bpe")
    bos_id = with_bos.convert_tokens_to_ids(END_OF_TEXT)
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{END_OF_TEXT} $A", special_tokens=[(END_OF_TEXT, bos_id)]
    )
    assert with_bos("a b")["input_ids"][0] == bos_id and with_bos.num_special_tokens_to_add() == 1
    kinds["bpe_with_bos"] = with_bos
    from_left = copy.deepcopy(kinds["wordpiece"])
    from_left.truncation_side = "left"
    kinds["wordpiece_left"] = from_left
    return kinds


def _awkward_long_texts() -> list[str]:
    """Long texts whose characters at every prefix size fall inside words, digit runs, whitespace
    runs and combining sequences (the shifts move each cut through them)."""
    prose = " ".join(local_corpus(12_000))
    odd = (
        "e\u0301t\u0301e\u0301 caf\u00e9  \t\r\n 1234567890123 unbelievably"
        "antidisestablishmentarianism ---=== \u4e2d\u6587\u5b57 "
    ) * 60
    texts = [prose[shift:] for shift in range(0, 9)]
    texts += [odd[shift:] for shift in range(0, 7)]
    texts += ["ab" * 6000, "a" * 9000, " " * 5000 + prose[:3000], "x\u0301" * 4000]
    return texts


@pytest.mark.parametrize("kind", ["bpe", "qwen2", "wordpiece", "gemma", "bpe_with_bos", "wordpiece_left"])
def test_long_texts_tokenize_exactly_as_whole_texts_truncated(kind):
    tokenizer = _tokenizers_of_every_kind()[kind]
    texts = _awkward_long_texts()
    for max_length in (2, 3, 4, 7, 16, 33, 64, 200):
        expected = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length)
        assert tokenize_samples(tokenizer, texts, max_length) == [
            list(ids) for ids in expected["input_ids"]
        ], (
            kind,
            max_length,
        )


class _InputRecorder:
    """A real tokenizer that records the length of every text it is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def __call__(self, text, **options):
        self.lengths += [len(text)] if isinstance(text, str) else [len(item) for item in text]
        return self.tokenizer(text, **options)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_huge_sample_is_tokenized_from_a_bounded_prefix():
    from engine.testing.tiny_models import build_tokenizer

    tokenizer = build_tokenizer(kind="bpe")
    prose = " ".join(local_corpus(50_000))
    huge = (prose * (20_000_000 // len(prose) + 1))[:20_000_000]  # 20 MB, one line
    recorder = _InputRecorder(tokenizer)
    (ids,) = tokenize_samples(recorder, [huge], 64)
    assert max(recorder.lengths) <= 64 * 8 * 4 and sum(recorder.lengths) <= 64 * 8 * 8
    assert ids == tokenizer(prose[:5000], truncation=True, max_length=64)["input_ids"]
