"""The SAE commands: train_sae, list_saes, export_sae, import_sae, on a real cache and a real worker."""

import io
import json
import tarfile

import pytest
import torch
from django.conf import settings
from django.core.management import CommandError, call_command

from engine.sae.formats import load_saelens
from mistudio.workers import run_worker
from saes.models import SparseAutoencoder
from saes.tests.conftest import HOOK, planted_rows

pytestmark = pytest.mark.django_db(transaction=True)


def run(*arguments) -> str:
    out = io.StringIO()
    call_command(*arguments, stdout=out)
    return out.getvalue()


def test_train_list_export_import_from_the_command_line(planted_cache, tmp_path):
    queued = run(
        "train_sae", planted_cache.id, "--k", "4", "--expansion", "2", "--batch-size", "256",
        "--tokens", "8192", "--no-wait",
    )  # fmt: skip
    sae = SparseAutoencoder.objects.get()
    assert queued.strip() == f"SAE {sae.id} queued"
    assert (sae.hook_name, sae.architecture, sae.d_sae, sae.k) == (HOOK, "topk", 128, 4)  # its only hook
    run_worker(name="sae-cli-worker", device="cpu", burst=True)
    sae.refresh_from_db()
    assert sae.status == "completed", (sae.error_code, sae.error_message)

    listing = run("list_saes")
    row = next(line for line in listing.splitlines() if line.startswith(sae.id))
    assert f"{sae.evaluation['explained_variance']:.3f}" in row and "64→128" in row

    folder = tmp_path / "exported"
    assert "SAELens layout" in run("export_sae", sae.id, str(folder))
    exported, described = load_saelens(folder)
    assert described["hook_name"] == HOOK and (folder / "sparsity.safetensors").is_file()
    x = planted_rows(64, seed=9)
    original, _ = load_saelens(sae.directory)
    torch.testing.assert_close(exported.encode(x), original.encode(x), rtol=0, atol=0)
    run("export_sae", sae.id, str(tmp_path / "exported.tar"))
    with tarfile.open(tmp_path / "exported.tar") as archive:
        assert f"{sae.id}/sae_weights.safetensors" in archive.getnames()

    # Labels travel in labels.json; an entry out of range is skipped on the way back in.
    from features.models import FeatureLabel
    from features.services import feature_label_set

    feature_label_set(sae=sae, index=3, actor=None, label="closing brackets", notes="fires on `)`")
    inside = settings.LOCAL_MODEL_ROOTS[0] / "cli-import"
    run("export_sae", sae.id, str(inside))
    labels = json.loads((inside / "labels.json").read_text())
    assert labels["labels"] == [{"index": 3, "label": "closing brackets", "notes": "fires on `)`"}]
    labels["labels"].append({"index": 128, "label": "beyond the SAE", "notes": ""})
    (inside / "labels.json").write_text(json.dumps(labels))
    queued = run("import_sae", str(inside), "--model", "tiny", "--no-wait")  # a worker reads the arrays
    copy = SparseAutoencoder.objects.exclude(pk=sae.id).get()
    assert queued.strip() == f"import of {copy.id} queued"
    run_worker(name="sae-cli-worker", device="cpu", burst=True)
    copy.refresh_from_db()
    assert (copy.status, copy.architecture, copy.d_in, copy.d_sae, copy.hook_name) == (
        "completed", "topk", 64, 128, HOOK,
    )  # fmt: skip
    assert copy.model_id == sae.model_id and copy.source == "saelens"
    assert list(FeatureLabel.objects.filter(sae=copy).values_list("index", "label", "notes")) == [
        (3, "closing brackets", "fires on `)`")
    ]
    # The same files again: the earlier import, nothing copied twice.
    assert (
        run("import_sae", str(inside), "--model", "tiny").strip()
        == f"already imported: {copy.id} (completed)"
    )
    assert SparseAutoencoder.objects.count() == 2


def test_command_errors_are_clear(planted_cache):
    with pytest.raises(CommandError, match="No activation cache"):
        run("train_sae", "act_missing")
    with pytest.raises(CommandError, match="INVALID_HOOK"):
        run("train_sae", planted_cache.id, "--hook", "blocks.9.hook_resid_post", "--no-wait")
    with pytest.raises(CommandError, match="INVALID_LOCAL_PATH"):
        run("import_sae", "/etc")
    with pytest.raises(CommandError, match="No completed SAE"):
        run("export_sae", "sae_missing", "/tmp/nowhere")
    assert "No SAEs yet" in run("list_saes")


def test_train_sae_group_from_the_command_line(tiny_model):
    from activations.models import Dataset
    from activations.services import dataset_create_from_texts
    from saes.models import SaeGroup

    texts = [f"sample number {index} says something about cats and dogs" for index in range(40)]
    dataset = dataset_create_from_texts(name="cli", texts=texts, owner=None, source=Dataset.Source.BUILTIN)
    queued = run(
        "train_sae_group", tiny_model.id, dataset.id, "--hooks", "blocks.0.hook_resid_post",
        "--transcoder", "blocks.1.ln2.hook_normalized -> blocks.1.hook_mlp_out", "--variant", "k=4",
        "--variant", "k=8", "--expansion", "2", "--batch-size", "64", "--tokens", "256", "--no-wait",
    )  # fmt: skip
    group = SaeGroup.objects.get()
    assert queued == f"SAE group {group.id} queued (4 members)\n"
    with pytest.raises(CommandError, match="input hook -> output hook"):
        run("train_sae_group", tiny_model.id, dataset.id, "--transcoder", "only-one-hook", "--no-wait")
    run_worker(name="cli-worker", device="cpu", burst=True)
    group.refresh_from_db()
    assert group.status == "completed", group.error_message
    # Waiting on a finished group prints its comparison table.
    table = io.StringIO()
    from saes.management.commands.train_sae_group import Command

    command = Command(stdout=table)
    command.follow(group, timeout=5)
    lines = table.getvalue().splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("SAE "))
    assert lines[header].split()[:3] == ["SAE", "hook", "arch"] and len(lines) - header == 5
