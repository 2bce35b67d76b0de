"""The decode loop: prefill, then one token per row per step over the KV cache, with capture."""

from __future__ import annotations

import contextlib
import inspect
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.generation.logprobs import prompt_logprobs, step_logprobs
from engine.generation.params import (
    CAPTURE_DTYPES,
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_YIELDED,
    GenerationError,
    GenerationResult,
    Progress,
    SamplingParams,
    TokenEvent,
    check_context,
    check_params,
    checked_prompts,
    context_length,
    eos_token_ids,
    invalid,
)
from engine.generation.sampling import sample_step
from engine.generation.text_stream import TextStream
from engine.hooks import MODULE_PREFIX, HookSite, base_model_path, hook_sites, list_hook_points
from engine.interventions import Intervention, Interventions, check_interventions
from engine.placement import input_device
from engine.runtime import HookRuntime, grad_free_mode, pad_token_id


@dataclass
class Row:
    """The state of one prompt of the batch while it is generated."""

    index: int
    params: SamplingParams
    # What the model is fed first: the prompt, and the tokens generated before a yield.
    prompt: list[int]
    generator: Any
    stream: TextStream
    # Column of the row's first real token in the padded batch.
    start: int
    # The prompt's own length (without tokens generated before a yield).
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    events: list[TokenEvent] | None = None
    # params.prompt_logprobs: the prompt's tokens with their logprobs (set by the prefill).
    prompt_events: list[TokenEvent] | None = None
    finish_reason: str | None = None
    last_token_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def steps_left(self) -> int:
        return self.params.max_new_tokens - len(self.token_ids)

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs or self.params.top_logprobs > 0

    @property
    def greedy_without_penalty(self) -> bool:
        return self.params.temperature == 0 and self.params.repetition_penalty == 1


class _Recorder:
    """Every forward pass's rows of the captured hook points, kept on the CPU.

    Each pass appends one [tokens, width] copy per hook point; they are concatenated once,
    after the loop.
    """

    def __init__(self, sites: dict[str, HookSite], dtype: Any) -> None:
        self.sites = sites
        self.dtype = dtype
        self.chunks: dict[str, list[Any]] = {name: [] for name in sites}

    def keep(self, name: str, tensor: Any) -> None:
        rows = tensor.detach().reshape(tensor.shape[1], -1)
        self.chunks[name].append(rows.to(device="cpu", dtype=self.dtype, copy=True))

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


