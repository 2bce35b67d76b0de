"""The generation engine on real tiny models of every causal family (no database, no mocks).

References are computed independently of the engine's decode loop: transformers' own
``model.generate`` (greedy, repetition penalty), teacher-forced forward passes over prompt +
completion without a cache (logprobs, ``output_hidden_states``), and the extraction engine's
one-pass hooks (captured activations).
"""

import dataclasses

import pytest
import torch

from engine.extraction import extract
from engine.generation import (
    GenerationError,
    SamplingParams,
    TokenEvent,
    context_length,
    generate,
    render_prompt,
)
from engine.hooks import HookError
from engine.testing.tiny_models import FAMILIES, default_tokenizer

CAUSAL_FAMILIES = tuple(family for family in FAMILIES if family != "bert")
ATOL = 1e-4
PROMPT = "The module provides functions for working with"
GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


def _prompt_ids(tokenizer, text: str = PROMPT) -> list[int]:
    return tokenizer(text, add_special_tokens=True).input_ids


def _reference_greedy(model, ids: list[int], max_new_tokens: int, **options) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, **options
        )
    return output[0, len(ids) :].tolist()


def _matches_reference(result, reference: list[int], eos_ids: set[int]) -> bool:
    """Our tokens equal ``generate``'s, which pads after an EOS where ours stops."""
    if result.finish_reason == "stop":
        return result.token_ids[-1] in eos_ids and reference[: len(result.token_ids)] == result.token_ids
    return result.token_ids == reference


def _eos_ids(weights) -> set[int]:
    return {weights.tokenizer.eos_token_id, weights.model.generation_config.eos_token_id} - {None}


def _teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def _hooks(model) -> dict[str, tuple[list, list]]:
    """The forward hooks and pre-hooks on every module. transformers 5 installs its own
    output-capturing hooks for good the first time ``output_hidden_states`` is asked for, so
    tests compare with a snapshot taken before the call rather than with "none"."""
    return {
        name: (list(module._forward_hooks.values()), list(module._forward_pre_hooks.values()))
        for name, module in model.named_modules()
    }


def _streamed(results_count: int, events: list[TokenEvent]) -> list[str]:
    texts = [""] * results_count
    for event in events:
        texts[event.row] += event.text
    return texts


# --- 1. greedy equals transformers' generate ----------------------------------------------------


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_greedy_matches_model_generate(load_tiny, family):
    weights = load_tiny(family)
    ids = _prompt_ids(weights.tokenizer)
    events = []

    (result,) = generate(weights.model, weights.tokenizer, [ids], [GREEDY], on_token=events.append)

    reference = _reference_greedy(weights.model, ids, GREEDY.max_new_tokens)
    assert _matches_reference(result, reference, _eos_ids(weights))
    assert [event.token_id for event in events] == result.token_ids
    assert [event.index for event in events] == list(range(len(result.token_ids)))
    assert "".join(event.text for event in events) == result.text
    without_eos = [token for token in result.token_ids if token not in _eos_ids(weights)]
    assert result.text == weights.tokenizer.decode(without_eos, skip_special_tokens=True)
    assert result.prompt_tokens == len(ids)
    assert result.prefill_seconds > 0 and result.decode_seconds >= 0
    assert result.logprobs is None and result.activations is None


def test_repetition_penalty_matches_model_generate(load_tiny):
    weights = load_tiny("gpt2")
    ids = _prompt_ids(weights.tokenizer)
    params = dataclasses.replace(GREEDY, repetition_penalty=1.8)

    (result,) = generate(weights.model, weights.tokenizer, [ids], [params])

    reference = _reference_greedy(weights.model, ids, params.max_new_tokens, repetition_penalty=1.8)
    assert _matches_reference(result, reference, _eos_ids(weights))
    # The penalty changed the output (the tiny gpt2 repeats one token without it).
    (plain,) = generate(weights.model, weights.tokenizer, [ids], [GREEDY])
    assert plain.token_ids != result.token_ids


