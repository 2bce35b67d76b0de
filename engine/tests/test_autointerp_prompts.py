"""The explainer's prompt (marks, activations, shrinking to fit a context) and the parsing of its
answer, against hand-computed references. Agreement with delphi itself: test_autointerp_delphi.py."""

import pytest

from engine.autointerp.prompts import (
    EXPLAIN_COMPACT_SYSTEM,
    EXPLAIN_SYSTEM,
    MAX_EXPLANATION_CHARS,
    PROMPT_VERSION,
    Example,
    PromptTooLong,
    explanation_messages,
    highlight,
    parse_explanation,
)
from engine.autointerp.scoring import prompt_templates
from engine.errors import EngineError

TWO_MARKED = "Example 1:  the<< ship sailed>> into the<< harbor>>\nExample 2:  a<< storm>> hit the port"
SHIP = Example((" the", " ship", " sailed", " into", " the", " harbor"), (0.0, 3.5, 10.0, 3.0, 0.0, 6.0))
STORM = Example((" a", " storm", " hit", " the", " port"), (0.0, 5.0, 0.0, 0.0, 1.0))
CALM = Example((" and", " then", " calm"), (0.0, 0.0, 0.0))


@pytest.mark.parametrize(
    ("marked", "expected"),
    [
        (set(), "abcde"),
        ({1, 2, 4}, "a<<bc>>d<<e>>"),
        ({0, 1, 2, 3, 4}, "<<abcde>>"),
        ({0, 3}, "<<a>>bc<<d>>e"),
    ],
)
def test_highlight_groups_consecutive_marked_tokens(marked, expected):
    assert highlight(["a", "b", "c", "d", "e"], marked.__contains__) == expected


def test_highlight_of_nothing():
    assert highlight([], lambda index: True) == ""


def test_example_properties():
    assert SHIP.activating and SHIP.max_activation == 10.0 and SHIP.text == " the ship sailed into the harbor"
    assert not CALM.activating and CALM.max_activation == 0.0
    assert not Example((), ()).activating
    listed = Example([" a", " b"], [1, 0])
    assert listed.tokens == (" a", " b") and listed.values == (1.0, 0.0) and hash(listed)
    with pytest.raises(ValueError, match="2 tokens but 1 values"):
        Example((" a", " b"), (1.0,))


