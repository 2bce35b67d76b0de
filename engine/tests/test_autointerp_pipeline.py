"""The pipeline's arithmetic without an endpoint (the requests themselves go through a real model
served by the workbench in features/tests/test_explanation_job.py): how a scoring batch is split to
fit a context, how many requests a feature takes, and what a feature's score is."""

from engine.autointerp.pipeline import FeatureResult, InterpretationConfig, _fitting
from engine.autointerp.scoring import Sample, Score, scorer_named, scoring_messages


def samples(count: int) -> list[Sample]:
    return [
        Sample(text=f"text number {index} " * (index + 1), activating=index % 2 == 0, example=index)
        for index in range(count)
    ]


def test_a_batch_is_halved_until_its_prompt_fits_and_a_sample_that_cannot_fit_is_not_sent():
    batch = samples(5)

    def length(part):
        return sum(len(message["content"]) for message in scoring_messages("detection", "digits", part))

    limit = length(batch[:2])  # two short samples fit; the longest one alone does not
    parts = list(
        _fitting(
            scorer_named("detection"),
            "digits",
            batch,
            lambda messages: sum(len(m["content"]) for m in messages) <= limit,
        )
    )
    assert [sample for part, _ in parts for sample in part] == batch  # every sample, in order, once
    assert all(fits == (length(part) <= limit) for part, fits in parts)
    assert any(not fits and len(part) == 1 for part, fits in parts)
    assert list(_fitting(scorer_named("detection"), "digits", batch, None)) == [(batch, True)]


def test_requests_per_feature_and_the_mean_score():
    assert InterpretationConfig().requests_per_feature() == 1 + 2 * 4  # 10 + 10 samples, 5 a prompt
    assert InterpretationConfig(scorers=("detection",), per_prompt=3).requests_per_feature() == 1 + 7
    score = Score(balanced_accuracy=0.75, true_positives=3, true_negatives=3, false_positives=1,
                  false_negatives=1, failed=0, total=8)  # fmt: skip
    none = Score(balanced_accuracy=None, true_positives=0, true_negatives=0, false_positives=0,
                 false_negatives=0, failed=8, total=8)  # fmt: skip
    assert FeatureResult(index=0, scores={"detection": score, "fuzzing": none}).score == 0.75
    assert FeatureResult(index=0, scores={"detection": none}).score is None
