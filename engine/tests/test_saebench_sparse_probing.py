"""SAEBench's sparse probing on our side (sae-bench itself is the reference in test_saebench.py, in
the benchmark environment): several SAEs at one hook point probed together, in one pass of the
model, get each what it gets alone; the model's own probes do not depend on the SAE."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.saebench.sparse_probing import sparse_probing, split_by_class
from engine.testing.corpus import first_word_classes
from engine.testing.tiny_models import build_tiny_model
from engine.testing.tiny_saes import random_sae

HOOK = "blocks.1.hook_resid_post"


def test_saes_probed_together_get_what_each_gets_alone(tmp_path):
    folder = build_tiny_model("gpt2", tmp_path / "gpt2", size="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    split = split_by_class(first_word_classes(300), train_fraction=0.7, max_per_class=30, seed=3)
    saes = [
        random_sae(model.config.hidden_size, "topk", k=4, seed=1),
        random_sae(model.config.hidden_size, "standard", seed=2),
        random_sae(model.config.hidden_size, "jumprelu", seed=3),
    ]
    options = {"hook_name": HOOK, "k_values": [1, 3], "context_length": 32, "seed": 5, "batch_size": 4}
    steps = []

    together = sparse_probing(
        model, tokenizer, saes, split, progress=lambda *step: steps.append(step), **options
    )

    assert steps[-1] == (2 * len(split.train), 2 * len(split.train))  # each class's train and test texts
    for sae, result in zip(saes, together, strict=True):
        (alone,) = sparse_probing(model, tokenizer, [sae], split, **options)
        assert result == alone  # bit for bit
        assert result["metrics"]["llm"] == together[0]["metrics"]["llm"]
        assert set(result["metrics"]["sae"]) == {"sae_top_1_test_accuracy", "sae_top_3_test_accuracy"}
        assert all(0 <= value <= 1 for value in result["metrics"]["sae"].values())
    assert together[0]["metrics"]["sae"] != pytest.approx(together[1]["metrics"]["sae"])  # different SAEs