def test_context_length_from_config(load_tiny):
    assert context_length(load_tiny("gpt2").model) == 128  # n_positions
    assert context_length(load_tiny("llama").model) == 128  # max_position_embeddings
    assert context_length(load_tiny("bloom").model) is None  # ALiBi: no bound


# --- 2. batches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_batch_of_different_lengths_equals_each_prompt_alone(load_tiny, family):
    weights = load_tiny(family)
    texts = [
        "Return",
        "The module provides functions for working with files and directories on every platform",
        "A queue is a list of items",
    ]
    prompts = [_prompt_ids(weights.tokenizer, text) for text in texts]
    assert len({len(ids) for ids in prompts}) == 3
    # Per-row parameters: each row stops at its own length.
    params = [dataclasses.replace(GREEDY, max_new_tokens=count) for count in (14, 20, 9)]
    events = []

    batched = generate(weights.model, weights.tokenizer, prompts, params, on_token=events.append)

    for ids, row_params, result in zip(prompts, params, batched, strict=True):
        (alone,) = generate(weights.model, weights.tokenizer, [ids], [row_params])
        assert result.token_ids == alone.token_ids
        assert result.text == alone.text
        assert result.prompt_tokens == len(ids)
        if result.finish_reason == "length":
            assert len(result.token_ids) == row_params.max_new_tokens
    assert _streamed(3, events) == [result.text for result in batched]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_row_at_the_end_of_the_context_beside_a_longer_answer(load_tiny, family):
    """A batch decodes as many steps as its longest answer; a row whose prompt and answer fill the
    context ends first and must not be fed a position past it (GPT-2's position table: IndexError)."""
    weights = load_tiny(family)
    limit = context_length(weights.model)
    long_prompt = (_prompt_ids(weights.tokenizer, "The module provides functions " * 40) * 2)[: limit - 4]
    prompts = [long_prompt, _prompt_ids(weights.tokenizer, "Return")]
    params = [dataclasses.replace(GREEDY, max_new_tokens=4), dataclasses.replace(GREEDY, max_new_tokens=20)]

    batched = generate(weights.model, weights.tokenizer, prompts, params)

    for ids, row_params, result in zip(prompts, params, batched, strict=True):
        (alone,) = generate(weights.model, weights.tokenizer, [ids], [row_params])
        assert result.token_ids == alone.token_ids


# --- 3. sampling --------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_seed_dependent(load_tiny):
    weights = load_tiny("llama")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _prompt_ids(tokenizer)
    hot = SamplingParams(max_new_tokens=32, temperature=1.5, seed=7)

    (first,) = generate(model, tokenizer, [ids], [hot])
    (again,) = generate(model, tokenizer, [ids], [hot])
    (other,) = generate(model, tokenizer, [ids], [dataclasses.replace(hot, seed=8)])

    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids
    # Each row has its own generator: a seeded row gives the same tokens next to another row.
    batched = generate(model, tokenizer, [ids, ids], [dataclasses.replace(hot, seed=8), hot])
    assert batched[0].token_ids == other.token_ids
    assert batched[1].token_ids == first.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(load_tiny):
    weights = load_tiny("llama")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _prompt_ids(tokenizer)
    (greedy,) = generate(model, tokenizer, [ids], [GREEDY])

    (top_k,) = generate(model, tokenizer, [ids], [dataclasses.replace(GREEDY, temperature=1.5, top_k=1)])
    (top_p,) = generate(model, tokenizer, [ids], [dataclasses.replace(GREEDY, temperature=1.5, top_p=1e-6)])
    (both,) = generate(
        model, tokenizer, [ids], [dataclasses.replace(GREEDY, temperature=1.5, top_k=50, top_p=1e-6)]
    )

    assert top_k.token_ids == greedy.token_ids
    assert top_p.token_ids == greedy.token_ids
    assert both.token_ids == greedy.token_ids


def test_unseeded_sampling_draws_a_fresh_seed(load_tiny):
    weights = load_tiny("llama")
    ids = _prompt_ids(weights.tokenizer)
    params = SamplingParams(max_new_tokens=32, temperature=1.5)

    runs = [generate(weights.model, weights.tokenizer, [ids], [params])[0].token_ids for _ in range(2)]

    assert runs[0] != runs[1]


