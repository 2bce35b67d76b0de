"""Choosing the next token of each row: greedy, or penalty, temperature, top-k, top-p and a seeded draw."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.generation.decode import Row

from typing import Any


def sample_step(rows: list[Row], logits: Any, sequence: Any, length: int, track_sequence: bool) -> Any:
    """The next token of every row, as a [batch] tensor on the logits' device.

    ``sequence[:, :length]`` holds prompt + generated ids so far (left-padded); when some row
    uses the repetition penalty, the sampled tokens are written to column ``length``.
    """
    import torch

    if all(row.greedy_without_penalty for row in rows):
        next_tokens = logits.argmax(-1)
    else:
        chosen = []
        for row in rows:
            if row.done:
                # Finished rows are still fed (the batch keeps its shape); any token does.
                chosen.append(logits[row.index].argmax())
            else:
                chosen.append(_sample_row(row, logits[row.index], sequence[row.index, row.start : length]))
        next_tokens = torch.stack(chosen)
    if track_sequence and length < sequence.shape[1]:
        sequence[:, length] = next_tokens
    return next_tokens


def _sample_row(row: Row, logits: Any, seen: Any) -> Any:
    """One row's next token (a 0-d tensor): penalty, temperature, top-k, top-p, then a draw."""
    import torch

    params = row.params
    scores = logits.float()
    if params.repetition_penalty != 1:
        # CTRL: divide positive logits by the penalty, multiply negative ones, for every token
        # already in the prompt or the completion (as RepetitionPenaltyLogitsProcessor does).
        previous = scores.gather(0, seen)
        penalized = torch.where(
            previous < 0, previous * params.repetition_penalty, previous / params.repetition_penalty
        )
        scores = scores.scatter(0, seen, penalized)
    if params.temperature == 0:
        return scores.argmax()
    scores = scores / params.temperature
    candidates = None
    if params.top_k > 0:
        scores, candidates = torch.topk(scores, min(params.top_k, scores.shape[-1]))
    if params.top_p < 1:
        if candidates is None:
            scores, candidates = torch.sort(scores, descending=True)
        probabilities = torch.softmax(scores, -1)
        # Keep a token while the mass of the more likely ones is below top_p, so the most likely
        # token always stays (the rule of transformers' TopPLogitsWarper).
        mass_before = probabilities.cumsum(-1) - probabilities
        scores = scores.masked_fill(mass_before >= params.top_p, float("-inf"))
    probabilities = torch.softmax(scores, -1)
    drawn = torch.multinomial(probabilities, 1, generator=row.generator)[0]
    return drawn if candidates is None else candidates[drawn]
