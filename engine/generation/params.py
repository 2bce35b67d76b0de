"""Generation's parameters and results, their validation, and the model's context limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError

CAPTURE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
# Config keys that bound the positions a model can embed, in the order they are looked up.
_CONTEXT_KEYS: tuple[str, ...] = ("max_position_embeddings", "n_positions", "n_ctx")

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
# Not finished: the batch yielded before the row ended (``generate(should_yield=…)``); the result's
# ``progress`` lets a later call go on from there. Never a client's finish reason.
FINISH_YIELDED = "yielded"


class GenerationError(EngineError):
    """A generation request refused or failed for a reason worth a stable code.

    Codes: ``INVALID_PARAMETER`` (details ``field``), ``INVALID_TOKENS``, ``EMPTY_PROMPT``,
    ``CONTEXT_LENGTH_EXCEEDED`` (details ``prompt_tokens``, ``max_tokens``, ``context_length``),
    ``CAPTURE_NEEDS_ONE_PROMPT``, ``NO_CHAT_TEMPLATE``, ``HOOK_NOT_REACHED``.
    """


@dataclass(frozen=True)
class SamplingParams:
    """How one row is sampled; the defaults sample from the model's plain distribution."""

    max_new_tokens: int = 128
    # 0 means greedy (argmax); at most MAX_TEMPERATURE.
    temperature: float = 1.0
    # Nucleus sampling: keep the most likely tokens whose mass reaches top_p; 1 turns it off.
    top_p: float = 1.0
    # Keep the top_k most likely tokens; 0 turns it off.
    top_k: int = 0
    # CTRL-style penalty on every token of prompt + completion (as transformers'
    # RepetitionPenaltyLogitsProcessor); 1 turns it off.
    repetition_penalty: float = 1.0
    # None draws a random seed; the same seed and input always give the same output.
    seed: int | None = None
    # Up to MAX_STOP_STRINGS strings; the completion ends right before the first one found.
    stop: tuple[str, ...] = ()
    # Report each chosen token's logprob (always from the raw model logits, see the module doc).
    logprobs: bool = False
    # And this many most likely alternatives (0..MAX_TOP_LOGPROBS).
    top_logprobs: int = 0
    # vLLM's prompt_logprobs: None, or each prompt token's logprob given the tokens before it
    # (None for the first) with this many most likely alternatives (0..MAX_TOP_LOGPROBS).
    prompt_logprobs: int | None = None
    # Treat end-of-sequence as an ordinary token (vLLM's ignore_eos): fixed-length runs for
    # benchmarks and long probes; the EOS token's text is then decoded like any other.
    ignore_eos: bool = False


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    # tokenizer.decode([token_id]), raw: it may contain the replacement character.
    token: str
    logprob: float


@dataclass
class TokenEvent:
    """One generated token, passed to ``on_token`` right after it is sampled."""

    # Index of the prompt in the batch.
    row: int
    # 0-based index among this row's generated tokens.
    index: int
    token_id: int
    # The completion text this token releases: '' while an incomplete character or a possible
    # stop string is pending, and for an EOS token unless it flushes text held back before it.
    text: str
    # When params.logprobs or params.top_logprobs > 0.
    logprob: float | None = None
    # When params.top_logprobs > 0, most likely first.
    top_logprobs: list[TopLogprob] | None = None


