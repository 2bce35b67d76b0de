"""One feature explained and scored; many features at once, with a bounded number in flight.

A feature's work is a short conversation with two endpoints: one explanation request, then the
scorers' requests (``per_prompt`` samples each), one after another. Features run side by side on
``concurrency`` threads, so at most that many requests are in flight: a serving endpoint batches
them (this workbench's ``/v1`` decodes concurrent requests together).

The caller's thread stays free while the threads wait on the network: :func:`interpret_many`
calls ``tick`` between results, which is where a worker serves its interactive queue, so a job
whose explainer is a model on its own worker is answered by that worker meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from engine.autointerp.chat import ChatClient, ChatError, Stopped
from engine.autointerp.prompts import Example, PromptTooLong, explanation_messages, parse_explanation
from engine.autointerp.scoring import (
    Sample,
    Score,
    Scorer,
    default_scorers,
    scorer_named,
)


@dataclass(frozen=True)
class InterpretationConfig:
    """How many examples each step sees, and what is asked of the endpoints."""

    explain_examples: int = 10  # the strongest examples, shown to the explainer
    test_examples: int = 10  # held-out activating examples, over the activation range
    non_activating: int = 10  # contexts of the same cache where the feature is zero
    per_prompt: int = 5  # samples in one scoring request (delphi's n_examples_shown)
    scorers: tuple[str, ...] = field(default_factory=default_scorers)
    explain_max_tokens: int = 60
    score_max_tokens: int = 24
    temperature: float = 0.0
    # vLLM's (and this workbench's /v1's) extension: answer max tokens whatever the model says, for
    # a small base model that would end its turn at once. Off: OpenAI's API refuses the field.
    ignore_eos: bool = False
    include_logits: bool = True
    concurrency: int = 16
    seed: int = 42

    def __post_init__(self) -> None:
        for name in self.scorers:
            scorer_named(name)  # UnknownScorer now, not when the first feature is scored

    def requests_per_feature(self) -> int:
        """The explanation's request and each scorer's (``Scorer.requests``)."""
        return 1 + sum(
            scorer_named(name).requests(
                test=self.test_examples, non_activating=self.non_activating, per_prompt=self.per_prompt
            )
            for name in self.scorers
        )


# The range of each numeric setting a request may choose, beside the defaults above (a form's
# limits and the API's come from here). ``concurrency``'s upper bound is the deployment's
# (miStudio: EXPLAINER_MAX_CONCURRENCY), so it is None here.
OPTION_BOUNDS: dict[str, tuple[float, float | None]] = {
    "explain_examples": (1, 100),
    "test_examples": (1, 100),
    "non_activating": (1, 100),
    "per_prompt": (1, 20),
    "explain_max_tokens": (8, 1024),
    "score_max_tokens": (8, 256),
    "temperature": (0.0, 2.0),
    "concurrency": (1, None),
    "seed": (0, 2**31 - 1),
}


@dataclass(frozen=True)
class FeatureExamples:
    """What a feature's explanation and scores are made from."""

    index: int
    train: list[Example]
    test: list[Example]
    non_activating: list[Example]
    logit_tokens: list[str] | None = None


@dataclass
class FeatureResult:
    index: int
    explanation: str = ""
    prompt: list[dict[str, str]] = field(default_factory=list)
    scores: dict[str, Score] = field(default_factory=dict)
    error_code: str = ""
    error_message: str = ""

    @property
    def score(self) -> float | None:
        """The mean balanced accuracy of the scorers that gave one."""
        values = [
            score.balanced_accuracy for score in self.scores.values() if score.balanced_accuracy is not None
        ]
        return sum(values) / len(values) if values else None


@dataclass
class Endpoints:
    """The explainer and the scorer (often one endpoint and model), with what fits their contexts,
    and the sentence embedding model's similarities (``similarities(query, texts)``) for the
    embedding scorer."""

    explainer: ChatClient
    scorer: ChatClient
    explainer_fits: Callable[[list[dict[str, str]]], bool] | None = None
    scorer_fits: Callable[[list[dict[str, str]]], bool] | None = None
    similarities: Callable[[str, list[str]], list[float]] | None = None


def interpret_feature(
    feature: FeatureExamples,
    endpoints: Endpoints,
    config: InterpretationConfig,
    stop: threading.Event | None = None,
) -> FeatureResult:
    """Explain ``feature``, then score the explanation with each of ``config.scorers``. An
    endpoint's failure or an unusable answer is the result's error, never an exception (except
    :class:`Stopped`)."""
    result = FeatureResult(index=feature.index)
    try:
        result.prompt = explanation_messages(
            feature.train,
            logit_tokens=feature.logit_tokens if config.include_logits else None,
            fits=endpoints.explainer_fits,
        )
        _check(stop)
        reply = endpoints.explainer.complete(
            result.prompt, max_tokens=config.explain_max_tokens, temperature=config.temperature,
            stop=stop, **_extra(config),
        )  # fmt: skip
    except (PromptTooLong, ChatError) as error:
        result.error_code, result.error_message = error.code, error.message
        return result
    except ValueError:  # no example to show
        result.error_code, result.error_message = "NO_EXAMPLES", "The feature has no example to explain."
        return result
    explanation = parse_explanation(reply.text)
    if explanation is None:
        result.error_code, result.error_message = (
            "NO_EXPLANATION",
            "The explainer's answer held no explanation.",
        )
        return result
    result.explanation = explanation
    result.scores = score_explanation(feature, explanation, endpoints, config, stop)
    return result