class _Hooks:
    """The run's hook points on one :class:`~engine.runtime.HookRuntime`: interventions write
    first, then capture reads (so captured activations are the steered ones)."""

    def __init__(
        self,
        model: Any,
        sites: dict[str, HookSite],
        recorder: _Recorder | None,
        steering: Interventions | None,
    ) -> None:
        self.recorder = recorder
        self.steering = steering
        purpose = "captured" if recorder is not None else "intervened on"
        self.runtime = HookRuntime(model, sites, self._visit, purpose=purpose)

    def begin_pass(self, absolute: Any, *, last: bool = False) -> None:
        """A pass over tokens at ``absolute`` [batch, tokens] positions of their rows (< 0:
        padding). The last pass only captures: it stops as soon as every hook point is in."""
        self.runtime.begin_pass(absolute.shape[0], absolute.shape[1], stop_when_complete=last)
        if self.steering is not None:
            self.steering.begin_pass(absolute)

    def _visit(self, name: str, tensor: Any) -> Any:
        replaced = self.steering.apply(name, tensor) if self.steering is not None else None
        if self.recorder is not None and name in self.recorder.sites:
            self.recorder.keep(name, tensor if replaced is None else replaced)
        return replaced


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
    interventions: Sequence[Sequence[Intervention]] | None = None,
    progress: Sequence[Progress | None] | None = None,
    should_yield: Callable[[], bool] | None = None,
) -> list[GenerationResult]:
    """Generate a completion for each prompt (token ids) with its own :class:`SamplingParams`.

    ``on_token(event)`` is called for every generated token right after it is sampled, before
    the next forward pass. ``cancelled_rows()`` is asked once per decode step (before its
    forward pass); the rows it names finish with "cancelled" (text held back for a possible stop
    string or an incomplete character is then dropped, so the result text stays the
    concatenation of the streamed texts). ``capture`` (hook point names, one prompt only)
    returns the activations of every prompt and generated token in ``capture_dtype``.
    ``interventions[r]`` (see :mod:`engine.interventions`) change row ``r``'s activations as it
    runs, and only row ``r``'s; captured activations are the changed ones.

    ``should_yield()`` is asked once per decode step too (after at least one token per row): when
    it answers True the batch stops, and every unfinished row's result is ``yielded`` with its
    ``progress``. Passed back as ``progress[r]`` (with the same prompt and parameters), it makes
    row ``r`` go on exactly where it stopped: the run is re-prefilled over prompt + tokens so far,
    and the row's random draws, held-back text and logprobs continue as if it had never stopped.
    Results always cover the whole row (tokens, text and events from its first token).

    Everything is validated before the model runs: :class:`GenerationError` (codes on the
    class) or :class:`HookError` for an unknown hook point. Hooks are removed before this
    returns, also when it raises.
    """
    import torch

    prompts, params = list(prompts), list(params)
    if not prompts:
        raise invalid("prompts", "At least one prompt is required.")
    if len(prompts) != len(params):
        raise invalid("params", "Give one SamplingParams per prompt.")
    for row_params in params:
        check_params(row_params)
    token_lists = checked_prompts(model, prompts)
    progress = _checked_progress(model, token_lists, params, progress)
    sites = _capture_sites(model, capture, capture_dtype, progress, should_yield) if capture else {}
    recorder = _Recorder(sites, getattr(torch, capture_dtype)) if sites else None
    steering = _checked_interventions(model, interventions, token_lists)
    if steering is not None:
        sites = {**sites, **hook_sites(model, steering.hooks)}
    hooks = _Hooks(model, sites, recorder, steering) if sites else None

    attached = hooks.runtime.attached() if hooks is not None else contextlib.nullcontext()
    with grad_free_mode(model)(), attached:
        return _run(
            model,
            tokenizer,
            token_lists,
            params,
            progress=progress,
            hooks=hooks,
            on_token=on_token,
            cancelled_rows=cancelled_rows,
            should_yield=should_yield,
        )


def _checked_progress(
    model: Any,
    prompts: list[list[int]],
    params: list[SamplingParams],
    progress: Sequence[Progress | None] | None,
) -> list[Progress | None]:
    """One progress (or None) per prompt, each leaving its row a token to generate, and every row's
    tokens so far plus those left within the model's context."""
    progress = list(progress) if progress is not None else [None] * len(prompts)
    if len(progress) != len(prompts):
        raise invalid("progress", "Give one progress (or None) per prompt.")
    left = [
        replace(row_params, max_new_tokens=row_params.max_new_tokens - (len(done.token_ids) if done else 0))
        for row_params, done in zip(params, progress, strict=True)
    ]
    if any(row_params.max_new_tokens < 1 for row_params in left):
        raise invalid("progress", "A row's progress already holds all its tokens.")
    check_context(model, _fed_tokens(prompts, progress), left)
    return progress


def _capture_sites(
    model: Any,
    capture: Sequence[str],
    capture_dtype: str,
    progress: list[Progress | None],
    should_yield: Callable[[], bool] | None,
) -> dict[str, HookSite]:
    """The hook points to capture: a list of names, for one prompt that runs whole."""
    if isinstance(capture, str):
        raise invalid("capture", "capture takes a list of hook point names.")
    if len(progress) != 1:
        raise GenerationError(
            "CAPTURE_NEEDS_ONE_PROMPT", "Activations can be captured for one prompt at a time."
        )
    if progress[0] is not None or should_yield is not None:
        raise invalid("capture", "A captured generation runs whole: it neither yields nor goes on.")
    if capture_dtype not in CAPTURE_DTYPES:
        raise invalid("capture_dtype", f"capture_dtype must be one of {', '.join(CAPTURE_DTYPES)}.")
    return hook_sites(model, list(capture))


