"""Our attribution graphs against circuit-tracer 0.5 itself, on tiny GPT-2 and Llama models with
random and trained per-layer transcoders, and random ReLU and JumpReLU cross-layer transcoders
(CLTs), each written in circuit-tracer's layout (engine.sae.formats.save_circuit_tracer,
engine.sae.clt.save_clt) and read back by its own loaders: the same active features,
logit targets and adjacency matrix (within 1e-4 of each row's largest entry), the same features
kept under a cap, the same pruned graph, the same graph JSON, and the same logits after an
intervention.

circuit-tracer lives in the benchmark environment (bench/requirements-circuits.txt), so this
module skips in ``make test``; .ci/run runs it in ``.venv-bench``.
"""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "circuit_tracer", reason="circuit-tracer is in .venv-bench only; .ci/run runs this module there"
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import peers

peers.import_circuit_tracer()

import torch  # noqa: E402
from circuit_tracer import attribute as circuit_tracer_attribute  # noqa: E402
from circuit_tracer.graph import prune_graph  # noqa: E402
from circuit_tracer.utils.create_graph_files import create_graph_files  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from engine.attribution import AttributionConfig, attribute, attribution_tokens, prune  # noqa: E402
from engine.attribution.intervention import FeatureIntervention, intervene  # noqa: E402
from engine.attribution.neuronpedia import graph_json  # noqa: E402
from engine.sae.clt import load_clt, save_clt  # noqa: E402
from engine.sae.formats import save_circuit_tracer  # noqa: E402
from engine.testing.tiny_models import build_tiny_model, local_corpus  # noqa: E402
from engine.testing.tiny_saes import random_clt, random_transcoders, trained_transcoders  # noqa: E402

PROMPT = "The cat sat on the mat because it was warm, and the dog"
KINDS = ("random relu", "random jumprelu with skip", "trained jumprelu", "clt relu", "clt jumprelu")


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """(family, kind) -> (our model, our transcoders, circuit-tracer's model, token ids), built once."""
    root = tmp_path_factory.mktemp("circuits")
    built = {}

    def setup(family: str, kind: str):
        if (family, kind) not in built:
            folder = root / family
            if not (folder / "config.json").exists():
                build_tiny_model(family, folder, size="tiny", seed=0)
            model = AutoModelForCausalLM.from_pretrained(folder).eval()
            tokenizer = AutoTokenizer.from_pretrained(folder)
            if kind.startswith("clt"):
                saved = save_clt(
                    random_clt(model, activation=kind.split()[1], seed=3), root / f"{family}-{kind}"
                )
                built[family, kind] = (
                    model,
                    load_clt(saved),  # what a researcher's import reads back
                    peers.load_circuit_tracer_clt(folder, saved),
                    attribution_tokens(tokenizer, PROMPT),
                    tokenizer,
                )
                return built[family, kind]
            if kind == "random relu":
                transcoders = random_transcoders(model, "standard", seed=1)
            elif kind == "random jumprelu with skip":
                transcoders = random_transcoders(model, "jumprelu", skip=True, seed=2)
            else:
                batches = [
                    torch.tensor([tokenizer(text)["input_ids"][:64]]) for text in local_corpus(60_000)[:200]
                ]
                transcoders = trained_transcoders(model, [b for b in batches if b.shape[1] > 1], steps=150)
            saved = root / f"{family}-{kind.replace(' ', '-')}"
            for layer, transcoder in enumerate(transcoders):
                save_circuit_tracer(transcoder, saved, layer=layer)
            theirs = peers.load_circuit_tracer(folder, saved, n_layers=len(transcoders))
            built[family, kind] = (
                model,
                transcoders,
                theirs,
                attribution_tokens(tokenizer, PROMPT),
                tokenizer,
            )
        return built[family, kind]

    return setup


def _assert_same_adjacency(ours, theirs):
    assert ours.shape == theirs.shape
    scale = theirs.abs().amax(1, keepdim=True).clamp_min(1e-6)
    assert ((ours - theirs).abs() / scale).max() <= 1e-4


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_graph_equals_circuit_tracers(setups, family, kind):
    model, transcoders, theirs, tokens, _ = setups(family, kind)
    ours = attribute(model, transcoders, tokens, AttributionConfig(batch_size=32))
    reference = circuit_tracer_attribute(torch.tensor(tokens), theirs, batch_size=32)
    assert torch.equal(ours.active_features, reference.active_features)
    assert ours.logit_tokens.tolist() == [target.vocab_idx for target in reference.logit_targets]
    assert torch.allclose(ours.logit_probabilities, reference.logit_probabilities, atol=1e-6)
    assert torch.allclose(ours.activation_values, reference.activation_values, rtol=1e-4, atol=1e-5)
    assert ours.n_features > 50
    _assert_same_adjacency(ours.adjacency, reference.adjacency_matrix)
    # The pruned graph keeps the same nodes and edges.
    our_pruned = prune(ours, 0.8, 0.98)
    their_pruned = prune_graph(reference, 0.8, 0.98)
    assert torch.equal(our_pruned.nodes, their_pruned.node_mask)
    assert torch.equal(our_pruned.edges, their_pruned.edge_mask)
    assert ours.completeness_error() <= 1e-4


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        ("gpt2", "random jumprelu with skip"),
        ("llama", "random jumprelu with skip"),
        ("llama", "clt jumprelu"),
    ],
)
def test_a_feature_cap_keeps_the_same_most_influential_features(setups, family, kind):
    model, transcoders, theirs, tokens, _ = setups(family, kind)
    config = AttributionConfig(batch_size=16, max_feature_nodes=60, update_interval=2)
    ours = attribute(model, transcoders, tokens, config)
    reference = circuit_tracer_attribute(torch.tensor(tokens), theirs, batch_size=16, max_feature_nodes=60,
                                         update_interval=2)  # fmt: skip
    assert len(ours.active_features) > 120
    assert torch.equal(ours.selected_features, reference.selected_features)
    _assert_same_adjacency(ours.adjacency, reference.adjacency_matrix)


