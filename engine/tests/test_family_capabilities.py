"""Qwen3, Gemma, Gemma 2 and Gemma 3 (text) through every capability, against references that
never go through the engine's hook runtime: plain forward hooks on the transformers modules,
teacher-forced forwards without a cache, and transformers' own generate.

The tiny Gemma 2 and 3 models mix sliding-window and full attention with a window (8 tokens)
shorter than the prompts here, Gemma 2 soft-caps attention scores and final logits, and every
norm weight is drawn away from its identity value (tiny_models), so a layout, mask or norm
mistake shows.
"""

import dataclasses
import math

import pytest
import torch

from engine.extraction import extract
from engine.generation import SamplingParams, generate
from engine.interventions import Add
from engine.patching import patching_grid
from engine.sae import SaeShape, SparseAutoencoder
from engine.sae.evaluation import ce_loss_recovered
from engine.testing.references import summed_next_token_loss

NEW_FAMILIES = ("qwen3", "gemma", "gemma2", "gemma3_text")
ATOL = 1e-5
LAYER = 1
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, logprobs=True)
PROMPT = "The module provides functions for working with files and directories"
# Per family, written from transformers' decoder layers: the module whose output is what the
# attention / MLP sub-layer adds to the residual stream, and the modules standing between the
# MLP's input and that output (the MLP, then Gemma 2/3's post-feedforward norm).
SUBLAYERS = {
    "qwen3": ("self_attn", "mlp", ("mlp",)),
    "gemma": ("self_attn", "mlp", ("mlp",)),
    "gemma2": (
        "post_attention_layernorm",
        "post_feedforward_layernorm",
        ("mlp", "post_feedforward_layernorm"),
    ),
    "gemma3_text": (
        "post_attention_layernorm",
        "post_feedforward_layernorm",
        ("mlp", "post_feedforward_layernorm"),
    ),
}


def _ids(tokenizer, text=PROMPT):
    return tokenizer(text, add_special_tokens=True).input_ids


def _block(model, layer=LAYER):
    return model.model.layers[layer]


def _edited(output, change):
    return (change(output[0]), *output[1:]) if isinstance(output, tuple) else change(output)


def _logprobs_with_hook(model, module, ids, change):
    """Log-probabilities of a teacher-forced forward with ``module``'s output changed by ``change``."""
    handle = module.register_forward_hook(lambda _module, _args, output: _edited(output, change))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    finally:
        handle.remove()
    return torch.log_softmax(logits, -1)


@pytest.fixture(params=NEW_FAMILIES)
def family(request):
    return request.param


def test_tokenizer_adds_bos_for_gemma_and_prompts_outrun_the_sliding_window(load_tiny, family):
    weights = load_tiny(family)
    ids = _ids(weights.tokenizer)
    if family.startswith("gemma"):
        assert ids[0] == weights.tokenizer.bos_token_id == weights.model.config.bos_token_id
    window = getattr(weights.model.config, "sliding_window", None)
    if family in ("gemma2", "gemma3_text"):
        assert window is not None and window < len(ids)
        assert set(weights.model.config.layer_types) == {"sliding_attention", "full_attention"}


def test_batched_generation_with_padding_equals_each_prompt_alone(load_tiny, family):
    weights = load_tiny(family)
    texts = ["Return", PROMPT + " on every platform and more", "A queue is a list of items"]
    prompts = [_ids(weights.tokenizer, text) for text in texts]
    params = [dataclasses.replace(GREEDY, max_new_tokens=count, logprobs=False) for count in (10, 14, 6)]

    batched = generate(weights.model, weights.tokenizer, prompts, params)

    for ids, row_params, result in zip(prompts, params, batched, strict=True):
        (alone,) = generate(weights.model, weights.tokenizer, [ids], [row_params])
        assert result.token_ids == alone.token_ids
        with torch.no_grad():
            reference = weights.model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=row_params.max_new_tokens
            )[0, len(ids) :].tolist()
        assert reference[: len(result.token_ids)] == result.token_ids


