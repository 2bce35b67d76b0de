"""Train a small GPT-2 from scratch on local text, within a wall-clock budget on a CPU.

The workbench's demo needs a model whose internals have *some* learned structure (random
weights make every feature look like noise), but no hub downloads are available. This
module trains one in about a minute and a half on two CPU cores: a 4-layer GPT-2 with a
4096-token BPE vocabulary, on the standard-library text of
:func:`~engine.testing.tiny_models.local_corpus`.

Like :mod:`~engine.testing.tiny_models` it does not need Django, and imports torch and
transformers only when training starts.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.testing.tiny_models import build_tokenizer, local_corpus

REPORT_FILENAME = "training_report.json"

# Geometry and optimisation settings, chosen by comparing held-out loss after equal time
# budgets on 2 CPU cores. This 1.3M-parameter model runs about 10,000 tokens/s there, so a
# 90 s budget sees ~3 passes over the ~280k-token corpus; wider models (192-256) or larger
# batches took fewer optimiser steps and ended with a higher loss, as did a 3e-3 peak rate.
VOCAB_SIZE = 4096
CONTEXT_LENGTH = 128
HIDDEN_SIZE = 128
NUM_LAYERS = 4
NUM_HEADS = 4
BATCH_SIZE = 8
PEAK_LEARNING_RATE = 2e-3
# The schedule's floor, as a fraction of the peak.
MIN_LEARNING_RATE_FRACTION = 0.1
WARMUP_STEPS = 10
WEIGHT_DECAY = 0.01
GRADIENT_CLIP_NORM = 1.0
PROGRESS_EVERY_STEPS = 10
# Every n-th packed sequence is held out, so the reported losses measure generalisation
# rather than memorisation of the batches just trained on.
HELD_OUT_EVERY = 50
MAX_HELD_OUT_SEQUENCES = 32


@dataclass
class DemoTrainingReport:
    """What a demo training run did, as written to ``training_report.json``.

    ``initial_loss`` and ``final_loss`` are mean next-token cross-entropies (nats) on the
    same held-out sequences, before the first and after the last optimiser step.
    ``seconds`` is the wall time of the training loop alone.
    """

    steps: int
    seconds: float
    initial_loss: float
    final_loss: float
    parameter_count: int
    tokens_seen: int


def demo_corpus(max_chars: int = 2_000_000) -> list[str]:
    """The demo's training text: the local standard-library corpus, capped at ``max_chars``."""
    return local_corpus(max_chars=max_chars)


def demo_topics(per_topic: int = 250) -> list[tuple[str, str]]:
    """The demo's labelled dataset (sparse probing's): docstring paragraphs and the topic of their
    module (networking, concurrency, files, text, numbers), at most ``per_topic`` of each."""
    from engine.testing.corpus import topic_corpus

    taken: dict[str, int] = {}
    pairs = []
    for text, topic in topic_corpus():
        if taken.get(topic, 0) < per_topic:
            taken[topic] = taken.get(topic, 0) + 1
            pairs.append((text, topic))
    return pairs


def _pack_sequences(tokenizer: Any, corpus: list[str], sequence_length: int) -> Any:
    """Tokenize the corpus, join paragraphs with eos, and cut it into equal-length rows.

    Packing wastes no compute on padding; the eos separators teach the model where a
    paragraph ends.
    """
    import torch

    encodings = tokenizer.backend_tokenizer.encode_batch(corpus, add_special_tokens=False)
    stream: list[int] = []
    for encoding in encodings:
        stream.extend(encoding.ids)
        stream.append(tokenizer.eos_token_id)
    rows = len(stream) // sequence_length
    return torch.tensor(stream[: rows * sequence_length], dtype=torch.long).view(rows, sequence_length)


