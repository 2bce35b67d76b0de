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

import contextlib
import inspect
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from activations.engine.extraction import first_tensor, grad_free_mode, register_hooks
from activations.engine.hooks import HookError, HookSite, base_model_path, hook_sites
from models_app.engine.errors import EngineError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CAPTURE_DTYPES",
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "GenerationError",
    "GenerationResult",
    "SamplingParams",
    "TokenEvent",
    "TopLogprob",
    "check_context",
    "context_length",
    "generate",
    "render_prompt",
]

CAPTURE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
# Config keys that bound the positions a model can embed, in the order they are looked up.
_CONTEXT_KEYS: tuple[str, ...] = ("max_position_embeddings", "n_positions", "n_ctx")
_ROLES: tuple[str, ...] = ("system", "user", "assistant")
_INCOMPLETE_CHARACTER = "\ufffd"

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"


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
class GenerationResult:
    """One row's completion."""

    # Generated ids only: includes the EOS id that ended the row and the tokens of a stop string.
    token_ids: list[int]
    # The completion: EOS and the stop string (and what follows it) excluded. Always the
    # concatenation of the row's event texts.
    text: str
    # "stop" (EOS or a stop string), "length" (max_new_tokens) or "cancelled".
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


def context_length(model: Any) -> int | None:
    """The most positions ``model`` can embed (from its config), or None when it sets no bound
    (e.g. BLOOM's ALiBi)."""
    config = model.config
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# --- prompts ------------------------------------------------------------------------------------


def render_prompt(
    tokenizer: Any,
    *,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
) -> list[int]:
    """The token ids of a prompt or a conversation, ready for :func:`generate`.

    Exactly one of ``prompt`` / ``messages`` (``[{"role": "system"|"user"|"assistant",
    "content": str}]``). ``chat_template=None`` uses the tokenizer's chat template when it has
    one; True requires one (``NO_CHAT_TEMPLATE`` otherwise); False never uses it.

    * With the template: ``apply_chat_template`` with a generation prompt; a plain ``prompt``
      becomes one user message, ``system_prompt`` a leading system message.
    * Messages without a template, a plain fallback::

          <system>\\n\\n          (system_prompt, then system messages; only when there is one)
          User: <content>\\n
          Assistant: <content>\\n
          Assistant:

      tokenized with the tokenizer's special tokens (a BOS where it adds one).
    * A plain prompt without a template: the text itself (``system_prompt + "\\n\\n"`` first when
      given), tokenized with the special tokens.

    Raises :class:`GenerationError` ``INVALID_PARAMETER`` for a malformed request and
    ``EMPTY_PROMPT`` when the result has no tokens.
    """
    if (prompt is None) == (messages is None):
        raise GenerationError(
            "INVALID_PARAMETER", "Give exactly one of prompt and messages.", {"field": "prompt"}
        )
    if prompt is not None and not isinstance(prompt, str):
        raise GenerationError("INVALID_PARAMETER", "prompt must be a string.", {"field": "prompt"})
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise GenerationError(
            "INVALID_PARAMETER", "system_prompt must be a string.", {"field": "system_prompt"}
        )
    conversation = _checked_messages(messages) if messages is not None else None
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise GenerationError("NO_CHAT_TEMPLATE", "This model's tokenizer has no chat template.")
    use_template = has_template if chat_template is None else bool(chat_template)

    if use_template:
        if conversation is None:
            conversation = [{"role": "user", "content": prompt}]
        if system_prompt:
            conversation = [{"role": "system", "content": system_prompt}, *conversation]
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        token_ids = _template_ids(rendered)
    elif conversation is not None:
        token_ids = _token_ids(tokenizer, _plain_conversation(conversation, system_prompt))
    else:
        text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        token_ids = _token_ids(tokenizer, text or "")
    if not token_ids:
        raise GenerationError("EMPTY_PROMPT", "The prompt has no tokens.")
    return token_ids


