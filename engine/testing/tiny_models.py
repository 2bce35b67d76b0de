"""A kit for building small, randomly initialised language models entirely offline.

The workbench needs real model folders (config + safetensors weights + tokenizer) for
tests and demos, but must not depend on downloading anything from a model hub. This
module makes such folders from scratch:

* :func:`local_corpus` gathers deterministic English text from the docstrings of the
  Python standard library (and the prose of the language reference bundled with it),
* :func:`build_tokenizer` trains a byte-level BPE or WordPiece tokenizer on that text,
* :func:`build_tiny_model` builds a model of one of :data:`FAMILIES` at one of
  :data:`SIZES` and saves it the way ``transformers`` expects to load it.

The corpus lives in :mod:`engine.testing.corpus` and the tokenizers in
:mod:`engine.testing.tiny_tokenizers`; their public names are importable from here too.

Importing this module is cheap: ``torch``, ``transformers`` and ``tokenizers`` are only
imported inside the functions that need them, so Django can import it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.inspection import DEFAULT_ARCHITECTURES
from engine.testing.corpus import local_corpus
from engine.testing.tiny_tokenizers import BERT_SPECIAL_TOKENS, END_OF_TEXT, TOKENIZER_KINDS, build_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

FAMILIES: tuple[str, ...] = (
    "gpt2",
    "gpt_neo",
    "gptj",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt_neox",
    "falcon",
    "bloom",
    "bert",
)
SIZES: tuple[str, ...] = ("tiny", "small", "gpt2-small")


# Geometry per size. "gpt2-small" is GPT-2 small exactly (124,439,808 parameters for gpt2);
# its vocabulary is GPT-2's even though the local tokenizer is smaller, so that parameter
# counts and memory use match the real model.
@dataclass(frozen=True)
class _Geometry:
    hidden: int
    layers: int
    heads: int
    # Key/value heads for the GQA families (llama, mistral, qwen2).
    kv_heads: int
    intermediate: int
    positions: int
    tokenizer_vocab: int
    # The model's vocabulary; None means the tokenizer's size.
    vocab: int | None = None


_GEOMETRIES: dict[str, _Geometry] = {
    "tiny": _Geometry(
        hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256, positions=128, tokenizer_vocab=1024
    ),
    "small": _Geometry(
        hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024, positions=256, tokenizer_vocab=4096
    ),
    "gpt2-small": _Geometry(
        hidden=768,
        layers=12,
        heads=12,
        kv_heads=4,
        intermediate=3072,
        positions=1024,
        tokenizer_vocab=4096,
        vocab=50257,
    ),
}


def _check_family_and_size(family: str, size: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"Unknown model family {family!r}; expected one of {', '.join(FAMILIES)}.")
    if size not in SIZES:
        raise ValueError(f"Unknown model size {size!r}; expected one of {', '.join(SIZES)}.")


def default_tokenizer(family: str, size: str = "tiny") -> PreTrainedTokenizerFast:
    """The locally trained tokenizer that :func:`build_tiny_model` uses when given none."""
    _check_family_and_size(family, size)
    geometry = _GEOMETRIES[size]
    kinds = {
        "bert": "wordpiece",
        "qwen2": "qwen2",
        "qwen3": "qwen2",
        "gemma": "gemma",
        "gemma2": "gemma",
        "gemma3_text": "gemma",
    }
    return build_tokenizer(
        kind=kinds.get(family, "bpe"),
        vocab_size=geometry.tokenizer_vocab,
        model_max_length=geometry.positions,
    )


def build_config(family: str, *, size: str = "tiny", tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The ``transformers`` config :func:`build_tiny_model` uses for ``family`` at ``size``.

    Exposed separately so that callers can inspect a geometry (or instantiate it on the
    meta device) without paying for weight initialisation.
    """
    import transformers

    _check_family_and_size(family, size)
    geometry = _GEOMETRIES[size]
    hidden, layers, heads = geometry.hidden, geometry.layers, geometry.heads
    intermediate, positions = geometry.intermediate, geometry.positions
    vocab = geometry.vocab or len(tokenizer)
    head_dim = hidden // heads
    # BERT's tokenizer has no bos/eos; [CLS] and [SEP] play those roles.
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    special_ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": bos_id, "eos_token_id": eos_id}
    # Families that use rotary embeddings with GQA: fewer key/value heads than query heads.
    rotary_gqa = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": geometry.kv_heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": positions,
    }

    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=positions,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=intermediate,
            **special_ids,
        )
    if family == "gpt_neo":
        if layers % 2:
            raise ValueError(
                "gpt_neo alternates global and local attention, so it needs an even layer count."
            )
        return transformers.GPTNeoConfig(
            vocab_size=vocab,
            max_position_embeddings=positions,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            intermediate_size=intermediate,
            # Alternate global and local (sliding-window) attention like the released models.
            attention_types=[[["global", "local"], layers // 2]],
            window_size=min(256, positions // 2),
            **special_ids,
        )
    if family == "gptj":
        return transformers.GPTJConfig(
            vocab_size=vocab,
            n_positions=positions,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=intermediate,
            # Partial rotary embeddings (only part of each head is rotated), as in GPT-J-6B.
            rotary_dim=head_dim // 2,
            **special_ids,
        )
    if family == "llama":
        return transformers.LlamaConfig(**rotary_gqa, **special_ids)
    if family == "mistral":
        # A window shorter than the context, so the sliding-window mask is really used.
        return transformers.MistralConfig(**rotary_gqa, sliding_window=positions // 2, **special_ids)
    if family == "qwen2":
        return transformers.Qwen2Config(**rotary_gqa, **special_ids)
    if family == "qwen3":
        # Qwen3's default head_dim (128) is not hidden / heads; q/k RMSNorms sit inside attention.
        return transformers.Qwen3Config(**rotary_gqa, head_dim=head_dim, **special_ids)
    if family in _GEMMA_CONFIGS:
        return _gemma_config(family, rotary_gqa, head_dim, special_ids)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=intermediate,
            max_position_embeddings=positions,
            **special_ids,
        )
    if family == "falcon":
        # The original (Falcon-7B) layout: parallel attention + MLP, multi-query attention,
        # rotary rather than ALiBi positions.
        return transformers.FalconConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            ffn_hidden_size=intermediate,
            max_position_embeddings=positions,
            new_decoder_architecture=False,
            multi_query=True,
            parallel_attn=True,
            alibi=False,
            bias=False,
            **special_ids,
        )
    if family == "bloom":
        # BLOOM's MLP is fixed at 4 * hidden and it has ALiBi rather than position embeddings.
        return transformers.BloomConfig(
            vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads, **special_ids
        )
    # bert
    return transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=positions,
        **special_ids,
    )


# Gemma families: their config class and what sets each apart. Gemma 2 and 3 mix sliding-window
# and full attention with a window shorter than the test sequences; Gemma 2 soft-caps attention
# scores and final logits, with caps small enough to bend a random model's values.
_GEMMA_CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "gemma": ("GemmaConfig", {}),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 0.25,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}
# Families whose norm weights start at an identity (0 for Gemma's (1 + w) RMSNorm, 1 for Qwen3's
# q/k norms): they are drawn at random so that a wrong norm formula cannot pass unseen.
_RANDOM_NORM_FAMILIES: frozenset[str] = frozenset({"qwen3", "gemma", "gemma2", "gemma3_text"})
_RANDOM_NORM_STD = 0.3


