"""Peak memory of the work a worker does, estimated from its sizes before anything is allocated.

Every job and worker request states its estimate (:class:`MemoryEstimate`) before it is queued;
the web refuses one over the worker's budget, and the worker checks its free memory again before
it starts (``mistudio.budgets``). Plain arithmetic, no torch: the web process imports it.

The factors are measured, not guessed: ``bench/memory_budgets.py`` runs each kind of work in a
fresh process and compares its peak resident memory with these estimates (each an upper bound;
engine/tests/test_budgets.py keeps them so for SAE training, the largest).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sae_architectures import architecture_named

FLOAT = 4  # bytes of a float32
GiB = 2**30
# Torch's own allocations and thread stacks the first time work of a kind runs in a process.
RUNTIME_BYTES = 256 * 2**20
# Parameters, gradients and Adam's two moments (4 copies), plus a checkpoint's copy of
# parameters and moments (3 more) while it is written.
TRAINING_PARAMETER_COPIES = 7
# [rows, d_sae] tensors alive while rows are encoded (pre-activations, activations, a mask).
ENCODING_TENSORS = 3
# Bytes per feature of a feature analysis's state (top and interval examples with their context
# windows, histogram, sums; engine.features.analysis.AnalysisState for its default config), twice:
# the state and the arrays built from it at the end.
ANALYSIS_BYTES_PER_FEATURE = 2 * 2_900
# Rows of W_dec a feature analysis multiplies at once (logit effects, decoder neighbours).
ANALYSIS_DECODER_BLOCK = 1024
# Rows a mean ablation encodes at once: at most this many floats in one [rows, d_sae] tensor.
MEAN_ENCODE_FLOATS = 2**24


@dataclass(frozen=True)
class MemoryEstimate:
    """An estimated peak in bytes, as named parts (what a refusal shows the user)."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        """``"1.25 GiB (one step's [batch, d_sae] tensors 0.94 GiB, …)"``, largest part first."""
        parts = sorted(self.parts.items(), key=lambda item: -item[1])
        return f"{gib(self.total)} ({', '.join(f'{name} {gib(size)}' for name, size in parts)})"

    def as_details(self) -> dict[str, int]:
        return {name.replace(" ", "_"): size for name, size in self.parts.items()}


def gib(size: int) -> str:
    return f"{size / GiB:.2f} GiB"


def sae_parameters(d_in: int, d_sae: int) -> int:
    """W_enc, W_dec, b_enc, a threshold, b_dec."""
    return 2 * d_in * d_sae + 2 * d_sae + d_in


def sae_training(
    *,
    architecture: str,
    d_in: int,
    d_sae: int,
    batch_size: int,
    buffered_rows: int,
    sample_rows: int,
    evaluation_rows: int,
) -> MemoryEstimate:
    """An SAE's training job: its optimizer state, one step's [batch, d_sae] tensors (or, later,
    the held-out evaluation's, whichever is larger), the rows read ahead and shuffled, and for
    BatchTopK the threshold computed on ``sample_rows`` at the end."""
    kind = architecture_named(architecture)
    # [batch, d_sae] float32 tensors alive at once in one step (activations, their gradients, the
    # top-k or threshold masks): each architecture's, measured on the CPU.
    step = kind.step_tensors * batch_size * d_sae * FLOAT
    evaluation = ENCODING_TENSORS * evaluation_rows * d_sae * FLOAT
    parts = {
        "parameters, gradients, Adam state and a checkpoint": (
            TRAINING_PARAMETER_COPIES * sae_parameters(d_in, d_sae) * FLOAT
        ),
        "one step's [batch, d_sae] tensors": max(step, evaluation),
        "rows read ahead and shuffled": buffered_rows * d_in * FLOAT,
        "runtime": RUNTIME_BYTES,
    }
    if kind.batch_wide:  # its inference threshold is taken on the sample at the end
        parts["the threshold's sample, encoded"] = ENCODING_TENSORS * sample_rows * d_sae * FLOAT
    return MemoryEstimate(parts)


def sae_encoding(*, d_in: int, d_sae: int, rows: int, label: str = "rows encoded at once") -> MemoryEstimate:
    """Encoding ``rows`` rows through an SAE (live encoding of a text, an evaluation step)."""
    return MemoryEstimate(
        {
            "SAE parameters": sae_parameters(d_in, d_sae) * FLOAT,
            label: ENCODING_TENSORS * rows * d_sae * FLOAT,
            "runtime": RUNTIME_BYTES,
        }
    )


def mean_encoding_rows(d_sae: int) -> int:
    """Rows of a cache a mean ablation encodes at once (memory flat whatever the cache's size)."""
    return max(1, MEAN_ENCODE_FLOATS // max(d_sae, 1))


def mean_ablation(*, d_in: int, d_sae: int | None) -> MemoryEstimate:
    """The means a mean ablation takes from a cache: its hook's mean (read from the cache's
    statistics), or its SAE features' mean (the cache encoded a bounded chunk at a time)."""
    if d_sae is None:  # read from the cache's statistics, nothing encoded
        return MemoryEstimate({"the hook's mean": d_in * 8})
    return sae_encoding(d_in=d_in, d_sae=d_sae, rows=mean_encoding_rows(d_sae), label="one chunk encoded")


def feature_analysis(
    *, d_in: int, d_sae: int, tokens: int, chunk_rows: int, vocabulary: int
) -> MemoryEstimate:
    """A feature analysis: one chunk encoded, the per-feature state, the cache's token table, and
    the logit effects and neighbours computed a block of features at a time."""
    return MemoryEstimate(
        {
            "SAE parameters": sae_parameters(d_in, d_sae) * FLOAT,
            "one chunk encoded": ENCODING_TENSORS * chunk_rows * d_sae * FLOAT
            + 3 * chunk_rows * d_in * FLOAT,
            "per-feature examples and histograms": ANALYSIS_BYTES_PER_FEATURE * d_sae,
            "token table": 40 * tokens,
            "logit effects and neighbours, a block at a time": (
                2 * ANALYSIS_DECODER_BLOCK * max(d_sae, vocabulary) * FLOAT
            ),
            "runtime": RUNTIME_BYTES,
        }
    )


def forward_pass(*, tokens: int, hidden: int, layers: int, heads: int, longest: int) -> int:
    """Activations of one forward pass over ``tokens`` tokens in sequences of at most ``longest``:
    the residual stream and MLP at every layer (kept by hooks or autograd-free, so a few copies)
    and one layer's attention scores at a time."""
    return 16 * tokens * hidden * FLOAT + 2 * heads * tokens * longest * FLOAT


def extraction(
    *, batch_size: int, max_length: int, widths: list[int], dtype_bytes: int, hidden: int, layers: int,
    heads: int, shard_bytes: int,
) -> MemoryEstimate:  # fmt: skip
    """An extraction job: one batch's forward pass, the hooks' buffers (on the model's device and
    page-locked on the host) and the cache writer's queued shards."""
    tokens = batch_size * max_length
    return MemoryEstimate(
        {
            "one batch's forward pass": forward_pass(
                tokens=tokens, hidden=hidden, layers=layers, heads=heads, longest=max_length
            ),
            "hook buffers": 3 * tokens * sum(widths) * dtype_bytes,
            "shards being written": 3 * shard_bytes,
            "runtime": RUNTIME_BYTES,
        }
    )


def model_probe(
    *, tokens: int, longest: int, hidden: int, layers: int, heads: int, runs: int = 2
) -> MemoryEstimate:
    """Prompts through the model a few times (patching, the logit lens, a steering vector's
    batches): the forward passes' activations and the values patched or read."""
    return MemoryEstimate(
        {
            "forward passes": runs
            * forward_pass(tokens=tokens, hidden=hidden, layers=layers, heads=heads, longest=longest),
            "runtime": RUNTIME_BYTES,
        }
    )


def sae_import(*, tensor_bytes: int) -> MemoryEstimate:
    """An SAE import: its arrays read, made into the SAE and written again in our layout."""
    return MemoryEstimate({"its arrays, read and written": 3 * tensor_bytes, "runtime": RUNTIME_BYTES})


# The graph's matrices: the edge rows ([feature rows + logits, every active feature + errors +
# tokens + logits]) and the final square adjacency, plus the copies made while reordering.
ATTRIBUTION_MATRIX_COPIES = 2


def attribution_matrices(*, feature_rows: int, active: int, tokens: int, layers: int, logits: int) -> int:
    """Bytes of an attribution graph's matrices with ``feature_rows`` feature rows kept out of
    ``active`` active features (see :data:`ATTRIBUTION_MATRIX_COPIES`)."""
    columns = active + (layers + 1) * tokens + logits
    nodes = feature_rows + (layers + 1) * tokens + logits
    return ATTRIBUTION_MATRIX_COPIES * ((feature_rows + logits) * columns + nodes * nodes) * FLOAT


def attribution_feature_rows(*, limit: int, active: int, tokens: int, layers: int, logits: int) -> int:
    """The most feature rows whose matrices fit in ``limit`` bytes (at least one)."""
    low, high = 1, max(1, active)
    while low < high:  # the matrices grow with the rows: the largest count that fits
        middle = (low + high + 1) // 2
        size = attribution_matrices(
            feature_rows=middle, active=active, tokens=tokens, layers=layers, logits=logits
        )
        if size <= limit:
            low = middle
        else:
            high = middle - 1
    return low


def attribution(
    *, tokens: int, hidden: int, layers: int, heads: int, d_sae: int, batch_size: int, feature_rows: int,
    active: int, logits: int,
) -> MemoryEstimate:  # fmt: skip
    """An attribution graph: the transcoders, ``batch_size`` copies of the prompt through the model
    with gradients (its activations and their gradients), and the graph's matrices for
    ``feature_rows`` feature nodes out of ``active`` active features."""
    return MemoryEstimate(
        {
            "transcoders": layers * (sae_parameters(hidden, d_sae) + hidden * hidden) * FLOAT,
            "the batched pass and its gradients": 2
            * forward_pass(
                tokens=batch_size * tokens, hidden=hidden, layers=layers, heads=heads, longest=tokens
            ),
            "the graph's matrices": attribution_matrices(
                feature_rows=feature_rows, active=active, tokens=tokens, layers=layers, logits=logits
            ),
            "runtime": RUNTIME_BYTES,
        }
    )


# The logits one stacked SAEBench pass holds at most (three runs of a few prompts).
SAEBENCH_LOGITS_BYTES = 2 * GiB


def saebench_core(
    *, d_in: int, d_sae: int, vocab: int, prompts: int, context: int, hidden: int, layers: int, heads: int,
    saes: int = 1,
) -> MemoryEstimate:  # fmt: skip
    """SAEBench's core metrics of ``saes`` SAEs at one hook point on one batch of ``prompts`` x
    ``context`` tokens (``engine.saebench.core``): the stacked runs' logits (clean, ablated and one
    per SAE, a few prompts at a time: at most :data:`SAEBENCH_LOGITS_BYTES`, at least one prompt's),
    a prompt's log-probabilities (three at once), a forward pass of the stacked rows those logits
    allow, and every SAE's features of the batch."""
    tokens = prompts * context
    runs = saes + 2
    logits = max(runs * context * vocab * FLOAT, min(runs * tokens * vocab * FLOAT, SAEBENCH_LOGITS_BYTES))
    stacked_tokens = logits // (vocab * FLOAT)
    return MemoryEstimate(
        {
            "stacked runs' logits": logits,
            "a prompt's log-probabilities": 3 * context * vocab * FLOAT,
            "forward pass": forward_pass(
                tokens=stacked_tokens, hidden=hidden, layers=layers, heads=heads, longest=context
            ),
            "SAE features": saes * ENCODING_TENSORS * tokens * d_sae * FLOAT,
            "SAE parameters": saes * sae_parameters(d_in, d_sae) * FLOAT,
            "runtime": RUNTIME_BYTES,
        }
    )


def sparse_probing(*, d_in: int, d_sae: int, texts: int, context: int, hidden: int, layers: int, heads: int,
                   batch: int) -> MemoryEstimate:  # fmt: skip
    """Sparse probing over ``texts`` texts of at most ``context`` tokens: each text's mean model
    activation and mean SAE features kept (the probes read them), one batch's forward pass and
    features at a time."""
    return MemoryEstimate(
        {
            "mean activations and features": texts * (d_in + d_sae) * FLOAT,
            "one batch's features": ENCODING_TENSORS * batch * context * d_sae * FLOAT,
            "forward pass": forward_pass(
                tokens=batch * context, hidden=hidden, layers=layers, heads=heads, longest=context
            ),
            "SAE parameters": sae_parameters(d_in, d_sae) * FLOAT,
            "runtime": RUNTIME_BYTES,
        }
    )


def absorption(*, d_in: int, d_sae: int, words: int, context: int, hidden: int, layers: int, heads: int,
               batch: int) -> MemoryEstimate:  # fmt: skip
    """Feature absorption over ``words`` prompts of ``context`` tokens: each prompt's activation at
    the word kept, the training words' SAE features (the L1 probe reads them every epoch), the
    probe with its gradient and Adam's two moments, one batch's forward pass at a time."""
    return MemoryEstimate(
        {
            "word activations": words * d_in * FLOAT,
            "training words' features": words * d_sae * FLOAT,
            "L1 probe and optimiser": 4 * 26 * d_sae * FLOAT,
            "forward pass": forward_pass(
                tokens=batch * context, hidden=hidden, layers=layers, heads=heads, longest=context
            ),
            "SAE parameters": sae_parameters(d_in, d_sae) * FLOAT,
            "runtime": RUNTIME_BYTES,
        }
    )
