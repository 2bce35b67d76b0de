"""The scorers' samples, prompts, answers and balanced accuracy, as EleutherAI's delphi defines them
(``eai-delphi`` 0.1.3: ``delphi/scorers/classifier/{classifier,sample,detection,fuzz}.py`` and
``delphi/log/result_analysis.py``).

- **Detection**: is this text one where the feature fires, given the explanation? The samples are
  the held-out activating examples and the non-activating ones, as plain text.
- **Fuzzing**: are the marked tokens those the explanation describes? Activating examples are
  marked where the feature fires (at least ``threshold`` of the example's maximum); non-activating
  ones have as many tokens marked at random as the activating examples have non-zero values on
  average.

Samples are shuffled once (``random.Random(seed)``), cut into prompts of ``per_prompt``, and a
prompt whose answer does not parse counts all its samples as failed; the balanced accuracy is then
computed over the samples that got a prediction. ``engine/tests/test_autointerp_delphi.py`` checks
all of it against delphi itself.

Each scorer is one class registered by name (:func:`register_scorer`): its question, its samples,
its messages and how it reads an answer. Every other layer takes the scorers' names from
:func:`scorer_names` and a scorer from :func:`scorer_named`, so adding a scorer is adding a class.
"""

from __future__ import annotations

import json
import math
import random
import re
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from itertools import cycle
from typing import ClassVar, Protocol, TypeVar

from engine.autointerp.prompts import (
    DETECTION_SYSTEM,
    EMBEDDING_QUERY,
    EXPLAIN_TEMPLATE,
    FUZZING_SYSTEM,
    INTRUDER_SYSTEM,
    Example,
    highlight,
    intruder_messages,
    messages_as_text,
    scorer_messages,
)
from engine.autointerp.simulation import (
    PROMPT_LOGPROBS,
    SIMULATION_SYSTEM,
    pooled_correlation,
    predicted_values,
    simulation_messages,
    simulation_records,
)
from engine.errors import EngineError

FUZZ_THRESHOLD = 0.3
FUZZ_SEED = 22
SHUFFLE_SEED = 42
PER_PROMPT = 5


@dataclass(frozen=True)
class Sample:
    """One text shown to a scorer: ``example`` is its index in the list it came from (the test
    examples when ``activating``, the non-activating ones otherwise)."""

    text: str
    activating: bool
    example: int


def detection_samples(test: list[Example], non_activating: list[Example]) -> list[Sample]:
    """The plain texts, non-activating first (delphi's ``DetectionScorer._prepare``). A test
    example counts as activating whatever its values, as in delphi."""
    return [Sample(example.text, False, index) for index, example in enumerate(non_activating)] + [
        Sample(example.text, True, index) for index, example in enumerate(test)
    ]


def _cutoff(example: Example, threshold: float) -> float:
    """``threshold`` of the example's maximum, rounded to float32: delphi compares its float32
    activations with it in float32, so a value equal to the cutoff there counts as equal here."""
    return struct.unpack("f", struct.pack("f", threshold * example.max_activation))[0]


def _marked_above(example: Example, threshold: float) -> str:
    cutoff = _cutoff(example, threshold)
    return highlight(example.tokens, lambda index: example.values[index] >= cutoff)


def _marked_at_random(example: Example, count: int, threshold: float, seed: int) -> str:
    """``count`` tokens at or below ``threshold`` of the example's maximum, marked at random
    (delphi's ``_prepare_text`` with ``n_incorrect > 0``)."""
    cutoff = _cutoff(example, threshold)
    eligible = [index for index, value in enumerate(example.values) if value <= cutoff]
    count = min(count, len(eligible))
    # delphi reseeds for each example and always marks the position where its centred windows
    # put the activating token, when it is eligible (delphi's own comment calls this wrong; it is
    # kept so that the same examples are marked). Where exactly one position is eligible, delphi
    # shows a fixed unrelated sentence instead (a squeeze() that turns a one-element index into a
    # scalar); that one position is marked here.
    rng = random.Random(seed)  # noqa: S311  (delphi's choice, not a secret)
    position = len(example.tokens) - len(example.tokens) // 4
    if position in eligible:
        others = [index for index in eligible if index != position]
        chosen = {position, *(rng.sample(others, count - 1) if count > 1 else [])}
    else:
        chosen = set(rng.sample(eligible, count))
    return highlight(example.tokens, chosen.__contains__)


