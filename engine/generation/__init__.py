"""The generation engine: prompts in, sampled completions out, streamed token by token.

It runs its own decode loop over the KV cache instead of ``model.generate``, because the
workbench needs what ``generate`` does not give together: per-row sampling parameters in one
batch, a callback per token with incrementally detokenized text, stop strings, cancellation of
single rows, per-token logprobs, and the activations of every prompt and generated token
captured on the way (no second pass over the sequence).

How it runs:

* **Prefill, then one token per row per step.** Prompts are left-padded into one batch; explicit
  position ids (the mask's cumulative sum - 1, so a padded row sees the positions of an unpadded
  run) and, when there is padding, the attention mask go with every forward pass (without
  padding the mask is left out, as ``generate`` does, so attention takes its causal fast path).
  The cache is fed back, and the prefill runs the LM head on the last position only
  (``logits_to_keep=1``). Rows that finish keep being fed (their outputs are ignored) until
  every row is done, so the batch never has to be rebuilt.
* **Sampling per row:** repetition penalty (CTRL-style, over prompt + generated tokens), then
  temperature (0 is greedy), top-k, top-p, then ``torch.multinomial`` with the row's own
  seeded ``torch.Generator``, so a row's output does not depend on the rest of the batch.
* **Logprobs** are the ``log_softmax`` of the raw model logits in float32, i.e. before the
  penalty and temperature change them (what vLLM reports by default): they describe the model,
  not the sampler.
* **Streaming text:** each token's event carries the text it releases. Text is held back while
  it ends in an incomplete UTF-8 character ('\\ufffd') or with what could be the start of a stop
  string; a row's event texts always concatenate to its result text.
* **Capture** (one prompt only): forward hooks copy each step's rows of the requested hook
  points to the CPU; after the loop, one extra single-token forward pass captures the last
  generated token, so the result covers prompt + generated tokens in order.

Importable without Django or torch (torch is imported inside the functions).
"""

from __future__ import annotations

from engine.generation.decode import generate
from engine.generation.params import (
    CAPTURE_DTYPES,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    GenerationError,
    GenerationResult,
    Progress,
    SamplingParams,
    TokenEvent,
    TopLogprob,
    check_context,
    context_length,
)
from engine.generation.prompts import render_prompt

__all__ = [
    "CAPTURE_DTYPES",
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "GenerationError",
    "GenerationResult",
    "Progress",
    "SamplingParams",
    "TokenEvent",
    "TopLogprob",
    "check_context",
    "context_length",
    "generate",
    "render_prompt",
]