# --- 4. capture ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_capture_equals_a_teacher_forced_forward(load_tiny, family):
    weights = load_tiny(family)
    model = weights.model
    ids = _prompt_ids(weights.tokenizer)
    extracted_hooks = ["hook_embed", "blocks.0.mlp.hook_post", "blocks.1.hook_attn_out"]
    hooks = ["blocks.0.hook_resid_post", *extracted_hooks, "module:lm_head"]
    params = dataclasses.replace(GREEDY, max_new_tokens=12)

    before = _hooks(model)

    (result,) = generate(model, weights.tokenizer, [ids], [params], capture=hooks)

    assert _hooks(model) == before
    full = ids + result.token_ids
    assert set(result.activations) == set(hooks)
    for tensor in result.activations.values():
        assert tensor.shape[0] == len(full) and tensor.dtype == torch.float32 and tensor.device.type == "cpu"
    with torch.no_grad():
        reference = model(torch.tensor([full]), output_hidden_states=True, use_cache=False)
    torch.testing.assert_close(
        result.activations["blocks.0.hook_resid_post"], reference.hidden_states[1][0], atol=ATOL, rtol=0
    )
    # A hook point outside the base model (the LM head): every prompt position, not only the last.
    torch.testing.assert_close(result.activations["module:lm_head"], reference.logits[0], atol=ATOL, rtol=0)
    (one_pass,) = extract(model, [full], [[0]], hooks=extracted_hooks)
    for name in extracted_hooks:
        torch.testing.assert_close(result.activations[name], one_pass.activations[name], atol=ATOL, rtol=0)


def test_capture_in_bfloat16(load_tiny):
    weights = load_tiny("gpt2")
    ids = _prompt_ids(weights.tokenizer)
    hooks = ["blocks.0.hook_resid_post"]
    params = dataclasses.replace(GREEDY, max_new_tokens=6)

    (full,) = generate(weights.model, weights.tokenizer, [ids], [params], capture=hooks)
    (half,) = generate(
        weights.model, weights.tokenizer, [ids], [params], capture=hooks, capture_dtype="bfloat16"
    )

    tensor = half.activations[hooks[0]]
    assert tensor.dtype == torch.bfloat16
    assert tensor.shape == full.activations[hooks[0]].shape == (len(ids) + 6, weights.model.config.n_embd)
    torch.testing.assert_close(tensor.float(), full.activations[hooks[0]], atol=0.05, rtol=0.02)


# --- 5. logprobs --------------------------------------------------------------------------------


