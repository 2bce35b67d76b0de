"""The versioned prompts of automatic interpretation, the examples they show, and the parsing of
the explainer's answer.

The explainer's prompt is modeled on EleutherAI's delphi default explainer (``eai-delphi`` 0.1.3,
``delphi/explainers/default``): guidelines, worked examples, then the feature's examples with the
tokens where it fires most between ``<<`` and ``>>`` and how strongly it fires on each (1 to 10).
The scorers' prompts (their questions here, each scorer's class in :mod:`engine.autointerp.scoring`
picks its own) are ours: delphi's questions, without its long worked examples, so that they suit
small scorers too.

Every template's text is here. :data:`PROMPT_VERSION` is stored beside every explanation and
score: bump it when any template changes, so that results from different prompts never mix.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

from engine.errors import EngineError

PROMPT_VERSION = "mistudio-autointerp/1"

LEFT, RIGHT = "<<", ">>"
# delphi's explainer marks the tokens strictly above this fraction of the example's maximum
# (Explainer._highlight, threshold=0.3 in delphi's pipeline), so an example whose values are all
# zero shows no mark.
EXPLAIN_THRESHOLD = 0.3
# delphi lists the activations of the marked tokens after each example, as integers from 0 to 10
# relative to the feature's maximum (samplers.normalize_activations); a few per example suffice.
MAX_LISTED_ACTIVATIONS = 10
MAX_EXPLANATION_CHARS = 500

EXPLAIN_SYSTEM = """\
You are a meticulous AI researcher studying one feature of a language model. You are given text \
examples in which the feature fires. The tokens where it fires most are between delimiters \
<<like this>>; a run of consecutive important tokens is delimited as one <<just like this>>. After \
each example, "Activations:" lists the marked tokens with how strongly the feature fires on each, \
from 1 to 10. "Promoted tokens:", when present, lists tokens the feature makes the model more \
likely to predict next.

Guidelines:
- Produce a concise final description of what the examples have in common: the marked tokens, \
and the text around them when it matters.
- If some examples are uninformative, you need not mention them. Summarize the pattern rather \
than listing the marked tokens.
- Do not mention the << >> delimiters in your explanation.
- Do not make lists of possible explanations. Keep your explanation short.
- The last line of your response must be the explanation, formatted as: [EXPLANATION]: <your \
explanation>"""

# Two worked examples, shown as earlier turns of the conversation (delphi shows three).
EXPLAIN_WORKED_EXAMPLES: tuple[tuple[str, str], ...] = (
    (
        'Example 1: the ocean is wid<<er>> than the river\nActivations: ("er", 8)\n'
        'Example 2: every year you get tall<<er>>, she said\nActivations: ("er", 3)\n'
        'Example 3: the hole was small<<er>> but deep<<er>> than\nActivations: ("er", 9), ("er", 9)',
        '[EXPLANATION]: The suffix "er" ending a comparative adjective of size.',
    ),
    (
        'Example 1: she flew from<< Paris>> to Rome\nActivations: (" Paris", 10)\n'
        'Example 2: he was born in<< New York>> in 1950\nActivations: (" New", 6), (" York", 9)\n'
        'Example 3: the trains to<< Berlin>> were late\nActivations: (" Berlin", 7)',
        "[EXPLANATION]: Names of cities, mostly after a preposition of place or movement.",
    ),
)

# The last resort for a small explainer context: no worked examples, no activation lists.
EXPLAIN_COMPACT_SYSTEM = (
    "Say what the tokens marked <<like this>> have in common. Reply: [EXPLANATION]: <description>"
)

# The scorers' questions are delphi's, without its three worked examples (about 700 tokens).
DETECTION_SYSTEM = (
    "Given an explanation of a feature of text, answer 1 for each example that has the feature, else 0."
)
FUZZING_SYSTEM = (
    "Given an explanation of a feature of text, answer 1 for each example in which every token marked "
    "<<like this>> fits the explanation, else 0 (some examples are marked at random)."
)

# Intruder detection (delphi's IntruderScorer): all examples but one come from the feature; which?
INTRUDER_SYSTEM = (
    "All text examples but one share a feature; tokens may be marked <<like this>>. Find the one that "
    "does not belong: reply [RESPONSE]: followed by its number only."
)
INTRUDER_WORKED_EXAMPLE = (
    "Example 0: the quarterback threw a<< touchdown>>\nExample 1: a<< field goal>> in the last minute\n"
    "Example 2: mix the<< flour>> and sugar\nExample 3: the<< linebacker>> made the tackle",
    "[RESPONSE]: 2",
)
# The embedding scorer's query (delphi's EmbeddingScorer, for instruction-tuned embedding models):
# the explanation after it is embedded, and so is each example's text.
EMBEDDING_QUERY = "Instruct: Retrieve sentences that could be related to the explanation.\nQuery:"


class PromptTooLong(EngineError):
    """Not even the compact prompt with one example fits the model's context."""

    def __init__(self, message: str, details: dict | None = None) -> None:
        super().__init__("PROMPT_TOO_LONG", message, details)