@dataclass
class Progress:
    """Where an unfinished row stood when its batch yielded: given back to :func:`generate`, the
    row goes on exactly as if it had never stopped (the same tokens, the same random draws, the
    same text held back for a stop string). JSON-able through :meth:`as_json`."""

    # Generated so far (fed again after the prompt when the row goes on).
    token_ids: list[int]
    # The row's torch.Generator state after its last draw.
    rng_state: bytes
    # The row's token events so far, when it reports logprobs.
    events: list[TokenEvent] | None = None

    def as_json(self) -> dict[str, Any]:
        import base64

        return {
            "token_ids": list(self.token_ids),
            "rng_state": base64.b64encode(self.rng_state).decode("ascii"),
            "events": None if self.events is None else [_event_json(event) for event in self.events],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Progress:
        import base64

        events = data.get("events")
        return cls(
            token_ids=[int(token) for token in data["token_ids"]],
            rng_state=base64.b64decode(data["rng_state"]),
            events=None if events is None else [_event_from_json(event) for event in events],
        )


def _event_json(event: TokenEvent) -> dict[str, Any]:
    return {
        "index": event.index, "token_id": event.token_id, "text": event.text, "logprob": event.logprob,
        "top_logprobs": None if event.top_logprobs is None
        else [[top.token_id, top.token, top.logprob] for top in event.top_logprobs],
    }  # fmt: skip


def _event_from_json(data: Mapping[str, Any]) -> TokenEvent:
    tops = data.get("top_logprobs")
    return TokenEvent(
        row=0, index=data["index"], token_id=data["token_id"], text=data["text"], logprob=data.get("logprob"),
        top_logprobs=None if tops is None else [TopLogprob(*top) for top in tops],
    )  # fmt: skip


@dataclass
class GenerationResult:
    """One row's completion."""

    # Generated ids only: includes the EOS id that ended the row and the tokens of a stop string.
    token_ids: list[int]
    # The completion: EOS and the stop string (and what follows it) excluded. Always the
    # concatenation of the row's event texts.
    text: str
    # "stop" (EOS or a stop string), "length" (max_new_tokens), "cancelled", or "yielded" (not
    # finished: see ``progress``).
    finish_reason: str
    # The row's events when logprobs were requested (the same objects on_token received).
    logprobs: list[TokenEvent] | None
    prompt_tokens: int
    # The first forward pass over the prompt(s) plus sampling the first token (whole batch).
    prefill_seconds: float
    # From the first sampled token to this row's last one: decode tokens/s = (n - 1) / this.
    decode_seconds: float
    # Capture only: hook point -> CPU tensor [prompt_tokens + len(token_ids), width] in the
    # capture dtype; row k is the k-th token of prompt + generated.
    activations: dict[str, torch.Tensor] | None = None
    # "yielded" only: where the row stood, to go on from (``generate(progress=…)``).
    progress: Progress | None = None
    # When params.prompt_logprobs is set: one event per prompt token (``index`` its position,
    # ``text`` its decoding without special tokens); the first token's logprob is None.
    prompt_logprobs: list[TokenEvent] | None = None


def context_length(model: Any) -> int | None:
    """The most positions ``model`` can embed (from its config), or None when it sets no bound
    (e.g. BLOOM's ALiBi)."""
    return config_context_length(model.config)


def config_context_length(config: Any) -> int | None:
    """:func:`context_length` from a config: a ``transformers`` config or its dict (as a model's
    row keeps it)."""
    for key in _CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# --- validation ---------------------------------------------------------------------------------


def invalid(field_name: str, message: str) -> GenerationError:
    return GenerationError("INVALID_PARAMETER", message, {"field": field_name})


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Each sampling parameter's check, in the order they are checked, with the message of a refusal.
_PARAMETER_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "max_new_tokens",
        lambda value: is_int(value) and value >= 1,
        "max_new_tokens must be an integer of at least 1.",
    ),
    (
        "temperature",
        lambda value: is_number(value) and 0 <= value <= MAX_TEMPERATURE,
        f"temperature must be in 0..{MAX_TEMPERATURE:g}.",
    ),
    ("top_p", lambda value: is_number(value) and 0 < value <= 1, "top_p must be in (0, 1]."),
    ("top_k", lambda value: is_int(value) and value >= 0, "top_k must be an integer of at least 0."),
    (
        "repetition_penalty",
        lambda value: is_number(value) and value > 0,
        "repetition_penalty must be greater than 0.",
    ),
    ("seed", lambda value: value is None or is_int(value), "seed must be an integer or None."),
    (
        "stop",
        lambda value: (
            isinstance(value, (tuple, list))
            and len(value) <= MAX_STOP_STRINGS
            and all(isinstance(text, str) and text for text in value)
        ),
        f"stop takes up to {MAX_STOP_STRINGS} non-empty strings.",
    ),
    ("logprobs", lambda value: isinstance(value, bool), "logprobs must be true or false."),
    (
        "top_logprobs",
        lambda value: is_int(value) and 0 <= value <= MAX_TOP_LOGPROBS,
        f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}.",
    ),
    (
        "prompt_logprobs",
        lambda value: value is None or (is_int(value) and 0 <= value <= MAX_TOP_LOGPROBS),
        f"prompt_logprobs must be None or in 0..{MAX_TOP_LOGPROBS}.",
    ),
)


def check_params(params: SamplingParams) -> None:
    """``INVALID_PARAMETER`` naming the first parameter out of its range."""
    if not isinstance(params, SamplingParams):
        raise invalid("params", "Each row needs a SamplingParams.")
    for name, valid, message in _PARAMETER_CHECKS:
        if not valid(getattr(params, name)):
            raise invalid(name, message)


def checked_prompts(model: Any, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    checked = []
    for prompt in prompts:
        try:
            ids = [int(token) for token in prompt]
        except (TypeError, ValueError) as error:
            raise GenerationError("INVALID_TOKENS", "A prompt must be a list of token ids.") from error
        if not ids:
            raise GenerationError("EMPTY_PROMPT", "A prompt has no tokens.")
        if min(ids) < 0 or (vocab is not None and max(ids) >= vocab):
            raise GenerationError(
                "INVALID_TOKENS",
                f"Token ids must be in 0..{vocab - 1 if vocab else '?'} for this model.",
                {"vocab_size": vocab},
            )
        checked.append(ids)
    return checked


def check_context(model: Any, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> None:
    """``CONTEXT_LENGTH_EXCEEDED`` when a prompt plus its ``max_new_tokens`` exceeds the context."""
    limit = context_length(model)
    if limit is None:
        return
    for prompt, row_params in zip(prompts, params, strict=True):
        if len(prompt) + row_params.max_new_tokens > limit:
            raise GenerationError(
                "CONTEXT_LENGTH_EXCEEDED",
                f"The prompt has {len(prompt)} tokens and up to {row_params.max_new_tokens} more were "
                f"asked for; the model takes at most {limit}.",
                {
                    "prompt_tokens": len(prompt),
                    "max_tokens": row_params.max_new_tokens,
                    "context_length": limit,
                },
            )


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if is_int(value):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(item) for item in value if is_int(item))
    return frozenset(ids)
