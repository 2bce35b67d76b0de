"""The bounded view of an attribution graph (``engine.attribution.prunable``): pruned from the view
alone (its file, a prefix of its matrix), a graph gives the same nodes, edges and graph JSON as the
full-matrix prune that circuit-tracer's ``prune_graph`` is (kept below, as it was written before
the view, as the reference), at every node threshold the view covers and any edge threshold; past
that, it refuses; and the memory a prune of it takes is bounded by ``prune_memory_bytes``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.attribution import (
    AttributionConfig,
    AttributionGraph,
    PrunableGraph,
    attribute,
    attribution_tokens,
    prune,
)
from engine.attribution.neuronpedia import graph_json, node_id, stored_positions
from engine.attribution.prunable import VIEW_FILENAME, ThresholdOutOfRange, prune_memory_bytes
from engine.testing.tiny_saes import random_transcoders

PROMPT = "The cat sat on the mat because it was warm, and the dog"
# Node and edge thresholds: the default, and around it as the page's sliders reach.
THRESHOLDS = [(0.8, 0.98), (0.5, 0.9), (0.95, 0.99), (0.3, 0.5), (0.9, 0.995), (1.0, 0.98)]


def _normalised(matrix, floor=1e-10):
    absolute = matrix.abs()
    return absolute / absolute.sum(1, keepdim=True).clamp(min=floor)


def _influence(normalised, weights):
    current = weights @ normalised
    influence = current.clone()
    while current.any():
        current = current @ normalised
        influence += current
    return influence


def _threshold(scores, fraction):
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, 0) / torch.sum(ordered)
    return ordered[min(int(torch.searchsorted(cumulative, fraction)), len(cumulative) - 1)]


def reference_prune(graph, node_threshold, edge_threshold):
    """The full-matrix prune as it was (circuit-tracer's ``prune_graph``): (nodes, edges)."""
    weights = torch.zeros(graph.n_nodes)
    weights[graph.logit_start :] = graph.logit_probabilities
    influence = _influence(_normalised(graph.adjacency), weights)
    nodes = influence >= _threshold(influence, node_threshold)
    nodes[graph.token_start :] = True
    kept = graph.adjacency.clone()
    kept[~nodes] = 0
    kept[:, ~nodes] = 0
    normalised = _normalised(kept)
    scores = normalised * (_influence(normalised, weights) + weights)[:, None]
    edges = scores >= _threshold(scores.flatten(), edge_threshold)
    sources, n_features = graph.token_start, graph.n_features
    previous = nodes.clone()
    nodes[:sources] &= edges[:, :sources].any(0)
    nodes[:n_features] &= edges[:n_features].any(1)
    while not torch.equal(previous, nodes):
        previous = nodes.clone()
        edges[~nodes] = False
        edges[:, ~nodes] = False
        nodes[:sources] &= edges[:, :sources].any(0)
        nodes[:n_features] &= edges[:n_features].any(1)
    return nodes, edges


@pytest.fixture(scope="module")
def graph(load_tiny):
    weights = load_tiny("gpt2")
    tokens = attribution_tokens(weights.tokenizer, PROMPT)
    return attribute(weights.model, random_transcoders(weights.model, seed=6), tokens, AttributionConfig())


def _decode(token: int) -> str:
    return f"t{token}"


def _json(graph, node_threshold, edge_threshold):
    return graph_json(graph, slug="g", scan="s", prompt=PROMPT, decode=_decode, node_threshold=node_threshold,
                      edge_threshold=edge_threshold)  # fmt: skip


@pytest.mark.parametrize(("node_threshold", "edge_threshold"), THRESHOLDS)
def test_the_prune_equals_the_full_matrix_prune(graph, node_threshold, edge_threshold):
    nodes, edges = reference_prune(graph, node_threshold, edge_threshold)
    pruned = prune(graph, node_threshold, edge_threshold)
    assert torch.equal(pruned.nodes, nodes)
    assert torch.equal(pruned.edges, edges)
    if 0.5 <= node_threshold < 0.99:  # a prune that keeps some features and leaves others
        assert 0 < int(nodes[: graph.n_features].sum()) < graph.n_features


@pytest.mark.parametrize("edge_threshold", [0.999, 0.9999, 1.0])
def test_an_edge_threshold_at_one_differs_only_by_rounding(graph, edge_threshold):
    """Near 1, consecutive cumulative shares of the weakest edges are closer than float32 tells
    apart, and the edge stage sums the kept nodes' matrix rather than the full one with the other
    rows zeroed: the same nodes, and at most a hundredth of the edges differ (at 1, weak ones)."""
    nodes, edges = reference_prune(graph, 0.9, edge_threshold)
    pruned = prune(graph, 0.9, edge_threshold)
    assert torch.equal(pruned.nodes, nodes)
    assert int((pruned.edges ^ edges).sum()) <= 1e-2 * int(edges.sum())


def test_a_saved_view_prunes_as_the_full_graph_without_it(graph, tmp_path):
    assert graph.n_nodes > 400
    view = PrunableGraph.of(graph, max_nodes=150)
    assert view.n_stored <= 150 + view.n_fixed
    assert 0.8 < view.max_node_threshold < 1.0
    path = view.save(tmp_path)
    assert path == tmp_path / VIEW_FILENAME and path.stat().st_size < graph.adjacency.numel()
    opened = PrunableGraph.open(tmp_path)
    assert opened.adjacency is None  # a prune reads the rows it keeps, no more
    covered = [pair for pair in THRESHOLDS if pair[0] <= opened.max_node_threshold]
    assert len(covered) >= 3
    for node_threshold, edge_threshold in covered:
        assert _json(opened, node_threshold, edge_threshold) == _json(graph, node_threshold, edge_threshold)
        nodes, _ = reference_prune(graph, node_threshold, edge_threshold)
        kept = opened.prune(node_threshold, edge_threshold)
        assert sorted(opened.nodes[kept.positions[kept.nodes]].tolist()) == nodes.nonzero().flatten().tolist()
    with pytest.raises(ThresholdOutOfRange):
        opened.prune(0.999, 0.98)
    # A view of every node covers every threshold.
    whole = PrunableGraph.of(graph)
    assert whole.max_node_threshold == 1.0 and whole.n_stored == graph.n_nodes
    assert _json(whole, 1.0, 1.0) == _json(graph, 1.0, 1.0)


def test_pinned_nodes_stay_at_any_threshold_with_their_strong_edges(graph, tmp_path):
    """A researcher's pinned nodes survive a prune that would drop them (the node slider moved to
    0.5), read from a saved view; the rest of the prune is circuit-tracer's unchanged, and a kept
    node's edges are those at least as strong as the weakest edge shown."""
    PrunableGraph.of(graph, max_nodes=150).save(tmp_path)
    view = PrunableGraph.open(tmp_path)
    plain = view.prune(0.5, 0.98)
    shown = set(plain.positions[plain.nodes].tolist())
    dropped = [index for index in range(view.n_fixed, view.n_stored) if index not in shown][-3:]
    assert len(dropped) == 3 and max(dropped) >= view.kept_count(0.5)  # one past the prefix read
    kept = view.prune(0.5, 0.98, keep=dropped)
    assert set(kept.positions[kept.nodes].tolist()) == shown | set(dropped)
    place = {int(stored): at for at, stored in enumerate(kept.positions.tolist())}
    old = torch.tensor([place[int(stored)] for stored in plain.positions.tolist()])
    assert torch.equal(kept.edges[old[:, None], old[None, :]], plain.edges)
    weakest = plain.adjacency[plain.edges].abs().min()
    forced = torch.tensor([place[index] for index in dropped])
    touching = torch.cat(
        [kept.adjacency[forced][kept.edges[forced]], kept.adjacency[:, forced][kept.edges[:, forced]]]
    )
    assert len(touching) > 0 and (touching.abs() >= weakest).all()
    # The JSON shows them, found by the node ids a graph row stores for its pins.
    pinned = [node_id(view, index) for index in dropped]
    assert stored_positions(view, pinned) == sorted(dropped)
    json_nodes = graph_json(view, slug="g", scan="s", prompt=PROMPT, decode=_decode, node_threshold=0.5,
                            kept=kept, pinned=pinned)["nodes"]  # fmt: skip
    assert set(pinned) <= {node["node_id"] for node in json_nodes}


def test_the_graph_json_is_the_full_graphs(graph):
    """Node ids, influence, activation and links, against the reference prune's masks."""
    view = _json(graph, 0.8, 0.98)
    nodes, edges = reference_prune(graph, 0.8, 0.98)
    feature_ids = {
        node["node_id"] for node in view["nodes"] if node["feature_type"] == "cross layer transcoder"
    }
    expected = set()
    for index in nodes[: graph.n_features].nonzero().flatten().tolist():
        layer, position, feature = graph.active_features[graph.selected_features[index]].tolist()
        expected.add(f"{layer}_{feature}_{position}")
    assert feature_ids and feature_ids <= expected
    assert len(view["links"]) == int(edges.sum())
    first = next(node for node in view["nodes"] if node["feature_type"] == "cross layer transcoder")
    layer, feature, position = (int(part) for part in first["node_id"].split("_"))
    row = ((graph.active_features == torch.tensor([layer, position, feature])).all(1)).nonzero().item()
    assert first["activation"] == pytest.approx(float(graph.activation_values[row]))


def _layered_graph(n_features: int, positions: int, logits: int) -> AttributionGraph:
    """A random graph of two layers: tokens feed features and errors of layer 0, which feed those
    of layer 1; all feed the logits (acyclic, as a real graph)."""
    torch.manual_seed(0)
    n_layers = 2
    half = n_features // 2
    level = torch.cat([
        torch.ones(half), torch.full((n_features - half,), 2.0),  # features
        torch.ones(positions), torch.full((positions,), 2.0),  # errors, layer-major
        torch.zeros(positions), torch.full((logits,), 3.0),  # tokens, logits
    ])  # fmt: skip
    adjacency = torch.rand(len(level), len(level)) ** 4 * (level[:, None] > level[None, :])
    features = torch.arange(n_features)
    return AttributionGraph(
        tokens=list(range(positions)), n_layers=n_layers,
        active_features=torch.stack([(features >= half).long(), features % positions, features], 1),
        activation_values=torch.ones(n_features), selected_features=features, adjacency=adjacency,
        logit_tokens=torch.arange(logits), logit_probabilities=torch.full((logits,), 1 / logits),
        bias=torch.zeros(len(level)), values=torch.zeros(len(level)),
    )  # fmt: skip


MEASURE = """
import re, sys
from engine.attribution import PrunableGraph

def memory(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

view = PrunableGraph.open(sys.argv[1])
threshold = view.max_node_threshold
before = memory("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
view.prune(threshold, 0.98)
print(view.kept_count(threshold), memory("VmHWM") - before)
"""


def test_a_prune_takes_at_most_its_estimate(tmp_path):
    """A graph of 3,000 nodes with a view of 1,200 and the tokens and logits: in a process of its
    own (whose peak memory is the prune's, not what an earlier test freed), a prune at the view's
    widest threshold takes at most ``prune_memory_bytes`` of the nodes it keeps."""
    PrunableGraph.of(_layered_graph(2640, 120, 10), max_nodes=1200).save(tmp_path)
    environment = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)], capture_output=True, text=True,
                         env=environment, check=True, timeout=120)  # fmt: skip
    kept, used = (int(part) for part in run.stdout.split())
    assert kept > 1200
    assert 16 * kept * kept < used <= prune_memory_bytes(kept), (kept, used, prune_memory_bytes(kept))