def test_full_prompt_marks_tokens_above_three_tenths_and_lists_their_activations():
    messages = explanation_messages([SHIP, STORM, CALM], logit_tokens=[" sea", " boat"])
    assert messages[0] == {"role": "system", "content": EXPLAIN_SYSTEM}
    assert [message["role"] for message in messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    # SHIP: cutoff 3.0 (strictly above, as delphi's explainer), so " into" (3.0) is not marked.
    # Activations are tenths of the strongest example's maximum (10), rounded up.
    assert messages[-1]["content"] == (
        "Example 1:  the<< ship sailed>> into the<< harbor>>\n"
        'Activations: (" ship", 4), (" sailed", 10), (" harbor", 6)\n'
        'Example 2:  a<< storm>> hit the port\nActivations: (" storm", 5)\n'
        "Example 3:  and then calm\n\n"
        'Promoted tokens: " sea", " boat"'
    )


def test_activations_are_relative_to_the_strongest_example_and_listed_up_to_ten():
    many = Example(tuple(f" t{index}" for index in range(12)), tuple(range(1, 13)))
    content = explanation_messages([many])[-1]["content"]
    activations = content.split("Activations: ")[1]
    # cutoff 3.6: tokens 4..12 are marked; ceil(v * 10 / 12); the first ten are listed
    assert activations == ", ".join(f'(" t{v - 1}", {-(-v * 10 // 12)})' for v in range(4, 13))
    assert content.startswith("Example 1:  t0 t1 t2<< t3 t4 t5 t6 t7 t8 t9 t10 t11>>")


def test_no_examples_is_an_error():
    with pytest.raises(ValueError):
        explanation_messages([])


def _size(messages: list[dict]) -> int:
    return sum(len(message["content"]) for message in messages)


def test_examples_are_dropped_from_the_end_until_the_full_prompt_fits():
    examples = [SHIP, STORM, CALM]
    two = _size(explanation_messages(examples[:2]))
    messages = explanation_messages(examples, fits=lambda prompt: _size(prompt) <= two)
    assert messages[0]["content"] == EXPLAIN_SYSTEM
    assert "Example 2:" in messages[-1]["content"] and "Example 3:" not in messages[-1]["content"]


def test_the_compact_instructions_come_when_one_example_does_not_fit():
    compact_two = len(EXPLAIN_COMPACT_SYSTEM) + len(TWO_MARKED)
    messages = explanation_messages([SHIP, STORM, CALM], fits=lambda prompt: _size(prompt) <= compact_two)
    assert messages == [
        {"role": "system", "content": EXPLAIN_COMPACT_SYSTEM},
        {"role": "user", "content": TWO_MARKED},
    ]


def test_promoted_tokens_go_last():
    messages = explanation_messages(
        [SHIP, STORM], logit_tokens=[" sea"], fits=lambda prompt: "Promoted" not in prompt[-1]["content"]
    )
    assert messages[0]["content"] == EXPLAIN_COMPACT_SYSTEM and messages[-1]["content"].count("Example") == 2


def test_nothing_fits():
    with pytest.raises(PromptTooLong) as raised:
        explanation_messages([SHIP], logit_tokens=[" sea"], fits=lambda prompt: False)
    assert isinstance(raised.value, EngineError) and raised.value.code == "PROMPT_TOO_LONG"


def test_a_128_token_explainer_gets_the_compact_prompt():
    """The GPT-2-like tokenizer of the tiny test models (a small vocabulary: about two characters a
    token); a context of 128 tokens, 32 of them kept for the answer, 4 a message for the template."""
    from engine.testing.tiny_models import default_tokenizer

    tokenizer = default_tokenizer("gpt2")

    def fits(prompt: list[dict]) -> bool:
        return sum(len(tokenizer(message["content"])["input_ids"]) + 4 for message in prompt) <= 128 - 32

    examples = [SHIP, STORM, CALM] * 3
    messages = explanation_messages(examples, logit_tokens=[" sea", " boat"], fits=fits)
    assert messages[0]["content"] == EXPLAIN_COMPACT_SYSTEM and fits(messages)
    assert 1 <= messages[-1]["content"].count("Example") < len(examples)
    system_tokens = len(tokenizer(EXPLAIN_COMPACT_SYSTEM)["input_ids"])
    assert system_tokens <= 50


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Looking at the examples...\n[EXPLANATION]: Words about ships", "Words about ships"),
        ("[EXPLANATION]: first\nmore thought\n[EXPLANATION]: second one  ", "second one"),
        ('[EXPLANATION]:\n\n  "Nautical nouns"  \nI hope this helps.', "Nautical nouns"),
        ("**[EXPLANATION]:** `harbor` and *port*", "harbor` and *port"),
        ("[explanation] : lower case", "lower case"),
        ("\n\n  'Nouns of places'\nsecond line", "Nouns of places"),
        ("\u201cCurly quotes\u201d", "Curly quotes"),
        ("", None),
        ("  \n \n", None),
        ("An answer\n[EXPLANATION]:   ", None),
        ('[EXPLANATION]: ""', None),
    ],
)
def test_parse_explanation(answer, expected):
    assert parse_explanation(answer) == expected


def test_parse_explanation_is_at_most_500_characters():
    assert (
        parse_explanation("[EXPLANATION]: " + "ab " * 400) == ("ab " * 400)[:MAX_EXPLANATION_CHARS].rstrip()
    )
    assert len(parse_explanation("x" * 900)) == MAX_EXPLANATION_CHARS


def test_templates_show_every_prompt():
    TEMPLATES = prompt_templates()
    assert PROMPT_VERSION == "mistudio-autointerp/1"
    assert set(TEMPLATES) == {"explain", "detection", "fuzzing", "intruder", "embedding", "simulation"}
    assert "{explanation}" in TEMPLATES["simulation"] and "{token}\tunknown" in TEMPLATES["simulation"]
    assert EXPLAIN_SYSTEM in TEMPLATES["explain"] and EXPLAIN_COMPACT_SYSTEM in TEMPLATES["explain"]
    assert "{explanation}" in TEMPLATES["detection"] and "<<marked tokens>>" in TEMPLATES["fuzzing"]