def _checked_interventions(
    model: Any, interventions: Sequence[Sequence[Intervention]] | None, prompts: list[list[int]]
) -> Interventions | None:
    if not interventions or not any(interventions):
        return None
    if len(interventions) != len(prompts):
        raise invalid("interventions", "Give one list of interventions per prompt.")
    names = list(dict.fromkeys(item.hook for items in interventions for item in items))
    hook_sites(model, names)  # INVALID_HOOK for an unknown name, all of them at once
    widths: dict[str, int | None] = {point.name: point.width for point in list_hook_points(model)}
    widths.update({name: None for name in names if name.startswith(MODULE_PREFIX)})
    for items in interventions:
        check_interventions(items, widths)
    return Interventions(interventions, [len(prompt) for prompt in prompts])


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
    progress: list[Progress | None],
    hooks: _Hooks | None,
    on_token: Callable[[TokenEvent], None] | None,
    cancelled_rows: Callable[[], Collection[int]] | None,
    should_yield: Callable[[], bool] | None,
) -> list[GenerationResult]:
    device = input_device(model)
    fed = _fed_tokens(prompts, progress)
    prompt_length = max(len(tokens) for tokens in fed)
    eos_ids = eos_token_ids(model, tokenizer)
    rows = [
        _row(index, prompt, tokens, row_params, done, start=prompt_length - len(tokens), device=device,
             tokenizer=tokenizer)
        for index, (prompt, tokens, row_params, done)
        in enumerate(zip(prompts, fed, params, progress, strict=True))
    ]  # fmt: skip
    layout = _layout(model, rows, [len(tokens) for tokens in fed], device)
    run = _Run(rows, layout, _Forward.of(model, layout.mask), hooks, eos_ids, tokenizer, on_token)
    wants_prompt = any(row.params.prompt_logprobs is not None for row in rows)
    run.prefill(keep_last=not (wants_prompt or _hooks_outside_base(model, hooks)))
    run.decode(cancelled_rows, should_yield)
    activations = run.capture_last(device) if hooks is not None and hooks.recorder is not None else None
    return run.results(activations)


@dataclass(frozen=True)
class _Layout:
    """The run's grid of columns: the left-padded prompts, then one column per decode step."""

    # Prompt + generated ids, left-padded: the repetition penalty reads each row's slice of it.
    sequence: Any
    # One mask for the whole run, sliced per step, rather than a cat per step; only with padding.
    mask: Any | None
    prompt_positions: Any
    # decode_positions[t] is the [batch] position of the t-th token fed after the prompt.
    decode_positions: Any
    # Each row's position of each prompt column (negative: left padding).
    prompt_absolute: Any
    row_lengths: Any
    prompt_length: int
    track_sequence: bool


def _layout(model: Any, rows: list[Row], lengths: list[int], device: Any) -> _Layout:
    import torch

    batch_size, prompt_length = len(rows), max(lengths)
    steps = max(row.steps_left for row in rows)
    sequence = torch.full((batch_size, prompt_length + steps), pad_token_id(model), dtype=torch.long)
    for row in rows:
        sequence[row.index, row.start : prompt_length] = torch.tensor(row.prompt, dtype=torch.long)
    sequence = sequence.to(device)
    mask = None
    if min(lengths) != prompt_length:
        mask = torch.ones((batch_size, prompt_length + steps), dtype=torch.long)
        for row in rows:
            mask[row.index, : row.start] = 0
        mask = mask.to(device)
    prompt_positions = torch.arange(prompt_length, device=device).repeat(batch_size, 1)
    if mask is not None:
        prompt_positions = (mask[:, :prompt_length].cumsum(-1) - 1).clamp(min=0)
    # A row that has ended is still fed while the batch runs on (its tokens are dropped): where the
    # batch's longest answer would take it past the context, it stays at the last position.
    decode_positions = (prompt_positions[:, -1] + 1) + torch.arange(steps, device=device)[:, None]
    limit = context_length(model)
    if limit is not None:
        decode_positions = decode_positions.clamp(max=limit - 1)
    starts = torch.tensor([row.start for row in rows], device=device)
    return _Layout(
        sequence=sequence,
        mask=mask,
        prompt_positions=prompt_positions,
        decode_positions=decode_positions,
        prompt_absolute=torch.arange(prompt_length, device=device)[None, :] - starts[:, None],
        row_lengths=torch.tensor(lengths, device=device),
        prompt_length=prompt_length,
        track_sequence=any(row.params.repetition_penalty != 1 for row in rows),
    )


