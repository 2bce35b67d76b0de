"""The client's documentation runs: every Python example of client/README.md and of the main README's
"From Python" section, and the quickstart
notebook (docs/notebooks/quickstart.ipynb, in a real Jupyter kernel through nbclient), against the
live stack, with their results and outputs checked.

Both are written for the demo model (``demo-gpt2``, four blocks); the live stack's model is the tiny
GPT-2 (``live-gpt2``, two blocks), so the model's name and the hook's block are the only words
replaced (the notebook's own parameters cell, as papermill would)."""

import re
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from circuits.tests.conftest import transcoder_rows
from models_app.models import LanguageModel

pytestmark = pytest.mark.slow
CLIENT = Path(__file__).resolve().parents[1]
ROOT = CLIENT.parent
LIVE = {"demo-gpt2": "live-gpt2", "blocks.2.": "blocks.1."}


def python_examples(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)


def section(markdown: Path, title: str) -> str:
    """The part of ``markdown`` under the heading ``title`` (to the next heading of its level)."""
    text = markdown.read_text()
    body = text[text.index(f"## {title}\n") :]
    return body[: body.find("\n## ", 4) if "\n## " in body[4:] else len(body)]


def for_the_live_stack(source: str) -> str:
    for word, replacement in LIVE.items():
        source = source.replace(word, replacement)
    return source


@pytest.fixture
def server(live_stack, monkeypatch, tmp_path):
    monkeypatch.setenv("MISTUDIO_URL", live_stack.base_url)
    monkeypatch.setenv("MISTUDIO_TOKEN", live_stack.token)
    monkeypatch.chdir(tmp_path)
    return live_stack


def test_every_readme_example_runs(server, tiny_gpt2_folder, django_user_model):
    model = LanguageModel.objects.get(pk=server.models["gpt2"])
    owner = django_user_model.objects.get(username="live-writer")
    transcoder_rows(model, tiny_gpt2_folder, owner)
    # A cancelled set beside it: the snippet picked every transcoder and failed with SAE_NOT_READY.
    for row in transcoder_rows(model, tiny_gpt2_folder, owner, seed=5):
        type(row).objects.filter(pk=row.pk).update(status="cancelled")
    main = python_examples(section(ROOT / "README.md", "From Python"))
    assert len(main) == 1
    namespace: dict = {}
    exec(compile(for_the_live_stack(main[0]), "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["rows"].shape == (4, 64)
    examples = python_examples((CLIENT / "README.md").read_text())
    assert len(examples) == 1
    namespace = {}
    exec(compile(for_the_live_stack(examples[0]), "client/README.md", "exec"), namespace)  # noqa: S102
    assert namespace["rows"].shape == (8, 64) and namespace["out"].text
    assert namespace["out"].activations["blocks.1.hook_resid_post"].shape[1] == 64
    assert namespace["pushed"].output_token_ids != namespace["out"].output_token_ids
    assert (Path("my-sae") / "cfg.json").is_file() and namespace["mine"].status == "completed"
    assert len(namespace["dense"]) == 10 and namespace["values"].shape[1] == 256
    assert namespace["steered"].text
    assert namespace["pruned"]["nodes"] and namespace["graph"].status == "completed"


def test_the_quickstart_notebook_runs(server, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(CLIENT))  # the kernel imports the client as pip installs it
    notebook = nbformat.read(ROOT / "docs" / "notebooks" / "quickstart.ipynb", as_version=4)
    position = next(
        index for index, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])
    )
    # Injected after the parameters cell, as papermill does; a stronger push for the tiny model.
    injected = 'MODEL = "live-gpt2"\nHOOK = "blocks.1.hook_resid_post"\nSTEER_COEFFICIENT = 40.0\n'
    notebook.cells.insert(position + 1, nbformat.v4.new_code_cell(injected))
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [
        output.get("text") or output.get("data", {}).get("text/plain", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    ]
    assert not [
        output
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.output_type == "error"
    ]
    text = "\n".join(outputs)
    # A wait draws one progress line, updated in place (before: a line per update, "0/100%").
    waits = [cell for cell in notebook.cells if cell.cell_type == "code" and ".wait()" in cell.source]
    assert waits
    for cell in waits:
        lines = [
            output.get("data", {}).get("text/plain", "") for output in cell.outputs
            if output.output_type == "display_data" and "%" in output.get("data", {}).get("text/plain", "")
        ]  # fmt: skip
        assert len(lines) == 1 and "100%" in lines[0], lines
        assert not [output for output in cell.outputs if "/100%" in (output.get("text") or "")]
    assert "'api_version': 1" in text
    assert "live-gpt2 ready" in text and "blocks.1.hook_resid_post [" in text
    tokens = int(re.search(r"texts -> \((\d+), 64\) activations", text).group(1))
    assert tokens > 500
    assert "d_in 64 d_sae 256" in text
    assert re.search(r"encoded: \(\d+, 256\) active per token: \[(\d+, )*\d+\]", text)
    per_token = [
        int(value) for value in re.search(r"active per token: \[([\d, ]+)\]", text).group(1).split(",")
    ]
    assert max(per_token) <= 8
    plain = re.search(r"^plain:   (.+)$", text, flags=re.MULTILINE).group(1)  # the texts' reprs
    steered = re.search(r"^steered: (.+)$", text, flags=re.MULTILINE).group(1)
    assert plain != steered
    assert re.search(r"captured while generating: \(\d+, 64\)", text)
    assert np.isfinite(float(re.search(r"vector norm ([\d.]+)", text).group(1)))