def fuzzing_samples(
    test: list[Example],
    non_activating: list[Example],
    *,
    threshold: float = FUZZ_THRESHOLD,
    seed: int = FUZZ_SEED,
) -> list[Sample]:
    """Marked texts, non-activating first (delphi's default ``FuzzingScorer._prepare``).

    Test examples are marked at the tokens at or above ``threshold`` of their maximum. The
    non-activating ones get ``ceil(mean number of non-zero values of the test examples)`` tokens
    marked at random among those at or below ``threshold`` of their own maximum. As in delphi,
    when the first non-activating example has a positive value (a contrastive set, such as a
    neighbouring feature's examples), the non-activating examples are marked like the test ones;
    and when the mean above is zero, so are they.
    """
    mean_non_zero = sum(sum(value != 0 for value in example.values) for example in test) / max(len(test), 1)
    count = math.ceil(mean_non_zero)
    contrastive = bool(non_activating) and non_activating[0].activating
    samples = []
    for index, example in enumerate(non_activating):
        if contrastive or count == 0:
            text = _marked_above(example, threshold)
        else:
            text = _marked_at_random(example, count, threshold, seed)
        samples.append(Sample(text, False, index))
    samples += [Sample(_marked_above(example, threshold), True, index) for index, example in enumerate(test)]
    return samples


def scoring_batches(
    samples: list[Sample], *, per_prompt: int = PER_PROMPT, seed: int = SHUFFLE_SEED
) -> list[list[Sample]]:
    """The samples shuffled by ``random.Random(seed)``, then cut into prompts of ``per_prompt``
    (delphi's ``Classifier.__call__`` and ``_batch``; delphi keeps one generator per scorer, so
    only its first feature is shuffled by a fresh one)."""
    if per_prompt < 1:
        raise ValueError("per_prompt must be at least 1")
    shuffled = list(samples)
    random.Random(seed).shuffle(shuffled)  # noqa: S311  (delphi's order, not a secret)
    return [shuffled[start : start + per_prompt] for start in range(0, len(shuffled), per_prompt)]


def scoring_messages(kind: str, explanation: str, batch: list[Sample]) -> list[dict]:
    """The chat messages asking the scorer named ``kind`` about ``batch``."""
    return scorer_named(kind).messages(explanation, batch)


_FIRST_LIST = re.compile(r"\[.*?\]")


def parse_predictions(text: str, n: int) -> list[bool] | None:
    """The scorer's answer as ``n`` predictions (delphi's ``Classifier._parse``): the first
    ``[...]`` on one line, read as JSON, each element's truth value. None when there is no such
    list, it is not JSON, or it does not hold exactly ``n`` elements."""
    match = _FIRST_LIST.search(text)
    if match is None:
        return None
    try:
        raw = json.loads(match.group(0))
    except ValueError:
        return None
    if not isinstance(raw, list) or len(raw) != n:
        return None
    return [bool(element) for element in raw]


@dataclass(frozen=True)
class Score:
    """A scorer's result for one explanation: ``failed`` samples got no prediction, ``total``
    counts all of them."""

    balanced_accuracy: float | None
    true_positives: int
    true_negatives: int
    false_positives: int
    false_negatives: int
    failed: int
    total: int
    # The scorer's one number: a classifier's balanced accuracy, the intruder scorer's accuracy, the
    # embedding scorer's ROC AUC; None when nothing could be scored.
    value: float | None = None
    metric: str = "balanced_accuracy"

    def as_dict(self) -> dict:
        return asdict(self)


