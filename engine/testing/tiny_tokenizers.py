"""Byte-level BPE and WordPiece tokenizers trained locally and reproducibly on the local corpus."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from engine.testing.corpus import _full_corpus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# The single special token of the causal-LM tokenizer; it doubles as bos, eos, pad and unk,
# as in GPT-2.
END_OF_TEXT = "<|endoftext|>"
_BERT_UNKNOWN = "[UNK]"
BERT_SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", _BERT_UNKNOWN, "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_KINDS: tuple[str, ...] = ("bpe", "qwen2", "wordpiece", "gemma")
# Gemma's special tokens, in Gemma's id order; its tokenizer adds <bos> to every sequence.
GEMMA_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
_GEMMA_BYTE_TOKENS = 256

# Qwen2's pre-tokenizer split (letters, single digits, punctuation runs, newlines). In
# transformers 5, AutoTokenizer ignores tokenizer_config.json's class for model_type "qwen2"
# and always builds Qwen2Tokenizer, which re-creates this split around the saved vocabulary;
# a tokenizer trained with the GPT-2 split would then tokenize differently after reloading.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Characters that continue a word are moved into the supplementary private-use planes
# while the WordPiece vocabulary is learned; see _train_wordpiece.
_CONTINUATION_OFFSET = 0xF0000
_MAX_MAPPABLE_CHAR = 0x10FFFF - _CONTINUATION_OFFSET


def _train_wordpiece(vocab_size: int, corpus: tuple[str, ...] | list[str]) -> Any:
    """Learn a BERT-style WordPiece tokenizer reproducibly.

    ``tokenizers``' own WordPieceTrainer is not reproducible across processes: it numbers
    the ``##x`` continuation pieces in Rust HashMap order, and merge ties are broken by
    those numbers, so both ids and (occasionally) the learned pieces change between runs.
    The plain BPE trainer is reproducible when every symbol is in its sorted alphabet, so
    the vocabulary is learned with it instead: each non-initial character of a word is
    shifted into the private-use planes, which makes "continuation" part of the symbol
    itself; learned pieces are then mapped back to ``piece`` / ``##piece`` form.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()

    def marked_words(paragraph: str) -> str:
        words = [word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(paragraph))]
        return " ".join(
            word[0] + "".join(chr(_CONTINUATION_OFFSET + ord(char)) for char in word[1:])
            for word in words
            if all(ord(char) <= _MAX_MAPPABLE_CHAR for char in word)
        )

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(BERT_SPECIAL_TOKENS), min_frequency=2, show_progress=False
    )
    learner.train_from_iterator((marked_words(paragraph) for paragraph in corpus), trainer)

    def unmarked(piece: str) -> str:
        if piece in BERT_SPECIAL_TOKENS:
            return piece
        plain = "".join(chr(ord(char) % _CONTINUATION_OFFSET) for char in piece)
        # A piece is either word-initial (a plain first character) or all continuation.
        return plain if ord(piece[0]) < _CONTINUATION_OFFSET else "##" + plain

    learned = learner.get_vocab()
    vocab = {unmarked(piece): token_id for piece, token_id in learned.items()}
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token=_BERT_UNKNOWN))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(list(BERT_SPECIAL_TOKENS))
    return tokenizer


