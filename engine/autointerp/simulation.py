"""delphi's simulation scorer, its logprob mode (``eai-delphi`` 0.1.3,
``delphi/scorers/simulator/simulation/``, after OpenAI's automated-interpretability): a language
model reads the explanation and "predicts" the feature on each token of an example; the score is
the correlation of its predictions with the feature's values.

The prompt shows three worked neurons (delphi's ``FewShotExampleSet.ORIGINAL``, kept verbatim in
``simulation_examples.json``) and then the example's tokens, each followed by a tab and
"unknown". The endpoint is asked for the prompt's logprobs (vLLM's ``prompt_logprobs``, which
``/v1`` serves): at each "unknown", the probabilities of the tokens "0" … "10", renormalised, give
the expected value that is the prediction. Everything is delphi's, down to the quirks that change
numbers: the worked neurons' explanations follow "find" without a space, the tab token is the one
the endpoint's tokenizer gives a lone tab, and a record's values are ``ceil(10 * value / maximum)``
clamped to 0..10 (the maximum over the test examples here; delphi's sampler uses the feature's).
``engine/tests/test_autointerp_delphi.py`` checks prompts, predictions and correlations against
delphi itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from engine.autointerp.prompts import Example

MAX_NORMALIZED = 10
# delphi's PROMPT_LOGPROBS_COUNT: the alternatives asked for at each prompt token.
PROMPT_LOGPROBS = 15
EXPLANATION_PREFIX = "the main thing this neuron does is find"
UNKNOWN = "unknown"
SIMULATION_SYSTEM = """We're studying neurons in a neural network.
Each neuron looks for some particular thing in a short document.
Look at summary of what the neuron does, and try to predict how it will fire on each token.

The activation format is token<tab>activation, activations go from 0 to 10, \
"unknown" indicates an unknown activation. Most activations will be 0.
"""


@dataclass(frozen=True)
class Record:
    """An example as the simulator sees it: its tokens and its values on 0..10."""

    tokens: tuple[str, ...]
    values: tuple[int, ...]
    # The quantile an activating example was drawn from; -1 for a non-activating one.
    quantile: int


def normalized(value: float, maximum: float) -> int:
    """delphi's ``normalize_activations``: ``ceil(10 * value / maximum)`` clamped to 0..10."""
    return int(min(MAX_NORMALIZED, max(0, math.ceil(value * MAX_NORMALIZED / max(maximum, 1e-6)))))


def simulation_records(tagged: list[tuple[int, Example]], non_activating: list[Example]) -> list[Record]:
    """The (quantile, example) test examples on 0..10 of their maximum, then the non-activating
    ones at zero (delphi's ``to_activation_records``)."""
    maximum = max((example.max_activation for _, example in tagged), default=0.0)
    records = [
        Record(example.tokens, tuple(normalized(value, maximum) for value in example.values), quantile)
        for quantile, example in tagged
    ]
    records += [Record(example.tokens, (0,) * len(example.tokens), -1) for example in non_activating]
    return records


def _worked_record(tokens: list[str], values: list[float], maximum: float, revealed_from: int) -> str:
    """delphi's ``_format_activation_record``: values on 0..10 of ``maximum`` (floored, as the
    worked examples are), "unknown" before ``revealed_from``."""
    entries = []
    for index, (token, value) in enumerate(zip(tokens, values, strict=True)):
        level = (
            0 if maximum <= 0 else min(MAX_NORMALIZED, math.floor(MAX_NORMALIZED * max(0.0, value) / maximum))
        )
        entries.append(f"{token}\t{UNKNOWN if index < revealed_from else level}")
    return "\n".join(entries)


def _sequences(records: list[str]) -> str:
    return "\n<start>\n" + "\n<end>\n<start>\n".join(records) + "\n<end>\n"


def simulation_messages(explanation: str, tokens: tuple[str, ...] | list[str]) -> list[dict[str, str]]:
    """The chat messages delphi's ``NeuronSimulator._make_logprob_prompt`` builds for ``tokens``."""
    messages = [dict(message) for message in _worked_messages()]
    number = len(messages) // 2 + 1  # the system message, then a user and an assistant one a neuron
    messages.append(
        {
            "role": "user",
            "content": f"\n\nNeuron {number}\nExplanation of neuron {number} behavior: {EXPLANATION_PREFIX} "
            f"{explanation.strip()}",
        }
    )
    unknowns = "\n".join(f"{token}\t{UNKNOWN}" for token in tokens)
    messages.append({"role": "assistant", "content": f"\nActivations: {_sequences([unknowns])}"})
    return messages