def balanced_accuracy(outcomes: Iterable[tuple[bool, bool | None]]) -> Score:
    """The balanced accuracy of (activating, prediction) pairs, as delphi's ``compute_confusion``
    and ``compute_classification_metrics`` ("accuracy"): samples without a prediction are left
    out, and a class without samples contributes 0 (so one class alone scores at most 0.5). None
    when no sample has a prediction."""
    counts = {"tp": 0, "tn": 0, "fp": 0, "fn": 0}
    failed = total = 0
    for activating, prediction in outcomes:
        total += 1
        if prediction is None:
            failed += 1
        elif activating:
            counts["tp" if prediction else "fn"] += 1
        else:
            counts["fp" if prediction else "tn"] += 1
    positives, negatives = counts["tp"] + counts["fn"], counts["tn"] + counts["fp"]
    accuracy = None
    if positives + negatives:
        accuracy = (
            (counts["tp"] / positives if positives else 0.0)
            + (counts["tn"] / negatives if negatives else 0.0)
        ) / 2
    return Score(
        balanced_accuracy=accuracy,
        true_positives=counts["tp"],
        true_negatives=counts["tn"],
        false_positives=counts["fp"],
        false_negatives=counts["fn"],
        failed=failed,
        total=total,
        value=accuracy,
    )


class Asking(Protocol):
    """What a scorer may ask of the job that runs it (``engine.autointerp.pipeline``)."""

    per_prompt: int
    seed: int

    def classify(
        self, scorer: Scorer, explanation: str, batch: list[Sample]
    ) -> list[tuple[bool, bool | None]]:
        """(truth, prediction) of each sample of ``batch``, from the scorer endpoint."""

    def reply(self, messages: list[dict]) -> str | None:
        """The scorer endpoint's answer to ``messages`` (None: the request failed)."""

    def similarities(self, query: str, texts: list[str]) -> list[float]:
        """The embedding model's similarity of ``query`` to each of ``texts``."""

    def prompt_logprobs(self, messages: list[dict], count: int) -> tuple[list[int], list[dict | None]] | None:
        """The scorer endpoint's templated prompt ids and vLLM-shaped ``prompt_logprobs`` for
        ``messages`` (None: the request failed)."""


class UnknownScorer(EngineError, ValueError):
    """A scorer name that no class is registered under."""

    def __init__(self, name: str) -> None:
        super().__init__(
            "UNKNOWN_SCORER",
            f"Unknown scorer {name!r}; the scorers are {', '.join(scorer_names())}.",
            {"scorer": name, "scorers": list(scorer_names())},
        )