def _checked_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise GenerationError(
            "INVALID_PARAMETER", "messages must be a non-empty list.", {"field": "messages"}
        )
    for message in messages:
        if (
            not isinstance(message, dict)
            or message.get("role") not in _ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise GenerationError(
                "INVALID_PARAMETER",
                f"Each message needs a role ({', '.join(_ROLES)}) and a string content.",
                {"field": "messages"},
            )
    return [{"role": message["role"], "content": message["content"]} for message in messages]


def _plain_conversation(messages: list[dict], system_prompt: str | None) -> str:
    system = [system_prompt] if system_prompt else []
    system += [message["content"] for message in messages if message["role"] == "system"]
    lines = [
        f"{message['role'].capitalize()}: {message['content']}\n"
        for message in messages
        if message["role"] != "system"
    ]
    header = "\n\n".join(system) + "\n\n" if system else ""
    return header + "".join(lines) + "Assistant:"


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return [int(token) for token in tokenizer(text, add_special_tokens=True)["input_ids"]]


def _template_ids(rendered: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (a dict) where 4.x returned the list itself.
    if hasattr(rendered, "keys") and "input_ids" in rendered:
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    rendered = list(rendered)
    if rendered and isinstance(rendered[0], (list, tuple)):
        rendered = list(rendered[0])
    return [int(token) for token in rendered]


# --- validation ---------------------------------------------------------------------------------


def _invalid(field_name: str, message: str) -> GenerationError:
    return GenerationError("INVALID_PARAMETER", message, {"field": field_name})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_params(params: SamplingParams) -> None:
    if not isinstance(params, SamplingParams):
        raise _invalid("params", "Each row needs a SamplingParams.")
    if not _is_int(params.max_new_tokens) or params.max_new_tokens < 1:
        raise _invalid("max_new_tokens", "max_new_tokens must be an integer of at least 1.")
    if not _is_number(params.temperature) or not 0 <= params.temperature <= MAX_TEMPERATURE:
        raise _invalid("temperature", f"temperature must be in 0..{MAX_TEMPERATURE:g}.")
    if not _is_number(params.top_p) or not 0 < params.top_p <= 1:
        raise _invalid("top_p", "top_p must be in (0, 1].")
    if not _is_int(params.top_k) or params.top_k < 0:
        raise _invalid("top_k", "top_k must be an integer of at least 0.")
    if not _is_number(params.repetition_penalty) or not params.repetition_penalty > 0:
        raise _invalid("repetition_penalty", "repetition_penalty must be greater than 0.")
    if params.seed is not None and not _is_int(params.seed):
        raise _invalid("seed", "seed must be an integer or None.")
    stop = params.stop
    if (
        not isinstance(stop, (tuple, list))
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(text, str) and text for text in stop)
    ):
        raise _invalid("stop", f"stop takes up to {MAX_STOP_STRINGS} non-empty strings.")
    if not isinstance(params.logprobs, bool):
        raise _invalid("logprobs", "logprobs must be true or false.")
    if not _is_int(params.top_logprobs) or not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise _invalid("top_logprobs", f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}.")


def _checked_prompts(model: Any, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
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


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if _is_int(value):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(item) for item in value if _is_int(item))
    return frozenset(ids)


def _pad_token_id(model: Any) -> int:
    # Pad ids only fill masked positions, so any valid id does; the model's own is tidiest.
    config = model.config
    for candidate in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if _is_int(candidate):
            return candidate
    return 0


# --- streaming text -----------------------------------------------------------------------------


class _TextStream:
    """Incremental detokenization plus stop strings for one row.

    Detokenization decodes a small window of ids (``ids[prefix_offset:]`` against
    ``ids[prefix_offset:read_offset]``), as vLLM and transformers' TextStreamer do, so each
    token costs two short decodes whatever the completion's length, and holds text back while
    it ends in an incomplete character. Stop strings: the released text never ends with a
    prefix of a stop string (that suffix waits in ``pending``), so a stop string is always
    found whole inside ``pending`` + the new text.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.pending = ""
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _detokenize(self, token_id: int | None, *, final: bool) -> str:
        if token_id is not None:
            self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        current = self._decode(self.ids[self.prefix_offset :])
        if len(current) > len(prefix) and (final or not current.endswith(_INCOMPLETE_CHARACTER)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return current[len(prefix) :]
        return ""

    def push(self, token_id: int | None, *, final: bool) -> tuple[str, bool]:
        """Add a token (None: only flush) and return (released text, whether a stop string ended it).

        ``final`` releases everything held back: the row ends with this token.
        """
        delta = self._detokenize(token_id, final=final)
        if not delta and not final:
            return "", False
        window = self.pending + delta
        if self.stop:
            found = [index for index in (window.find(stop) for stop in self.stop) if index >= 0]
            if found:
                released = window[: min(found)]
                self.pending = ""
                self.parts.append(released)
                return released, True
        hold = 0 if final else self._held_suffix(window)
        released = window[: len(window) - hold]
        self.pending = window[len(window) - hold :]
        self.parts.append(released)
        return released, False

    def _held_suffix(self, window: str) -> int:
        """The length of the longest suffix of ``window`` that is a proper prefix of a stop string."""
        if not self.stop:
            return 0
        longest = min(len(window), max(len(stop) for stop in self.stop) - 1)
        for size in range(longest, 0, -1):
            suffix = window[-size:]
            if any(stop.startswith(suffix) for stop in self.stop):
                return size
        return 0


# --- the loop -----------------------------------------------------------------------------------


@dataclass
class _Row:
    """The state of one prompt of the batch while it is generated."""

    index: int
    params: SamplingParams
    prompt: list[int]
    generator: Any
    stream: _TextStream
    # Column of the row's first real token in the padded batch.
    start: int
    token_ids: list[int] = field(default_factory=list)
    events: list[TokenEvent] | None = None
    finish_reason: str | None = None
    last_token_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs or self.params.top_logprobs > 0

    @property
    def greedy_without_penalty(self) -> bool:
        return self.params.temperature == 0 and self.params.repetition_penalty == 1


class _StopForward(Exception):
    """Raised from a hook in the final capture pass once every hook point is in."""


class _Capture:
    """Forward hooks that keep every step's rows of the requested hook points, on the CPU.

    Each forward pass appends one [tokens, width] copy per hook point (a module called twice in
    one pass: the first call counts); they are concatenated once, after the loop.
    """

    def __init__(self, sites: dict[str, HookSite], dtype: Any) -> None:
        self.sites = sites
        self.dtype = dtype
        self.chunks: dict[str, list[Any]] = {name: [] for name in sites}
        self.pass_number = 0
        self.seen_in_pass: dict[str, int] = {}
        self.tokens_in_pass = 0
        self.captured_in_pass = 0
        self.stop_when_complete = False

    def begin_pass(self, tokens: int, *, last: bool = False) -> None:
        self.pass_number += 1
        self.tokens_in_pass = tokens
        self.captured_in_pass = 0
        self.stop_when_complete = last

    def take(self, name: str, value: Any) -> None:
        if self.seen_in_pass.get(name) == self.pass_number:
            return
        tensor = first_tensor(value)
        if tensor is None or tensor.dim() < 2 or tuple(tensor.shape[:2]) != (1, self.tokens_in_pass):
            raise HookError(
                "INVALID_HOOK",
                f"Hook point {name} does not give one vector per token, so it cannot be captured.",
                {"invalid": [name]},
            )
        rows = tensor.detach().reshape(self.tokens_in_pass, -1)
        self.chunks[name].append(rows.to(device="cpu", dtype=self.dtype, copy=True))
        self.seen_in_pass[name] = self.pass_number
        self.captured_in_pass += 1
        if self.stop_when_complete and self.captured_in_pass == len(self.sites):
            raise _StopForward

    def register(self, model: Any) -> list[Any]:
        return register_hooks(dict(model.named_modules()), self.sites, self.take)

    def tensors(self, expected_rows: int) -> dict[str, Any]:
        import torch

        result = {}
        for name, chunks in self.chunks.items():
            tensor = torch.cat(chunks) if chunks else None
            if tensor is None or tensor.shape[0] != expected_rows:
                raise GenerationError(
                    "HOOK_NOT_REACHED",
                    f"The forward passes did not produce {name} for every token.",
                    {"hooks": [name]},
                )
            result[name] = tensor
        return result


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    capture: Sequence[str] = (),
    capture_dtype: str = "float32",
    on_token: Callable[[TokenEvent], None] | None = None,
    cancelled_rows: Callable[[], Collection[int]] | None = None,
) -> list[GenerationResult]:
    """Generate a completion for each prompt (token ids) with its own :class:`SamplingParams`.

    ``on_token(event)`` is called for every generated token right after it is sampled, before
    the next forward pass. ``cancelled_rows()`` is asked once per decode step (before its
    forward pass); the rows it names finish with "cancelled" (text held back for a possible stop
    string or an incomplete character is then dropped, so the result text stays the
    concatenation of the streamed texts). ``capture`` (hook point names, one prompt only)
    returns the activations of every prompt and generated token in ``capture_dtype``.

    Everything is validated before the model runs: :class:`GenerationError` (codes on the
    class) or :class:`HookError` for an unknown hook point. Hooks are removed before this
    returns, also when it raises.
    """
    import torch

    prompts, params = list(prompts), list(params)
    if not prompts:
        raise _invalid("prompts", "At least one prompt is required.")
    if len(prompts) != len(params):
        raise _invalid("params", "Give one SamplingParams per prompt.")
    for row_params in params:
        _check_params(row_params)
    token_lists = _checked_prompts(model, prompts)
    check_context(model, token_lists, params)
    sites: dict[str, HookSite] = {}
    if capture:
        if isinstance(capture, str):
            raise _invalid("capture", "capture takes a list of hook point names.")
        if len(token_lists) != 1:
            raise GenerationError(
                "CAPTURE_NEEDS_ONE_PROMPT", "Activations can be captured for one prompt at a time."
            )
        if capture_dtype not in CAPTURE_DTYPES:
            raise _invalid("capture_dtype", f"capture_dtype must be one of {', '.join(CAPTURE_DTYPES)}.")
        sites = hook_sites(model, list(capture))
    recorder = _Capture(sites, getattr(torch, capture_dtype)) if sites else None

    with grad_free_mode(model)():
        handles = recorder.register(model) if recorder is not None else []
        try:
            return _run(
                model,
                tokenizer,
                token_lists,
                params,
                recorder=recorder,
                on_token=on_token,
                cancelled_rows=cancelled_rows,
            )
        finally:
            for handle in handles:
                handle.remove()


def _forward_arguments(model: Any) -> tuple[bool, str | None]:
    """Whether the model's forward takes position ids, and its name for ``logits_to_keep``."""
    parameters = inspect.signature(model.forward).parameters
    # transformers < 4.50 called it num_logits_to_keep.
    keep = next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)
    return "position_ids" in parameters, keep