@dataclass(frozen=True)
class Example:
    """A token window and the feature's value at each token (delphi's ``ActivatingExample`` or
    ``NonActivatingExample``, with ``str_tokens``)."""

    tokens: tuple[str, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "values", tuple(float(value) for value in self.values))
        if len(self.tokens) != len(self.values):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.values)} values")

    @property
    def max_activation(self) -> float:
        return max(self.values, default=0.0)

    @property
    def activating(self) -> bool:
        return self.max_activation > 0

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def highlight(tokens: Sequence[str], marked: Callable[[int], bool]) -> str:
    """The tokens joined, each run of consecutive marked ones inside one ``<<``…``>>`` (delphi's
    ``_highlight``)."""
    parts: list[str] = []
    for is_marked, run in groupby(range(len(tokens)), key=marked):
        text = "".join(tokens[index] for index in run)
        parts.append(f"{LEFT}{text}{RIGHT}" if is_marked else text)
    return "".join(parts)


def _explained_example(number: int, example: Example, scale: float, *, with_activations: bool) -> str:
    cutoff = EXPLAIN_THRESHOLD * example.max_activation
    marked = [index for index, value in enumerate(example.values) if value > cutoff]
    marked_set = set(marked)
    line = f"Example {number}: {highlight(example.tokens, marked_set.__contains__)}"
    if not with_activations or not marked:
        return line
    listed = ", ".join(
        f"({json.dumps(example.tokens[index], ensure_ascii=False)}, "
        f"{min(10, max(0, math.ceil(example.values[index] * 10 / scale)))})"
        for index in marked[:MAX_LISTED_ACTIVATIONS]
    )
    return f"{line}\nActivations: {listed}"


def _promoted(logit_tokens: list[str] | None) -> str:
    if not logit_tokens:
        return ""
    return "\n\nPromoted tokens: " + ", ".join(
        json.dumps(token, ensure_ascii=False) for token in logit_tokens
    )


def _full_messages(examples: list[Example], scale: float, logit_tokens: list[str] | None) -> list[dict]:
    messages = [{"role": "system", "content": EXPLAIN_SYSTEM}]
    for question, answer in EXPLAIN_WORKED_EXAMPLES:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    body = "\n".join(
        _explained_example(number, example, scale, with_activations=True)
        for number, example in enumerate(examples, start=1)
    )
    messages.append({"role": "user", "content": body + _promoted(logit_tokens)})
    return messages


def _compact_messages(examples: list[Example], scale: float, logit_tokens: list[str] | None) -> list[dict]:
    body = "\n".join(
        _explained_example(number, example, scale, with_activations=False)
        for number, example in enumerate(examples, start=1)
    )
    return [
        {"role": "system", "content": EXPLAIN_COMPACT_SYSTEM},
        {"role": "user", "content": body + _promoted(logit_tokens)},
    ]