@pytest.mark.parametrize("kind", ["trained jumprelu", "clt jumprelu"])
def test_the_graph_json_equals_circuit_tracers(setups, tmp_path, kind):
    model, transcoders, theirs, tokens, tokenizer = setups("gpt2", kind)
    ours = attribute(model, transcoders, tokens, AttributionConfig(batch_size=32))
    reference = circuit_tracer_attribute(torch.tensor(tokens), theirs, batch_size=32)
    reference.cfg.tokenizer_name = str(Path(tokenizer.name_or_path))
    create_graph_files(reference, slug="cats", output_path=tmp_path, scan="mistudio")
    expected = json.loads((tmp_path / "cats.json").read_text())
    actual = graph_json(
        ours, slug="cats", scan="mistudio", prompt=reference.input_string, decode=tokenizer.decode
    )
    assert actual["metadata"] == expected["metadata"]
    assert actual["qParams"] == expected["qParams"]
    assert [node["node_id"] for node in actual["nodes"]] == [node["node_id"] for node in expected["nodes"]]
    for mine, theirs_node in zip(actual["nodes"], expected["nodes"], strict=True):
        assert mine.keys() == theirs_node.keys()
        for key, value in theirs_node.items():
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
            else:
                assert mine[key] == value, key
    assert [(link["source"], link["target"]) for link in actual["links"]] == [
        (link["source"], link["target"]) for link in expected["links"]
    ]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["random jumprelu with skip", "clt jumprelu"])
def test_an_intervention_on_the_last_layer_equals_circuit_tracers(setups, family, kind):
    """circuit-tracer's unconstrained intervention runs the real MLPs and adds the intervened
    features' decoders; ours runs the replacement model. They agree where nothing lies downstream
    (the last layer); effects through later layers (a CLT's too) are checked against a
    hand-written replacement forward in test_attribution.py."""
    model, transcoders, theirs, tokens, _ = setups(family, kind)
    graph = attribute(model, transcoders, tokens, AttributionConfig(batch_size=32))
    # The strongest feature of the last layer at the last position (earlier ones cannot reach its logits).
    at_the_end = (graph.active_features[:, 0] == graph.n_layers - 1) & (
        graph.active_features[:, 1] == len(tokens) - 1
    )
    strongest = graph.activation_values.masked_fill(~at_the_end, -1).argmax()
    layer, position, feature = graph.active_features[strongest].tolist()
    ours = intervene(model, transcoders, tokens, [FeatureIntervention(layer, position, feature, 0.0)],
                     freeze_norms=False)  # fmt: skip
    their_logits, _ = theirs.feature_intervention(torch.tensor(tokens), [(layer, position, feature, 0.0)])
    assert torch.allclose(ours.logits_after, their_logits[0, -1].float(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours.logits_after, ours.logits_before, atol=1e-4)


@pytest.mark.parametrize("kind", ["random jumprelu with skip", "clt jumprelu"])
def test_token_and_logit_difference_targets_equal_circuit_tracers(setups, kind):
    """circuit-tracer's ``attribution_targets``: given token ids (weighted by their probabilities),
    and a custom target, logit(a) - logit(b) weighted 1."""
    from circuit_tracer.attribution.targets import CustomTarget

    model, transcoders, theirs, tokens, _ = setups("llama", kind)
    chosen = [5, 17, 300]
    ours = attribute(
        model, transcoders, tokens, AttributionConfig(batch_size=32, target_tokens=tuple(chosen))
    )
    reference = circuit_tracer_attribute(torch.tensor(tokens), theirs, batch_size=32,
                                         attribution_targets=torch.tensor(chosen))  # fmt: skip
    assert ours.logit_tokens.tolist() == chosen == [target.vocab_idx for target in reference.logit_targets]
    assert torch.allclose(ours.logit_probabilities, reference.logit_probabilities, atol=1e-6)
    _assert_same_adjacency(ours.adjacency, reference.adjacency_matrix)
    assert ours.completeness_error() <= 1e-4

    unembedding = model.get_output_embeddings().weight.detach()
    ours = attribute(model, transcoders, tokens, AttributionConfig(batch_size=32, target_difference=(5, 17)))
    difference = CustomTarget("logit(5)-logit(17)", 1.0, unembedding[5] - unembedding[17])
    reference = circuit_tracer_attribute(torch.tensor(tokens), theirs, batch_size=32,
                                         attribution_targets=[difference])  # fmt: skip
    assert ours.n_logits == 1 and ours.info["target"] == {"kind": "difference", "tokens": [5, 17]}
    _assert_same_adjacency(ours.adjacency, reference.adjacency_matrix)
    assert torch.equal(prune(ours, 0.8, 0.98).nodes, prune_graph(reference, 0.8, 0.98).node_mask)
    # The target's value is the difference of the two logits.
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1]
    assert float(ours.values[-1]) == pytest.approx(float(logits[5] - logits[17]), abs=1e-4)
    assert ours.completeness_error() <= 1e-4
