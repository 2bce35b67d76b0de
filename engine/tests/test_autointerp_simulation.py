"""delphi's simulation scorer, the parts checked here without delphi (``test_autointerp_delphi.py``
checks prompts, predictions and correlations against delphi itself): values on 0..10, expected
values, where the predictions are read, and what a failed or short answer counts as."""

import math

import pytest

from engine.autointerp.prompts import Example
from engine.autointerp.scoring import SimulationScorer
from engine.autointerp.simulation import (
    correlation,
    expected_value,
    normalized,
    predicted_values,
    simulation_messages,
    simulation_records,
)

TAB, UNKNOWN, OTHER = 7, 8, 9


def test_values_on_zero_to_ten_as_delphis_sampler():
    assert [normalized(value, 4.0) for value in (0.0, 0.01, 0.4, 0.41, 2.0, 4.0, 5.0, -1.0)] == [
        0, 1, 1, 2, 5, 10, 10, 0,
    ]  # fmt: skip
    assert normalized(0.0, 0.0) == 0  # a maximum of zero is taken as 1e-6, as delphi does
    records = simulation_records([(0, Example(("a", "b"), (0.0, 2.0)))], [Example(("c",), (0.0,))])
    assert [(r.tokens, r.values, r.quantile) for r in records] == [
        (("a", "b"), (0, 10), 0),
        (("c",), (0,), -1),
    ]


def test_expected_value_renormalises_the_digits_and_ignores_the_rest():
    assert expected_value({"0": math.log(0.2), "10": math.log(0.2), " sea": math.log(0.5)}) == pytest.approx(
        5.0
    )
    assert expected_value({"3": -1.0}) == pytest.approx(3.0)
    assert expected_value({"11": -1.0, "x": -0.1}) == 0.0  # nothing on 0..10: delphi's 0


def _entries(ids, digits_at):
    """vLLM-shaped prompt logprobs: each position's own token; ``digits_at`` maps a position to
    ``{digit: logprob}``."""
    entries = [None]
    for position in range(1, len(ids)):
        entry = {
            str(ids[position]): {"logprob": -1.0, "decoded_token": "\t" if ids[position] == TAB else "w"}
        }
        for token_id, (text, logprob) in enumerate(digits_at.get(position, {}).items(), start=100):
            entry[str(token_id)] = {"logprob": logprob, "decoded_token": text}
        entries.append(entry)
    return entries


def test_predictions_are_read_after_the_last_tabs():
    # A worked line (tab, 5) before the message, then the message's two lines (tab, unknown).
    ids = [1, OTHER, TAB, 5, OTHER, TAB, UNKNOWN, OTHER, TAB, UNKNOWN, 2, 3]
    entries = _entries(ids, {3: {"9": -0.1}, 6: {"2": -0.5}, 9: {"4": -0.3, "6": -0.3}})
    assert predicted_values(ids, entries, 2) == pytest.approx([2.0, 5.0])
    assert predicted_values(ids, entries, 0) == []
    assert predicted_values(ids, entries, 4) is None  # fewer tabs than tokens
    assert predicted_values([1, OTHER, OTHER], _entries([1, OTHER, OTHER], {}), 1) is None  # no tab


class Asking:
    per_prompt, seed = 5, 42

    def __init__(self, answers):
        self.answers, self.asked = list(answers), []

    def prompt_logprobs(self, messages, count):
        self.asked.append(messages)
        return self.answers.pop(0)


def test_a_failed_or_short_answer_counts_as_failed_and_predicts_zeros():
    test = [Example(("a", "b"), (1.0, 3.0)), Example(("c", "d"), (2.0, 0.0))]
    quiet = [Example(("e", "f"), (0.0, 0.0))]
    ids = [1, OTHER, TAB, UNKNOWN, OTHER, TAB, UNKNOWN, 2]
    good = (ids, _entries(ids, {3: {"3": -0.1}, 6: {"9": -0.1}}))
    short = (ids[:4], _entries(ids[:4], {3: {"3": -0.1}}))
    asking = Asking([good, None, short])
    score = SimulationScorer().score(test, quiet, "sea words", asking)
    assert score.failed == 2 and score.total == 3 and score.metric == "correlation"
    assert asking.asked[0] == simulation_messages("sea words", ("a", "b"))
    # Truth (ceil on 0..10 of the test maximum 3): 4, 10 | 7, 0 | 0, 0; predicted 3, 9 | 0, 0 | 0, 0.
    assert score.value == pytest.approx(correlation([4, 10, 7, 0, 0, 0], [3, 9, 0, 0, 0, 0]))
    assert correlation([1, 2, 3], [5, 5, 5]) is None and correlation([1, 2], [1]) is None
    assert SimulationScorer().score([], quiet, "x", Asking([])) is None  # nothing activating to predict
