"""Feature analysis against a brute-force computation over all the rows at once.

The reference encodes every row in one call and takes densities, top examples, histograms,
interval examples and context values with plain numpy over the whole [rows, d_sae] matrix:
what the streaming passes must reproduce exactly, whatever the chunking and however often the
sweep is interrupted and resumed. Logit effects and neighbours are checked against the full
[d_sae, vocab] and [d_sae, d_sae] products.
"""

import numpy as np
import pytest
import torch

from engine.features.analysis import (
    AnalysisCancelled,
    AnalysisConfig,
    AnalysisState,
    TokenTable,
    _samples_contiguous,
    analyze,
    feature_arrays,
    interval_of,
    row_feature_hash,
)
from engine.features.decoder import decoder_neighbours, logit_effects
from engine.features.inference import auto_label
from engine.sae import SaeShape, SparseAutoencoder

D_IN, D_SAE = 12, 40
CONFIG = AnalysisConfig(
    top_k=6, intervals=3, per_interval=2, context_before=3, context_after=2, histogram_bins=7, chunk_rows=97
)


def random_sae(architecture="standard", k=None) -> SparseAutoencoder:
    generator = torch.Generator().manual_seed(3)
    sae = SparseAutoencoder(SaeShape(architecture, D_IN, D_SAE, k=k))
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            parameter = getattr(sae, name)
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        sae.b_enc -= 1.5  # sparse enough that some features are rare
        sae.b_enc[:2] = -1e4  # two dead features
    return sae


def cache(rows_per_sample=(5, 17, 1, 30, 9, 12) * 20, *, order="rows"):
    """Rows and a token table of samples of unequal lengths, stored in sample order (``rows``),
    longest sample first as an extraction writes them (``samples``: each sample's rows together),
    or every row anywhere (``shuffled``, as a generation's cache may be)."""
    generator = torch.Generator().manual_seed(5)
    if order == "samples":
        rows_per_sample = tuple(sorted(rows_per_sample, reverse=True))
    sample_ids = np.arange(len(rows_per_sample))
    if order == "samples":
        sample_ids = np.random.default_rng(1).permutation(sample_ids)
    samples = np.repeat(sample_ids, rows_per_sample)
    positions = np.concatenate([np.arange(n) for n in rows_per_sample])
    rows = torch.randn(len(samples), D_IN, generator=generator)
    if order == "shuffled":
        scatter = np.random.default_rng(0).permutation(len(samples))
        samples, positions, rows = samples[scatter], positions[scatter], rows[torch.from_numpy(scatter)]
    token_ids = (np.arange(len(samples)) * 7 + 3) % 50
    return rows, TokenTable(token_ids=token_ids, sample_index=samples, position=positions)


def brute_force(acts: np.ndarray, tokens: TokenTable, config: AnalysisConfig):
    """Every number of the analysis from the whole activation matrix."""
    d_sae = acts.shape[1]
    firing = acts > 0
    count = firing.sum(axis=0)
    maxima = acts.max(axis=0)
    top_rows = np.full((d_sae, config.top_k), -1)
    top_values = np.zeros((d_sae, config.top_k), dtype=np.float32)
    histogram = np.zeros((d_sae, config.histogram_bins), dtype=np.int64)
    interval_rows = [[] for _ in range(d_sae)]
    for feature in range(d_sae):
        column = acts[:, feature]
        positive = np.flatnonzero(column > 0)
        order = positive[np.lexsort((positive, -column[positive]))][: config.top_k]
        top_rows[feature, : len(order)] = order
        top_values[feature, : len(order)] = column[order]
        if len(positive):
            bins = interval_of(
                column[positive], np.full(len(positive), maxima[feature]), config.histogram_bins
            )
            histogram[feature] = np.bincount(bins, minlength=config.histogram_bins)
            interval = interval_of(
                column[positive], np.full(len(positive), maxima[feature]), config.intervals
            )
            priority = row_feature_hash(positive, np.full(len(positive), feature))
            for q in range(config.intervals):
                members = positive[interval == q]
                chosen = members[np.argsort(-priority[interval == q], kind="stable")][: config.per_interval]
                interval_rows[feature].extend(chosen.tolist())
    return {
        "count": count, "max": maxima, "top_rows": top_rows, "top_values": top_values,
        "histogram": histogram, "interval_rows": interval_rows,
    }  # fmt: skip


def run(sae, rows, tokens, config=CONFIG, **options):
    return analyze(
        sae.encode, lambda start, stop: rows[start:stop], tokens, d_sae=D_SAE, config=config, **options
    )


