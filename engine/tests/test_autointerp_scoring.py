"""The scorers' samples, batches, prompts, answers and balanced accuracy, against hand-computed
references. Agreement with delphi itself: test_autointerp_delphi.py (in .venv-bench)."""

import random

import pytest

from engine.autointerp.pipeline import InterpretationConfig
from engine.autointerp.prompts import Example
from engine.autointerp.scoring import (
    DetectionScorer,
    FuzzingScorer,
    Sample,
    Score,
    UnknownScorer,
    balanced_accuracy,
    detection_samples,
    fuzzing_samples,
    parse_predictions,
    register_scorer,
    scorer_named,
    scorer_names,
    scoring_batches,
    scoring_messages,
)

LETTERS = tuple("abcdefgh")
# Non-zero values: 3 and 4, so non-activating examples get ceil(3.5) = 4 random marks.
TEST = [
    Example(("a", "b", "c", "d", "e", "f"), (0.0, 1.0, 5.0, 10.0, 0.0, 3.0)),
    Example(("g", "h", "i", "j"), (2.0, 0.5, 0.0, 0.25)),
]
ZEROS = Example(LETTERS, (0.0,) * 8)


def _marked(text: str) -> list[str]:
    """The single-letter tokens between << and >>."""
    marked, inside = [], False
    for part in text.replace("<<", "\0<").replace(">>", "\0>").split("\0"):
        if part.startswith("<"):
            inside, part = True, part[1:]
        elif part.startswith(">"):
            inside, part = False, part[1:]
        if inside:
            marked.append(part)
    return list("".join(marked))


def test_detection_samples_are_plain_texts_non_activating_first():
    samples = detection_samples(TEST, [ZEROS, ZEROS])
    assert samples == [
        Sample("abcdefgh", False, 0),
        Sample("abcdefgh", False, 1),
        Sample("abcdef", True, 0),
        Sample("ghij", True, 1),
    ]


def test_fuzzing_marks_test_examples_at_three_tenths_of_their_maximum_or_more():
    samples = fuzzing_samples(TEST, [])
    # cutoffs 3.0 (3.0 itself is marked) and 0.6 (0.5 and 0.25 are not)
    assert samples == [Sample("ab<<cd>>e<<f>>", True, 0), Sample("<<g>>hij", True, 1)]


def test_fuzzing_marks_non_activating_examples_at_random_reproducibly():
    samples = fuzzing_samples(TEST, [ZEROS, ZEROS, Example(tuple("abcdefghijkl"), (0.0,) * 12)])
    first, second, longer = (sample.text for sample in samples[:3])
    assert not any(sample.activating for sample in samples[:3])
    assert len(_marked(first)) == len(_marked(longer)) == 4
    # delphi reseeds for each example: same length, same marks; the position of its centred
    # windows' activating token (len - len // 4) is always among them
    assert first == second and "g" in _marked(first) and "j" in _marked(longer)
    assert first == "<<ab>>cdef<<gh>>"  # as delphi marks it (checked once against eai-delphi 0.1.3)
    assert fuzzing_samples(TEST, [ZEROS])[0].text == first
    assert fuzzing_samples(TEST, [ZEROS], seed=23)[0].text != first


def test_fuzzing_marks_only_tokens_at_or_below_the_cutoff_and_no_more_than_there_are():
    # the first non-activating example decides (zeros: random marks); the others may have values
    partly = Example(tuple("abcde"), (0.0, 9.0, 2.7, 5.0, 0.0))  # cutoff 2.7: a, c, e eligible
    one = Example(("a", "b"), (5.0, 0.0))  # b alone eligible (delphi shows an unrelated sentence)
    none = Example(("a", "b"), (5.0, 5.0))
    samples = fuzzing_samples(TEST, [ZEROS, partly, one, none])
    assert sorted(_marked(samples[1].text)) == ["a", "c", "e"]
    assert samples[2].text == "a<<b>>"
    assert samples[3].text == "ab"


def test_fuzzing_with_contrastive_non_activating_examples_marks_them_like_the_test_ones():
    first = Example(tuple("abcd"), (0.0, 4.0, 1.0, 0.0))
    samples = fuzzing_samples(TEST, [first, ZEROS])
    # cutoff 1.2 for the first; for all-zero ZEROS the cutoff is 0, which every token reaches
    assert [sample.text for sample in samples[:2]] == ["a<<b>>cd", "<<abcdefgh>>"]