def score_explanation(
    feature: FeatureExamples,
    explanation: str,
    endpoints: Endpoints,
    config: InterpretationConfig,
    stop: threading.Event | None = None,
) -> dict[str, Score]:
    """Each of ``config.scorers``' score of ``explanation`` (any text: a person's label, another
    feature's explanation for a baseline) on the feature's held-out and non-activating examples; a
    scorer without an activating sample to show is left out."""
    asking = JobAsking(endpoints=endpoints, config=config, stop=stop)
    scores: dict[str, Score] = {}
    for name in config.scorers:
        score = scorer_named(name).score(feature.test, feature.non_activating, explanation, asking)
        if score is not None:
            scores[name] = score
    return scores


@dataclass
class JobAsking:
    """What a scorer asks of a job (``engine.autointerp.scoring.Asking``): its endpoint, with the
    job's settings, and the embedding model."""

    endpoints: Endpoints
    config: InterpretationConfig
    stop: threading.Event | None = None

    @property
    def per_prompt(self) -> int:
        return self.config.per_prompt

    @property
    def seed(self) -> int:
        return self.config.seed

    def classify(
        self, scorer: Scorer, explanation: str, batch: list[Sample]
    ) -> list[tuple[bool, bool | None]]:
        outcomes: list[tuple[bool, bool | None]] = []
        for part, fits in _fitting(scorer, explanation, batch, self.endpoints.scorer_fits):
            if not fits:  # not even one sample fits the context: no request, no prediction
                outcomes.extend((sample.activating, None) for sample in part)
                continue
            _check(self.stop)
            outcomes.extend(
                _predict(scorer, explanation, part, self.endpoints.scorer, self.config, self.stop)
            )
        return outcomes

    def reply(self, messages: list[dict]) -> str | None:
        _check(self.stop)
        if self.endpoints.scorer_fits is not None and not self.endpoints.scorer_fits(messages):
            return None
        try:
            return self.endpoints.scorer.complete(
                messages, max_tokens=self.config.score_max_tokens, temperature=self.config.temperature,
                stop=self.stop, **_extra(self.config),
            ).text  # fmt: skip
        except ChatError:
            return None

    def prompt_logprobs(self, messages: list[dict], count: int) -> tuple[list[int], list[dict | None]] | None:
        _check(self.stop)
        if self.endpoints.scorer_fits is not None and not self.endpoints.scorer_fits(messages):
            return None
        try:
            return self.endpoints.scorer.prompt_logprobs(messages, count, stop=self.stop)
        except ChatError:
            return None

    def similarities(self, query: str, texts: list[str]) -> list[float]:
        if self.endpoints.similarities is None:
            raise ValueError("the embedding scorer needs a sentence embedding model")
        return self.endpoints.similarities(query, texts)


def _fitting(
    scorer: Scorer, explanation: str, batch: list[Sample], fits
) -> Iterator[tuple[list[Sample], bool]]:
    """``batch``, halved until each part's prompt fits the scorer's context, with whether it does
    (a single sample whose prompt is still too long does not)."""
    if fits is None or fits(scorer.messages(explanation, batch)):
        yield batch, True
        return
    if len(batch) == 1:
        yield batch, False
        return
    middle = len(batch) // 2
    yield from _fitting(scorer, explanation, batch[:middle], fits)
    yield from _fitting(scorer, explanation, batch[middle:], fits)


def _predict(
    scorer: Scorer,
    explanation: str,
    batch: list[Sample],
    client: ChatClient,
    config: InterpretationConfig,
    stop: threading.Event | None = None,
) -> list[tuple[bool, bool | None]]:
    """(truth, prediction) of each sample; a failed request counts as an answer that does not
    parse."""
    try:
        answer = client.complete(
            scorer.messages(explanation, batch),
            max_tokens=config.score_max_tokens,
            temperature=config.temperature,
            stop=stop,
            **_extra(config),
        ).text
    except ChatError:
        answer = None
    return scorer.outcomes(batch, answer)


def _extra(config: InterpretationConfig) -> dict[str, Any]:
    return {"extra": {"ignore_eos": True}} if config.ignore_eos else {}


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise Stopped


def interpret_many(
    features: Iterable[FeatureExamples],
    endpoints: Endpoints,
    config: InterpretationConfig,
    *,
    on_result: Callable[[FeatureResult], None],
    tick: Callable[[], bool] = lambda: False,
    tick_seconds: float = 0.02,
) -> bool:
    """Run every feature, ``config.concurrency`` at a time; ``on_result`` gets each result in the
    caller's thread as it comes. ``tick()`` is called at least every ``tick_seconds`` while waiting;
    when it returns True the run stops (requests in flight finish, nothing new is sent) and this
    returns False. Returns True when every feature ran. An exception from ``on_result`` stops the
    run the same way, then is raised here.

    ``tick`` is called until the last request in flight has ended, even once stopping: those
    requests may be waiting for what ``tick`` serves (a worker answering its own job's requests).
    """
    stop = threading.Event()
    queue = iter(features)
    running: set[Future] = set()
    failure: BaseException | None = None
    with ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="autointerp") as pool:

        def submit_next() -> bool:
            feature = None if stop.is_set() else next(queue, None)
            if feature is None:
                return False
            running.add(pool.submit(interpret_feature, feature, endpoints, config, stop))
            return True

        while len(running) < config.concurrency and submit_next():
            pass
        while running:
            done, _ = wait(running, timeout=tick_seconds, return_when=FIRST_COMPLETED)
            for future in done:
                running.discard(future)
                try:
                    result = future.result()
                except Stopped:
                    continue
                if failure is None:
                    try:
                        on_result(result)
                    except BaseException as error:
                        failure = error
                        stop.set()
                submit_next()
            if tick():
                stop.set()
    if failure is not None:
        raise failure
    return not stop.is_set()
