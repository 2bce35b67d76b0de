"""Attribution graphs in the application's environment: the frozen model computes the real logits,
every node is its incoming edges plus its bias (the linearity the method rests on), an
intervention equals a hand-written replacement forward, a feature cap bounds the graph, graphs
round-trip through their files, and the model is left as it was. Equality with circuit-tracer
itself: test_attribution_circuit_tracer.py (benchmark environment)."""

import math

import pytest
import torch

from engine.attribution import AttributionConfig, AttributionGraph, attribute, attribution_tokens
from engine.attribution.intervention import FeatureIntervention, intervene
from engine.errors import EngineError
from engine.sae.clt import CrossLayerTranscoder
from engine.testing.tiny_saes import random_clt, random_transcoders

PROMPT = "The cat sat on the mat because it was warm, and the dog"


def _tokens(weights):
    return attribution_tokens(weights.tokenizer, PROMPT)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_the_frozen_replacement_model_computes_the_real_logits(load_tiny, family):
    weights = load_tiny(family)
    tokens = _tokens(weights)
    result = intervene(weights.model, random_transcoders(weights.model), tokens, [])
    with torch.no_grad():
        real = weights.model(torch.tensor([tokens])).logits[0, -1]
    assert torch.allclose(result.logits_before, real, atol=1e-5)
    assert torch.equal(result.logits_after, result.logits_before)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma", "gemma2", "gemma3_text"])
@pytest.mark.parametrize(("architecture", "skip"), [("standard", False), ("jumprelu", True), ("topk", False)])
def test_every_node_is_its_incoming_edges_plus_its_bias(load_tiny, family, architecture, skip):
    weights = load_tiny(family)
    k = 16 if architecture == "topk" else None
    transcoders = random_transcoders(weights.model, architecture, skip=skip, k=k, seed=4)
    graph = attribute(weights.model, transcoders, _tokens(weights), AttributionConfig(batch_size=16))
    assert graph.n_features > 40 and graph.n_logits >= 1
    assert graph.completeness_error() <= 1e-4
    # The feature nodes' values are their activations (active: pre-activation = activation),
    # and no feature sits at position 0, the attention sink.
    assert torch.allclose(
        graph.values[: graph.n_features], graph.activation_values[graph.selected_features], atol=1e-5
    )
    assert (graph.active_features[:, 1] > 0).all()
    # Edges only run forward: from earlier layers (or the same layer's tokens) and earlier positions.
    targets = graph.active_features[graph.selected_features]
    for index in torch.randperm(graph.n_features, generator=torch.Generator().manual_seed(0))[:20].tolist():
        layer, position, _ = targets[index].tolist()
        row = graph.adjacency[index, : graph.n_features]
        later = (targets[:, 0] >= layer) | (targets[:, 1] > position)
        assert not row[later].any()