def test_fuzzing_when_test_examples_are_all_zero_marks_everything_as_delphi():
    samples = fuzzing_samples([Example(("x", "y"), (0.0, 0.0))], [ZEROS])
    assert [sample.text for sample in samples] == ["<<abcdefgh>>", "<<xy>>"]


def test_fuzzing_threshold():
    assert fuzzing_samples(TEST[:1], [], threshold=0.5)[0].text == "ab<<cd>>ef"


def test_batches_are_a_seeded_shuffle_cut_into_prompts():
    samples = [Sample(str(index), index % 2 == 0, index) for index in range(12)]
    batches = scoring_batches(samples, per_prompt=5, seed=42)
    assert [len(batch) for batch in batches] == [5, 5, 2]
    shuffled = list(samples)
    random.Random(42).shuffle(shuffled)  # noqa: S311
    assert [sample for batch in batches for sample in batch] == shuffled != samples
    assert scoring_batches(samples, per_prompt=5, seed=42) == batches
    assert scoring_batches(samples, per_prompt=5, seed=7) != batches
    assert samples == [Sample(str(index), index % 2 == 0, index) for index in range(12)]  # untouched
    assert scoring_batches([], per_prompt=5) == []
    with pytest.raises(ValueError):
        scoring_batches(samples, per_prompt=0)


def test_scoring_messages():
    batch = [Sample("ab<<c>>", True, 0), Sample("de", False, 3)]
    system, user = scoring_messages("fuzzing", "Letters", batch)
    assert system["role"] == "system" and "<<like this>>" in system["content"]
    assert user == {
        "role": "user",
        "content": "Explanation: Letters\n\nExample 0: ab<<c>>\nExample 1: de\n\n"
        "Reply with only a Python list of 2 numbers (0 or 1), one per example, in order.",
    }
    assert "1 number (0 or 1)" in scoring_messages("detection", "Letters", batch[:1])[1]["content"]
    assert "<<" not in scoring_messages("detection", "Letters", batch[:1])[0]["content"]
    with pytest.raises(ValueError):
        scoring_messages("nonsense", "Letters", batch)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[1, 0, 1]", [True, False, True]),
        ("Sure! [1,0,0] is my answer", [True, False, False]),
        ("[true, false, 2]", [True, False, True]),
        ('["0", 0, 1]', [True, False, True]),  # bool("0"), as delphi
        ("[1, 0, 1] then [0, 0, 0]", [True, False, True]),  # the first list
        ("[0, 1] and later [1, 1, 1]", None),  # the first list, of the wrong length
        ("[1, 0, 1, 1]", None),
        ("[1, 0,\n1]", None),  # on one line only
        ("[1, x, 0]", None),
        ("[1, 0, 1", None),
        ("no list at all", None),
        ("", None),
    ],
)
def test_parse_predictions(text, expected):
    assert parse_predictions(text, 3) == expected


def test_balanced_accuracy_leaves_failed_predictions_out():
    outcomes = [
        (True, True),
        (True, True),
        (True, False),
        (True, None),
        (False, False),
        (False, True),
        (False, None),
    ]
    score = balanced_accuracy(iter(outcomes))
    assert score == Score(
        balanced_accuracy=pytest.approx((2 / 3 + 1 / 2) / 2),
        true_positives=2,
        true_negatives=1,
        false_positives=1,
        false_negatives=1,
        failed=2,
        total=7,
        value=pytest.approx(7 / 12),
    )
    assert score.as_dict() == {
        "balanced_accuracy": pytest.approx(7 / 12),
        "true_positives": 2,
        "true_negatives": 1,
        "false_positives": 1,
        "false_negatives": 1,
        "failed": 2,
        "total": 7,
        "value": pytest.approx(7 / 12),
        "metric": "balanced_accuracy",
    }


def test_balanced_accuracy_with_one_class_missing_counts_it_as_zero():
    assert balanced_accuracy([(True, True), (True, True), (True, False)]).balanced_accuracy == pytest.approx(
        1 / 3
    )
    # the negatives' predictions all failed: only the positives' rate counts
    assert balanced_accuracy([(True, True), (False, None)]).balanced_accuracy == 0.5
    assert balanced_accuracy([(False, False)]).balanced_accuracy == 0.5