def _gemma_config(
    family: str, rotary_gqa: dict[str, int], head_dim: int, special_ids: dict[str, object]
) -> PretrainedConfig:
    import transformers

    class_name, extras = _GEMMA_CONFIGS[family]
    layers = rotary_gqa["num_hidden_layers"]
    if "layer_types" in extras:
        pattern = extras["layer_types"]
        extras = {**extras, "layer_types": [pattern[layer % len(pattern)] for layer in range(layers)]}
    if family != "gemma":
        extras = {**extras, "query_pre_attn_scalar": head_dim}
    return getattr(transformers, class_name)(
        **rotary_gqa,
        head_dim=head_dim,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        **extras,
        **special_ids,
    )


def _randomize_norms(model: object) -> None:
    """Draw every norm weight of ``model`` around its initial value (seeded by the caller)."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2] and parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter) * _RANDOM_NORM_STD)


def model_class(family: str) -> type:
    """The ``transformers`` model class :func:`build_tiny_model` instantiates for ``family``."""
    import transformers

    _check_family_and_size(family, "tiny")
    return getattr(transformers, DEFAULT_ARCHITECTURES[family])


def build_tiny_model(
    family: str,
    output_dir: str | Path,
    *,
    size: str = "tiny",
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Build a randomly initialised ``family`` model at ``size`` and save it to ``output_dir``.

    The weights depend only on ``seed`` (and the library versions): the global torch RNG is
    seeded right before construction. The folder gets ``config.json`` (with
    ``architectures``), ``model.safetensors`` and the tokenizer files, so it loads with
    ``AutoModelForCausalLM`` (or ``AutoModel`` for bert) and ``AutoTokenizer``. When no
    tokenizer is given, the locally trained one from :func:`default_tokenizer` is used.
    Raises ``ValueError`` for an unknown family or size.
    """
    import torch

    _check_family_and_size(family, size)
    if tokenizer is None:
        tokenizer = default_tokenizer(family, size)
    config = build_config(family, size=size, tokenizer=tokenizer)

    torch.manual_seed(seed)
    model = model_class(family)(config)
    if family in _RANDOM_NORM_FAMILIES:
        _randomize_norms(model)
    model.eval()

    output_path = Path(output_dir)
    output_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_path)  # safetensors is the default (and only) format in v5
    tokenizer.save_pretrained(output_path)
    return output_path


__all__ = [
    "BERT_SPECIAL_TOKENS",
    "END_OF_TEXT",
    "FAMILIES",
    "SIZES",
    "TOKENIZER_KINDS",
    "build_config",
    "build_tiny_model",
    "build_tokenizer",
    "default_tokenizer",
    "local_corpus",
    "model_class",
]
