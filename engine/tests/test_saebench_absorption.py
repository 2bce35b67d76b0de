"""SAEBench's feature absorption on our side (sae-bench itself is the reference in
test_saebench.py, in the benchmark environment): the words and prompts, SAEs judged together
getting what each gets alone, and the refusals."""

import random

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.errors import EngineError
from engine.saebench.absorption import (
    AbsorptionConfig,
    absorption,
    absorption_plan,
    alpha_words,
    spelling_prompt,
    summarised,
    word_position,
)
from engine.testing.tiny_models import build_tiny_model
from engine.testing.tiny_saes import random_sae

HOOK = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_model("gpt2", tmp_path_factory.mktemp("absorption") / "gpt2", size="tiny", seed=0)
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def test_words_prompts_and_the_words_position(tiny):
    _, tokenizer = tiny
    words = alpha_words(tokenizer)
    ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(word))[0] for word in words]
    assert ids == sorted(ids)  # the vocabulary's order
    assert all(word.strip().isalpha() and word.strip().isascii() for word in words)
    assert any(word.startswith(" ") for word in words) and any(not word.startswith(" ") for word in words)

    rng = random.Random(1)  # noqa: S311
    prompt = spelling_prompt("cat", ["dog", "cat", "emu", "fox"], rng, template="{word}:", count=3)
    lines = prompt.split("\n")
    assert lines[0] == "" and lines[-1] == "cat:" and len(lines) == 5
    assert sorted(lines[1:4]) == ["dog: D", "emu: E", "fox: F"]  # never the word itself
    tail = len(tokenizer(" has the first letter:", add_special_tokens=False)["input_ids"])
    assert word_position(tokenizer, "{word} has the first letter:") == -(tail + 1)
    plan = absorption_plan(tokenizer, AbsorptionConfig())
    assert plan["words"] == len(words) and plan["prompts"] == len(words) + len(words) - int(0.8 * len(words))


def test_saes_judged_together_get_what_each_gets_alone(tiny):
    model, tokenizer = tiny
    config = AbsorptionConfig(min_probe_f1=0.0, min_letters=1, probe_epochs=5, k_sparse_epochs=5, max_k=3)
    saes = [random_sae(64, "topk", k=8, seed=1), random_sae(64, "standard", seed=2)]
    steps = []

    together = absorption(model, tokenizer, saes, hook_name=HOOK, config=config, progress=steps.append)

    assert steps[-1] == 1.0 and steps == sorted(steps)
    for sae, result in zip(saes, together, strict=True):
        (alone,) = absorption(model, tokenizer, [sae], hook_name=HOOK, config=config)
        assert result == alone
        assert result["words"]["train"] + result["words"]["test"] == len(alpha_words(tokenizer))
        scored = [row for row in result["letters"] if row["counted"]]
        assert scored and all(0 <= row["mean_absorption_fraction"] <= 1 for row in scored)
        assert all(1 <= row["num_split_features"] <= 3 for row in result["letters"])
    assert together[0]["letters"] != together[1]["letters"]  # different SAEs


def test_too_few_words_or_letters_known_are_said():
    config = AbsorptionConfig(min_probe_f1=0.6, min_letters=20)
    letter = {"first_letter": "a", "probe_f1": 0.9, "num_split_features": 1}
    letters = [{**letter, "mean_absorption_fraction": 0.5, "full_absorption_rate": 0.0}]
    result = summarised(letters, config)
    assert result["metrics"]["mean"]["mean_absorption_fraction_score"] is None
    assert result["not_scored"].startswith("1 of 26 letters")


def test_a_vocabulary_missing_letters_is_refused(tiny):
    model, tokenizer = tiny
    for words, said in ((40, "examples need 11 or more"), (80, "need all 26 letters")):
        with pytest.raises(EngineError) as refused:
            absorption(
                model, tokenizer, [random_sae(64)], hook_name=HOOK, config=AbsorptionConfig(max_words=words)
            )
        assert refused.value.code == "NOT_ENOUGH_WORDS" and said in refused.value.message