def test_logprobs_are_the_raw_model_distribution(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _prompt_ids(tokenizer)
    rows = [
        dataclasses.replace(GREEDY, max_new_tokens=10, top_logprobs=5),
        # Sampled hot: the logprobs still describe the model, not the tempered distribution.
        SamplingParams(max_new_tokens=10, temperature=1.5, seed=3, logprobs=True),
    ]
    streamed = []

    results = generate(model, tokenizer, [ids, ids], rows, on_token=streamed.append)

    for row, (params, result) in enumerate(zip(rows, results, strict=True)):
        assert result.logprobs == [event for event in streamed if event.row == row]
        assert all(
            a is b for a, b in zip(result.logprobs, [e for e in streamed if e.row == row], strict=True)
        )
        logits = _teacher_forced_logits(model, ids + result.token_ids)
        expected = torch.log_softmax(logits, -1)
        for index, event in enumerate(result.logprobs):
            position = len(ids) - 1 + index
            assert event.logprob == pytest.approx(expected[position, event.token_id].item(), abs=ATOL)
            if params.top_logprobs:
                top = event.top_logprobs
                assert len(top) == 5
                assert [item.logprob for item in top] == sorted((item.logprob for item in top), reverse=True)
                assert top[0].token_id == event.token_id  # greedy picks the most likely token
                values, indices = expected[position].topk(5)
                assert [item.token_id for item in top] == indices.tolist()
                assert [item.logprob for item in top] == pytest.approx(values.tolist(), abs=ATOL)
                assert all(item.token == tokenizer.decode([item.token_id]) for item in top)
            else:
                assert event.top_logprobs is None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prompt_logprobs_are_the_teacher_forced_distribution_of_each_padded_row(
    load_tiny, family, monkeypatch
):
    from engine.generation import logprobs

    monkeypatch.setattr(logprobs, "PROMPT_LOGPROBS_CHUNK", 3)  # a long prompt's chunks, on a short one
    weights = load_tiny(family)
    model, tokenizer = weights.model, weights.tokenizer
    long_ids, short_ids = _prompt_ids(tokenizer), _prompt_ids(tokenizer, "Open the file")
    rows = [
        dataclasses.replace(GREEDY, max_new_tokens=2, prompt_logprobs=3),
        dataclasses.replace(GREEDY, max_new_tokens=2, prompt_logprobs=0),
        dataclasses.replace(GREEDY, max_new_tokens=2),
    ]

    results = generate(model, tokenizer, [long_ids, short_ids, short_ids], rows)

    assert results[2].prompt_logprobs is None
    for ids, params, result in zip((long_ids, short_ids), rows, results, strict=False):
        expected = torch.log_softmax(_teacher_forced_logits(model, ids), -1)
        events = result.prompt_logprobs
        assert [event.token_id for event in events] == ids
        assert [event.index for event in events] == list(range(len(ids)))
        assert events[0].logprob is None and events[0].top_logprobs is None
        for position, event in enumerate(events[1:], start=1):
            assert event.logprob == pytest.approx(expected[position - 1, ids[position]].item(), abs=ATOL)
            if params.prompt_logprobs:
                values, indices = expected[position - 1].topk(3)
                assert [top.token_id for top in event.top_logprobs] == indices.tolist()
                assert [top.logprob for top in event.top_logprobs] == pytest.approx(values.tolist(), abs=ATOL)
            else:
                assert event.top_logprobs is None
        # Each token's text is what it adds to the decoded prompt.
        assert "".join(event.text for event in events) == tokenizer.decode(ids, skip_special_tokens=True)
        # The completion is the one a run without prompt logprobs gives.
        plain = generate(model, tokenizer, [ids], [dataclasses.replace(params, prompt_logprobs=None)])
        assert result.token_ids == plain[0].token_ids


def test_prompt_logprobs_out_of_range_are_refused(load_tiny):
    weights = load_tiny("gpt2")
    with pytest.raises(GenerationError) as raised:
        generate(weights.model, weights.tokenizer, [[1, 2]], [SamplingParams(prompt_logprobs=21)])
    assert raised.value.details == {"field": "prompt_logprobs"}


# --- 6. stopping --------------------------------------------------------------------------------


def _stop_string_in(text: str) -> tuple[str, int]:
    """A 3-character piece of ``text`` first found at index >= 5 (so the cut text is not empty)."""
    for index in range(5, len(text) - 3):
        piece = text[index : index + 3]
        if "\ufffd" not in piece and text.find(piece) == index:
            return piece, index
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text_before_it(load_tiny):
    weights = load_tiny("llama")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _prompt_ids(tokenizer)
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    (first,) = generate(model, tokenizer, [ids], [params])
    assert first.finish_reason == "length" and len(first.token_ids) == 40
    stop, index = _stop_string_in(first.text)
    later = first.text[index + 4 :][:3]
    events = []

    (result,) = generate(
        model, tokenizer, [ids], [dataclasses.replace(params, stop=(later, stop))], on_token=events.append
    )

    assert result.finish_reason == "stop"
    assert result.text == first.text[:index]
    assert "".join(event.text for event in events) == result.text
    # The tokens that formed the stop string are kept, and generation ended there.
    assert first.token_ids[: len(result.token_ids)] == result.token_ids
    assert tokenizer.decode(result.token_ids).startswith(first.text[:index] + stop)
    assert stop not in tokenizer.decode(result.token_ids[:-1])

    # A stop string that the completion's end begins but never completes: held back while it
    # might come, then released when the row ends.
    never = first.text[-2:] + "\u2603"
    events.clear()
    (unstopped,) = generate(
        model, tokenizer, [ids], [dataclasses.replace(params, stop=(never,))], on_token=events.append
    )
    assert unstopped.finish_reason == "length"
    assert unstopped.text == first.text == "".join(event.text for event in events)
    assert events[-1].text.endswith(first.text[-2:])


def test_eos_token_stops_the_row(load_tiny):
    weights = load_tiny("gpt_neo")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _prompt_ids(tokenizer)
    (first,) = generate(model, tokenizer, [ids], [GREEDY])
    step = next(k for k in range(3, len(first.token_ids)) if first.token_ids[k] not in first.token_ids[:k])
    eos = first.token_ids[step]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    events = []
    try:
        (result,) = generate(model, tokenizer, [ids], [GREEDY], on_token=events.append)
    finally:
        model.generation_config.eos_token_id = saved

    assert result.finish_reason == "stop"
    assert result.token_ids == first.token_ids[: step + 1]
    assert result.text == tokenizer.decode(first.token_ids[:step], skip_special_tokens=True)
    assert "".join(event.text for event in events) == result.text
    assert events[-1].token_id == eos

    # ignore_eos: the same EOS is just another token, and the row runs to its length.
    model.generation_config.eos_token_id = eos
    try:
        (ignoring,) = generate(model, tokenizer, [ids], [dataclasses.replace(GREEDY, ignore_eos=True)])
    finally:
        model.generation_config.eos_token_id = saved
    assert ignoring.finish_reason == "length" and ignoring.token_ids == first.token_ids


def test_length_finish(load_tiny):
    weights = load_tiny("gpt_neo")
    ids = _prompt_ids(weights.tokenizer)

    (result,) = generate(
        weights.model, weights.tokenizer, [ids], [dataclasses.replace(GREEDY, max_new_tokens=5)]
    )

    assert result.finish_reason == "length" and len(result.token_ids) == 5


def test_streamed_text_waits_for_whole_characters():
    # Byte-level BPE splits most non-ASCII characters over several tokens; no event may carry
    # half a character (a replacement character) and the pieces must add up to the text.
    from engine.generation.text_stream import TextStream

    tokenizer = default_tokenizer("gpt2")
    text = "Grüße aus Köln: 3 € für naïve Cafés, ½ ÷ ∞"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)  # really split
    for stop, expected in (((), text), (("naïve",), text[: text.index("naïve")])):
        stream = TextStream(tokenizer, stop)
        pieces = []
        for position, token in enumerate(ids):
            piece, stopped = stream.push(token, final=position == len(ids) - 1)
            pieces.append(piece)
            if stopped:
                break
        assert not any("\ufffd" in piece for piece in pieces)
        assert "".join(pieces) == stream.text == expected


