"""Interventions during generation, against hand-written transformers forward hooks.

The reference never goes through the engine's hook runtime: a plain ``register_forward_hook``
on the block module changes the block's output, and a teacher-forced forward over prompt +
completion (no KV cache) gives the logits. The engine's decode loop runs the prompt once and
then one token at a time over the KV cache, so agreement covers both.
"""

import dataclasses

import pytest
import torch

from engine.generation import SamplingParams, generate
from engine.interventions import Ablate, Add, ClampFeature, InterventionError, Replace
from engine.testing.tiny_saes import random_sae

ATOL = 1e-5
PROMPT = "The module provides functions for working with"
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, logprobs=True)
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}
LAYER = 1


def _ids(tokenizer, text=PROMPT):
    return tokenizer(text, add_special_tokens=True).input_ids


def _block(model, family):
    return model.get_submodule(BLOCKS[family])[LAYER]


def _edited_output(output, change):
    if isinstance(output, tuple):
        return (change(output[0]), *output[1:])
    return change(output)


def _reference_logprobs(model, family, ids, change):
    """Log-probabilities of a teacher-forced forward over ``ids`` with the block's output
    changed by ``change(hidden [1, tokens, width]) -> hidden`` through a plain forward hook."""
    handle = _block(model, family).register_forward_hook(
        lambda module, args, output: _edited_output(output, change)
    )
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    finally:
        handle.remove()
    return torch.log_softmax(logits, -1)


def _assert_matches(result, reference, prompt_length):
    for index, event in enumerate(result.logprobs):
        expected = reference[prompt_length - 1 + index]
        assert event.token_id == int(expected.argmax())
        assert event.logprob == pytest.approx(expected[event.token_id].item(), abs=ATOL)


def _random_vector(width, seed=0, scale=4.0):
    return scale * torch.randn(width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_add_equals_a_forward_hook_adding_the_vector(load_tiny, family):
    weights = load_tiny(family)
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer)
    vector = _random_vector(model.config.hidden_size)
    add = Add(f"blocks.{LAYER}.hook_resid_post", vector=vector, coefficient=0.75)

    (plain,) = generate(model, tokenizer, [ids], [GREEDY])
    (steered,) = generate(model, tokenizer, [ids], [GREEDY], interventions=[[add]])

    reference = _reference_logprobs(model, family, ids + steered.token_ids, lambda h: h + 0.75 * vector)
    _assert_matches(steered, reference, len(ids))
    assert steered.token_ids != plain.token_ids  # a vector this large changes the greedy text


def test_positions_prompt_generated_and_listed(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer)
    vector = _random_vector(model.config.hidden_size, seed=1)
    hook = f"blocks.{LAYER}.hook_resid_post"
    choices = {
        "prompt": lambda position: position < len(ids),
        "generated": lambda position: position >= len(ids),
        (2, len(ids) + 3): lambda position: position in (2, len(ids) + 3),
    }
    for positions, applies in choices.items():
        add = Add(hook, positions=positions, vector=vector)
        (steered,) = generate(model, tokenizer, [ids], [GREEDY], interventions=[[add]])
        full = ids + steered.token_ids
        mask = torch.tensor([applies(position) for position in range(len(full))])[None, :, None]
        reference = _reference_logprobs(model, "gpt2", full, lambda h, mask=mask: h + mask * vector)
        _assert_matches(steered, reference, len(ids))


def test_normalized_add_scales_with_each_tokens_norm(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer)
    vector = _random_vector(model.config.hidden_size, seed=2)
    add = Add(f"blocks.{LAYER}.hook_resid_post", vector=vector, coefficient=0.5, normalize=True)

    (steered,) = generate(model, tokenizer, [ids], [GREEDY], interventions=[[add]])

    direction = vector / vector.norm()
    reference = _reference_logprobs(
        model, "gpt2", ids + steered.token_ids, lambda h: h + 0.5 * h.norm(dim=-1, keepdim=True) * direction
    )
    _assert_matches(steered, reference, len(ids))


def test_ablate_and_replace_equal_forward_hooks(load_tiny):
    weights = load_tiny("llama")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer)
    width = model.config.hidden_size
    hook = f"blocks.{LAYER}.hook_resid_post"
    means = torch.linspace(-1, 1, width)
    patch = _random_vector(width, seed=4, scale=1.0)

    def zeroed(h):
        h = h.clone()
        h[..., [0, 3, 5]] = 0
        return h

    def to_means(h):
        h = h.clone()
        h[..., [1, 2]] = means[[1, 2]]
        return h

    def replaced(h, positions):
        h = h.clone()
        h[0, list(positions)] = patch
        return h

    cases = [
        (Ablate(hook, neurons=(0, 3, 5)), zeroed),
        (Ablate(hook, neurons=(1, 2), means=means), to_means),
        (Replace(hook, positions=(1, 4), vector=patch), lambda h: replaced(h, (1, 4))),
    ]
    for intervention, change in cases:
        (result,) = generate(model, tokenizer, [ids], [GREEDY], interventions=[[intervention]])
        reference = _reference_logprobs(model, "llama", ids + result.token_ids, change)
        _assert_matches(result, reference, len(ids))