def test_capture_equals_a_teacher_forced_forward(load_tiny, family):
    weights = load_tiny(family)
    model = weights.model
    ids = _ids(weights.tokenizer)
    extracted = ["hook_embed", "blocks.0.hook_attn_out", "blocks.1.mlp.hook_post", "blocks.1.hook_mlp_out"]
    hooks = ["blocks.0.hook_resid_post", *extracted, "module:lm_head"]

    (result,) = generate(
        model, weights.tokenizer, [ids], [dataclasses.replace(GREEDY, logprobs=False)], capture=hooks
    )

    full = ids + result.token_ids
    with torch.no_grad():
        reference = model(torch.tensor([full]), output_hidden_states=True, use_cache=False)
        unembedded = model.lm_head(reference.hidden_states[-1][0])  # before any soft-cap
    torch.testing.assert_close(
        result.activations["hook_embed"], reference.hidden_states[0][0], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        result.activations["blocks.0.hook_resid_post"], reference.hidden_states[1][0], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(result.activations["module:lm_head"], unembedded, atol=ATOL, rtol=0)
    (one_pass,) = extract(model, [full], [[0]], hooks=extracted)
    for name in extracted:
        torch.testing.assert_close(result.activations[name], one_pass.activations[name], atol=ATOL, rtol=0)


@pytest.mark.parametrize("site", ["hook_resid_post", "hook_attn_out", "hook_mlp_out"])
def test_steering_each_site_equals_a_forward_hook_on_its_module(load_tiny, family, site):
    weights = load_tiny(family)
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer)
    vector = 4.0 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    attention, mlp, _ = SUBLAYERS[family]
    module = {"hook_resid_post": _block(model), "hook_attn_out": getattr(_block(model), attention)}.get(
        site, getattr(_block(model), mlp)
    )

    (plain,) = generate(model, tokenizer, [ids], [GREEDY])
    add = Add(f"blocks.{LAYER}.{site}", vector=vector, coefficient=0.75)
    (steered,) = generate(model, tokenizer, [ids], [GREEDY], interventions=[[add]])

    reference = _logprobs_with_hook(model, module, ids + steered.token_ids, lambda h: h + 0.75 * vector)
    for index, event in enumerate(steered.logprobs):
        expected = reference[len(ids) - 1 + index]
        assert event.token_id == int(expected.argmax())
        assert event.logprob == pytest.approx(expected[event.token_id].item(), abs=ATOL)
    assert [event.logprob for event in steered.logprobs] != pytest.approx(
        [event.logprob for event in plain.logprobs], abs=1e-3
    )


def test_patching_equals_hand_patched_forwards(load_tiny, family):
    weights = load_tiny(family)
    model = weights.model
    clean = _ids(weights.tokenizer)
    corrupted = [clean[0], *((token * 7 + 11) % 900 + 5 for token in clean[1:-1]), clean[-1]]
    answer, wrong = clean[-1], corrupted[2]
    attention = getattr(_block(model, 0), SUBLAYERS[family][0])

    result = patching_grid(
        model, clean, corrupted, answer_id=answer, wrong_id=wrong, hooks=["blocks.0.hook_attn_out"]
    )

    seen = {}
    handle = attention.register_forward_hook(
        lambda _m, _a, output: seen.setdefault("clean", _edited(output, torch.clone))
    )
    with torch.no_grad():
        model(torch.tensor([clean]), use_cache=False)
    handle.remove()
    clean_value = seen["clean"][0] if isinstance(seen["clean"], tuple) else seen["clean"]

    def patched_metric(positions):
        def patch(h):
            h = h.clone()
            h[0, positions] = clean_value[0, positions]
            return h

        handle = attention.register_forward_hook(lambda _m, _a, output: _edited(output, patch))
        try:
            with torch.no_grad():
                logits = model(torch.tensor([corrupted]), use_cache=False).logits[0, -1].float()
        finally:
            handle.remove()
        return float(logits[answer] - logits[wrong])

    for position in range(len(clean)):
        assert result.grid[0][position] == pytest.approx(patched_metric([position]), abs=1e-4)
    assert result.all_positions[0] == pytest.approx(patched_metric(list(range(len(clean)))), abs=1e-4)
    assert abs(result.clean_metric - result.corrupted_metric) > 1e-3


def test_a_transcoder_spliced_for_the_mlp_equals_a_hand_written_forward(load_tiny, family):
    weights = load_tiny(family)
    model, tokenizer = weights.model, weights.tokenizer
    width = model.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    transcoder = SparseAutoencoder(
        SaeShape("jumprelu", width, 96, None, apply_b_dec_to_input=False, d_out=width, skip=True)
    )
    with torch.no_grad():
        for tensor in transcoder.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) / math.sqrt(width))
        transcoder.threshold.fill_(0.05)
    sequences = [_ids(tokenizer), _ids(tokenizer, "A short one.")]

    measured = ce_loss_recovered(
        model,
        sequences,
        hook_name=f"blocks.{LAYER}.hook_mlp_out",
        input_hook=f"blocks.{LAYER}.ln2.hook_normalized",
        sae=transcoder,
    )

    # By hand: the MLP (and Gemma 2/3's post-feedforward norm after it) replaced by the transcoder.
    block = _block(model)
    replaced = SUBLAYERS[family][2]
    originals = {name: getattr(block, name).forward for name in replaced}
    getattr(block, replaced[0]).forward = lambda hidden: transcoder(hidden)
    for name in replaced[1:]:
        getattr(block, name).forward = lambda hidden: hidden
    try:
        total, tokens = summed_next_token_loss(model, sequences)
    finally:
        for name, forward in originals.items():
            getattr(block, name).forward = forward
    assert measured.tokens == tokens
    assert measured.sae_loss == pytest.approx(total / tokens, abs=1e-5)
    assert measured.sae_loss != pytest.approx(measured.clean_loss, abs=1e-3)
