"""Logprobs in the decode loop: each sampled token's with its alternatives, and the prompt's own
tokens' (``SamplingParams.prompt_logprobs``), always from the raw model logits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.generation.params import TokenEvent, TopLogprob
from engine.generation.text_stream import TextStream

if TYPE_CHECKING:
    from engine.generation.decode import Row


def step_logprobs(
    rows: list[Row], token_list: list[int], logits: Any, tokenizer: Any
) -> tuple[dict[int, float], dict[int, list[TopLogprob]]]:
    """The chosen token's logprob of each of ``rows`` (those that want logprobs), and its
    ``top_logprobs`` alternatives where it asks for some: one softmax and one topk for them all."""
    import torch

    if not rows:
        return {}, {}
    indices = torch.tensor([row.index for row in rows], device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, indices).float(), -1)
    picked = torch.tensor([token_list[row.index] for row in rows], device=logits.device)
    chosen_values = logprobs.gather(1, picked[:, None])[:, 0].tolist()
    most = max(row.params.top_logprobs for row in rows)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if most:
        values, ids = logprobs.topk(most, -1)
        top_values, top_ids = values.tolist(), ids.tolist()
    chosen: dict[int, float] = {}
    alternatives: dict[int, list[TopLogprob]] = {}
    for position, row in enumerate(rows):
        chosen[row.index] = chosen_values[position]
        count = row.params.top_logprobs
        if count:
            alternatives[row.index] = alternatives_of(
                tokenizer, top_ids[position][:count], top_values[position][:count]
            )
    return chosen, alternatives


# Prompt positions whose logprobs are computed at once (see prompt_logprobs).
PROMPT_LOGPROBS_CHUNK = 256


def prompt_logprobs(row: Row, logits: Any, tokenizer: Any) -> list[TokenEvent]:
    """Each prompt token of ``row`` with its logprob given the tokens before it (None for the
    first) and ``params.prompt_logprobs`` alternatives, from the prefill's ``logits`` [columns,
    vocab] of the row; each event's text is what the token adds to the decoded prompt."""
    import torch

    tokens = row.prompt[: row.prompt_tokens]
    count = row.params.prompt_logprobs or 0
    following = torch.tensor(tokens[1:], dtype=torch.long, device=logits.device)
    chosen: list[float] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    # Column start + i holds token i; its logits predict token i + 1. A few hundred positions at a
    # time: a float32 copy of a long prompt's logits over a large vocabulary takes gigabytes.
    for first in range(0, len(tokens) - 1, PROMPT_LOGPROBS_CHUNK):
        last = min(first + PROMPT_LOGPROBS_CHUNK, len(tokens) - 1)
        logprobs = torch.log_softmax(logits[row.start + first : row.start + last].float(), -1)
        chosen += logprobs.gather(1, following[first:last, None])[:, 0].tolist()
        if count:
            values, ids = logprobs.topk(count, -1)
            top_values += values.tolist()
            top_ids += ids.tolist()
    stream = TextStream(tokenizer, ())
    events = []
    for position, token_id in enumerate(tokens):
        text, _stopped = stream.push(token_id, final=position == len(tokens) - 1)
        event = TokenEvent(row=row.index, index=position, token_id=token_id, text=text)
        if position:
            event.logprob = chosen[position - 1]
            if count:
                event.top_logprobs = alternatives_of(
                    tokenizer, top_ids[position - 1], top_values[position - 1]
                )
        events.append(event)
    return events


def alternatives_of(tokenizer: Any, token_ids: list[int], values: list[float]) -> list[TopLogprob]:
    """The most likely tokens, each decoded alone (raw: it may hold the replacement character)."""
    return [
        TopLogprob(token_id=token_id, token=tokenizer.decode([token_id]), logprob=value)
        for token_id, value in zip(token_ids, values, strict=True)
    ]