class Scorer:
    """One way of checking an explanation on a feature's held-out and non-activating examples.

    A subclass names itself (``name``), asks its question (``system``, a text of
    :mod:`engine.autointerp.prompts`, versioned with the others) and builds its samples; the
    messages and the reading of an answer are delphi's for every classifier scorer, so they are
    shared here. ``placeholder`` is how one sample looks on the page that shows the template.
    """

    name: ClassVar[str]
    system: ClassVar[str]
    placeholder: ClassVar[str] = "{text}"
    # Run when a job names no scorers (the others are asked for by name: they cost more, or need
    # more than the scorer endpoint).
    default_on: ClassVar[bool] = True

    def samples(self, test: list[Example], non_activating: list[Example]) -> list[Sample]:
        raise NotImplementedError

    def requests(self, *, test: int, non_activating: int, per_prompt: int) -> int:
        """Requests to the scorer endpoint for one feature (a classifier's: one per prompt)."""
        return -(-(test + non_activating) // per_prompt)

    def score(
        self, test: list[Example], non_activating: list[Example], explanation: str, asking: Asking
    ) -> Score | None:
        """The balanced accuracy of the endpoint's answers on the shuffled samples, ``per_prompt`` a
        request; None without an activating sample to show."""
        samples = self.samples(test, non_activating)
        if not samples or not any(sample.activating for sample in samples):
            return None
        outcomes: list[tuple[bool, bool | None]] = []
        for batch in scoring_batches(samples, per_prompt=asking.per_prompt, seed=asking.seed):
            outcomes.extend(asking.classify(self, explanation, batch))
        return balanced_accuracy(outcomes)

    def messages(self, explanation: str, batch: list[Sample]) -> list[dict]:
        return scorer_messages(self.system, explanation, [sample.text for sample in batch])

    def outcomes(self, batch: list[Sample], answer: str | None) -> list[tuple[bool, bool | None]]:
        """(truth, prediction) of each sample of ``batch`` from the scorer's ``answer`` (None: the
        request failed); every prediction is None when there is no answer or it does not parse,
        as delphi records them."""
        predictions = None if answer is None else parse_predictions(answer, len(batch))
        if predictions is None:
            return [(sample.activating, None) for sample in batch]
        return [
            (sample.activating, prediction) for sample, prediction in zip(batch, predictions, strict=True)
        ]

    def template(self) -> str:
        return messages_as_text(scorer_messages(self.system, "{explanation}", [self.placeholder]))


_SCORERS: dict[str, type[Scorer]] = {}
ScorerClass = TypeVar("ScorerClass", bound=type[Scorer])


def register_scorer(scorer_class: ScorerClass) -> ScorerClass:
    """Register ``scorer_class`` under its ``name`` (a class decorator); a name is taken once."""
    if scorer_class.name in _SCORERS:
        raise ValueError(f"a scorer named {scorer_class.name!r} is already registered")
    _SCORERS[scorer_class.name] = scorer_class
    return scorer_class


def scorer_names() -> tuple[str, ...]:
    """The registered scorers' names, in the order they were registered."""
    return tuple(_SCORERS)


def default_scorers() -> tuple[str, ...]:
    """The scorers a job runs when it names none."""
    return tuple(name for name, scorer_class in _SCORERS.items() if scorer_class.default_on)


def scorer_named(name: str) -> Scorer:
    """The scorer registered as ``name``; :class:`UnknownScorer` for any other name."""
    scorer_class = _SCORERS.get(name)
    if scorer_class is None:
        raise UnknownScorer(name)
    return scorer_class()


@register_scorer
class DetectionScorer(Scorer):
    """Is this text one where the feature fires? (delphi's ``DetectionScorer``)"""

    name = "detection"
    system = DETECTION_SYSTEM

    def samples(self, test: list[Example], non_activating: list[Example]) -> list[Sample]:
        return detection_samples(test, non_activating)


@register_scorer
@dataclass(frozen=True)
class FuzzingScorer(Scorer):
    """Are the marked tokens those the explanation describes? (delphi's ``FuzzingScorer``)"""

    name: ClassVar[str] = "fuzzing"
    system: ClassVar[str] = FUZZING_SYSTEM
    placeholder: ClassVar[str] = "{text with <<marked tokens>>}"
    threshold: float = FUZZ_THRESHOLD
    seed: int = FUZZ_SEED

    def samples(self, test: list[Example], non_activating: list[Example]) -> list[Sample]:
        return fuzzing_samples(test, non_activating, threshold=self.threshold, seed=self.seed)


# --- intruder detection --------------------------------------------------------------------------


@dataclass(frozen=True)
class IntruderSentence:
    """One intruder prompt: the texts shown, which is the intruder, and the strength group (quantile)
    its activating examples came from."""

    texts: tuple[str, ...]
    intruder: int
    quantile: int


def quantiles(test: list[Example], size: int) -> list[tuple[int, Example]]:
    """(quantile, example) of each test example: the examples by their maximum, strongest first, in
    groups of ``size`` (0 is the strongest; the last may be smaller). delphi's sampler tags its test
    examples with the quantile they were drawn from; ours are spread over the activation range."""
    ranked = sorted(range(len(test)), key=lambda index: -test[index].max_activation)
    group = {index: rank // max(1, size) for rank, index in enumerate(ranked)}
    return [(group[index], example) for index, example in enumerate(test)]


def intruder_sentences(
    tagged: list[tuple[int, Example]],
    non_activating: list[Example],
    *,
    shown: int,
    seed: int = SHUFFLE_SEED,
    threshold: float = FUZZ_THRESHOLD,
) -> list[IntruderSentence]:
    """delphi's ``IntruderScorer._prepare_and_batch`` (its default type): one prompt per
    non-activating example, cycling over the quantiles of the (quantile, example) pairs in the
    order they first appear; each shows ``shown - 1`` examples of its quantile drawn with
    ``random.Random(seed)`` (fewer if the quantile has fewer), marked where the feature fires, and
    the intruder at a random place, marked at as many random tokens as those examples have active
    ones on average (where the feature fires, for a contrastive intruder)."""
    if shown < 2:
        raise ValueError("an intruder prompt shows at least two examples")
    groups: dict[int, list[Example]] = {}
    for quantile, example in tagged:
        groups.setdefault(quantile, []).append(example)
    if not groups:
        return []
    rng = random.Random(seed)  # noqa: S311  (delphi's draws, not a secret)
    sentences = []
    for (quantile, examples), intruder in zip(cycle(groups.items()), non_activating):
        count = min(shown - 1, len(examples))
        chosen = rng.sample(examples, count)
        texts = [_marked_above(example, threshold) for example in chosen]
        active = sum(sum(value > 0 for value in example.values) for example in chosen)
        marked = 0 if intruder.activating else active // len(chosen)
        if marked == 0:
            intruder_text = _marked_above(intruder, threshold)
        else:
            intruder_text = _marked_at_random(intruder, marked, threshold, FUZZ_SEED)
        place = rng.randint(0, count)
        texts.insert(place, intruder_text)
        sentences.append(IntruderSentence(texts=tuple(texts), intruder=place, quantile=quantile))
    return sentences


_RESPONSE = re.compile(r"\[RESPONSE\]:")


def parse_intruder(text: str, shown: int) -> int | None:
    """The index after the first ``[RESPONSE]:`` (delphi's ``IntruderScorer._parse``): None when
    there is none, it is not a whole number, or it is outside ``0 .. shown - 1``."""
    match = _RESPONSE.search(text)
    if match is None:
        return None
    try:
        prediction = int(text[match.end() :].strip())
    except ValueError:
        return None
    return prediction if 0 <= prediction < shown else None


def intruder_accuracy(sentences: list[IntruderSentence], predictions: list[int | None]) -> Score:
    """The fraction of prompts whose intruder was found; a failed or unreadable answer counts as
    wrong (delphi's default ``IntruderResult``)."""
    correct = sum(
        prediction == sentence.intruder for sentence, prediction in zip(sentences, predictions, strict=True)
    )
    failed = sum(prediction is None for prediction in predictions)
    total = len(sentences)
    return Score(
        balanced_accuracy=None, true_positives=correct, true_negatives=0,
        false_positives=total - correct - failed, false_negatives=0, failed=failed, total=total,
        value=correct / total if total else None, metric="accuracy",
    )  # fmt: skip


@register_scorer
@dataclass(frozen=True)
class IntruderScorer(Scorer):
    """Which of these examples is not one of the feature's? (delphi's ``IntruderScorer``): it asks
    for no explanation, so it judges the feature itself, how coherent its examples are."""

    name: ClassVar[str] = "intruder"
    system: ClassVar[str] = INTRUDER_SYSTEM
    default_on: ClassVar[bool] = False
    threshold: float = FUZZ_THRESHOLD

    def requests(self, *, test: int, non_activating: int, per_prompt: int) -> int:
        return non_activating

    def score(
        self, test: list[Example], non_activating: list[Example], explanation: str, asking: Asking
    ) -> Score | None:
        shown = max(2, asking.per_prompt)
        sentences = intruder_sentences(
            quantiles(test, shown - 1),
            non_activating,
            shown=shown,
            seed=asking.seed,
            threshold=self.threshold,
        )
        if not sentences:
            return None
        predictions = []
        for sentence in sentences:
            answer = asking.reply(intruder_messages(list(sentence.texts)))
            predictions.append(None if answer is None else parse_intruder(answer, shown))
        return intruder_accuracy(sentences, predictions)

    def template(self) -> str:
        return messages_as_text(intruder_messages(["{text}", "{text with <<marked tokens>>}", "{…}"]))


# --- embedding -----------------------------------------------------------------------------------


def embedding_auc(activating: list[bool], similarities: list[float]) -> float | None:
    """The ROC AUC of ``similarities`` telling activating texts from the others (scikit-learn's
    ``roc_auc_score``, as delphi's result analysis computes its AUC); None with one class only."""
    if len(set(activating)) < 2:
        return None
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(activating, similarities))


@register_scorer
class EmbeddingScorer(Scorer):
    """How much nearer the explanation are the feature's examples than the others, to a sentence
    embedding model? (delphi's ``EmbeddingScorer``): no language model is asked."""

    name = "embedding"
    system = EMBEDDING_QUERY
    default_on = False

    def samples(self, test: list[Example], non_activating: list[Example]) -> list[Sample]:
        return detection_samples(test, non_activating)

    def requests(self, *, test: int, non_activating: int, per_prompt: int) -> int:
        return 0

    def score(
        self, test: list[Example], non_activating: list[Example], explanation: str, asking: Asking
    ) -> Score | None:
        samples = self.samples(test, non_activating)
        if not samples:
            return None
        similarities = asking.similarities(EMBEDDING_QUERY + explanation, [sample.text for sample in samples])
        truth = [sample.activating for sample in samples]
        return Score(
            balanced_accuracy=None, true_positives=0, true_negatives=0, false_positives=0, false_negatives=0,
            failed=0, total=len(samples), value=embedding_auc(truth, similarities), metric="auc",
        )  # fmt: skip

    def template(self) -> str:
        return (
            "(no language model: a sentence embedding model embeds)\n\n"
            f"{EMBEDDING_QUERY}{{explanation}}\n\nand each example's text; the score is the ROC AUC of the "
            "similarities, the feature's examples against the others."
        )


# --- simulation ----------------------------------------------------------------------------------


@register_scorer
class SimulationScorer(Scorer):
    """How well does a language model that reads the explanation predict the feature, token by
    token? (delphi's simulator in its logprob mode, :mod:`engine.autointerp.simulation`): the
    correlation of its expected values with the feature's, over every test and non-activating
    example (delphi's group -1). It needs an endpoint that serves vLLM's ``prompt_logprobs``."""

    name = "simulation"
    system = SIMULATION_SYSTEM
    default_on = False

    def requests(self, *, test: int, non_activating: int, per_prompt: int) -> int:
        return test + non_activating

    def score(
        self, test: list[Example], non_activating: list[Example], explanation: str, asking: Asking
    ) -> Score | None:
        records = simulation_records(quantiles(test, max(1, asking.per_prompt)), non_activating)
        if not any(record.quantile >= 0 for record in records):
            return None
        predictions, failed = [], 0
        for record in records:
            answer = asking.prompt_logprobs(simulation_messages(explanation, record.tokens), PROMPT_LOGPROBS)
            predicted = None if answer is None else predicted_values(*answer, len(record.tokens))
            if predicted is None:  # delphi's simulator predicts zeros when it fails
                failed, predicted = failed + 1, [0.0] * len(record.tokens)
            predictions.append(predicted)
        value = pooled_correlation(records, predictions)
        return Score(
            balanced_accuracy=None, true_positives=0, true_negatives=0, false_positives=0, false_negatives=0,
            failed=failed, total=len(records), value=value, metric="correlation",
        )  # fmt: skip

    def template(self) -> str:
        return messages_as_text(simulation_messages("{explanation}", ["{token}", "{token}", "{…}"]))


def prompt_templates() -> dict[str, str]:
    """What each prompt looks like, for showing on a page: the explainer's, then each scorer's."""
    return {"explain": EXPLAIN_TEMPLATE, **{name: scorer_named(name).template() for name in scorer_names()}}