# --- 7. cancellation ----------------------------------------------------------------------------


def test_cancelled_row_ends_while_the_other_runs_on(load_tiny):
    weights = load_tiny("llama")
    model, tokenizer = weights.model, weights.tokenizer
    prompts = [_prompt_ids(tokenizer), _prompt_ids(tokenizer, "A queue is a list")]
    params = [dataclasses.replace(GREEDY, max_new_tokens=16)] * 2
    events = []
    asked = []

    def cancelled_rows():
        asked.append(len(events))
        return {0} if sum(event.row == 0 for event in events) >= 3 else set()

    results = generate(
        model, tokenizer, prompts, params, on_token=events.append, cancelled_rows=cancelled_rows
    )

    assert results[0].finish_reason == "cancelled"
    assert len(results[0].token_ids) == 3
    assert results[1].finish_reason == "length" and len(results[1].token_ids) == 16
    (alone,) = generate(model, tokenizer, [prompts[1]], [params[1]])
    assert results[1].token_ids == alone.token_ids
    assert _streamed(2, events) == [result.text for result in results]
    assert len(asked) == 15  # once per decode step


def test_cancelling_every_row_stops_at_once(load_tiny):
    weights = load_tiny("gpt2")
    ids = _prompt_ids(weights.tokenizer)

    results = generate(
        weights.model, weights.tokenizer, [ids, ids], [GREEDY, GREEDY], cancelled_rows=lambda: {0, 1}
    )

    assert [result.finish_reason for result in results] == ["cancelled", "cancelled"]
    assert [len(result.token_ids) for result in results] == [1, 1]  # only the prefill's token


