"""The training defaults a researcher would pick when a request does not say: sizes, k, tokens,
the dead-feature window and Matryoshka's nested widths. Torch-free (the web fills requests in)."""

from __future__ import annotations

# What a researcher picks today: TopK, 16x, k 64 on a research-scale model.
DEFAULT_ARCHITECTURE = "topk"


# --- the defaults of a training that does not say ------------------------------------------------


K_BOUNDS = (16, 128)
K_DIVISOR = 24  # from a cache
LIVE_K_DIVISOR = 12  # from the model, at research scale


def default_k(d_in: int) -> int:
    """Active features per token unless asked: d_in / 24, from 16 to 128 (32 for GPT-2 small's 768,
    as OpenAI's TopK SAEs; 16 for the 128-wide demo model, where 32 left features firing on 40 %
    of tokens and 5 or 8 left most features dead: bench/sae_demo.py --product-defaults)."""
    return max(K_BOUNDS[0], min(K_BOUNDS[1], round(d_in / K_DIVISOR)))


def k_rule(*, live: bool) -> str:
    """The rule of :func:`default_k` (``live``: :func:`default_live_k`) in words, for a form's hint:
    read from here, so that a hint never disagrees with the default."""
    return f"d_in ÷ {LIVE_K_DIVISOR if live else K_DIVISOR}, {K_BOUNDS[0]} to {K_BOUNDS[1]}"


DEFAULT_EXPANSION = 8
# A default dictionary is no larger than gives each feature this many distinct training tokens:
# on the demo cache (about 58,000 tokens, d_in 128) 1,024 features left 29 % dead on held-out
# tokens (57-74 % on a less trained demo model, whatever k, lr or AuxK's weight), 512 left 9 % at
# explained variance 0.90 (docs/benchmarks.md).
MIN_TOKENS_PER_FEATURE = 100


def default_expansion(d_in: int, training_tokens: int) -> int:
    """d_sae / d_in unless asked: 8, or on a cache too small for that the largest power of two
    whose features each have :data:`MIN_TOKENS_PER_FEATURE` training tokens (at least 1). A
    research-scale cache (GPT-2 small: 620,000 tokens or more) keeps 8."""
    expansion = DEFAULT_EXPANSION
    while expansion > 1 and training_tokens < MIN_TOKENS_PER_FEATURE * expansion * d_in:
        expansion //= 2
    return expansion


# Training from the model: what a researcher picks at research scale. 16x and k = d_in/12
# (64 for GPT-2 small's 768, 128 at most; 16 at least); enough tokens that each feature sees
# LIVE_TOKENS_PER_FEATURE of them (GPT-2 small 16x: 49M tokens), within the bounds below.
DEFAULT_LIVE_EXPANSION = 16
LIVE_TOKENS_PER_FEATURE = 4000
LIVE_TOKENS_BOUNDS = (1_000_000, 2_000_000_000)


def default_live_k(d_in: int) -> int:
    return max(K_BOUNDS[0], min(K_BOUNDS[1], round(d_in / LIVE_K_DIVISOR)))


def default_live_tokens(d_sae: int) -> int:
    low, high = LIVE_TOKENS_BOUNDS
    return max(low, min(high, LIVE_TOKENS_PER_FEATURE * d_sae))


# A default training runs at least this many steps (several passes over a small cache): one pass
# over the demo cache was 15 steps, explained variance 0.48 with k 32 and 0.30 with k 16; 425
# steps reached 0.92 with k 16.
MIN_DEFAULT_STEPS = 512


def default_total_tokens(available: int, batch_size: int) -> int:
    """Tokens a training sees unless asked: one pass over the ``available`` ones, or
    :data:`MIN_DEFAULT_STEPS` batches when that is more (the data reshuffled each pass)."""
    return max(available, MIN_DEFAULT_STEPS * batch_size)


def default_dead_after_steps(total_steps: int) -> int:
    """Steps without firing after which a feature counts as dead (and AuxK revives it): a tenth of
    the run, at most 1,000 (SAELens' window). A fixed 1,000 was longer than a demo-scale run, so
    AuxK never engaged."""
    return max(1, min(1000, total_steps // 10))


def matryoshka_widths(d_sae: int, widths: list[int] | tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The nested dictionary sizes of a Matryoshka SAE, ending at ``d_sae``: the given ones, or
    d_sae / 16, / 4 and the whole (the first prefix learns the most general features)."""
    if widths:
        found = tuple(sorted({int(width) for width in widths}))
        if found[0] < 1 or found[-1] > d_sae:
            raise ValueError(f"Matryoshka widths must lie in 1..{d_sae}")
        return found if found[-1] == d_sae else (*found, d_sae)
    return tuple(sorted({max(1, d_sae // 16), max(1, d_sae // 4), d_sae}))
