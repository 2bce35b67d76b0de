"""An activation cache that is never written (engine.features.model_rows) against an extraction.

The rows it gives equal, bit for bit, the rows an extraction of the same samples and plan yields
(the order an extraction's cache stores them in), and a feature analysis over them equals one over
those extracted rows exactly, while each batch of samples runs once a pass."""

import numpy as np
import pytest
import torch

from engine.extraction import extract, plan_batches
from engine.features.analysis import AnalysisConfig, TokenTable, analyze, feature_arrays
from engine.features.model_rows import KEPT_BATCHES, ModelRows
from engine.sae import SaeShape, SparseAutoencoder

HOOK = "blocks.1.hook_resid_post"
CONFIG = AnalysisConfig(
    top_k=5, intervals=3, per_interval=2, context_before=3, context_after=2, chunk_rows=37
)


def samples(vocab: int) -> list[list[int]]:
    generator = np.random.default_rng(4)
    return [list(generator.integers(0, vocab, size=length)) for length in (9, 23, 4, 30, 17, 11, 2, 26)]


def extracted(model, tokenized, plan):
    """What an extraction's cache holds: every batch's rows in plan order, and its token table."""
    batches = list(extract(model, tokenized, plan, hooks=[HOOK], dtype="float32"))
    rows = torch.cat([batch.activations[HOOK] for batch in batches])
    table = {
        "token_ids": torch.cat([batch.token_ids for batch in batches]).numpy(),
        "sample_index": torch.cat([batch.sample_index for batch in batches]).numpy(),
        "position": torch.cat([batch.positions for batch in batches]).numpy(),
    }
    return rows, table


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_rows_and_token_table_equal_an_extraction(family, load_tiny):
    model = load_tiny(family).model
    tokenized = samples(model.config.vocab_size)
    plan = plan_batches([len(ids) for ids in tokenized], 3)
    rows, table = extracted(model, tokenized, plan)
    source = ModelRows(model, tokenized, plan, hook=HOOK)

    assert source.num_tokens == len(rows) == sum(map(len, tokenized))
    for name, column in source.tokens().items():
        np.testing.assert_array_equal(column, table[name])
    assert torch.equal(source.get(HOOK, 0, len(rows)), rows)
    for start, stop in [(0, 1), (5, 40), (31, 32), (len(rows) - 3, len(rows)), (12, 12)]:
        assert torch.equal(source.get(HOOK, start, stop), rows[start:stop])
    with pytest.raises(KeyError):
        source.get("blocks.0.hook_resid_post", 0, 1)


@pytest.mark.parametrize("batch_size", [3, 1])
def test_an_analysis_from_the_model_equals_one_over_the_extracted_rows(batch_size, load_tiny):
    model = load_tiny("gpt2").model
    tokenized = samples(model.config.vocab_size)
    plan = plan_batches([len(ids) for ids in tokenized], batch_size)
    rows, table = extracted(model, tokenized, plan)
    generator = torch.Generator().manual_seed(2)
    sae = SparseAutoencoder(SaeShape("standard", rows.shape[1], 24))
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc"):
            getattr(sae, name).copy_(torch.randn(getattr(sae, name).shape, generator=generator))

    def sweep(read_rows, token_columns):
        tokens = TokenTable(
            token_columns["token_ids"], token_columns["sample_index"], token_columns["position"]
        )
        state = analyze(sae.encode, read_rows, tokens, d_sae=24, config=CONFIG)
        return feature_arrays(state, tokens, CONFIG)

    source = ModelRows(model, tokenized, plan, hook=HOOK)
    from_model = sweep(lambda start, stop: source.get(HOOK, start, stop), source.tokens())
    from_cache = sweep(lambda start, stop: rows[start:stop], table)

    assert from_model.keys() == from_cache.keys()
    for name in from_cache:
        np.testing.assert_array_equal(from_model[name], from_cache[name], err_msg=name)
    assert from_cache["density"].max() > 0
    # Passes 1 and 2 run each batch once (a chunk ending inside a batch finds it kept for the
    # next), the third only the batches around its examples; a plan no longer than the batches
    # kept runs once in all.
    if len(plan) <= KEPT_BATCHES:
        assert source.forward_passes == len(plan)
    else:
        assert 2 * len(plan) <= source.forward_passes <= 3 * len(plan)