def test_prefill_runs_the_lm_head_on_the_last_position_only(load_tiny):
    weights = load_tiny("gpt2")
    model = weights.model
    head_rows = []
    handle = model.lm_head.register_forward_hook(
        lambda module, args, output: head_rows.append(output.shape[1])
    )
    params = dataclasses.replace(GREEDY, max_new_tokens=3)
    try:
        generate(model, weights.tokenizer, [list(range(1, 11))], [params])
        # With capture, the extra pass for the last token stops before the head.
        generate(
            model, weights.tokenizer, [list(range(1, 11))], [params], capture=["blocks.0.hook_resid_post"]
        )
    finally:
        handle.remove()

    assert head_rows == [1, 1, 1] * 2


# --- 8. errors and hooks ------------------------------------------------------------------------


def test_context_length_exceeded(load_tiny):
    weights = load_tiny("gpt2")
    ids = list(range(1, 101))

    with pytest.raises(GenerationError) as raised:
        generate(weights.model, weights.tokenizer, [ids], [SamplingParams(max_new_tokens=29)])

    assert raised.value.code == "CONTEXT_LENGTH_EXCEEDED"
    assert raised.value.details == {"prompt_tokens": 100, "max_tokens": 29, "context_length": 128}
    # Exactly at the limit is fine.
    (result,) = generate(weights.model, weights.tokenizer, [ids], [SamplingParams(max_new_tokens=28, seed=0)])
    assert len(result.token_ids) <= 28


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("top_logprobs", 21),
        ("stop", ("a", "b", "c", "d", "e")),
        ("stop", ("",)),
        ("seed", "seven"),
    ],
)
def test_invalid_parameter(load_tiny, field, value):
    weights = load_tiny("gpt2")

    with pytest.raises(GenerationError) as raised:
        generate(weights.model, weights.tokenizer, [[1, 2, 3]], [SamplingParams(**{field: value})])

    assert raised.value.code == "INVALID_PARAMETER"
    assert raised.value.details == {"field": field}


