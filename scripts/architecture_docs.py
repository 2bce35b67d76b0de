"""The parts of docs/architecture.md that are facts about the tree, generated from the tree.

Hand-written maps drift: the page once said two modules were over 500 lines where a dozen were, and
its engine map missed nine modules. So the engine's module map (each module's docstring summary)
and the list of long modules (their line counts) are written between marker comments by this
script: ``--write`` brings the page up to date, ``--check`` (run by .ci/run) fails with a diff when
it is stale. Everything outside the markers is prose and is left as it is, but the repository paths
it names in code spans must exist: a module split or renamed leaves a sentence pointing nowhere.

A generated part is ``<!-- generated: NAME; ... -->`` then the text, then ``<!-- end generated -->``,
where NAME is one of ``SECTIONS``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = Path("docs/architecture.md")

# Every top-level folder of project code (the apps, the engine, the client, benchmarks, scripts).
CODE_ROOTS = (
    "activations",
    "bench",
    "circuits",
    "client",
    "engine",
    "features",
    "frontend",
    "generation",
    "mistudio",
    "models_app",
    "saes",
    "scripts",
    "steering",
)
TEST_DIRS = frozenset({"tests"})
NEVER_READ = frozenset({"__pycache__", "migrations", "build"})
LONG_MODULE_LINES = 500
MAP_WIDTH = 108
MAP_NAME_COLUMN = 28

MARKER = re.compile(
    r"(?P<open><!-- generated: (?P<name>[^;>]+?)(?:;[^>]*)? -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- end generated -->)",
    re.DOTALL,
)
FENCED_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`([^`]+)`")
# The end of a docstring's first sentence: a full stop (or ! ?) before a capital, a quote or a bracket.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\"'])")


def python_modules(root: Path, folders: tuple[str, ...], *, with_tests: bool) -> Iterator[Path]:
    """The project's Python files under ``folders``, sorted; generated migrations are never code."""
    skipped = NEVER_READ if with_tests else NEVER_READ | TEST_DIRS
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if skipped.isdisjoint(path.relative_to(root).parts[:-1]):
                yield path


def docstring_summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line ("(no docstring)" to make it show).

    A folder of modules without an ``__init__.py`` is a package without a docstring.
    """
    source = path.read_text(encoding="utf-8") if path.exists() else ""
    docstring = ast.get_docstring(ast.parse(source)) or ""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    return SENTENCE_END.split(paragraph, maxsplit=1)[0] or "(no docstring)"


def _map_entry(name: str, depth: int, summary: str) -> list[str]:
    """One module or package of the map, its summary wrapped beside the name column."""
    label = "  " * depth + name
    indent = " " * MAP_NAME_COLUMN
    first = label.ljust(MAP_NAME_COLUMN - 1) + " "
    return textwrap.wrap(
        summary, MAP_WIDTH, initial_indent=first, subsequent_indent=indent, break_on_hyphens=False
    )


def _package_lines(package: Path, depth: int) -> list[str]:
    """A package's entry, then its modules and sub-packages (tests left out), one level deeper."""
    lines = _map_entry(package.name + "/", depth, docstring_summary(package / "__init__.py"))
    for child in sorted(package.iterdir()):
        if child.is_dir() and child.name not in TEST_DIRS | NEVER_READ and any(child.rglob("*.py")):
            lines += _package_lines(child, depth + 1)
        elif child.suffix == ".py" and child.name != "__init__.py":
            lines += _map_entry(child.name, depth + 1, docstring_summary(child))
    return lines


def module_map(root: Path) -> str:
    """The engine's modules and packages, each with its docstring's first sentence."""
    return "```\n" + "\n".join(_package_lines(root / "engine", 0)) + "\n```\n"


