"""Activation patching and the logit lens against plain transformers forward passes."""

import pytest
import torch

from engine.extraction import extract
from engine.patching import PatchingError, logit_lens, patching_grid
from engine.readout import logits_from_residual

CLEAN = "The cat sat on the mat and the cat"


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=True).input_ids


def _pair(tokenizer):
    """The clean prompt's ids, and the same with two tokens swapped for others (same length)."""
    clean = _ids(tokenizer, CLEAN)
    corrupted = list(clean)
    for position in range(len(clean) - 1):  # all but the last token: the model's inputs differ
        corrupted[position] = (corrupted[position] * 7 + 11) % 1000
    return clean, corrupted


def _metric(model, ids, answer, wrong, hook=None):
    handle = model.transformer.h[0].register_forward_pre_hook(hook) if hook else None
    try:
        with torch.no_grad():
            last = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
    finally:
        if handle:
            handle.remove()
    return float(last[answer] - last[wrong])


def test_patching_equals_hand_patched_forwards(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    clean, corrupted = _pair(tokenizer)
    answer, wrong = clean[-1], corrupted[1]
    hooks = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.0.hook_attn_out"]

    result = patching_grid(model, clean, corrupted, answer_id=answer, wrong_id=wrong, hooks=hooks)

    assert result.hooks == hooks and len(result.grid) == 3 and len(result.grid[0]) == len(clean)
    assert result.clean_metric == pytest.approx(_metric(model, clean, answer, wrong), abs=1e-4)
    assert result.corrupted_metric == pytest.approx(_metric(model, corrupted, answer, wrong), abs=1e-4)
    spread = abs(result.clean_metric - result.corrupted_metric)
    assert spread > 1e-2, spread  # a random tiny model still tells the two apart
    # Every position of a residual stream patched: the clean run's metric.
    assert result.all_positions[0] == pytest.approx(result.clean_metric, abs=1e-4)
    assert result.all_positions[1] == pytest.approx(result.clean_metric, abs=1e-4)
    # One position of block 0's input, by a hand-written pre-hook.
    with torch.no_grad():
        embedded = model(torch.tensor([clean]), output_hidden_states=True).hidden_states[0][0]
    for position in range(len(clean)):

        def patch(module, args, position=position):
            hidden = args[0].clone()
            hidden[0, position] = embedded[position]
            return (hidden, *args[1:])

        expected = _metric(model, corrupted, answer, wrong, hook=patch)
        assert result.grid[0][position] == pytest.approx(expected, abs=1e-4)


def test_patching_a_run_into_itself_changes_nothing(load_tiny):
    weights = load_tiny("llama")
    clean = _ids(weights.tokenizer, CLEAN)
    hooks = ["blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]
    result = patching_grid(weights.model, clean, clean, answer_id=clean[-1], wrong_id=clean[1], hooks=hooks)
    assert result.corrupted_metric == pytest.approx(result.clean_metric, abs=1e-5)
    for row in result.grid:
        assert row == pytest.approx([result.clean_metric] * len(clean), abs=1e-4)


def test_patching_refuses_prompts_of_different_lengths(load_tiny):
    weights = load_tiny("gpt2")
    with pytest.raises(PatchingError) as raised:
        patching_grid(
            weights.model, [1, 2, 3], [1, 2], answer_id=1, wrong_id=2, hooks=["blocks.0.hook_resid_pre"]
        )
    assert raised.value.code == "PROMPT_LENGTHS_DIFFER"


def test_logit_lens_reads_each_layer_through_the_final_norm_and_unembedding(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer, CLEAN)

    lens = logit_lens(model, ids, top=3)

    with torch.no_grad():
        output = model(torch.tensor([ids]), output_hidden_states=True)
        blocks = len(model.transformer.h)
        assert lens.layers == list(range(blocks))
        for layer in lens.layers:
            # hidden_states[layer + 1] is block layer's output, except the last, which has ln_f applied.
            residual = output.hidden_states[layer + 1][0]
            normed = residual if layer == blocks - 1 else model.transformer.ln_f(residual)
            probabilities = torch.softmax(model.lm_head(normed), -1)
            values, top_ids = probabilities.topk(3, -1)
            for position in range(len(ids)):
                got = lens.top[layer][position]
                assert [token for token, _ in got] == top_ids[position].tolist()
                assert [p for _, p in got] == pytest.approx(values[position].tolist(), abs=1e-5)
    # The last layer's lens is the model's own prediction.
    assert lens.top[-1][-1][0][0] == int(output.logits[0, -1].argmax())


def _output_head_by_hand(model, residual):
    """Final norm (the model's module), unembedding and, when configured, ``cap * tanh(x / cap)``."""
    logits = model.get_output_embeddings()(model.get_submodule("model.norm")(residual))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_logit_lens_applies_the_final_norm_and_soft_cap_of_each_family(family, load_tiny):
    weights = load_tiny(family)
    model, tokenizer = weights.model, weights.tokenizer
    ids = _ids(tokenizer, CLEAN)

    lens = logit_lens(model, ids, top=4)

    with torch.no_grad():
        output = model(torch.tensor([ids]), output_hidden_states=True)
        blocks = model.config.num_hidden_layers
        for layer in lens.layers[:-1]:
            probabilities = torch.softmax(_output_head_by_hand(model, output.hidden_states[layer + 1][0]), -1)
            values, top_ids = probabilities.topk(4, -1)
            for position in range(len(ids)):
                got = lens.top[layer][position]
                assert [token for token, _ in got] == top_ids[position].tolist()
                assert [p for _, p in got] == pytest.approx(values[position].tolist(), abs=1e-6)
        # The last layer's lens is the model's own next-token distribution, soft-cap included.
        own = torch.softmax(output.logits[0].float(), -1)
        values, top_ids = own.topk(4, -1)
        for position in range(len(ids)):
            got = lens.top[blocks - 1][position]
            assert [token for token, _ in got] == top_ids[position].tolist()
            assert [p for _, p in got] == pytest.approx(values[position].tolist(), abs=1e-6)
        # The readout itself, from the last block's output: the model's logits exactly.
        (run,) = extract(model, [ids], [[0]], hooks=[f"blocks.{blocks - 1}.hook_resid_post"])
        logits = logits_from_residual(model, run.activations[f"blocks.{blocks - 1}.hook_resid_post"])
        torch.testing.assert_close(logits, output.logits[0].float(), atol=1e-6, rtol=1e-5)
        if getattr(model.config, "final_logit_softcapping", None):
            # The cap is small enough that forgetting it would change the distribution.
            uncapped = torch.log_softmax(model.lm_head(output.hidden_states[-1][0]), -1)
            assert (uncapped - own.log()).abs().max() > 0.1