def _train_gemma(vocab_size: int, corpus: tuple[str, ...] | list[str]) -> Any:
    """Learn a Gemma-style BPE: spaces become "▁", no pre-tokenization, and byte fallback, so
    the 256 ``<0xNN>`` byte tokens close the vocabulary.

    transformers 5 rebuilds ``GemmaTokenizer``'s pipeline around the saved vocabulary and merges
    whatever tokenizer.json says, so the tokenizer is built as that class from the start. Merges
    are learned within words (split before each "▁"), so they never cross one; applied to
    whole texts they tokenize as Gemma's own pipeline does.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE(byte_fallback=True, unk_token=GEMMA_SPECIAL_TOKENS[3], fuse_unk=True))
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - _GEMMA_BYTE_TOKENS,
        special_tokens=list(GEMMA_SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
    )
    learner.train_from_iterator(corpus, trainer)
    return learner


def _train_tokenizer_json(kind: str, vocab_size: int, corpus: tuple[str, ...] | list[str]) -> str:
    """Train a ``tokenizers`` tokenizer and return it serialised, so callers get fresh copies."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    if kind == "wordpiece":
        tokenizer = _train_wordpiece(vocab_size, corpus)
        # Positional arguments: the binding takes (sep, cls) and rejects keywords.
        tokenizer.post_processor = processors.BertProcessing(
            ("[SEP]", tokenizer.token_to_id("[SEP]")),
            ("[CLS]", tokenizer.token_to_id("[CLS]")),
        )
        return tokenizer.to_str()

    if kind == "gemma":
        return _train_gemma(vocab_size, corpus).to_str()

    tokenizer = Tokenizer(models.BPE())
    if kind == "bpe":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind == "qwen2":
        # Exactly the pipeline Qwen2Tokenizer rebuilds around a saved vocab and merges.
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"Unknown tokenizer kind {kind!r}; expected one of {', '.join(TOKENIZER_KINDS)}.")
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        # Every byte must be in the vocabulary, or unseen characters could not be encoded; a
        # complete, sorted alphabet is also what makes the trainer reproducible.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer.to_str()


@functools.lru_cache(maxsize=8)
def _cached_tokenizer_json(kind: str, vocab_size: int) -> str:
    """Tokenizer training on the default corpus, done once per process per (kind, size)."""
    return _train_tokenizer_json(kind, vocab_size, _full_corpus())


def build_tokenizer(
    *,
    kind: str = "bpe",
    vocab_size: int = 1024,
    corpus: list[str] | None = None,
    model_max_length: int = 1024,
) -> PreTrainedTokenizerFast:
    """Train a tokenizer locally and wrap it as a ``transformers`` fast tokenizer.

    ``kind="bpe"`` gives a GPT-2 style byte-level BPE whose only special token,
    ``<|endoftext|>``, serves as bos, eos, pad and unk. ``kind="qwen2"`` is the same with
    Qwen2's normalizer and pre-tokenizer (digits split one by one), which is what a qwen2
    model folder needs to reload identically. ``kind="wordpiece"`` gives a BERT
    style lowercasing WordPiece with ``[PAD] [UNK] [CLS] [SEP] [MASK]`` that wraps
    sequences in ``[CLS] ... [SEP]``. Training is deterministic; with ``corpus=None`` it
    uses :func:`local_corpus` and is cached per process. Each call returns a new object, so
    callers may change it without affecting later calls.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"Unknown tokenizer kind {kind!r}; expected one of {', '.join(TOKENIZER_KINDS)}.")
    if vocab_size < 300:
        # Byte-level BPE needs the 256-byte alphabet plus room for merges.
        raise ValueError(f"vocab_size must be at least 300, got {vocab_size}.")
    if corpus is None:
        serialised = _cached_tokenizer_json(kind, vocab_size)
    else:
        serialised = _train_tokenizer_json(kind, vocab_size, corpus)
    if kind == "gemma":
        return _gemma_tokenizer(serialised, model_max_length)
    backend = Tokenizer.from_str(serialised)

    if kind in ("bpe", "qwen2"):
        special_tokens = {
            "bos_token": END_OF_TEXT,
            "eos_token": END_OF_TEXT,
            "pad_token": END_OF_TEXT,
            "unk_token": END_OF_TEXT,
        }
    else:
        special_tokens = {
            "pad_token": "[PAD]",
            "unk_token": _BERT_UNKNOWN,
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
        }
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=model_max_length, **special_tokens
    )


def _gemma_tokenizer(serialised: str, model_max_length: int) -> PreTrainedTokenizerFast:
    import json

    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    learned = json.loads(serialised)["model"]
    vocab = dict(learned["vocab"])
    for byte in range(_GEMMA_BYTE_TOKENS):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    pad, eos, bos, unknown, mask = GEMMA_SPECIAL_TOKENS
    return GemmaTokenizer(
        vocab=vocab,
        merges=[tuple(merge) for merge in learned["merges"]],
        model_max_length=model_max_length,
        add_bos_token=True,
        pad_token=pad,
        eos_token=eos,
        bos_token=bos,
        unk_token=unknown,
        mask_token=mask,
    )
