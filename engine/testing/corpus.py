"""A deterministic English corpus gathered offline from the standard library's docstrings."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings
from typing import Any

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


def first_word_classes(length: int = 400) -> list[tuple[str, str]]:
    """(paragraph, label) of :func:`local_corpus`' paragraphs (their first ``length`` characters)
    that mention one of "the", "a", "is": the label is the one mentioned first. Three classes a
    probe can partly tell apart, for sparse-probing tests."""
    pairs = []
    for text in local_corpus():
        lowered = text.lower()
        found = [(lowered.find(word), word) for word in ("the", "a", "is") if f" {word} " in lowered]
        if found:
            pairs.append((text[:length], min(found)[1]))
    return pairs


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


# Standard-library modules grouped by what they are about: a labelled corpus (a paragraph's topic
# is its module's), the demo's dataset for sparse probing.
TOPICS: dict[str, tuple[str, ...]] = {
    "networking": (
        "ftplib", "http.client", "http.cookiejar", "http.server", "imaplib", "poplib", "smtplib",
        "socketserver", "urllib.parse", "urllib.request", "mailbox", "email.message", "email.parser",
        "email.utils", "ipaddress",
    ),
    "concurrency": (
        "asyncio.base_events", "asyncio.events", "asyncio.futures", "asyncio.locks", "asyncio.queues",
        "asyncio.streams", "asyncio.tasks", "concurrent.futures", "threading", "queue",
        "multiprocessing.pool", "multiprocessing.process", "sched", "selectors", "subprocess",
    ),
    "files": (
        "pathlib", "shutil", "tempfile", "tarfile", "gzip", "lzma", "fileinput", "filecmp", "fnmatch",
        "glob", "shelve", "zipfile", "mimetypes", "netrc", "plistlib",
    ),
    "text": (
        "re", "string", "textwrap", "difflib", "csv", "codecs", "html", "html.parser", "json",
        "json.decoder", "json.encoder", "shlex", "pprint", "quopri", "base64",
    ),
    "numbers": (
        "decimal", "fractions", "statistics", "random", "numbers", "bisect", "heapq", "colorsys",
        "datetime", "calendar", "operator", "secrets", "uuid", "hashlib", "hmac",
    ),
}  # fmt: skip


@functools.lru_cache(maxsize=1)
def topic_corpus() -> tuple[tuple[str, str], ...]:
    """(paragraph, topic) of every docstring paragraph of :data:`TOPICS`' modules, in a fixed
    order; a paragraph found under two topics is kept once, under the first."""
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for topic, modules in TOPICS.items():
            for module_name in modules:
                try:
                    module = importlib.import_module(module_name)
                except ImportError:
                    continue
                for documented in _documented_objects(module):
                    for paragraph in _docstring_paragraphs(inspect.getdoc(documented) or ""):
                        if paragraph not in seen:
                            seen.add(paragraph)
                            pairs.append((paragraph, topic))
    return tuple(pairs)