@cache
def _worked_messages() -> tuple[dict[str, str], ...]:
    """The prompt up to the feature's explanation: the system text and the worked neurons (the same
    for every example, so built once)."""
    neurons = json.loads(Path(__file__).with_name("simulation_examples.json").read_text("utf-8"))
    messages = [{"role": "system", "content": SIMULATION_SYSTEM}]
    for number, neuron in enumerate(neurons, start=1):
        records = neuron["activation_records"]
        maximum = max(max(max(0.0, value) for value in record["activations"]) for record in records)
        shown = [
            _worked_record(record["tokens"], record["activations"], maximum, revealed_from)
            for record, revealed_from in zip(
                records, neuron["first_revealed_activation_indices"], strict=True
            )
        ]
        messages.append(
            {
                "role": "user",
                "content": f"\n\nNeuron {number}\nExplanation of neuron {number} behavior: "
                f"{EXPLANATION_PREFIX}{neuron['explanation']}",
            }
        )
        messages.append({"role": "assistant", "content": f"\nActivations: {_sequences(shown)}\n"})
    return tuple(messages)


def expected_value(alternatives: dict[str, float]) -> float:
    """The mean of the values 0..10 among ``{token: logprob}``, their probabilities renormalised
    (delphi's ``compute_predicted_activation_stats_for_token``)."""
    probabilities: dict[int, float] = {}
    for token, logprob in alternatives.items():
        try:
            value = int(token)
        except (ValueError, TypeError):
            continue
        if 0 <= value <= MAX_NORMALIZED:
            probabilities[value] = math.exp(logprob)
    total = sum(probabilities.values())
    return sum(value * probability / total for value, probability in probabilities.items())


def predicted_values(
    prompt_ids: list[int], prompt_logprobs: list[dict[str, dict[str, Any]] | None], count: int
) -> list[float] | None:
    """The prediction at each "unknown" of the last assistant message (``count`` of them), from
    vLLM-shaped ``prompt_logprobs``: the token after each of the prompt's last ``count`` tab
    tokens (the message's lines are its only ones after the worked neurons, and nothing follows
    it but the template's closing). delphi's ``parse_simulation_response`` takes the tabs after
    the last assistant turn it finds by the token three from the end, which is the same message
    in Llama's chat template and can miss it in others. None when the tabs or their logprobs are
    not all there."""
    if count <= 0:
        return []
    tab = _tab_token(prompt_ids, prompt_logprobs)
    if tab is None:
        return None
    tabs = [index for index, token in enumerate(prompt_ids) if token == tab][-count:]
    if len(tabs) < count or tabs[-1] + 1 >= len(prompt_logprobs):
        return None
    predictions = []
    for index in tabs:
        entry = prompt_logprobs[index + 1]
        if entry is None:
            return None
        alternatives = {item["decoded_token"]: item["logprob"] for item in entry.values()}
        predictions.append(float(expected_value(alternatives)))
    return predictions


def _tab_token(prompt_ids: list[int], prompt_logprobs: list[dict[str, dict[str, Any]] | None]) -> int | None:
    """The id of a lone tab among the prompt's tokens (delphi asks its tokenizer for it)."""
    for token_id, entry in zip(prompt_ids, prompt_logprobs, strict=False):
        if entry is not None and entry.get(str(token_id), {}).get("decoded_token") == "\t":
            return token_id
    return None


def correlation(truth: list[float], predicted: list[float]) -> float | None:
    """Pearson's correlation (numpy's ``corrcoef``, as delphi); None where it is undefined (a
    constant side) or the lengths differ."""
    import numpy as np

    if len(truth) != len(predicted) or len(truth) < 2:
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        value = float(np.corrcoef(truth, predicted)[0, 1])
    return None if math.isnan(value) else value


def pooled_correlation(records: list[Record], predictions: list[list[float]]) -> float | None:
    """The correlation over ``records``' values and their ``predictions``, each concatenated."""
    return correlation(
        [float(value) for record in records for value in record.values],
        [value for predicted in predictions for value in predicted],
    )


def aggregate_correlations(records: list[Record], predictions: list[list[float]]) -> dict[int, float | None]:
    """delphi's ``simulate_and_score`` groups: per quantile of the activating records, and -1 (all
    records) when there are non-activating ones: each the correlation over the concatenated values
    of its records (a failed simulation predicts zeros, as delphi's does)."""
    groups: dict[int, list[int]] = {}
    for index, record in enumerate(records):
        if record.quantile >= 0:
            groups.setdefault(record.quantile, []).append(index)
    if any(record.quantile < 0 for record in records):
        groups[-1] = list(range(len(records)))
    return {
        quantile: pooled_correlation(
            [records[index] for index in members], [predictions[index] for index in members]
        )
        for quantile, members in groups.items()
    }