def test_invalid_requests(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    vocab = model.get_input_embeddings().num_embeddings
    before = _hooks(model)

    def code_of(*args, **kwargs) -> str:
        with pytest.raises((GenerationError, HookError)) as raised:
            generate(model, tokenizer, *args, **kwargs)
        return raised.value.code

    assert code_of([[1, 2]], [GREEDY, GREEDY]) == "INVALID_PARAMETER"
    assert code_of([], []) == "INVALID_PARAMETER"
    assert code_of([[1, vocab]], [GREEDY]) == "INVALID_TOKENS"
    assert code_of([[-1, 2]], [GREEDY]) == "INVALID_TOKENS"
    assert code_of([[]], [GREEDY]) == "EMPTY_PROMPT"
    assert code_of([[1], [2]], [GREEDY, GREEDY], capture=["hook_embed"]) == "CAPTURE_NEEDS_ONE_PROMPT"
    assert code_of([[1]], [GREEDY], capture=["blocks.99.hook_resid_post"]) == "INVALID_HOOK"
    assert code_of([[1]], [GREEDY], capture=["hook_embed"], capture_dtype="int8") == "INVALID_PARAMETER"
    assert _hooks(model) == before


def test_hooks_are_removed_when_generation_fails(load_tiny):
    weights = load_tiny("llama")
    model = weights.model
    hooks = ["hook_embed", "blocks.0.mlp.hook_post", "blocks.1.hook_resid_post"]

    def fail_on_third(event):
        if event.index == 2:
            raise RuntimeError("consumer went away")

    before = _hooks(model)

    with pytest.raises(RuntimeError, match="consumer went away"):
        generate(model, weights.tokenizer, [[5, 6, 7]], [GREEDY], capture=hooks, on_token=fail_on_third)

    assert _hooks(model) == before
    # And the model still generates normally afterwards.
    (result,) = generate(model, weights.tokenizer, [[5, 6, 7]], [GREEDY], capture=hooks)
    assert _hooks(model) == before
    assert result.activations["hook_embed"].shape[0] == 3 + len(result.token_ids)


# --- 9. prompts ---------------------------------------------------------------------------------

_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_render_prompt_with_a_chat_template():
    tokenizer = default_tokenizer("llama")
    tokenizer.chat_template = _TEMPLATE
    messages = [
        {"role": "user", "content": "What is a queue?"},
        {"role": "assistant", "content": "A list."},
        {"role": "user", "content": "And a stack?"},
    ]

    def templated(conversation):
        encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"])

    assert render_prompt(tokenizer, messages=messages) == templated(messages)
    system = {"role": "system", "content": "Be brief."}
    assert render_prompt(tokenizer, messages=messages, system_prompt="Be brief.") == templated(
        [system, *messages]
    )
    assert render_prompt(tokenizer, prompt="Hello", system_prompt="Be brief.") == templated(
        [system, {"role": "user", "content": "Hello"}]
    )
    # chat_template=False ignores the template.
    assert render_prompt(tokenizer, prompt="Hello", chat_template=False) == tokenizer("Hello").input_ids


def test_render_prompt_without_a_chat_template():
    tokenizer = default_tokenizer("llama")
    assert not tokenizer.chat_template
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a queue?"},
        {"role": "assistant", "content": "A list."},
        {"role": "user", "content": "And a stack?"},
    ]
    expected = "Be brief.\n\nUser: What is a queue?\nAssistant: A list.\nUser: And a stack?\nAssistant:"

    assert render_prompt(tokenizer, messages=messages) == tokenizer(expected).input_ids
    assert (
        render_prompt(tokenizer, messages=messages[1:2])
        == tokenizer("User: What is a queue?\nAssistant:").input_ids
    )
    assert render_prompt(tokenizer, prompt="Hello there") == tokenizer("Hello there").input_ids
    assert (
        render_prompt(tokenizer, prompt="Hello", system_prompt="Be brief.")
        == tokenizer("Be brief.\n\nHello").input_ids
    )


def test_render_prompt_errors():
    tokenizer = default_tokenizer("gpt2")  # adds no special tokens, so "" has none

    def code_of(**kwargs) -> str:
        with pytest.raises(GenerationError) as raised:
            render_prompt(tokenizer, **kwargs)
        return raised.value.code

    assert code_of(prompt="") == "EMPTY_PROMPT"
    assert code_of() == "INVALID_PARAMETER"
    assert code_of(prompt="a", messages=[{"role": "user", "content": "b"}]) == "INVALID_PARAMETER"
    assert code_of(messages=[{"role": "robot", "content": "b"}]) == "INVALID_PARAMETER"
    assert code_of(prompt="a", chat_template=True) == "NO_CHAT_TEMPLATE"


# --- 10. quantized ------------------------------------------------------------------------------


def test_int8_greedy_matches_its_own_generate(load_tiny):
    weights = load_tiny("llama", "int8")
    assert weights.quantized_module_count > 0
    ids = _prompt_ids(weights.tokenizer)

    (result,) = generate(weights.model, weights.tokenizer, [ids], [GREEDY])

    reference = _reference_greedy(weights.model, ids, GREEDY.max_new_tokens)
    assert _matches_reference(result, reference, _eos_ids(weights))


# --- 9. yielding a batch and going on ----------------------------------------------------------