def _run(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    recorder: _Capture | None,
    on_token: Callable[[TokenEvent], None] | None,
    cancelled_rows: Callable[[], Collection[int]] | None,
) -> list[GenerationResult]:
    import torch

    device = model.get_input_embeddings().weight.device
    batch_size = len(prompts)
    lengths = [len(prompt) for prompt in prompts]
    prompt_length = max(lengths)
    steps = max(row_params.max_new_tokens for row_params in params)
    padded = min(lengths) != prompt_length
    takes_position_ids, logits_to_keep_name = _forward_arguments(model)
    eos_ids = _eos_token_ids(model, tokenizer)

    rows = []
    for index, (prompt, row_params) in enumerate(zip(prompts, params, strict=True)):
        seed = row_params.seed if row_params.seed is not None else secrets.randbits(63)
        rows.append(
            _Row(
                index=index,
                params=row_params,
                prompt=prompt,
                generator=torch.Generator(device=device).manual_seed(seed),
                stream=_TextStream(tokenizer, row_params.stop),
                start=prompt_length - len(prompt),
                events=[] if row_params.logprobs or row_params.top_logprobs else None,
            )
        )

    # Prompt + generated ids, left-padded: the repetition penalty reads each row's slice of it.
    sequence = torch.full((batch_size, prompt_length + steps), _pad_token_id(model), dtype=torch.long)
    for row in rows:
        sequence[row.index, row.start : prompt_length] = torch.tensor(row.prompt, dtype=torch.long)
    sequence = sequence.to(device)
    track_sequence = any(row.params.repetition_penalty != 1 for row in rows)

    # One mask for the whole run, sliced per step, rather than a cat per step; only with padding.
    full_mask = None
    if padded:
        full_mask = torch.ones((batch_size, prompt_length + steps), dtype=torch.long)
        for row in rows:
            full_mask[row.index, : row.start] = 0
        full_mask = full_mask.to(device)
    prompt_positions = torch.arange(prompt_length, device=device).repeat(batch_size, 1)
    if full_mask is not None:
        prompt_positions = (full_mask[:, :prompt_length].cumsum(-1) - 1).clamp(min=0)
    # decode_positions[t] is the [batch] position of the t-th token fed after the prompt.
    decode_positions = (prompt_positions[:, -1] + 1) + torch.arange(steps, device=device)[:, None]

    def forward(input_ids: Any, length: int, positions: Any, past: Any, *, keep_last: bool) -> Any:
        arguments: dict[str, Any] = {"input_ids": input_ids, "use_cache": True}
        if past is not None:
            arguments["past_key_values"] = past
        if full_mask is not None:
            # A view, not a copy: every family's mask code reads it by index (checked with
            # batches against single prompts in the tests).
            arguments["attention_mask"] = full_mask[:, :length]
        if takes_position_ids:
            arguments["position_ids"] = positions
        if keep_last and logits_to_keep_name is not None:
            arguments[logits_to_keep_name] = 1
        return model(**arguments)

    # A module: hook point outside the base model (the LM head) needs every prompt row, so the
    # prefill then computes all logits.
    base = base_model_path(model)
    hooks_outside_base = recorder is not None and any(
        not site.module_path.startswith(base + ".") for site in recorder.sites.values()
    )

    started = time.perf_counter()
    prompt_ids = sequence[:, :prompt_length].contiguous()
    if recorder is not None:
        recorder.begin_pass(prompt_length)
    output = forward(prompt_ids, prompt_length, prompt_positions, None, keep_last=not hooks_outside_base)
    past = output.past_key_values
    next_tokens = _sample_step(rows, output.logits[:, -1, :], sequence, prompt_length, track_sequence)
    token_list = next_tokens.tolist()
    first_token_at = time.perf_counter()
    _emit(rows, token_list, output.logits[:, -1, :], eos_ids, tokenizer, on_token, first_token_at)
    del output

    step = 1
    while not all(row.done for row in rows):
        if cancelled_rows is not None:
            cancelled = cancelled_rows() or ()
            for row in rows:
                if not row.done and row.index in cancelled:
                    row.finish_reason = FINISH_CANCELLED
            if all(row.done for row in rows):
                break
        if recorder is not None:
            recorder.begin_pass(1)
        output = forward(
            next_tokens[:, None],
            prompt_length + step,
            decode_positions[step - 1][:, None],
            past,
            keep_last=False,
        )
        past = output.past_key_values
        logits = output.logits[:, -1, :]
        next_tokens = _sample_step(rows, logits, sequence, prompt_length + step, track_sequence)
        token_list = next_tokens.tolist()
        _emit(rows, token_list, logits, eos_ids, tokenizer, on_token, time.perf_counter())
        del output, logits
        step += 1

    activations = None
    if recorder is not None:
        (only_row,) = rows
        generated = len(only_row.token_ids)
        # The last token was sampled but never fed: one more pass captures its rows (its logits
        # are not needed, and the pass stops as soon as every hook point is in).
        recorder.begin_pass(1, last=True)
        with contextlib.suppress(_StopForward):
            forward(
                torch.tensor([[only_row.token_ids[-1]]], device=device),
                prompt_length + generated,
                decode_positions[generated - 1][:, None],
                past,
                keep_last=True,
            )
        activations = recorder.tensors(len(only_row.prompt) + generated)

    prefill_seconds = first_token_at - started
    return [
        GenerationResult(
            token_ids=row.token_ids,
            text=row.stream.text,
            finish_reason=row.finish_reason or FINISH_LENGTH,
            logprobs=row.events,
            prompt_tokens=len(row.prompt),
            prefill_seconds=prefill_seconds,
            decode_seconds=max(0.0, row.last_token_at - first_token_at),
            activations=activations,
        )
        for row in rows
    ]