def _hand_written_replacement_logits(model, transcoders, tokens, interventions):
    """GPT-2 by hand in float64: a real run records attention patterns, LayerNorm scales and each
    transcoder's error; a second run replays them with the MLPs replaced by transcoder + error and
    the features of ``interventions`` set. ``transcoders``: one per layer, or a CLT, whose
    features write into their own layer's MLP output and every later one's."""
    config = model.config
    parameters = {name: tensor.double() for name, tensor in model.state_dict().items()}
    if isinstance(transcoders, CrossLayerTranscoder):
        clt = {name: tensor.double() for name, tensor in transcoders.state_dict().items()}
        jumprelu = transcoders.shape.activation == "jumprelu"

        def encode(layer, x):
            pre = x @ clt["W_enc"][layer] + clt["b_enc"][layer]
            return pre * (pre > clt["threshold"][layer]) if jumprelu else pre.relu()

        def transcode(layer, x, features):
            written = sum(
                features[source] @ clt[f"W_dec.{source}"][:, layer - source] for source in range(layer + 1)
            )
            return written + clt["b_dec"][layer]
    else:
        coders = [
            {name: tensor.double() for name, tensor in coder.state_dict().items()} for coder in transcoders
        ]

        def encode(layer, x):
            coder = coders[layer]
            pre = x @ coder["W_enc"] + coder["b_enc"]
            return pre.relu() * (pre > coder["threshold"])

        def transcode(layer, x, features):
            coder = coders[layer]
            return features[layer] @ coder["W_dec"] + coder["b_dec"] + x @ coder["W_skip"].T

    heads, width = config.n_head, config.n_embd
    ids = torch.tensor(tokens)
    n = len(tokens)
    causal = torch.ones(n, n).tril().bool()

    def layer_norm(x, prefix, scales, key):
        centred = x - x.mean(-1, keepdim=True)
        if key not in scales:
            scales[key] = (centred.pow(2).mean(-1, keepdim=True) + config.layer_norm_epsilon).sqrt()
        return centred / scales[key] * parameters[f"{prefix}.weight"] + parameters[f"{prefix}.bias"]

    def run(patterns, scales, errors, chosen):
        h = parameters["transformer.wte.weight"][ids] + parameters["transformer.wpe.weight"][:n]
        features = []
        for layer in range(config.n_layer):
            block = f"transformer.h.{layer}"
            x = layer_norm(h, f"{block}.ln_1", scales, (layer, 1))
            qkv = x @ parameters[f"{block}.attn.c_attn.weight"] + parameters[f"{block}.attn.c_attn.bias"]
            q, k, v = (part.reshape(n, heads, -1).transpose(0, 1) for part in qkv.split(width, -1))
            if layer not in patterns:
                scores = (q @ k.transpose(-1, -2) / math.sqrt(width // heads)).masked_fill(~causal, -math.inf)
                patterns[layer] = scores.softmax(-1)
            attended = (patterns[layer] @ v).transpose(0, 1).reshape(n, width)
            h = (
                h
                + attended @ parameters[f"{block}.attn.c_proj.weight"]
                + parameters[f"{block}.attn.c_proj.bias"]
            )
            x = layer_norm(h, f"{block}.ln_2", scales, (layer, 2))
            features.append(encode(layer, x))
            if errors is None:  # the real run: the model's own MLP
                hidden = torch.nn.functional.gelu(
                    x @ parameters[f"{block}.mlp.c_fc.weight"] + parameters[f"{block}.mlp.c_fc.bias"],
                    approximate="tanh",
                )
                out = (
                    hidden @ parameters[f"{block}.mlp.c_proj.weight"] + parameters[f"{block}.mlp.c_proj.bias"]
                )
                recorded_errors.append(out - transcode(layer, x, features))
            else:
                for item in chosen:
                    if item.layer == layer:
                        features[layer][item.position, item.feature] = item.value
                out = transcode(layer, x, features) + errors[layer]
            h = h + out
        h = layer_norm(h, "transformer.ln_f", scales, "final")
        return h[-1] @ parameters["lm_head.weight"].T

    patterns, scales, recorded_errors = {}, {}, []
    before = run(patterns, scales, None, [])
    after = run(patterns, scales, recorded_errors, interventions)
    return before, after


def test_an_intervention_equals_a_hand_written_replacement_forward(load_tiny):
    weights = load_tiny("gpt2")
    transcoders = random_transcoders(weights.model, "jumprelu", skip=True, seed=5)
    tokens = _tokens(weights)
    graph = attribute(weights.model, transcoders, tokens, AttributionConfig(batch_size=16))
    # Two layer-0 features, ablated and doubled (their effects go on through layer 1's transcoder),
    # and a layer-1 feature that was off, turned on.
    layer_0 = graph.active_features[graph.active_features[:, 0] == 0]
    values = graph.activation_values[graph.active_features[:, 0] == 0]
    last = len(tokens) - 1
    on_at_the_end = {
        f for layer, position, f in graph.active_features.tolist() if (layer, position) == (1, last)
    }
    off = min(set(range(transcoders[1].shape.d_sae)) - on_at_the_end)
    chosen = [
        FeatureIntervention(*layer_0[-1].tolist(), value=0.0),
        FeatureIntervention(*layer_0[-2].tolist(), value=2 * float(values[-2])),
        FeatureIntervention(1, last, off, value=0.5),
    ]
    ours = intervene(weights.model, transcoders, tokens, chosen)
    before, after = _hand_written_replacement_logits(weights.model, transcoders, tokens, chosen)
    assert ours.previous_values[2] == 0.0
    # Equal within 1e-5 of the logits' scale (float32 against float64).
    assert (ours.logits_before.double() - before).abs().max() <= 1e-5 * before.abs().max()
    assert (ours.logits_after.double() - after).abs().max() <= 1e-5 * after.abs().max()
    assert (after - before).abs().max() > 1e-2 * before.abs().max()  # the intervention does change them


@pytest.mark.parametrize("activation", ["relu", "jumprelu"])
def test_a_clt_intervention_equals_a_hand_written_clt_replacement_forward(load_tiny, activation):
    weights = load_tiny("gpt2")
    clt = random_clt(weights.model, activation=activation, seed=7)
    tokens = _tokens(weights)
    graph = attribute(weights.model, clt, tokens, AttributionConfig(batch_size=16))
    assert graph.completeness_error() <= 1e-4
    # A layer-0 feature ablated and another doubled: each writes into layer 0's MLP output and
    # layer 1's, and layer 1's features are re-encoded from what they now receive.
    layer_0 = graph.active_features[graph.active_features[:, 0] == 0]
    values = graph.activation_values[graph.active_features[:, 0] == 0]
    chosen = [
        FeatureIntervention(*layer_0[-1].tolist(), value=0.0),
        FeatureIntervention(*layer_0[-2].tolist(), value=2 * float(values[-2])),
    ]
    ours = intervene(weights.model, clt, tokens, chosen)
    before, after = _hand_written_replacement_logits(weights.model, clt, tokens, chosen)
    assert (ours.logits_before.double() - before).abs().max() <= 1e-5 * before.abs().max()
    assert (ours.logits_after.double() - after).abs().max() <= 1e-5 * after.abs().max()
    assert (after - before).abs().max() > 1e-2 * before.abs().max()


def test_a_feature_cap_bounds_the_graph_and_a_graph_round_trips_through_its_files(load_tiny, tmp_path):
    weights = load_tiny("gpt2")
    transcoders = random_transcoders(weights.model, seed=6)
    tokens = _tokens(weights)
    graph = attribute(
        weights.model, transcoders, tokens, AttributionConfig(batch_size=16, max_feature_nodes=30)
    )
    assert len(graph.active_features) > 100
    assert graph.n_features == 30
    assert graph.adjacency.shape == (graph.n_nodes, graph.n_nodes)
    assert graph.n_nodes == 30 + (graph.n_layers + 1) * len(tokens) + graph.n_logits
    assert graph.info["capped"] and graph.info["feature_nodes"] == 30
    assert graph.completeness_error() <= 1e-4  # the features left out count as constants
    # A memory limit on the matrices keeps fewer feature nodes, never fails.
    from engine.budgets import attribution_matrices

    limit = attribution_matrices(feature_rows=12, active=len(graph.active_features), tokens=len(tokens),
                                 layers=graph.n_layers, logits=graph.n_logits)  # fmt: skip
    small = attribute(
        weights.model, transcoders, tokens, AttributionConfig(batch_size=16, matrix_limit_bytes=limit)
    )
    assert small.n_features == 12
    loaded = AttributionGraph.load(graph.save(tmp_path / "graph"))
    assert loaded.tokens == graph.tokens and loaded.info == graph.info
    assert torch.equal(loaded.adjacency, graph.adjacency)
    assert torch.equal(loaded.selected_features, graph.selected_features)


def test_attribution_leaves_the_model_as_it_was(load_tiny):
    model = load_tiny("llama").model
    flags = [parameter.requires_grad for parameter in model.parameters()]
    implementation = model.config._attn_implementation

    def hooks():  # transformers keeps output-recording hooks of its own once a test asked for them
        return [(dict(module._forward_hooks), dict(module._forward_pre_hooks)) for module in model.modules()]

    before = hooks()
    attribute(model, random_transcoders(model), [0, 5, 9, 11], AttributionConfig(batch_size=4))
    assert [parameter.requires_grad for parameter in model.parameters()] == flags
    assert model.config._attn_implementation == implementation
    assert hooks() == before


def test_bad_transcoders_and_unsupported_families_are_refused(load_tiny):
    weights = load_tiny("gpt2")
    transcoders = random_transcoders(weights.model)
    with pytest.raises(EngineError) as refused:
        attribute(weights.model, transcoders[:1], [0, 1, 2])
    assert refused.value.code == "INVALID_TRANSCODERS"
    neox = load_tiny("gpt_neox").model
    with pytest.raises(EngineError) as unsupported:
        attribute(neox, random_transcoders(neox), [0, 1, 2])
    assert unsupported.value.code == "UNSUPPORTED_ARCHITECTURE"


def test_a_special_token_goes_first(load_tiny):
    tokenizer = load_tiny("gpt2").tokenizer
    tokens = attribution_tokens(tokenizer, "the cat")
    assert tokens[0] in tokenizer.all_special_ids
    assert tokens[1:] == tokenizer("the cat", add_special_tokens=False)["input_ids"]
    assert attribution_tokens(tokenizer, tokenizer.decode(tokens)) == tokens