def explanation_messages(
    examples: list[Example],
    *,
    logit_tokens: list[str] | None = None,
    fits: Callable[[list[dict]], bool] | None = None,
) -> list[dict]:
    """The explainer's chat messages for ``examples`` (strongest first: when the prompt must
    shrink, the last ones go first).

    ``fits(messages)`` says whether a prompt fits the explainer's context. The full prompt keeps
    as many examples as fit (at least one); failing that, the compact instructions with as many
    examples as fit; failing that, the compact ones without the promoted tokens. Raises
    :class:`PromptTooLong` when nothing fits.
    """
    if not examples:
        raise ValueError("no examples to explain")
    # Activations are shown relative to the strongest example given, as delphi scales them by the
    # feature's maximum.
    scale = max(max(example.max_activation for example in examples), 1e-6)
    if fits is None:
        return _full_messages(examples, scale, logit_tokens)
    variants: list[Callable[[int], list[dict]]] = [
        lambda count: _full_messages(examples[:count], scale, logit_tokens),
        lambda count: _compact_messages(examples[:count], scale, logit_tokens),
    ]
    if logit_tokens:
        variants.append(lambda count: _compact_messages(examples[:count], scale, None))
    for build in variants:
        if not fits(build(1)):
            continue
        # The prompt grows with the number of examples: the largest count that fits, by bisection.
        low, high = 1, len(examples)
        while low < high:
            middle = (low + high + 1) // 2
            if fits(build(middle)):
                low = middle
            else:
                high = middle - 1
        return build(low)
    raise PromptTooLong(
        "Not even one example with the compact instructions fits the explainer's context.",
        {"examples": len(examples)},
    )


_EXPLANATION_MARKER = re.compile(r"\[EXPLANATION\]\s*:", re.IGNORECASE)
# Quotes and Markdown emphasis that models wrap around a one-line answer.
_WRAPPING = "\"'`* \t\u201c\u201d\u2018\u2019"  # and curly quotes


def parse_explanation(text: str) -> str | None:
    """The explanation in the explainer's answer: the first line with text after the last
    ``[EXPLANATION]:``, else the answer's first line with text; stripped of wrapping quotes, at
    most :data:`MAX_EXPLANATION_CHARS` characters. None when there is nothing."""
    markers = list(_EXPLANATION_MARKER.finditer(text))
    if markers:
        text = text[markers[-1].end() :]
    for line in text.splitlines():
        explanation = line.strip().strip(_WRAPPING).strip()
        if explanation:
            return explanation[:MAX_EXPLANATION_CHARS].rstrip()
    return None


def scorer_messages(system: str, explanation: str, texts: list[str]) -> list[dict]:
    """A scorer's chat messages: ``system`` is its question (such as :data:`DETECTION_SYSTEM`);
    ``texts`` are the samples' texts (those of fuzzing with their marks), shown as ``Example i:
    text`` from 0 as in delphi."""
    examples = "\n".join(f"Example {index}: {text}" for index, text in enumerate(texts))
    count = f"{len(texts)} number" + ("" if len(texts) == 1 else "s")
    question = (
        f"Explanation: {explanation}\n\n{examples}\n\n"
        f"Reply with only a Python list of {count} (0 or 1), one per example, in order."
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def intruder_messages(texts: list[str]) -> list[dict]:
    """The intruder scorer's chat messages: its question, one worked example, then ``texts`` (the
    feature's examples with the intruder among them) as ``Example i:text`` from 0, as in delphi."""
    examples = "\n".join(f"Example {index}:{text}" for index, text in enumerate(texts))
    worked_question, worked_answer = INTRUDER_WORKED_EXAMPLE
    return [
        {"role": "system", "content": INTRUDER_SYSTEM},
        {"role": "user", "content": worked_question},
        {"role": "assistant", "content": worked_answer},
        {"role": "user", "content": f"Examples:\n\n{examples}\n"},
    ]


def messages_as_text(messages: list[dict]) -> str:
    """Chat messages as one text, for showing a prompt on a page."""
    return "\n\n".join(f"[{message['role']}]\n{message['content']}" for message in messages)


_PLACEHOLDER = Example(tokens=("{text}", "{activating tokens}", "{text}"), values=(0.0, 1.0, 0.0))

# What the explainer's prompt looks like, for showing on a page (rendered by the code that builds
# it); the scorers' templates are beside it in :func:`engine.autointerp.scoring.prompt_templates`.
EXPLAIN_TEMPLATE = (
    messages_as_text(_full_messages([_PLACEHOLDER], 1.0, ["{promoted tokens}"]))
    + "\n\n(When the prompt does not fit the explainer's context: fewer examples, then)\n\n"
    + messages_as_text(_compact_messages([_PLACEHOLDER], 1.0, ["{promoted tokens}"]))
)
