"""The extraction engine: token batches in, per-hook activations out, one batch at a time.

What it guarantees (ARCHITECTURE.md, "Extraction engine"):

* **No change to the model.** Forward hooks (and pre-hooks) are registered for one batch and
  removed right after it, also when the forward pass raises; between batches, while the caller
  holds a :class:`BatchActivations`, the model carries none of them.
* **Stop early.** The base model (``model.transformer`` / ``model.model`` / ...) runs rather than
  the LM wrapper, so the LM head never runs unless a ``module:`` hook point lies outside the base
  model; and the forward pass is aborted (a private exception raised from a hook) as soon as
  every requested hook point has been captured, so blocks after the deepest one never run.
* **Padding-correct.** Every batch passes the attention mask and, where the model takes them,
  position ids computed from the mask, so left and right padding both give each sample the
  positions of an unpadded run; pad positions are never stored.
* **Preallocated buffers.** Each hook copies its token rows straight into a per-hook buffer sized
  once for the largest batch of the plan (in the stored dtype, on the hook's device); the
  module's full output is not kept.
* **Streaming.** :func:`extract` is a generator: one batch in memory at a time, so memory stays
  flat as the dataset grows. Batch indices are positions in the plan, so a job resumes after a
  crash with ``start_batch``.

Importable without Django or torch (torch is imported inside the functions).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError
from engine.hooks import HookSite, hook_sites
from engine.placement import input_device
from engine.runtime import HookRuntime, grad_free_mode, smallest_runner
from engine.runtime import pad_token_id as runtime_pad_token_id

__all__ = [
    "DTYPES",
    "PADDING_SIDES",
    "BatchActivations",
    "ExtractionCancelled",
    "ExtractionError",
    "extract",
    "plan_batches",
    "tokenize_samples",
]

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
PADDING_SIDES: tuple[str, ...] = ("right", "left")
# Config keys that bound the sequence length a model can embed.
_CONTEXT_KEYS: tuple[str, ...] = ("max_position_embeddings", "n_positions")
# A first guess of how many characters a token covers at most (English averages about 4); a
# text longer than this many characters per allowed token is tokenized a prefix at a time.
PREFIX_CHARS_PER_TOKEN = 8
# Tokens a prefix must yield beyond the kept ones: cutting a text changes only the tokens near
# the cut (the last word's pieces, a whitespace run, a normalized character sequence), and these
# must all lie past the kept ones.
_CUT_MARGIN_TOKENS = 16
# A cut inside a word longer than this is allowed (past WordPiece's 100-character word limit).
_LONG_WORD_CHARS = 1024
_NON_SPACE_RUN = re.compile(r"\S*")


class ExtractionError(EngineError):
    """An extraction refused or failed for a reason worth a stable code."""


class ExtractionCancelled(ExtractionError):
    """``should_cancel()`` said stop; raised between batches, never in the middle of one."""

    def __init__(self) -> None:
        super().__init__("EXTRACTION_CANCELLED", "The extraction was cancelled.")


@dataclass
class BatchActivations:
    """One batch's activations, token-major: row ``k`` of every tensor is the same token.

    Rows are in (sample order within the batch, position) order, pad positions removed. All
    tensors are on the CPU and owned by the caller (nothing here writes to them later).

    From a GPU the copies to the host are still in flight when the batch is yielded (so the next
    batch's forward pass is queued behind them without a wait): reading ``activations`` waits
    for them, on whichever thread reads it first.
    """

    # Position of this batch in the plan.
    batch_index: int
    # Dataset indices of the batch's samples, in row order.
    sample_indices: list[int]
    # int64 [n]: the token id, the dataset sample index and the position in the sample of each row.
    token_ids: Any
    sample_index: Any
    positions: Any
    # hook point name -> [n, width] in the stored dtype, once ``ready`` has completed.
    host_copies: dict[str, Any]
    # CUDA events recorded after the copies (none on the CPU).
    ready: list[Any] = field(default_factory=list)

    @property
    def activations(self) -> dict[str, Any]:
        while self.ready:
            self.ready.pop().synchronize()
        return self.host_copies

    @property
    def token_count(self) -> int:
        return int(self.token_ids.shape[0])


def plan_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Group sample indices into batches of at most ``batch_size`` with little padding.

    Samples are sorted by length, longest first (so the biggest batch runs first and an
    out-of-memory error shows at once rather than at the end), ties by index; consecutive
    runs of ``batch_size`` form the batches, each listing its indices in ascending order.
    Deterministic: the same lengths always give the same plan, which is what makes batch
    indices stable for resuming.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ExtractionError(
            "INVALID_BATCH_SIZE", f"batch_size must be a positive integer, got {batch_size!r}."
        )
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    return [sorted(order[start : start + batch_size]) for start in range(0, len(order), batch_size)]


def tokenize_samples(tokenizer: Any, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids of each text, truncated to ``max_length`` tokens.

    Special tokens are added as the model's tokenizer normally does (a BOS for Llama-style
    tokenizers that add one, ``[CLS] ... [SEP]`` for BERT; none for GPT-2); truncation keeps them.

    The result is exactly what tokenizing each whole text and truncating gives, but the work is
    bounded by ``max_length``, not by the text: a text longer than ``max_length`` times
    :data:`PREFIX_CHARS_PER_TOKEN` characters is tokenized a prefix at a time (see
    :func:`_long_text_ids`), so one huge sample cannot tie up a worker.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ExtractionError(
            "INVALID_MAX_LENGTH", f"max_length must be a positive integer, got {max_length!r}."
        )
    special = tokenizer.num_special_tokens_to_add(pair=False)
    if max_length < special:
        # The tokenizer would not truncate at all (it warns and returns whole texts).
        raise ExtractionError(
            "INVALID_MAX_LENGTH",
            f"max_length must be at least {special}, the special tokens this tokenizer adds.",
            {"minimum": special},
        )
    if not texts:
        return []
    window = max_length * PREFIX_CHARS_PER_TOKEN
    short = [index for index, text in enumerate(texts) if len(text) <= window]
    ids: list[list[int]] = [[] for _ in texts]
    for index, row in zip(
        short, _truncated_ids(tokenizer, [texts[index] for index in short], max_length), strict=True
    ):
        ids[index] = row
    for index, text in enumerate(texts):
        if len(text) > window:
            ids[index] = _long_text_ids(tokenizer, text, max_length, window)
    return ids


def _truncated_ids(tokenizer: Any, texts: list[str], max_length: int) -> list[list[int]]:
    if not texts:
        return []
    encoded = tokenizer(
        texts,
        add_special_tokens=True,
        truncation=True,
        max_length=max_length,
        padding=False,
        return_attention_mask=False,
    )
    return [list(ids) for ids in encoded["input_ids"]]


def _long_text_ids(tokenizer: Any, text: str, max_length: int, window: int) -> list[int]:
    """The truncated token ids of a long text, from a prefix of it no longer than needed.

    Two effects of cutting a text are guarded against. A cut inside a word can change the whole
    word (WordPiece turns a word over 100 characters into one ``[UNK]``), so a prefix stops
    before the word it would split, unless :data:`_LONG_WORD_CHARS` characters of that word are
    in it. A cut also changes the tokens right before it (a whitespace run, punctuation that
    absorbs a following newline, a combining accent), so a prefix must yield
    :data:`_CUT_MARGIN_TOKENS` tokens beyond the kept ones. The prefix doubles from ``window``
    characters until two consecutive prefixes both pass and agree on the kept tokens; the smaller
    one is then tokenized as usual, so special tokens come out exactly as for the whole text. If
    the text ends first, the whole text is tokenized. A tokenizer that truncates on the left is
    given suffixes instead.
    """
    from_left = getattr(tokenizer, "truncation_side", "right") == "left"
    kept = max(max_length - tokenizer.num_special_tokens_to_add(pair=False), 0)
    enough = kept + _CUT_MARGIN_TOKENS
    earlier: tuple[str, list[int]] | None = None
    size = window
    while size < len(text):
        piece = _cut_between_words(text, size, from_left=from_left)
        content = tokenizer(
            piece, add_special_tokens=False, truncation=True, max_length=enough, return_attention_mask=False
        )["input_ids"]
        if len(content) >= enough:
            kept_ids = list(content[len(content) - kept :] if from_left else content[:kept])
            if earlier is not None and earlier[1] == kept_ids:
                return _truncated_ids(tokenizer, [earlier[0]], max_length)[0]
            earlier = (piece, kept_ids)
        size *= 2
    return _truncated_ids(tokenizer, [text], max_length)[0]


def _cut_between_words(text: str, size: int, *, from_left: bool) -> str:
    """The first ``size`` characters of ``text`` (its last ones when ``from_left``), less the part
    of a word the cut would split, unless that part is already long."""
    if from_left:
        start = len(text) - size
        split = _NON_SPACE_RUN.match(text[start - 1 : start + _LONG_WORD_CHARS]).end() - 1
        return text[start + split :] if 0 < split < _LONG_WORD_CHARS else text[start:]
    split = _NON_SPACE_RUN.match(text[max(size - _LONG_WORD_CHARS, 0) : size + 1][::-1]).end() - 1
    return text[: size - split] if 0 < split < _LONG_WORD_CHARS else text[:size]


def extract(
    model: Any,
    tokenized: Sequence[Sequence[int]],
    plan: Sequence[Sequence[int]],
    *,
    hooks: Sequence[str],
    dtype: str = "float32",
    start_batch: int = 0,
    padding_side: str = "right",
    pad_token_id: int | None = None,
    should_cancel: Callable[[], bool] | None = None,
    to_host: bool = True,
) -> Iterator[BatchActivations]:
    """Run ``model`` over the batches of ``plan`` and yield each batch's activations.

    ``tokenized[i]`` is sample ``i``'s token ids; ``plan`` lists batches of sample indices (see
    :func:`plan_batches`); batches before ``start_batch`` are skipped (resume). ``hooks`` are
    hook point names (validated here, raising :class:`HookError`); ``dtype`` is the stored
    dtype. ``should_cancel()`` is asked before every batch; when it says yes,
    :class:`ExtractionCancelled` is raised. Arguments are checked when this is called, the
    model runs as the returned iterator is consumed. ``to_host=False`` keeps the activations on
    the hooks' device (fresh copies there): for a consumer on the GPU, such as SAE training from
    the model, which then never waits on a device-to-host copy.
    """
    import torch

    sites = hook_sites(model, list(hooks))
    if dtype not in DTYPES:
        raise ExtractionError("INVALID_DTYPE", f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    if padding_side not in PADDING_SIDES:
        raise ExtractionError(
            "INVALID_PADDING_SIDE",
            f"padding_side must be one of {', '.join(PADDING_SIDES)}, got {padding_side!r}.",
        )
    if isinstance(start_batch, bool) or not isinstance(start_batch, int) or not 0 <= start_batch <= len(plan):
        raise ExtractionError(
            "INVALID_START_BATCH", f"start_batch must be in 0..{len(plan)}, got {start_batch!r}."
        )
    batches = [list(batch) for batch in plan[start_batch:]]
    lengths = {index: len(tokenized[index]) for batch in batches for index in batch}
    _check_lengths(model, max(lengths.values(), default=0))
    capacity = max((sum(lengths[index] for index in batch) for batch in batches), default=0)
    runner = smallest_runner(model, sites.values())
    return _extract_batches(
        model,
        runner,
        tokenized,
        batches,
        start_batch=start_batch,
        sites=sites,
        stored_dtype=getattr(torch, dtype),
        capacity=capacity,
        padding_side=padding_side,
        pad_token_id=runtime_pad_token_id(model, pad_token_id),
        should_cancel=should_cancel,
        to_host=to_host,
    )


def _check_lengths(model: Any, longest: int) -> None:
    config = model.config
    for key in _CONTEXT_KEYS:
        limit = getattr(config, key, None)
        if isinstance(limit, int) and longest > limit:
            raise ExtractionError(
                "SEQUENCE_TOO_LONG",
                f"A sample has {longest} tokens; the model takes at most {limit}.",
                {"longest": longest, "limit": limit},
            )


def _batch_inputs(
    tokenized: Sequence[Sequence[int]], batch: list[int], *, padding_side: str, pad_token_id: int
) -> dict[str, Any]:
    """The padded input ids, mask, position ids and the stored rows' metadata of one batch (CPU)."""
    import torch

    rows = [list(tokenized[index]) for index in batch]
    lengths = [len(row) for row in rows]
    # At least one column, so a batch of empty samples still runs (and stores nothing).
    seq_len = max(1, *lengths) if lengths else 1
    input_ids = torch.full((len(rows), seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    flat_index = []
    for row_number, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        start = seq_len - length if padding_side == "left" else 0
        if length:
            input_ids[row_number, start : start + length] = torch.tensor(row, dtype=torch.long)
            attention_mask[row_number, start : start + length] = 1
        flat_index.append(torch.arange(start, start + length) + row_number * seq_len)
    # Positions count real tokens only, so a left-padded sample starts at 0 as it would alone.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    token_count = sum(lengths)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "row_index": None if token_count == input_ids.numel() else torch.cat(flat_index),
        "token_ids": torch.tensor([token for row in rows for token in row], dtype=torch.long),
        "sample_index": torch.repeat_interleave(
            torch.tensor(batch, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)
        ),
        "positions": torch.cat([torch.arange(length) for length in lengths])
        if lengths
        else torch.zeros(0, dtype=torch.long),
        "token_count": token_count,
    }


def _check_token_ids(model: Any, input_ids: Any) -> None:
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if input_ids.numel() and (
        int(input_ids.min()) < 0 or (vocab is not None and int(input_ids.max()) >= vocab)
    ):
        raise ExtractionError(
            "INVALID_TOKENS",
            f"Token ids must be in 0..{vocab - 1 if vocab else '?'} for this model.",
            {"vocab_size": vocab},
        )


def _extract_batches(
    model: Any,
    runner: Any,
    tokenized: Sequence[Sequence[int]],
    batches: list[list[int]],
    *,
    start_batch: int,
    sites: dict[str, HookSite],
    stored_dtype: Any,
    capacity: int,
    padding_side: str,
    pad_token_id: int,
    should_cancel: Callable[[], bool] | None,
    to_host: bool,
) -> Iterator[BatchActivations]:
    names = list(sites)
    parameters = inspect.signature(runner.forward).parameters
    takes_position_ids = "position_ids" in parameters
    takes_use_cache = "use_cache" in parameters
    device = input_device(model)
    grad_free = grad_free_mode(model)
    # hook point -> [capacity, width] buffer, allocated on first use and reused by every batch.
    buffers: dict[str, Any] = {}

    def keep_rows(row_index: Any, token_count: int) -> Callable[[str, Any], None]:
        """The visitor of one batch: copy its real-token rows into each hook's buffer."""
        import torch

        def visit(name: str, tensor: Any) -> None:
            flat = tensor.detach().reshape(tensor.shape[0] * tensor.shape[1], -1)
            buffer = buffers.get(name)
            if buffer is None or buffer.shape[1] != flat.shape[1] or buffer.device != flat.device:
                buffer = torch.empty((capacity, flat.shape[1]), dtype=stored_dtype, device=flat.device)
                buffers[name] = buffer
            target = buffer[:token_count]
            if row_index is None:
                target.copy_(flat)
            elif flat.dtype == target.dtype:
                torch.index_select(flat, 0, row_index.to(flat.device), out=target)
            else:
                target.copy_(flat.index_select(0, row_index.to(flat.device)))

        return visit

    for offset, batch in enumerate(batches):
        # Grad mode is entered and left inside each step, never across a yield: a context held
        # open over a yield would leak into the caller's code while the generator is suspended.
        if should_cancel is not None and should_cancel():
            raise ExtractionCancelled
        inputs = _batch_inputs(tokenized, batch, padding_side=padding_side, pad_token_id=pad_token_id)
        _check_token_ids(model, inputs["input_ids"])
        arguments: dict[str, Any] = {
            "input_ids": inputs["input_ids"].to(device),
            "attention_mask": inputs["attention_mask"].to(device),
        }
        if takes_position_ids:
            arguments["position_ids"] = inputs["position_ids"].to(device)
        if takes_use_cache:
            arguments["use_cache"] = False
        row_index = None if inputs["row_index"] is None else inputs["row_index"].to(device)
        visit = keep_rows(row_index, inputs["token_count"])
        runtime = HookRuntime(model, sites, visit, purpose="extracted")
        runtime.begin_pass(*inputs["input_ids"].shape, stop_when_complete=True)
        with grad_free(), runtime.attached():
            runtime.run(runner, **arguments)
        missing = runtime.missing()
        if missing:
            raise ExtractionError(
                "HOOK_NOT_REACHED",
                f"The forward pass never reached {', '.join(missing)}.",
                {"hooks": missing},
            )
        count = inputs["token_count"]
        kept = {name: buffers[name][:count] for name in names}
        copies, ready = (
            _copy_to_host(kept) if to_host else ({name: rows.clone() for name, rows in kept.items()}, [])
        )
        yield BatchActivations(
            batch_index=start_batch + offset,
            sample_indices=list(batch),
            token_ids=inputs["token_ids"],
            sample_index=inputs["sample_index"],
            positions=inputs["positions"],
            # Fresh copies: the buffers are overwritten by the next batch.
            host_copies=copies,
            ready=ready,
        )


def _copy_to_host(tensors: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Fresh CPU copies of ``tensors``, which the caller owns, and the CUDA events to wait for
    before reading them.

    From a GPU: into page-locked host memory (torch's caching host allocator hands the same
    blocks back batch after batch once their tensors are freed and their copies are done, so
    nothing is pinned anew in steady state) with asynchronous copies queued on each device's
    current stream, behind the forward pass that filled the buffers and ahead of the next one
    that overwrites them. Nothing here waits: the reader waits for the events
    (:attr:`BatchActivations.activations`), so the GPU runs the next forward pass meanwhile.
    """
    import torch

    on_gpu = [tensor for tensor in tensors.values() if tensor.device.type == "cuda"]
    if not on_gpu:
        return {name: tensor.to("cpu", copy=True) for name, tensor in tensors.items()}, []
    copies = {}
    for name, tensor in tensors.items():
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
        copies[name] = host.copy_(tensor, non_blocking=True)
    # A split model's hook points may sit on several GPUs: one event per device's stream.
    ready = []
    for device in {tensor.device for tensor in on_gpu}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        ready.append(event)
    return copies, ready