def _sample_step(rows: list[_Row], logits: Any, sequence: Any, length: int, track_sequence: bool) -> Any:
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


def _sample_row(row: _Row, logits: Any, seen: Any) -> Any:
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


def _emit(
    rows: list[_Row],
    token_list: list[int],
    logits: Any,
    eos_ids: frozenset[int],
    tokenizer: Any,
    on_token: Callable[[TokenEvent], None] | None,
    sampled_at: float,
) -> None:
    """Record the step's tokens of the unfinished rows, finish rows, and stream the events."""
    import torch

    active = [row for row in rows if not row.done]
    logprob_rows = [row for row in active if row.wants_logprobs]
    chosen_logprobs: dict[int, float] = {}
    alternatives: dict[int, list[TopLogprob]] = {}
    if logprob_rows:
        indices = torch.tensor([row.index for row in logprob_rows], device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, indices).float(), -1)
        picked = torch.tensor([token_list[row.index] for row in logprob_rows], device=logits.device)
        chosen_values = logprobs.gather(1, picked[:, None])[:, 0].tolist()
        most = max(row.params.top_logprobs for row in logprob_rows)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if most:
            values, ids = logprobs.topk(most, -1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for position, row in enumerate(logprob_rows):
            chosen_logprobs[row.index] = chosen_values[position]
            count = row.params.top_logprobs
            if count:
                alternatives[row.index] = [
                    TopLogprob(token_id=token_id, token=tokenizer.decode([token_id]), logprob=value)
                    for token_id, value in zip(
                        top_ids[position][:count], top_values[position][:count], strict=True
                    )
                ]

    for row in active:
        token_id = token_list[row.index]
        row.token_ids.append(token_id)
        row.last_token_at = sampled_at
        is_eos = token_id in eos_ids and not row.params.ignore_eos
        at_length = len(row.token_ids) >= row.params.max_new_tokens
        # EOS adds no text (and is not decoded), but flushes what was held back before it.
        text, stopped = row.stream.push(None if is_eos else token_id, final=is_eos or at_length)
        if is_eos or stopped:
            row.finish_reason = FINISH_STOP
        elif at_length:
            row.finish_reason = FINISH_LENGTH
        event = TokenEvent(
            row=row.index,
            index=len(row.token_ids) - 1,
            token_id=token_id,
            text=text,
            logprob=chosen_logprobs.get(row.index),
            top_logprobs=alternatives.get(row.index),
        )
        if row.events is not None:
            row.events.append(event)
        if on_token is not None:
            on_token(event)