def _in_segments(model, tokenizer, prompts, params, *, steps_per_segment: int, **options):
    """Run ``prompts`` to the end, yielding every ``steps_per_segment`` decode steps and going on
    from each row's progress (serialised to JSON and back, as the worker stores it)."""
    from engine.generation import Progress

    progress = [None] * len(prompts)
    events: list[list[TokenEvent]] = [[] for _ in prompts]
    finished: dict[int, object] = {}
    segments = 0
    while len(finished) < len(prompts):
        waiting = [index for index in range(len(prompts)) if index not in finished]
        steps = iter(range(10**6))

        def relay(event, waiting=waiting):
            events[waiting[event.row]].append(event)

        results = generate(
            model, tokenizer, [prompts[index] for index in waiting], [params[index] for index in waiting],
            progress=[progress[index] for index in waiting], on_token=relay,
            should_yield=lambda steps=steps: next(steps) >= steps_per_segment - 1, **options,
        )  # fmt: skip
        segments += 1
        for index, result in zip(waiting, results, strict=True):
            if result.finish_reason == "yielded":
                assert (
                    result.progress is not None
                    and len(result.progress.token_ids) < params[index].max_new_tokens
                )
                progress[index] = Progress.from_json(result.progress.as_json())
            else:
                finished[index] = result
    return [finished[index] for index in range(len(prompts))], events, segments


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_yielded_batch_goes_on_exactly_as_an_uninterrupted_one(load_tiny, family):
    weights = load_tiny(family)
    model, tokenizer = weights.model, weights.tokenizer
    short = _prompt_ids(tokenizer, "Hello")
    prompts = [_prompt_ids(tokenizer), short, _prompt_ids(tokenizer, "import os")]
    params = [
        SamplingParams(max_new_tokens=30, temperature=1.3, top_p=0.9, seed=11, logprobs=True, top_logprobs=2),
        SamplingParams(max_new_tokens=17, temperature=0, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=25, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
    ]
    whole_events: list[TokenEvent] = []
    whole = generate(model, tokenizer, prompts, params, on_token=whole_events.append)

    parts, events, segments = _in_segments(model, tokenizer, prompts, params, steps_per_segment=4)

    assert segments >= 7  # 30 tokens, 4 steps a segment (and a token from each re-prefill)
    for index, (one, other) in enumerate(zip(whole, parts, strict=True)):
        assert other.token_ids == one.token_ids
        assert other.text == one.text == "".join(event.text for event in events[index])
        assert other.finish_reason == one.finish_reason
        assert other.prompt_tokens == len(prompts[index])
        assert [event.index for event in events[index]] == list(range(len(one.token_ids)))
    resumed, uninterrupted = parts[0].logprobs, whole[0].logprobs
    assert len(resumed) == 30
    assert [event.token_id for event in resumed] == [event.token_id for event in uninterrupted]
    # Re-prefilled positions are computed without the KV cache: equal within float32 rounding.
    assert [event.logprob for event in resumed] == pytest.approx(
        [event.logprob for event in uninterrupted], abs=1e-4
    )
    assert [[top.token_id for top in event.top_logprobs] for event in resumed] == [
        [top.token_id for top in event.top_logprobs] for event in uninterrupted
    ]


def test_a_yielded_row_keeps_text_held_back_for_a_stop_string(load_tiny):
    weights = load_tiny("llama")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _prompt_ids(tokenizer)
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    (first,) = generate(model, tokenizer, [ids], [params])
    stop, index = _stop_string_in(first.text)
    stopping = dataclasses.replace(params, stop=(stop,))
    (whole,) = generate(model, tokenizer, [ids], [stopping])

    # Yield after every step: some yield falls while the stop string's first characters are held.
    (part,), events, _ = _in_segments(model, tokenizer, [ids], [stopping], steps_per_segment=1)

    assert part.finish_reason == whole.finish_reason == "stop"
    assert part.text == whole.text == first.text[:index] == "".join(event.text for event in events[0])
    assert part.token_ids == whole.token_ids


def test_progress_is_checked(load_tiny):
    from engine.generation import Progress

    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    ids = _prompt_ids(tokenizer)
    full = Progress(token_ids=[5] * 4, rng_state=torch.Generator().get_state().numpy().tobytes())
    with pytest.raises(GenerationError) as error:
        generate(model, tokenizer, [ids], [SamplingParams(max_new_tokens=4)], progress=[full])
    assert error.value.code == "INVALID_PARAMETER"
    with pytest.raises(GenerationError):
        generate(
            model, tokenizer, [ids], [GREEDY], capture=["blocks.0.hook_resid_post"], should_yield=lambda: True
        )