@pytest.mark.parametrize(("architecture", "k"), [("standard", None), ("topk", 8)])
def test_clamp_feature_keeps_the_reconstruction_error(load_tiny, architecture, k):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer)
    hook = f"blocks.{LAYER}.hook_resid_post"
    sae = random_sae(model.config.hidden_size, architecture, k=k)
    (plain,) = generate(model, tokenizer, [ids], [GREEDY], capture=[hook])
    features = sae.encode(plain.activations[hook]).detach()
    position = 3
    feature = int(features[position].argmax())  # active there
    own = float(features[position, feature])

    # Clamped to its own value: nothing changes (the error term keeps what the SAE misses).
    same = ClampFeature(hook, positions=(position,), sae=sae, features=(feature,), value=own)
    (unchanged,) = generate(model, tokenizer, [ids], [GREEDY], interventions=[[same]])
    assert unchanged.token_ids == plain.token_ids
    for a, b in zip(unchanged.logprobs, plain.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)

    # Clamped high everywhere: the residual moves by (value - f) along the feature's decoder row.
    value = own + 25.0
    clamp = ClampFeature(hook, sae=sae, features=(feature,), value=value)
    (clamped,) = generate(model, tokenizer, [ids], [GREEDY], interventions=[[clamp]], capture=[hook])
    direction = sae.W_dec[feature].detach()

    changed = []

    def by_hand(h):
        with torch.no_grad():
            current = sae.encode(h[0])[:, feature]
        changed.append(h + ((value - current)[:, None] * direction)[None])
        return changed[-1]

    reference = _reference_logprobs(model, "gpt2", ids + clamped.token_ids, by_hand)
    _assert_matches(clamped, reference, len(ids))
    # Captured activations are the steered ones (the prompt's tokens are the same as unsteered).
    torch.testing.assert_close(clamped.activations[hook], changed[0][0], atol=1e-4, rtol=0)
    prompt_rows = slice(0, len(ids))
    moved = clamped.activations[hook][prompt_rows] - plain.activations[hook][prompt_rows]
    assert moved.abs().max() > 1.0


def test_interventions_stay_in_their_row_of_a_batch(load_tiny):
    weights = load_tiny("llama")
    model, tokenizer = weights.model, weights.tokenizer
    prompts = [_ids(tokenizer), _ids(tokenizer, "A queue is a list"), _ids(tokenizer, "Return")]
    vector = _random_vector(model.config.hidden_size, seed=5)
    add = Add(f"blocks.{LAYER}.hook_resid_post", vector=vector)
    per_row = [[add], [], [dataclasses.replace(add, coefficient=-1.0, positions="generated")]]
    params = [GREEDY] * 3

    batched = generate(model, tokenizer, prompts, params, interventions=per_row)

    for ids, row_params, items, result in zip(prompts, params, per_row, batched, strict=True):
        (alone,) = generate(model, tokenizer, [ids], [row_params], interventions=[items])
        assert result.token_ids == alone.token_ids
        for a, b in zip(result.logprobs, alone.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    (plain,) = generate(model, tokenizer, [prompts[1]], [GREEDY])
    assert batched[1].token_ids == plain.token_ids


def test_bad_interventions_are_refused_by_index(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer)
    width = model.config.hidden_size
    hook = f"blocks.{LAYER}.hook_resid_post"
    good = Add(hook, vector=torch.ones(width))
    cases = [
        Add(hook, vector=torch.ones(width + 1), index=1),
        Add(hook, vector=torch.full((width,), float("nan")), index=1),
        Add(hook, vector=torch.ones(width), coefficient=float("inf"), index=1),
        Ablate(hook, neurons=(width,), index=1),
        ClampFeature(hook, sae=random_sae(width), features=(4 * width,), index=1),
        ClampFeature(hook, sae=random_sae(width + 2), features=(0,), index=1),
        Add(hook, positions="later", vector=torch.ones(width), index=1),
    ]
    for bad in cases:
        with pytest.raises(InterventionError) as raised:
            generate(model, tokenizer, [ids], [GREEDY], interventions=[[good, bad]])
        assert raised.value.code == "INVALID_INTERVENTION"
        assert raised.value.details["intervention"] == 1
        assert raised.value.message.startswith("Intervention 1:")


def test_a_module_hook_whose_width_shows_only_when_it_runs_refuses_a_misfit_by_index(load_tiny):
    """A ``module:`` hook point has no width before it runs: an intervention that does not fit is
    refused there with INVALID_INTERVENTION (it was a shape error deep in torch, a 500)."""
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    width = model.config.hidden_size
    hook = f"module:transformer.h.{LAYER}.mlp.c_fc"  # 4 x width wide
    cases = [
        Add(hook, vector=torch.ones(width), index=0),
        Replace(hook, vector=torch.ones(width), index=0),
        ClampFeature(hook, sae=random_sae(width), features=(0,), value=1.0, index=0),
        Ablate(hook, neurons=(4 * width,), index=0),
        Ablate(hook, neurons=(0,), means=torch.zeros(width), index=0),
    ]
    for bad in cases:
        with pytest.raises(InterventionError) as raised:
            generate(model, tokenizer, [_ids(tokenizer)], [GREEDY], interventions=[[bad]])
        assert raised.value.code == "INVALID_INTERVENTION", bad.kind
        assert raised.value.details == {
            "intervention": 0,
            "width": 4 * width,
            "needs": raised.value.details["needs"],
        }
    fitting = Add(hook, vector=torch.ones(4 * width), index=0)
    generate(model, tokenizer, [_ids(tokenizer)], [GREEDY], interventions=[[fitting]])