@pytest.mark.parametrize(
    ("architecture", "k", "order"),
    [("standard", None, "rows"), ("topk", 5, "samples"), ("topk", 5, "shuffled")],
)
def test_analysis_equals_brute_force(architecture, k, order):
    sae = random_sae(architecture, k)
    rows, tokens = cache(order=order)
    # Only a table whose samples are scattered needs the (16 bytes a token) index.
    assert (tokens._order is not None) == (order == "shuffled")
    state = run(sae, rows, tokens)
    result = feature_arrays(state, tokens, CONFIG)
    with torch.no_grad():
        acts = sae.encode(rows).numpy()
    reference = brute_force(acts, tokens, CONFIG)

    assert state.phase == 4
    np.testing.assert_array_equal(result["nonzero_count"], reference["count"])
    np.testing.assert_allclose(result["density"], reference["count"] / len(rows), rtol=1e-6)
    assert (result["nonzero_count"] == 0).sum() >= 2  # the dead ones
    np.testing.assert_allclose(result["max"], np.maximum(reference["max"], 0), rtol=1e-5)
    mean = np.where(
        reference["count"] > 0, np.where(acts > 0, acts, 0).sum(0) / np.maximum(reference["count"], 1), 0
    )
    np.testing.assert_allclose(result["mean"], mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(result["top_rows"], reference["top_rows"])
    np.testing.assert_allclose(result["top_values"], reference["top_values"], rtol=1e-5)
    np.testing.assert_array_equal(result["histogram"], reference["histogram"])
    for feature in range(D_SAE):
        got = result["interval_rows"][feature]
        assert sorted(got[got >= 0].tolist()) == sorted(reference["interval_rows"][feature])
        values = result["interval_values"][feature][got >= 0]
        assert list(values) == sorted(values, reverse=True)  # strongest first
        np.testing.assert_allclose(values, acts[got[got >= 0], feature], rtol=1e-5)

    # Context: the feature's own value on each token around the example, same sample only.
    for prefix in ("top", "interval"):
        example_rows = result[f"{prefix}_rows"]
        context, context_tokens = result[f"{prefix}_context"], result[f"{prefix}_context_tokens"]
        for feature in range(0, D_SAE, 3):
            for slot, row in enumerate(example_rows[feature]):
                if row < 0:
                    assert np.isnan(context[feature, slot].astype(np.float32)).all()
                    continue
                same = np.flatnonzero(tokens.sample_index == tokens.sample_index[row])
                same = same[np.argsort(tokens.position[same])]
                at = int(np.flatnonzero(same == row)[0])
                for offset in range(-CONFIG.context_before, CONFIG.context_after + 1):
                    cell = offset + CONFIG.context_before
                    if 0 <= at + offset < len(same):
                        neighbour = same[at + offset]
                        assert context_tokens[feature, slot, cell] == tokens.token_ids[neighbour]
                        assert context[feature, slot, cell] == pytest.approx(
                            acts[neighbour, feature], rel=1e-3, abs=1e-3
                        )
                    else:
                        assert context_tokens[feature, slot, cell] == -1
                assert result[f"{prefix}_position"][feature, slot] == tokens.position[row]


def test_contiguity_check_across_blocks():
    samples = np.array([4, 4, 4, 0, 0, 7, 7, 7, 7, 2])
    positions = np.array([0, 1, 2, 0, 1, 0, 1, 2, 3, 0])
    for block in (1, 2, 3, 4, 100):
        assert _samples_contiguous(samples, positions, block=block)
        # Sample 4 again after others: its rows are in two runs.
        assert not _samples_contiguous(np.append(samples, 4), np.append(positions, 3), block=block)
        # Positions going back within a sample.
        assert not _samples_contiguous(samples, np.array([0, 2, 1, 0, 1, 0, 1, 2, 3, 0]), block=block)
    assert _samples_contiguous(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def test_interrupted_and_resumed_sweep_gives_the_same_arrays(tmp_path):
    sae = random_sae()
    rows, tokens = cache()
    whole = run(sae, rows, tokens)

    calls = {"n": 0}

    def cancel_every_fifth_chunk():
        calls["n"] += 1
        return calls["n"] % 5 == 0

    saved: list[AnalysisState] = []
    state = None
    for _ in range(100):  # each round runs until the cancel, then resumes from the saved state
        try:
            state = run(
                sae, rows, tokens, resume=AnalysisState.load(tmp_path),
                should_cancel=cancel_every_fifth_chunk, checkpoint_seconds=0,
                on_checkpoint=lambda s: (s.save(tmp_path), saved.append(s)),
            )  # fmt: skip
            break
        except AnalysisCancelled:
            continue
    assert state is not None and state.phase == 4 and len(saved) > 5
    for name, array in whole.arrays.items():
        np.testing.assert_array_equal(state.arrays[name], array, err_msg=name)


class Yielded(Exception):
    """A job giving its worker up once its state is saved."""


def test_a_sweep_that_yields_at_due_checkpoints_resumes_to_the_same_arrays(tmp_path):
    """``checkpoint_due`` offers the state off the periodic schedule (a job's time slice ending);
    an ``on_checkpoint`` that raises stops the sweep, which resumes from the saved state."""
    sae = random_sae()
    rows, tokens = cache()
    whole = run(sae, rows, tokens)
    asked = iter(range(10**6))

    def save_and_yield(state: AnalysisState) -> None:
        state.save(tmp_path)
        raise Yielded

    state, yielded = None, 0
    for _ in range(100):
        try:
            state = run(
                sae, rows, tokens, resume=AnalysisState.load(tmp_path), checkpoint_seconds=10**9,
                checkpoint_due=lambda: next(asked) % 4 == 3, on_checkpoint=save_and_yield,
            )  # fmt: skip
            break
        except Yielded:
            yielded += 1
    assert state is not None and state.phase == 4 and yielded > 3
    for name, array in whole.arrays.items():
        np.testing.assert_array_equal(state.arrays[name], array, err_msg=name)


def test_logit_effects_and_neighbours_equal_the_full_products():
    generator = torch.Generator().manual_seed(1)
    W_dec, W_U, scale = (
        torch.randn(D_SAE, D_IN, generator=generator),
        torch.randn(D_IN, 300, generator=generator),
        torch.rand(D_IN, generator=generator) + 0.5,
    )
    effects = logit_effects(W_dec, W_U, scale, top=10, bins=8, block=7)
    logits = (W_dec * scale).numpy().astype(np.float64) @ W_U.numpy().astype(np.float64)
    for feature in range(D_SAE):
        order = np.argsort(-logits[feature])
        np.testing.assert_array_equal(effects["logit_top_ids"][feature], order[:10])
        np.testing.assert_allclose(
            effects["logit_top_values"][feature], logits[feature, order[:10]], rtol=1e-4
        )
        np.testing.assert_array_equal(effects["logit_bottom_ids"][feature], order[::-1][:10])
        assert effects["logit_histogram"][feature].sum() == 300
        np.testing.assert_allclose(
            effects["logit_range"][feature], [logits[feature].min(), logits[feature].max()], rtol=1e-4
        )

    neighbours = decoder_neighbours(W_dec, top=5, block=6)
    unit = W_dec.numpy() / np.linalg.norm(W_dec.numpy(), axis=1, keepdims=True)
    cosine = unit @ unit.T
    np.fill_diagonal(cosine, -np.inf)
    np.testing.assert_array_equal(neighbours["neighbour_ids"], np.argsort(-cosine, axis=1)[:, :5])
    np.testing.assert_allclose(
        neighbours["neighbour_cosines"], np.sort(cosine, axis=1)[:, ::-1][:, :5], rtol=1e-5
    )


def test_auto_label_is_the_most_frequent_activating_tokens():
    words = {1: " must", 2: " should", 3: "\n", 4: " need", 5: "Must", 6: "\ufffd"}
    assert auto_label([2, 1, 1, 3, 6, 6, 4, 2, 1, 5], words.__getitem__) == "must · should · need"
    assert auto_label([-1, -1], words.__getitem__) == ""


def test_take_from_a_memory_map_reads_blocks_in_row_order(tmp_path):
    values = np.arange(1000, dtype=np.int64) * 3 + 1
    mapped = np.memmap(tmp_path / "column", dtype=np.int64, mode="w+", shape=values.shape)
    mapped[:] = values
    mapped.flush()
    column = np.memmap(tmp_path / "column", dtype=np.int64, mode="r", shape=values.shape)
    rows = np.random.default_rng(2).integers(0, 1000, size=(13, 7))
    for block in (1, 64, 1 << 20):
        np.testing.assert_array_equal(TokenTable.take(column, rows, block=block), values[rows])
    np.testing.assert_array_equal(TokenTable.take(values, rows), values[rows])  # plain memory


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_logit_effects_scale_by_the_final_rms_norm_of_each_family(family, load_tiny):
    """A direction's logit weights are what the model's own final RMSNorm and head give it, less
    the norm's division by the direction's root mean square (Gemma's norm scales by 1 + w)."""
    from engine.features.decoder import unembedding

    model = load_tiny(family).model
    norm = model.get_submodule("model.norm")
    assert norm.weight.abs().min() > 0  # the tiny models draw norm weights away from identity
    W_U, scale = unembedding(model)
    W_dec = torch.randn(D_SAE, model.config.hidden_size, generator=torch.Generator().manual_seed(5))

    effects = logit_effects(W_dec, W_U, scale, top=5, bins=4, block=9)

    with torch.no_grad():
        eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
        root_mean_square = (W_dec.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        expected = model.get_output_embeddings()(norm(W_dec)) * root_mean_square
    values, ids = expected.topk(5, dim=1)
    np.testing.assert_array_equal(effects["logit_top_ids"], ids.numpy())
    np.testing.assert_allclose(effects["logit_top_values"], values.numpy(), rtol=1e-4, atol=1e-5)