@dataclass(frozen=True)
class _Forward:
    """One forward pass of the model over the KV cache, with the arguments its family takes."""

    model: Any
    mask: Any | None
    takes_position_ids: bool
    logits_to_keep_name: str | None

    @classmethod
    def of(cls, model: Any, mask: Any | None) -> _Forward:
        takes_position_ids, logits_to_keep_name = _forward_arguments(model)
        return cls(model, mask, takes_position_ids, logits_to_keep_name)

    def __call__(self, input_ids: Any, length: int, positions: Any, past: Any, *, keep_last: bool) -> Any:
        arguments: dict[str, Any] = {"input_ids": input_ids, "use_cache": True}
        if past is not None:
            arguments["past_key_values"] = past
        if self.mask is not None:
            # A view, not a copy: every family's mask code reads it by index (checked with
            # batches against single prompts in the tests).
            arguments["attention_mask"] = self.mask[:, :length]
        if self.takes_position_ids:
            arguments["position_ids"] = positions
        if keep_last and self.logits_to_keep_name is not None:
            arguments[self.logits_to_keep_name] = 1
        return self.model(**arguments)


def _hooks_outside_base(model: Any, hooks: _Hooks | None) -> bool:
    """Whether a module: hook point lies outside the base model (the LM head): it needs every
    prompt row, so the prefill then computes all logits."""
    if hooks is None:
        return False
    base = base_model_path(model)
    return any(not site.module_path.startswith(base + ".") for site in hooks.runtime.sites.values())


@dataclass
class _Run:
    """The decode loop's state: the prefill, one step per token, and the results."""

    rows: list[Row]
    layout: _Layout
    forward: _Forward
    hooks: _Hooks | None
    eos_ids: frozenset[int]
    tokenizer: Any
    on_token: Callable[[TokenEvent], None] | None
    past: Any = None
    next_tokens: Any = None
    started: float = 0.0
    first_token_at: float = 0.0

    def prefill(self, *, keep_last: bool) -> None:
        layout = self.layout
        self.started = time.perf_counter()
        prompt_ids = layout.sequence[:, : layout.prompt_length].contiguous()
        if self.hooks is not None:
            self.hooks.begin_pass(layout.prompt_absolute)
        output = self.forward(
            prompt_ids, layout.prompt_length, layout.prompt_positions, None, keep_last=keep_last
        )
        self.past = output.past_key_values
        for row in self.rows:
            if row.params.prompt_logprobs is not None:
                row.prompt_events = prompt_logprobs(row, output.logits[row.index], self.tokenizer)
        self.first_token_at = self._sample(output.logits[:, -1, :], layout.prompt_length)
        del output

    def decode(
        self,
        cancelled_rows: Callable[[], Collection[int]] | None,
        should_yield: Callable[[], bool] | None,
    ) -> None:
        step = 1
        while not all(row.done for row in self.rows):
            if _stop_requested(self.rows, cancelled_rows, should_yield):
                break
            self._step(step)
            step += 1

    def _step(self, step: int) -> None:
        layout = self.layout
        if self.hooks is not None:
            self.hooks.begin_pass((layout.row_lengths + step - 1)[:, None])
        output = self.forward(
            self.next_tokens[:, None],
            layout.prompt_length + step,
            layout.decode_positions[step - 1][:, None],
            self.past,
            keep_last=False,
        )
        self.past = output.past_key_values
        logits = output.logits[:, -1, :]
        del output
        self._sample(logits, layout.prompt_length + step)

    def _sample(self, logits: Any, length: int) -> float:
        """Sample and emit the step's tokens from ``logits``; returns when they were sampled."""
        layout = self.layout
        self.next_tokens = sample_step(self.rows, logits, layout.sequence, length, layout.track_sequence)
        token_list = self.next_tokens.tolist()  # waits for the device: the token is there now
        sampled_at = time.perf_counter()
        _emit(self.rows, token_list, logits, self.eos_ids, self.tokenizer, self.on_token, sampled_at)
        return sampled_at

    def capture_last(self, device: Any) -> dict[str, Any]:
        """The last token was sampled but never fed: one more pass captures its rows (its logits
        are not needed, and the pass stops as soon as every hook point is in)."""
        import torch

        assert self.hooks is not None and self.hooks.recorder is not None
        layout = self.layout
        (only_row,) = self.rows
        generated = len(only_row.token_ids)
        self.hooks.begin_pass((layout.row_lengths + generated - 1)[:, None], last=True)
        self.hooks.runtime.run(
            self.forward,
            input_ids=torch.tensor([[only_row.token_ids[-1]]], device=device),
            length=layout.prompt_length + generated,
            positions=layout.decode_positions[generated - 1][:, None],
            past=self.past,
            keep_last=True,
        )
        return self.hooks.recorder.tensors(len(only_row.prompt) + generated)

    def results(self, activations: dict[str, Any] | None) -> list[GenerationResult]:
        prefill_seconds = self.first_token_at - self.started
        return [
            GenerationResult(
                token_ids=row.token_ids,
                text=row.stream.text,
                finish_reason=row.finish_reason or FINISH_LENGTH,
                logprobs=row.events,
                prompt_tokens=row.prompt_tokens,
                prefill_seconds=prefill_seconds,
                decode_seconds=max(0.0, row.last_token_at - self.first_token_at),
                activations=activations,
                progress=_progress(row) if row.finish_reason == FINISH_YIELDED else None,
                prompt_logprobs=row.prompt_events,
            )
            for row in self.rows
        ]


