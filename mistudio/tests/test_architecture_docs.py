"""docs/architecture.md's generated parts match the tree, and the code gates find what they refuse.

The scripts run on the real repository (the page must be current) and on small trees written here,
so each gate is shown refusing an example and passing its look-alikes.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture
def scripts(monkeypatch):
    """The scripts folder on the import path, as it is when the scripts run (they import each other)."""
    monkeypatch.syspath_prepend(str(REPOSITORY / "scripts"))
    import architecture_docs
    import code_gates

    return architecture_docs, code_gates


def write(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def test_the_page_is_current(scripts, capsys):
    architecture_docs, _ = scripts
    assert architecture_docs.main(["--check"]) == 0, capsys.readouterr().out


def test_write_fills_the_generated_parts_and_leaves_the_prose(scripts, tmp_path, capsys):
    architecture_docs, _ = scripts
    write(tmp_path, "engine/__init__.py", '"""The engine. More about it."""\n')
    write(tmp_path, "engine/runtime.py", '"""The hook runtime: hooks.\n\nDetails."""\n')
    write(tmp_path, "engine/sae/__init__.py", '"""Sparse autoencoders."""\n')
    write(tmp_path, "engine/sae/model.py", '"""The SAE\nitself, wrapped. Second sentence."""\n')
    write(tmp_path, "engine/tests/test_runtime.py", '"""Not in the map."""\n')
    write(tmp_path, "saes/services.py", '"""Long."""\n' + "x = 1\n" * 600)
    write(tmp_path, "saes/tests/test_services.py", "x = 1\n" * 900)
    page = """
        # Architecture

        Prose before.

        <!-- generated: module map; edit the docstrings -->
        stale map
        <!-- end generated -->

        Prose between.

        <!-- generated: long modules -->
        <!-- end generated -->
        Prose after.
    """
    write(tmp_path, "docs/architecture.md", page)

    assert architecture_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "is stale" in capsys.readouterr().out
    assert architecture_docs.main(["--write", "--root", str(tmp_path)]) == 0
    written = (tmp_path / "docs/architecture.md").read_text()
    assert architecture_docs.main(["--check", "--root", str(tmp_path)]) == 0

    assert "Prose before.\n\n<!-- generated: module map; edit the docstrings -->\n```\n" in written
    assert "engine/                     The engine.\n" in written
    assert "  runtime.py                The hook runtime: hooks.\n" in written
    assert "    model.py                The SAE itself, wrapped.\n" in written
    assert "stale map" not in written and "Not in the map" not in written
    assert "1 modules of 500 lines or more" in written
    assert "saes/services.py" in written and "600+" in written and "test_services" not in written
    assert written.endswith("<!-- end generated -->\nProse after.\n")


def test_a_missing_generated_part_is_refused(scripts, tmp_path):
    architecture_docs, _ = scripts
    write(tmp_path, "engine/__init__.py", '"""The engine."""\n')
    write(tmp_path, "docs/architecture.md", "<!-- generated: module map -->\n<!-- end generated -->\n")
    with pytest.raises(SystemExit, match="missing \\['long modules'\\]"):
        architecture_docs.main(["--check", "--root", str(tmp_path)])


def branchy(name: str, branches: int, indent: str = "") -> str:
    """A function of complexity ``branches + 1``: one path, and one more per ``if``."""
    body = "".join(f"{indent}    if x == {n}:\n{indent}        return {n}\n" for n in range(branches))
    return f"{indent}def {name}(x):\n{body}"


def test_complexity_gate_names_functions_over_the_limit(scripts, tmp_path):
    _, code_gates = scripts
    write(tmp_path, "engine/branchy.py", branchy("at_limit", 24))
    write(tmp_path, "saes/branchier.py", "class Kinds:\n" + branchy("over", 25, indent="    "))
    write(tmp_path, "saes/tests/test_branchy.py", branchy("over_in_a_test", 30))
    write(tmp_path, "steering/branchy.py", branchy("over_elsewhere", 30))

    findings = code_gates.GATES[0].run(tmp_path)

    assert [str(finding) for finding in findings] == ["saes/branchier.py:2: Kinds.over: complexity 26"]


def test_issue_reference_gate_reads_comments_and_strings_only(scripts, tmp_path):
    _, code_gates = scripts
    # Written as TRACKER here, so that this file does not cite one itself.
    cited = """
        \"\"\"What the bench measures (TRACKER 17, part 4).\"\"\"
        # as trackers link it: see #123
        GOAL = 1.1  # TRACKERs 12 and 14 asked for this
        help_text = "only the steering comparison (TRACKER 16)"
    """
    write(tmp_path, "bench/cited.py", cited.replace("TRACKER", "issue"))
    write(
        tmp_path,
        "features/tests/test_clean.py",
        '''
        """Feature #5 of sae_1#812, an issue of shapes, tissue 3."""
        assert token_strings(None, [5, -1]) == ["#5", ""]  # the unknown id is blank
        issue = 27
        ''',
    )

    findings = code_gates.GATES[1].run(tmp_path)

    expected = [
        "bench/cited.py:1: cites 'TRACKER 17'",
        "bench/cited.py:2: cites '#123'",
        "bench/cited.py:3: cites 'TRACKERs 12'",
        "bench/cited.py:4: cites 'TRACKER 16'",
    ]
    assert [str(finding) for finding in findings] == [line.replace("TRACKER", "issue") for line in expected]


def test_dispatch_gate_allows_each_registry_its_own_names_and_loops(scripts, tmp_path):
    _, code_gates = scripts
    dispatching = """
        if sae.architecture == "topk":
            pass
        if architecture not in ("standard", "topk"):
            pass
        if item.kind in ("add", "replace"):
            pass
        if kind != "ablate":
            pass
        match job.kind:
            case "extraction":
                pass
        for architecture in ("standard", "topk"):
            pass
        if kind == "top":  # explanation selections are not a registered kind
            pass
        # if architecture == "jumprelu": a comment is not dispatch
    """
    for module in ("engine/sae/training.py", "engine/sae_architectures/base.py", "engine/interventions.py"):
        write(tmp_path, module, dispatching)
    write(tmp_path, "engine/tests/test_training.py", dispatching)

    findings = code_gates.GATES[2].run(tmp_path)

    assert [(finding.path, finding.line, finding.text.split(":")[0]) for finding in findings] == [
        ("engine/interventions.py", 1, "branches on an SAE architecture"),
        ("engine/interventions.py", 3, "branches on an SAE architecture"),
        ("engine/interventions.py", 10, "branches on a job kind"),
        ("engine/sae/training.py", 1, "branches on an SAE architecture"),
        ("engine/sae/training.py", 3, "branches on an SAE architecture"),
        ("engine/sae/training.py", 5, "branches on an intervention kind"),
        ("engine/sae/training.py", 7, "branches on an intervention kind"),
        ("engine/sae/training.py", 10, "branches on a job kind"),
        ("engine/sae_architectures/base.py", 5, "branches on an intervention kind"),
        ("engine/sae_architectures/base.py", 7, "branches on an intervention kind"),
        ("engine/sae_architectures/base.py", 10, "branches on a job kind"),
    ]


def test_prose_naming_a_moved_module_fails_the_check(scripts, tmp_path, capsys):
    architecture_docs, _ = scripts
    write(tmp_path, "engine/__init__.py", '"""The engine."""\n')
    write(tmp_path, "activations/services/caches.py", '"""Caches."""\n')
    page = """
        Cleanup (`activations/services.py: cache_cleanup`), now `activations/services/caches.py`; the
        pages `frontend/views/<page>.py`, tests `activations/services/*.py`, elsewhere `delphi/log/x.py`.

        ```
        engine/                    the engine, a hand-written map

        engine/sae_architectures.py  moved into a package since
        ```

        <!-- generated: module map -->
        <!-- end generated -->
        <!-- generated: long modules -->
        <!-- end generated -->
    """
    write(tmp_path, "docs/architecture.md", page)

    assert architecture_docs.main(["--write", "--root", str(tmp_path)]) == 1
    assert architecture_docs.main(["--check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "generated parts updated" in out and "generated parts current" in out
    assert out.count("names ") == 4
    assert "names activations/services.py, which does not exist" in out
    assert "names engine/sae_architectures.py, which does not exist" in out