def test_balanced_accuracy_without_any_prediction_is_none():
    score = balanced_accuracy([(True, None), (False, None)])
    assert score.balanced_accuracy is None and score.failed == score.total == 2
    assert balanced_accuracy([]).balanced_accuracy is None


def test_scorers_are_registered_classes_and_an_unknown_name_is_refused():
    assert scorer_names() == ("detection", "fuzzing", "intruder", "embedding", "simulation")
    assert isinstance(scorer_named("detection"), DetectionScorer)
    assert scorer_named("fuzzing") == FuzzingScorer()
    with pytest.raises(UnknownScorer) as refused:
        scorer_named("surprisal")
    assert refused.value.code == "UNKNOWN_SCORER"
    assert refused.value.details["scorers"] == ["detection", "fuzzing", "intruder", "embedding", "simulation"]
    with pytest.raises(ValueError, match="already registered"):
        register_scorer(DetectionScorer)
    with pytest.raises(UnknownScorer):
        InterpretationConfig(scorers=("detection", "surprisal"))


def test_a_scorer_reads_an_answer_into_outcomes_and_a_missing_or_bad_answer_fails_the_batch():
    batch = [Sample("a", True, 0), Sample("b", False, 1)]
    scorer = scorer_named("detection")
    assert scorer.outcomes(batch, "[1, 1]") == [(True, True), (False, True)]
    assert scorer.outcomes(batch, "[1]") == [(True, None), (False, None)]
    assert scorer.outcomes(batch, None) == [(True, None), (False, None)]


def test_intruder_prompts_hide_one_non_activating_example_among_a_strength_groups_examples():
    from engine.autointerp.pipeline import InterpretationConfig
    from engine.autointerp.scoring import (
        default_scorers,
        intruder_accuracy,
        intruder_sentences,
        parse_intruder,
        quantiles,
    )

    test = [Example((f"a{index}", " b", " c"), (0.0, float(index + 1), 0.0)) for index in range(8)]
    non_activating = [Example((f"z{index}", " y"), (0.0, 0.0)) for index in range(5)]
    tagged = quantiles(test, 4)
    assert [quantile for quantile, _ in tagged] == [1, 1, 1, 1, 0, 0, 0, 0]  # the strongest are group 0
    sentences = intruder_sentences(tagged, non_activating, shown=5, seed=42)
    assert len(sentences) == 5 and [sentence.quantile for sentence in sentences] == [1, 0, 1, 0, 1]
    for sentence, intruder in zip(sentences, non_activating, strict=True):
        assert len(sentence.texts) == 5
        plain = [text.replace("<<", "").replace(">>", "") for text in sentence.texts]
        assert plain[sentence.intruder] == intruder.text  # the intruder, marked at random tokens
        assert all(text.startswith("a") for index, text in enumerate(plain) if index != sentence.intruder)
        assert "<<" in sentence.texts[sentence.intruder]
    answers = [parse_intruder(f"[RESPONSE]: {sentence.intruder}", 5) for sentence in sentences[:3]] + [
        None,
        0,
    ]
    score = intruder_accuracy(sentences, answers)
    assert score.failed == 1 and score.total == 5 and score.metric == "accuracy"
    assert score.value == pytest.approx((3 + (sentences[4].intruder == 0)) / 5)
    assert "intruder" not in default_scorers() and "embedding" not in default_scorers()
    # one request per intruder prompt; the embedding scorer asks no language model
    base = InterpretationConfig(test_examples=10, non_activating=10, per_prompt=5)
    assert base.requests_per_feature() == 1 + 2 * 4
    with_both = InterpretationConfig(
        test_examples=10, non_activating=10, per_prompt=5, scorers=("detection", "intruder", "embedding")
    )
    assert with_both.requests_per_feature() == 1 + 4 + 10


def test_the_embedding_score_is_the_auc_of_the_similarities():
    from engine.autointerp.scoring import embedding_auc

    assert embedding_auc([True, True, False, False], [0.9, 0.8, 0.1, 0.2]) == 1.0
    assert embedding_auc([True, False, True, False], [0.9, 0.8, 0.1, 0.2]) == 0.5
    assert embedding_auc([True, True], [0.2, 0.3]) is None