def _learning_rate(step: int, elapsed_fraction: float) -> float:
    """Linear warm-up, then cosine decay over the *time* budget, since the step count is unknown."""
    if step < WARMUP_STEPS:
        return PEAK_LEARNING_RATE * (step + 1) / WARMUP_STEPS
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed_fraction)))
    return PEAK_LEARNING_RATE * (MIN_LEARNING_RATE_FRACTION + (1 - MIN_LEARNING_RATE_FRACTION) * cosine)


def _mean_loss(model: Any, sequences: Any) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        loss = model(
            input_ids=sequences, attention_mask=torch.ones_like(sequences), labels=sequences
        ).loss.item()
    model.train()
    return loss


def train_demo_gpt2(
    output_dir: str | Path,
    *,
    time_budget_seconds: float = 90.0,
    max_steps: int | None = None,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> DemoTrainingReport:
    """Train a small GPT-2 on the local corpus for at most ``time_budget_seconds`` of training
    (and at most ``max_steps`` optimiser steps: the same work on any machine, however busy).

    Preparation (corpus, tokenizer training, tokenization; a few seconds) and saving come on
    top of the budget. The model (safetensors), tokenizer and ``training_report.json`` are
    written to ``output_dir``. ``progress(step, loss)`` is called every
    ``PROGRESS_EVERY_STEPS`` optimiser steps with that step's training loss. The seed fixes
    initialisation and data order; how many steps fit in the budget depends on the machine.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    corpus = demo_corpus()
    tokenizer = build_tokenizer(
        kind="bpe", vocab_size=VOCAB_SIZE, corpus=corpus, model_max_length=CONTEXT_LENGTH
    )
    sequences = _pack_sequences(tokenizer, corpus, CONTEXT_LENGTH)
    is_held_out = torch.arange(len(sequences)) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    held_out = sequences[is_held_out][:MAX_HELD_OUT_SEQUENCES]
    training = sequences[~is_held_out]

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=CONTEXT_LENGTH,
        n_embd=HIDDEN_SIZE,
        n_layer=NUM_LAYERS,
        n_head=NUM_HEADS,
        # No dropout: a couple of passes over the data cannot overfit, and dropout would
        # only slow learning down.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    parameter_count = sum(parameter.numel() for parameter in model.parameters())

    # Weight decay on matrices only; biases and LayerNorm gains are conventionally exempt.
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    not_decayed = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": not_decayed, "weight_decay": 0.0}],
        lr=PEAK_LEARNING_RATE,
        betas=(0.9, 0.95),
    )
    data_order = torch.Generator().manual_seed(seed)

    initial_loss = _mean_loss(model, held_out)
    step = 0
    epoch_order = torch.empty(0, dtype=torch.long)
    position = 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < time_budget_seconds and step != max_steps:
        if position + BATCH_SIZE > len(epoch_order):
            epoch_order = torch.randperm(len(training), generator=data_order)
            position = 0
        batch = training[epoch_order[position : position + BATCH_SIZE]]
        position += BATCH_SIZE

        for group in optimizer.param_groups:
            done = max(elapsed / time_budget_seconds, step / max_steps if max_steps else 0.0)
            group["lr"] = _learning_rate(step, done)
        # An explicit all-ones mask: packed rows contain eos (= pad) tokens that must be attended
        # to, and without a mask transformers warns that padding might be unmasked.
        loss = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRADIENT_CLIP_NORM)
        optimizer.step()
        step += 1
        if progress is not None and step % PROGRESS_EVERY_STEPS == 0:
            progress(step, loss.item())
    seconds = time.monotonic() - started
    final_loss = _mean_loss(model, held_out)

    model.eval()
    output_path = Path(output_dir)
    output_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_path)
    tokenizer.save_pretrained(output_path)
    report = DemoTrainingReport(
        steps=step,
        seconds=round(seconds, 3),
        initial_loss=initial_loss,
        final_loss=final_loss,
        parameter_count=parameter_count,
        # Labels are the inputs shifted by one, so each row trains on CONTEXT_LENGTH - 1 targets.
        tokens_seen=step * BATCH_SIZE * CONTEXT_LENGTH,
    )
    (output_path / REPORT_FILENAME).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
