"""Gates on habits the reviews asked for and no linter checks, run by .ci/run in a few seconds.

* ``complexity``: no function in engine/, saes/ or generation/ above cyclomatic complexity 25
  (radon's count, the one ``radon cc`` prints). Functions that grow a branch per kind are what the
  registries replace, and a reviewer should not have to count branches by hand.
* ``issue-references``: comments and strings name what the code does, not the tracker entry that
  asked for it (the word issue and a number, or a hash and a number in a comment): an issue number
  tells a reader nothing and goes stale.
* ``dispatch``: comparing an SAE architecture, an intervention kind or a job kind against a
  literal belongs in the registry that names them, not in every layer that uses them.

Each gate lists what it found, as ``path:line: text``; the script exits 1 when any found something.
``python scripts/code_gates.py complexity`` runs one gate.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from architecture_docs import CODE_ROOTS, ROOT, python_modules
from radon.complexity import cc_visit
from radon.visitors import Function

COMPLEXITY_LIMIT = 25
COMPLEXITY_ROOTS = ("engine", "saes", "generation")

# The word issue (or issues) and a number; in comments also a hash and a number, as trackers link them.
ISSUE_NUMBER = re.compile(r"\bissues?\s+\d+", re.IGNORECASE)
TRACKER_NUMBER = re.compile(r"(?:^|[\s(\[])#\d+\b")

# The names the registries own. Written out rather than imported, so that the gate runs without the
# project's dependencies and a registry being rebuilt does not break it.
ARCHITECTURES = ("standard", "topk", "batchtopk", "jumprelu", "matryoshka_batchtopk")
INTERVENTION_KINDS = ("add", "clamp_feature", "ablate", "replace")
JOB_KINDS = ("extraction", "sae", "evaluation", "sae_group", "analysis", "explanation", "vector", "graph")


def comparison(subject: str, names: tuple[str, ...], *, any_value: bool) -> re.Pattern[str]:
    """``subject ==``/``!=``/``in (...)`` a literal of ``names`` (any value with ``any_value``), or a
    ``case`` of one; a loop (``for architecture in ...``) names them, it does not dispatch on one."""
    literal = "[\"'](?:" + "|".join(names) + ")[\"']"
    value = "" if any_value else rf"\s*{literal}"
    return re.compile(
        rf"\b{subject}\s*(?:==|!=){value}"
        rf"|(?<!\bfor\s)\b{subject}\s+(?:not\s+)?in\s*[(\[{{]{value}"
        rf"|^\s*case\s+{literal}"
    )


@dataclass(frozen=True)
class Dispatch:
    """A set of registered names, how a branch on one reads, and the modules allowed to branch."""

    what: str
    pattern: re.Pattern[str]
    homes: tuple[str, ...]  # fnmatch patterns, relative to the repository

    def found_in(self, relative: str, line: str) -> bool:
        code = line.split("#", 1)[0]
        return bool(self.pattern.search(code)) and not any(fnmatch(relative, home) for home in self.homes)


DISPATCHES = (
    Dispatch(
        "an SAE architecture",
        comparison("architecture", ARCHITECTURES, any_value=True),
        ("engine/sae_architectures/*",),
    ),
    Dispatch(
        "an intervention kind",
        comparison("kind", INTERVENTION_KINDS, any_value=False),
        ("engine/interventions.py", "engine/interventions/*"),
    ),
    Dispatch("a job kind", comparison("kind", JOB_KINDS, any_value=False), ("mistudio/jobs.py",)),
)


@dataclass(frozen=True)
class Finding:
    """One thing a gate refuses: where it is and what it says."""

    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def _relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def complex_functions(root: Path, paths: Iterable[Path]) -> list[Finding]:
    """Functions whose cyclomatic complexity is above ``COMPLEXITY_LIMIT``."""
    return [
        Finding(
            _relative(root, path), function.lineno, f"{function.fullname}: complexity {function.complexity}"
        )
        for path in paths
        for function in cc_visit(path.read_text(encoding="utf-8"))  # functions, classes and methods
        if isinstance(function, Function) and function.complexity > COMPLEXITY_LIMIT
    ]


def _issue_reference(token: tokenize.TokenInfo) -> str | None:
    """The issue number a comment or string token cites, if any."""
    if token.type == tokenize.COMMENT:
        text = token.string.lstrip("#")
        match = ISSUE_NUMBER.search(text) or TRACKER_NUMBER.search(text)
    elif token.type == tokenize.STRING:
        match = ISSUE_NUMBER.search(token.string)
    else:
        return None
    return match.group().strip() if match else None


def issue_references(root: Path, paths: Iterable[Path]) -> list[Finding]:
    """Comments, docstrings and other strings that cite an issue number."""
    findings = []
    for path in paths:
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
        for token in tokens:
            cited = _issue_reference(token)
            if cited is not None:
                findings.append(Finding(_relative(root, path), token.start[0], f"cites {cited!r}"))
    return findings


def dispatch_sites(root: Path, paths: Iterable[Path]) -> list[Finding]:
    """Branches on an architecture or a kind (a comparison or a ``case``) outside its registry."""
    findings = []
    for path in paths:
        relative = _relative(root, path)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            findings += [
                Finding(relative, number, f"branches on {dispatch.what}: {line.strip()}")
                for dispatch in DISPATCHES
                if dispatch.found_in(relative, line)
            ]
    return findings


@dataclass(frozen=True)
class Gate:
    """A named check over a set of files, and what to do about what it finds."""

    name: str
    find: Callable[[Path, Iterable[Path]], list[Finding]]
    folders: tuple[str, ...]
    with_tests: bool
    remedy: str

    def run(self, root: Path = ROOT) -> list[Finding]:
        return self.find(root, python_modules(root, self.folders, with_tests=self.with_tests))


APPS_AND_ENGINE = tuple(folder for folder in CODE_ROOTS if folder not in ("bench", "client", "scripts"))
GATES = (
    Gate(
        "complexity",
        complex_functions,
        COMPLEXITY_ROOTS,
        with_tests=False,
        remedy=f"split each along its domain's seams (a function per kind) to {COMPLEXITY_LIMIT} or less",
    ),
    Gate(
        "issue-references",
        issue_references,
        CODE_ROOTS,
        with_tests=True,
        remedy="say what the code does or guarantees, not which issue asked for it",
    ),
    Gate(
        "dispatch",
        dispatch_sites,
        APPS_AND_ENGINE,
        with_tests=False,
        remedy="ask the registry that names them ("
        + ", ".join(home for dispatch in DISPATCHES for home in dispatch.homes)
        + ") instead of comparing names",
    ),
)


def main(argv: list[str] | None = None) -> int:
    """Run the gates named (all by default); exit 1 when any of them found something."""
    names = [gate.name for gate in GATES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gates", nargs="*", metavar="GATE", help="one of " + ", ".join(names))
    asked = parser.parse_args(argv).gates or names
    if unknown := sorted(set(asked) - set(names)):
        parser.error(f"unknown gates {unknown}: choose from {names}")
    chosen = [gate for gate in GATES if gate.name in asked]
    failed = False
    for gate in chosen:
        findings = gate.run()
        print(f"{gate.name}: {len(findings) or 'nothing'} found" + (f"; {gate.remedy}:" if findings else ""))
        for finding in findings:
            print(f"  {finding}")
        failed = failed or bool(findings)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
