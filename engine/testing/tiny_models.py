"""A kit for building small, randomly initialised language models entirely offline.

The workbench needs real model folders (config + safetensors weights + tokenizer) for
tests and demos, but must not depend on downloading anything from a model hub. This
module makes such folders from scratch:

* :func:`local_corpus` gathers deterministic English text from the docstrings of the
  Python standard library (and the prose of the language reference bundled with it),
* :func:`build_tokenizer` trains a byte-level BPE or WordPiece tokenizer on that text,
* :func:`build_tiny_model` builds a model of one of :data:`FAMILIES` at one of
  :data:`SIZES` and saves it the way ``transformers`` expects to load it.

Importing this module is cheap: ``torch``, ``transformers`` and ``tokenizers`` are only
imported inside the functions that need them, so Django can import it at start-up.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.inspection import DEFAULT_ARCHITECTURES

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

FAMILIES: tuple[str, ...] = (
    "gpt2",
    "gpt_neo",
    "gptj",
    "llama",
    "mistral",
    "qwen2",
    "gpt_neox",
    "falcon",
    "bloom",
    "bert",
)
SIZES: tuple[str, ...] = ("tiny", "small", "gpt2-small")

# The single special token of the causal-LM tokenizer; it doubles as bos, eos, pad and unk,
# as in GPT-2.
END_OF_TEXT = "<|endoftext|>"
_BERT_UNKNOWN = "[UNK]"
BERT_SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", _BERT_UNKNOWN, "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_KINDS: tuple[str, ...] = ("bpe", "qwen2", "wordpiece")

# Qwen2's pre-tokenizer split (letters, single digits, punctuation runs, newlines). In
# transformers 5, AutoTokenizer ignores tokenizer_config.json's class for model_type "qwen2"
# and always builds Qwen2Tokenizer, which re-creates this split around the saved vocabulary;
# a tokenizer trained with the GPT-2 split would then tokenize differently after reloading.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# A fixed list (not ``sys.stdlib_module_names``, which differs between platforms) of
# pure-Python standard-library modules with substantial docstrings. Modules deprecated by
# PEP 594 are left out: they warn on import and are gone from newer Pythons.
_CORPUS_MODULES: tuple[str, ...] = tuple(
    sorted(
        {
            "abc",
            "argparse",
            "ast",
            "asyncio.base_events",
            "asyncio.events",
            "asyncio.futures",
            "asyncio.locks",
            "asyncio.queues",
            "asyncio.streams",
            "asyncio.tasks",
            "base64",
            "bdb",
            "bisect",
            "calendar",
            "cmd",
            "code",
            "codecs",
            "codeop",
            "collections",
            "collections.abc",
            "colorsys",
            "compileall",
            "concurrent.futures",
            "configparser",
            "contextlib",
            "copy",
            "copyreg",
            "csv",
            "dataclasses",
            "datetime",
            "decimal",
            "difflib",
            "dis",
            "doctest",
            "email.message",
            "email.parser",
            "email.utils",
            "enum",
            "filecmp",
            "fileinput",
            "fnmatch",
            "fractions",
            "ftplib",
            "functools",
            "getopt",
            "gettext",
            "glob",
            "graphlib",
            "gzip",
            "hashlib",
            "heapq",
            "hmac",
            "html",
            "html.parser",
            "http.client",
            "http.cookiejar",
            "http.server",
            "imaplib",
            "importlib",
            "importlib.resources",
            "importlib.util",
            "inspect",
            "ipaddress",
            "json",
            "json.decoder",
            "json.encoder",
            "keyword",
            "linecache",
            "locale",
            "logging",
            "logging.handlers",
            "lzma",
            "mailbox",
            "mimetypes",
            "modulefinder",
            "multiprocessing.pool",
            "multiprocessing.process",
            "netrc",
            "numbers",
            "operator",
            "optparse",
            "pathlib",
            "pdb",
            "pickle",
            "pickletools",
            "pkgutil",
            "platform",
            "plistlib",
            "poplib",
            "pprint",
            "profile",
            "pstats",
            "py_compile",
            "pyclbr",
            "pydoc",
            "queue",
            "quopri",
            "random",
            "re",
            "reprlib",
            "rlcompleter",
            "runpy",
            "sched",
            "secrets",
            "selectors",
            "shelve",
            "shlex",
            "shutil",
            "smtplib",
            "socketserver",
            "sqlite3",
            "statistics",
            "string",
            "subprocess",
            "symtable",
            "sysconfig",
            "tabnanny",
            "tarfile",
            "tempfile",
            "textwrap",
            "threading",
            "timeit",
            "tokenize",
            "trace",
            "traceback",
            "tracemalloc",
            "types",
            "typing",
            "unittest.case",
            "unittest.mock",
            "urllib.parse",
            "urllib.request",
            "uuid",
            "warnings",
            "wave",
            "weakref",
            "webbrowser",
            "wsgiref.handlers",
            "xml.dom.minidom",
            "xml.etree.ElementTree",
            "xml.sax",
            "xmlrpc.client",
            "zipapp",
            "zipfile",
            "zipimport",
            "zoneinfo",
        }
    )
)

_MIN_PARAGRAPH_CHARS = 40
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_UNDERLINE = re.compile(r"^[*=\-~^]{3,}$")


def _docstring_paragraphs(doc: str) -> list[str]:
    """Split a docstring into prose paragraphs, dropping code samples and headings.

    Indented blocks are code, grammar rules or tables in both docstrings and the language
    reference; collapsing their whitespace would turn them into noise, so they are skipped.
    """
    paragraphs = []
    for block in _PARAGRAPH_BREAK.split(doc):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or lines[0][:1].isspace() or lines[0].lstrip().startswith(">>>"):
            continue
        lines = [line for line in lines if not _UNDERLINE.match(line.strip())]
        text = " ".join(" ".join(lines).split())
        if len(text) >= _MIN_PARAGRAPH_CHARS:
            paragraphs.append(text)
    return paragraphs


def _documented_objects(module: Any) -> list[Any]:
    """The module itself, its public classes and functions, and their public methods."""
    objects: list[Any] = [module]
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        member = vars(module)[name]
        is_own = getattr(member, "__module__", None) == module.__name__
        if not is_own or not (inspect.isclass(member) or inspect.isroutine(member)):
            continue
        objects.append(member)
        if inspect.isclass(member):
            objects.extend(
                method
                for method_name, method in sorted(vars(member).items())
                if not method_name.startswith("_") and inspect.isfunction(method)
            )
    return objects


@functools.lru_cache(maxsize=1)
def _full_corpus() -> tuple[str, ...]:
    """Every paragraph of the local corpus, in a fixed order, without duplicates."""
    seen: set[str] = set()
    paragraphs: list[str] = []

    def add(doc: str | None) -> None:
        for paragraph in _docstring_paragraphs(doc or ""):
            if paragraph not in seen:
                seen.add(paragraph)
                paragraphs.append(paragraph)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in _CORPUS_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # e.g. sqlite3 on a Python built without it
                continue
            for documented in _documented_objects(module):
                add(inspect.getdoc(documented))
        try:
            # The language reference's topics are what `help("if")` shows: plain prose that
            # ships with every CPython, which roughly doubles the corpus.
            from pydoc_data.topics import topics
        except ImportError:
            topics = {}
        for topic in sorted(topics):
            add(topics[topic])
    return tuple(paragraphs)


def local_corpus(max_chars: int | None = None) -> list[str]:
    """Deterministic English-ish text gathered locally, as a list of paragraphs.

    The text is the docstrings of a fixed, sorted list of standard-library modules (module,
    public classes, functions and methods) followed by the prose of the language reference
    in ``pydoc_data``. Paragraphs are whitespace-collapsed; short ones, code samples and
    duplicates are dropped. The output is identical on every call and on every machine with
    the same Python version. ``max_chars`` caps the total length: whole paragraphs are
    kept while they fit.
    """
    paragraphs = _full_corpus()
    if max_chars is None:
        return list(paragraphs)
    selected: list[str] = []
    total = 0
    for paragraph in paragraphs:
        if total + len(paragraph) > max_chars:
            break
        selected.append(paragraph)
        total += len(paragraph)
    return selected


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
    kinds = {"bert": "wordpiece", "qwen2": "qwen2"}
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
    model.eval()

    output_path = Path(output_dir)
    output_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_path)  # safetensors is the default (and only) format in v5
    tokenizer.save_pretrained(output_path)
    return output_path