def long_modules(root: Path) -> str:
    """The non-test modules over ``LONG_MODULE_LINES`` lines, longest first, each with its size in
    hundreds of lines ("600+"): an edit of a few lines leaves the page current."""
    counts = [
        (len(path.read_text(encoding="utf-8").splitlines()) // 100 * 100, path.relative_to(root).as_posix())
        for path in python_modules(root, CODE_ROOTS, with_tests=False)
    ]
    long = sorted(((-lines, name) for lines, name in counts if lines >= LONG_MODULE_LINES))
    if not long:
        return f"No module is over {LONG_MODULE_LINES} lines.\n"
    rows = "\n".join(f"{name:<40} {-lines:>4}+" for lines, name in long)
    heading = f"{len(long)} modules of {LONG_MODULE_LINES} lines or more (tests and migrations left out):"
    return f"{heading}\n\n```\n{rows}\n```\n"


@dataclass(frozen=True)
class Section:
    """One generated part of the page: the name its markers carry and how its text is made."""

    name: str
    render: Callable[[Path], str]


SECTIONS = (Section("module map", module_map), Section("long modules", long_modules))


def regenerate(text: str, root: Path) -> str:
    """``text`` with every generated part made again from the tree at ``root``; prose untouched."""
    renderers = {section.name: section.render for section in SECTIONS}
    found = [match["name"] for match in MARKER.finditer(text)]
    unknown = sorted(set(found) - set(renderers))
    missing = sorted(set(renderers) - set(found))
    if unknown or missing:
        raise SystemExit(f"{DOC}: unknown generated parts {unknown}, missing {missing}")

    def replace(match: re.Match[str]) -> str:
        return match["open"] + renderers[match["name"]](root) + match["close"]

    return MARKER.sub(replace, text)


def missing_paths(text: str, root: Path) -> list[str]:
    """The repository paths the prose names that match nothing (a module moved or renamed since):
    in code spans (``engine/runtime.py: HookRuntime``, ``frontend/tests/test_browser_*.py``) and
    first on a line of a fenced block (a hand-written map)."""
    prose = FENCED_BLOCK.sub("", text)
    top_level = {entry.name for entry in root.iterdir()}
    spans = [re.split(r"[\s:(]", span, maxsplit=1)[0] for span in CODE_SPAN.findall(prose)]
    # A hand-written map in a fenced block names its path first on a line.
    lines = (line for block in FENCED_BLOCK.findall(text) for line in block.splitlines()[1:])
    mapped = [line.split()[0] for line in lines if line.strip()]
    named = spans + [name for name in mapped if not name.startswith("`")]
    return sorted(
        {
            path
            for path in named
            if "/" in path
            and "<" not in path  # a placeholder: frontend/views/<page>.py
            and path.split("/")[0] in top_level
            and not any(root.glob(path.rstrip("/")))
        }
    )


def _stale_diff(current: str, fresh: str) -> str:
    """A unified diff from the page as it is to the page the tree makes, and what to run."""
    diff = difflib.unified_diff(
        current.splitlines(keepends=True), fresh.splitlines(keepends=True), f"{DOC} (now)", f"{DOC} (tree)"
    )
    return "".join(diff) + f"\n{DOC} is stale: run `.venv/bin/python scripts/architecture_docs.py --write`."


def main(argv: list[str] | None = None) -> int:
    """``--check``: exit 1 with a diff when the page is stale; ``--write``: update it. Either exits
    1 when the prose names a path that does not exist (that needs a person, not this script)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="fail with a diff if the page is stale")
    mode.add_argument("--write", action="store_true", help="rewrite the generated parts in place")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    path = args.root / DOC
    current = path.read_text(encoding="utf-8")
    fresh = regenerate(current, args.root)
    if args.write and fresh != current:
        path.write_text(fresh, encoding="utf-8")
    stale = args.check and fresh != current
    if stale:
        print(_stale_diff(current, fresh))
    else:
        print(f"{DOC}: generated parts {'updated' if fresh != current else 'current'}")
    missing = missing_paths(fresh, args.root)
    for name in missing:
        print(f"{DOC} names {name}, which does not exist: point it at the module that does this now")
    return 1 if stale or missing else 0


if __name__ == "__main__":
    sys.exit(main())
