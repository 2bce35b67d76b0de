"""The measured effect of steering, against a hand-written forward: plain transformers forward
hooks read the block's output, the SAE's encoder is applied by hand, and the KL is computed from
two teacher-forced forwards."""

import pytest
import torch

from engine.effects import distinct_n, feature_on_text, first_token_kl, steering_effect
from engine.generation import SamplingParams, generate
from engine.interventions import Add
from engine.testing.tiny_saes import random_sae

LAYER = 1
HOOK = f"blocks.{LAYER}.hook_resid_post"
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}


def _block_output(model, family, ids, change=None):
    """The block's output [tokens, width] and the last position's log-probabilities, read through a
    plain forward hook (changing the output with ``change`` when given)."""
    seen = {}

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if change is not None:
            hidden = change(hidden)
        seen["hidden"] = hidden[0].detach().clone()
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.get_submodule(BLOCKS[family])[LAYER].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    finally:
        handle.remove()
    return seen["hidden"], torch.log_softmax(logits, -1)


def test_distinct_2_counts_repeated_bigrams():
    assert distinct_n([1, 1, 1, 1]) == pytest.approx(1 / 3)
    assert distinct_n([1, 2, 3, 4]) == 1.0
    assert distinct_n([5]) is None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_effect_equals_a_hand_written_forward(load_tiny, family):
    weights = load_tiny(family)
    model, tokenizer = weights.model, weights.tokenizer
    width = model.config.hidden_size
    sae = random_sae(width)
    feature = 3
    prompt = tokenizer("The module provides functions for", add_special_tokens=True).input_ids
    direction = sae.W_dec[feature].detach()
    add = Add(HOOK, vector=direction, coefficient=6.0)
    (steered,) = generate(
        model, tokenizer, [prompt], [SamplingParams(max_new_tokens=8, temperature=0)], interventions=[[add]]
    )
    effect = steering_effect(
        model, prompt, steered.token_ids, sae=sae, hook=HOOK, feature=feature, interventions=[add]
    )

    # The feature, read off the unsteered model over prompt + output, encoded by hand.
    hidden, _ = _block_output(model, family, prompt + steered.token_ids)
    expected = torch.relu((hidden - sae.b_dec) @ sae.W_enc[:, feature] + sae.b_enc[feature])
    generated = expected[len(prompt) :]
    assert effect.activation_mean == pytest.approx(float(generated.mean()), abs=1e-5)
    assert effect.activation_max == pytest.approx(float(generated.max()), abs=1e-5)
    assert torch.allclose(
        feature_on_text(model, sae, HOOK, feature, prompt + steered.token_ids), expected, atol=1e-5
    )

    # KL at the first generated position: steered against unsteered, over the prompt only.
    _, base = _block_output(model, family, prompt)
    _, moved = _block_output(model, family, prompt, change=lambda h: h + 6.0 * direction)
    kl = float((moved.exp() * (moved - base)).sum())
    assert effect.first_token_kl == pytest.approx(kl, rel=1e-4, abs=1e-6)
    assert kl > 1e-3  # the vector is large enough to move the distribution
    assert effect.distinct_2 == distinct_n(steered.token_ids)
    assert effect.generated_tokens == len(steered.token_ids) == 8


def test_no_intervention_no_kl_and_generated_positions_move_nothing_at_the_first_token(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    sae = random_sae(model.config.hidden_size)
    prompt = tokenizer("Return the value", add_special_tokens=True).input_ids
    effect = steering_effect(model, prompt, [11, 12], sae=sae, hook=HOOK, feature=0)
    assert effect.first_token_kl is None
    later = Add(HOOK, positions="generated", vector=sae.W_dec[0].detach(), coefficient=9.0)
    assert first_token_kl(model, prompt, [later]) == 0.0
    nothing = steering_effect(model, prompt, [], sae=sae, hook=HOOK, feature=0)
    assert nothing.activation_mean is None and nothing.distinct_2 is None
