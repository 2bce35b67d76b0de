"""Gemma 3 270M, a real pretrained model, against independent references: the tests marked
``real_model`` that .ci/run runs once (in the benchmark environment, which has nnsight), sharing
one converted copy (engine/testing/real_model.py).

Each hook point miStudio reads on the real model is checked against nnsight reading the same
module; steering against a hand-written forward hook; a transcoder's splice against a hand-written
forward; the logit lens against the final norm and unembedding applied by hand; an attribution
graph's completeness."""

from __future__ import annotations

import pytest
import torch

from engine.attribution.tracing import AttributionConfig, attribute, attribution_tokens
from engine.extraction import extract, plan_batches
from engine.hooks import hook_sites, list_hook_points
from engine.interventions import Add
from engine.patching import logit_lens, run_with_interventions
from engine.sae.evaluation import ce_loss_recovered
from engine.testing.real_model import real_model_folder
from engine.testing.references import summed_next_token_loss
from engine.testing.tiny_saes import random_sae, random_transcoders

pytestmark = pytest.mark.real_model

PROMPTS = [
    "In the beginning God created the heaven and the earth.",
    "def fibonacci(n):\n    if n == 0:\n        return 0",
    "The quick brown fox jumps over the lazy dog, and then it runs away.",
]
MIDDLE = 9


@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = real_model_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


@pytest.fixture(scope="module")
def token_ids(gemma):
    _, tokenizer = gemma
    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert all(row[0] == tokenizer.bos_token_id for row in ids)  # Gemma needs its BOS
    return ids


def test_the_converted_model_is_gemma_3_270m_and_writes_code(gemma):
    model, tokenizer = gemma
    assert model.config.model_type == "gemma3_text"
    assert model.num_parameters() == 268_098_176
    ids = tokenizer("def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    assert "return 0" in tokenizer.decode(out[0])


def test_every_hook_point_of_two_layers_equals_nnsight(gemma, token_ids):
    nnsight = pytest.importorskip("nnsight")
    model, _ = gemma
    # In the order the forward pass makes them: nnsight 0.8 reads modules in execution order.
    names = ["hook_embed"]
    names += [point.name for point in list_hook_points(model) if point.layer in (0, MIDDLE)]
    names += ["ln_final.hook_normalized"]
    sites = hook_sites(model, names)
    batches = list(extract(model, token_ids, plan_batches([len(r) for r in token_ids], 8), hooks=names))
    ours = {name: torch.cat([b.activations[name] for b in batches]) for name in names}
    order = torch.cat([b.sample_index for b in batches])

    wrapped = nnsight.NNsight(model)
    worst = 0.0
    for index, ids in enumerate(token_ids):
        saved = {}
        with wrapped.trace(torch.tensor([ids])):
            for site in dict.fromkeys(sites.values()):
                envoy = wrapped
                for part in site.module_path.split("."):
                    envoy = getattr(envoy, part)
                value = envoy.input if site.reads == "input" else envoy.output
                saved[site] = (value[0] if isinstance(value, tuple) else value).save()
        for name, site in sites.items():
            reference = saved[site]
            reference = reference.value if hasattr(reference, "value") else reference
            difference = (ours[name][order == index] - reference[0]).abs().max().item()
            worst = max(worst, difference / max(1.0, reference.abs().max().item()))
    # 1e-4 of each point's scale: Gemma's post-sub-layer norms make outputs of magnitude 100+.
    assert worst <= 1e-4


def test_steering_equals_a_hand_written_hook(gemma, token_ids):
    model, _ = gemma
    ids = torch.tensor([token_ids[0]])
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    steered = run_with_interventions(
        model, ids, [[Add(hook=f"blocks.{MIDDLE}.hook_resid_post", vector=vector, coefficient=4.0)]]
    )

    def add(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden + 4.0 * vector
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.model.layers[MIDDLE].register_forward_hook(add)
    try:
        with torch.no_grad():
            reference = model(input_ids=ids, use_cache=False).logits
    finally:
        handle.remove()
    with torch.no_grad():
        clean = model(input_ids=ids, use_cache=False).logits
    assert (steered - clean).abs().max() > 1e-2  # the vector moved the logits
    assert torch.allclose(steered, reference, atol=1e-4, rtol=0)


def test_a_transcoders_splice_equals_a_hand_written_forward(gemma, token_ids):
    """The MLP's output (after Gemma 3's post-feedforward norm) replaced by a transcoder of the
    MLP's input (after the pre-feedforward norm): the cross-entropy miStudio measures equals a
    forward with those two modules hooked by hand."""
    model, _ = gemma
    width = model.config.hidden_size
    transcoder = random_sae(width, expansion=2, seed=3)
    with torch.no_grad():
        transcoder.W_dec.mul_(0.05)
    result = ce_loss_recovered(
        model,
        token_ids,
        hook_name=f"blocks.{MIDDLE}.hook_mlp_out",
        sae=transcoder,
        input_hook=f"blocks.{MIDDLE}.ln2.hook_normalized",
    )
    layer = model.model.layers[MIDDLE]
    read = {}
    handles = [
        layer.mlp.register_forward_pre_hook(lambda module, args: read.__setitem__("x", args[0])),
        layer.post_feedforward_layernorm.register_forward_hook(
            lambda module, args, output: transcoder(read["x"].float()).to(output.dtype)
        ),
    ]
    try:
        losses, tokens = summed_next_token_loss(model, token_ids)
    finally:
        for handle in handles:
            handle.remove()
    assert result.sae_loss == pytest.approx(losses / tokens, rel=1e-5)
    assert result.sae_loss > result.clean_loss


def test_the_logit_lens_equals_the_final_norm_and_unembedding_by_hand(gemma, token_ids):
    model, _ = gemma
    ids = token_ids[0]
    lens = logit_lens(model, ids, top=3)
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        # hidden_states[i + 1] is block i's output, except the last (HF applies the final norm there).
        residual = hidden[MIDDLE + 1][0]
        norm = model.model.norm
        by_hand = residual.float() * torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + norm.eps)
        by_hand = by_hand * (1.0 + norm.weight.float())
        probabilities = torch.softmax(by_hand @ model.lm_head.weight.float().T, dim=-1)
    assert model.config.final_logit_softcapping is None  # Gemma 3 has no final soft-cap
    values, indices = probabilities.topk(3, dim=-1)
    for position, row in enumerate(lens.top[MIDDLE]):
        assert [token for token, _ in row] == indices[position].tolist()
        assert [p for _, p in row] == pytest.approx(values[position].tolist(), abs=1e-5)


def test_an_attribution_graph_on_the_real_model_is_complete(gemma):
    """Gemma 3's four norms per block, its (1 + w) weights, sliding and global layers and its
    scaled embedding in the frozen replacement model: every node's value equals its incoming
    edges plus its bias, and the chosen logits are the model's own top tokens."""
    model, tokenizer = gemma
    tokens = attribution_tokens(tokenizer, "The capital of France is")
    transcoders = random_transcoders(model, "jumprelu", expansion=1, seed=1)
    graph = attribute(model, transcoders, tokens, AttributionConfig(batch_size=64, max_feature_nodes=500))
    assert graph.n_features == 500
    assert graph.completeness_error() <= 1e-3
    with torch.no_grad():
        real = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    assert tokenizer.decode([int(real.argmax())]) == " the"