def _stop_requested(
    rows: list[Row],
    cancelled_rows: Callable[[], Collection[int]] | None,
    should_yield: Callable[[], bool] | None,
) -> bool:
    """Finish the rows cancelled since the last step; whether the batch stops now (every row is
    done, or it yields: its unfinished rows then finish as yielded)."""
    if cancelled_rows is not None:
        cancelled = cancelled_rows() or ()
        for row in rows:
            if not row.done and row.index in cancelled:
                row.finish_reason = FINISH_CANCELLED
        if all(row.done for row in rows):
            return True
    if should_yield is not None and should_yield():
        for row in rows:
            if not row.done:
                row.finish_reason = FINISH_YIELDED
        return True
    return False


def _fed_tokens(prompts: list[list[int]], progress: list[Progress | None]) -> list[list[int]]:
    """What each row feeds the model first: its prompt, then what it generated before a yield."""
    return [prompt + (done.token_ids if done else []) for prompt, done in zip(prompts, progress, strict=True)]


def _row(
    index: int, prompt: list[int], fed: list[int], params: SamplingParams, done: Progress | None, *,
    start: int, device: Any, tokenizer: Any,
) -> Row:  # fmt: skip
    """A row of the batch: fresh, or going on from ``done`` (its tokens, random state, held-back
    text and events as they were when its batch yielded)."""
    import torch

    generator = torch.Generator(device=device)
    if done is None:
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    else:
        generator.set_state(torch.frombuffer(bytearray(done.rng_state), dtype=torch.uint8))
    row = Row(
        index=index,
        params=params,
        prompt=fed,
        generator=generator,
        stream=TextStream(tokenizer, params.stop),
        start=start,
        prompt_tokens=len(prompt),
        events=[] if params.logprobs or params.top_logprobs else None,
    )
    if done is not None:
        row.token_ids = list(done.token_ids)
        for token_id in done.token_ids:  # replayed: the same text released, the same held back
            row.stream.push(token_id, final=False)
        if row.events is not None:
            row.events = list(done.events or [])
    return row


def _progress(row: Row) -> Progress:
    return Progress(
        token_ids=list(row.token_ids),
        rng_state=row.generator.get_state().numpy().tobytes(),
        events=None if row.events is None else list(row.events),
    )


def _emit(
    rows: list[Row],
    token_list: list[int],
    logits: Any,
    eos_ids: frozenset[int],
    tokenizer: Any,
    on_token: Callable[[TokenEvent], None] | None,
    sampled_at: float,
) -> None:
    """Record the step's tokens of the unfinished rows, finish rows, and stream the events."""
    active = [row for row in rows if not row.done]
    chosen, alternatives = step_logprobs(
        [row for row in active if row.wants_logprobs], token_list, logits, tokenizer
    )
    for row in active:
        token_id = token_list[row.index]
        text = _append(row, token_id, eos_ids, sampled_at)
        event = TokenEvent(
            row=row.index,
            index=len(row.token_ids) - 1,
            token_id=token_id,
            text=text,
            logprob=chosen.get(row.index),
            top_logprobs=alternatives.get(row.index),
        )
        if row.events is not None:
            row.events.append(event)
        if on_token is not None:
            on_token(event)


def _append(row: Row, token_id: int, eos_ids: frozenset[int], sampled_at: float) -> str:
    """Add ``token_id`` to ``row``, finishing it at EOS, a stop string or its length; the text it
    releases."""
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
    return text
