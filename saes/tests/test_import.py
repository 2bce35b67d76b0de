"""SAE import guards (``POST /api/saes/import``), each test driving the real API and, where a job
runs, an in-process burst worker.

What they prove:

* a folder whose weights link into miStudio's own data (another user's SAE) or outside the roots is
  refused (400 ``UNSAFE_PATH``), even when an operator's roots are wide enough to hold the data;
* a safetensors header that lies about its byte ranges, a Gemma Scope ``params.npz`` zip bomb, a
  ``cfg.json`` nested 100 000 deep or over 1 MiB are refused from their headers (400
  ``INVALID_SAE``) — the bomb without anything decompressed (tracemalloc peak under 16 MB);
* non-finite weights are refused by the worker: the row ends ``failed`` (``INVALID_SAE``) with no
  folder left under ``SAE_DIR``;
* re-importing identical files gives back the owner's earlier row (200, same id, no new bytes),
  another user gets a row of their own;
* a hook name from ``cfg.json`` that is too long or not hook-shaped is refused (400 ``INVALID_HOOK``);
* the web process reads no arrays: the row is ``queued`` with no folder until the worker writes the
  SAELens files, which encode exactly as the original;
* an import over the memory budget is refused (400 ``MEMORY_BUDGET_EXCEEDED``).

Every refusal is checked to create no row, write nothing under ``SAE_DIR`` and answer the
documented error body without any server path in it.
"""

import json
import math
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from django.conf import settings

from conftest import make_user
from engine.sae.formats import load_saelens, save_saelens
from mistudio.tests.at_once import at_once
from mistudio.workers import run_worker
from saes.models import SparseAutoencoder as SaeRow
from saes.tests.conftest import D_IN, HOOK
from saes.tests.test_api import random_sae

pytestmark = pytest.mark.django_db(transaction=True)  # the burst worker closes DB connections

D_SAE = 128


@pytest.fixture
def sae_folder():
    """``sae_folder(name)``: an empty folder under the first of LOCAL_MODEL_ROOTS, removed afterwards."""
    made = []

    def build(name: str) -> Path:
        folder = settings.LOCAL_MODEL_ROOTS[0] / "import-tests" / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        made.append(folder)
        return folder

    yield build
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def sae_dir_files() -> dict[str, int]:
    """Every file under SAE_DIR with its size."""
    root = Path(settings.SAE_DIR)
    if not root.exists():
        return {}
    return {str(path.relative_to(root)): path.stat().st_size for path in root.rglob("*") if path.is_file()}


def post_import(api, body: dict):
    return api.post("/api/saes/import", body, format="json")


def assert_refused(response, status: int, code: str, *, paths=()) -> dict:
    """The documented error body, with ``code``, naming no server path; returns the error."""
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"code", "message", "details", "timestamp"}
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    text = response.content.decode()
    for path in (settings.DATA_DIR, settings.SAE_DIR, *settings.LOCAL_MODEL_ROOTS, *paths):
        assert str(path) not in text, f"{path} leaks into {text}"
        assert str(Path(path).resolve()) not in text, f"{path} leaks into {text}"
    return error


def run_import(api, body: dict) -> dict:
    """POST an import (202, queued), run a burst worker, return the SAE as the API shows it."""
    response = post_import(api, body)
    assert response.status_code == 202, response.content
    assert response.json()["status"] == "queued"
    run_worker(name="import-worker", device="cpu", burst=True)
    return api.get(f"/api/saes/{response.json()['id']}").json()


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file by hand: 8-byte little-endian header length, the JSON header, the data."""
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


# --- 1. links into miStudio's own data or outside the roots ----------------------------------------


def test_weights_linked_to_another_users_sae_or_outside_the_roots_are_unsafe(
    writer, client_for, sae_folder, tmp_path, settings
):
    other = make_user("otto-other", "model:write")
    source = sae_folder("others-sae")
    save_saelens(random_sae("standard", seed=1), source, hook_name=HOOK, model_name="tiny-gpt2")
    theirs = run_import(client_for(other), {"local_path": str(source)})
    assert theirs["status"] == "completed", theirs
    their_weights = Path(settings.SAE_DIR) / theirs["id"] / "sae_weights.safetensors"
    assert their_weights.is_file()
    before = sae_dir_files()

    # A SAELens folder of the writer's whose weights are a link to the other user's stored SAE.
    stealing = sae_folder("stealing")
    save_saelens(random_sae("standard", seed=2), stealing, hook_name=HOOK, model_name="tiny-gpt2")
    (stealing / "sae_weights.safetensors").unlink()
    (stealing / "sae_weights.safetensors").symlink_to(their_weights)
    api = client_for(writer)
    error = assert_refused(post_import(api, {"local_path": str(stealing)}), 400, "UNSAFE_PATH")
    assert error["details"] == {"file": "sae_weights.safetensors"}

    # Even with roots an operator set wide enough to hold miStudio's data, its own folders stay out.
    roots = list(settings.LOCAL_MODEL_ROOTS)
    settings.LOCAL_MODEL_ROOTS = [Path(settings.DATA_DIR)]
    assert Path(settings.SAE_DIR).resolve().is_relative_to(Path(settings.DATA_DIR).resolve())
    error = assert_refused(post_import(api, {"local_path": str(stealing)}), 400, "UNSAFE_PATH")
    assert error["details"] == {"file": "sae_weights.safetensors"}
    settings.LOCAL_MODEL_ROOTS = roots

    # A link to a file outside the roots.
    outside = tmp_path / "outside"
    save_saelens(random_sae("standard", seed=3), outside, hook_name=HOOK, model_name="tiny-gpt2")
    (stealing / "sae_weights.safetensors").unlink()
    (stealing / "sae_weights.safetensors").symlink_to(outside / "sae_weights.safetensors")
    error = assert_refused(
        post_import(api, {"local_path": str(stealing)}), 400, "UNSAFE_PATH", paths=[tmp_path]
    )
    assert error["details"] == {"file": "sae_weights.safetensors"}

    assert SaeRow.objects.count() == 1  # the other user's only
    assert sae_dir_files() == before


# --- 2. safetensors headers that lie -----------------------------------------------------------------


def lying_header(kind: str) -> tuple[dict, bytes]:
    """A header of a standard SAE (every shape right) whose byte ranges lie, and the data written."""
    shapes = {"W_enc": [D_IN, D_SAE], "W_dec": [D_SAE, D_IN], "b_enc": [D_SAE], "b_dec": [D_IN]}
    header, offset = {}, 0
    for name, shape in shapes.items():
        span = 4 * math.prod(shape) if kind == "beyond_the_file" else 4  # 4: one float, not the shape's
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + span]}
        offset += span
    # beyond_the_file: the ranges match the shapes but the file holds only 16 bytes of data;
    # short_spans: the file holds exactly what the ranges say, less than the shapes need.
    return header, bytes(16)


@pytest.mark.parametrize("kind", ["beyond_the_file", "short_spans"])
def test_a_safetensors_header_that_lies_is_invalid(writer, client_for, sae_folder, kind):
    folder = sae_folder(f"lying-{kind}")
    save_saelens(random_sae("standard"), folder, hook_name=HOOK, model_name="tiny-gpt2")
    header, data = lying_header(kind)
    write_safetensors(folder / "sae_weights.safetensors", header, data)
    before = sae_dir_files()
    error = assert_refused(post_import(client_for(writer), {"local_path": str(folder)}), 400, "INVALID_SAE")
    expected = "outside the file" if kind == "beyond_the_file" else "declares"
    assert expected in error["message"]
    assert error["details"] == {"tensor": "W_enc"}
    assert SaeRow.objects.count() == 0
    assert sae_dir_files() == before


# --- 3. a Gemma Scope zip bomb --------------------------------------------------------------------


def test_a_gemma_scope_zip_bomb_is_refused_without_decompressing_it(writer, client_for, sae_folder):
    folder = sae_folder("zip-bomb")
    d_sae = 262_144
    np.savez_compressed(
        folder / "params.npz",
        W_enc=np.zeros((D_IN, d_sae), np.float32),
        W_dec=np.zeros((d_sae, D_IN), np.float32),
        b_enc=np.zeros(d_sae, np.float32),
        b_dec=np.zeros(D_IN, np.float32),
        threshold=np.zeros(d_sae, np.float32),
    )
    size = (folder / "params.npz").stat().st_size
    assert size < 1 << 20 and 2 * 4 * D_IN * d_sae >= 100_000_000  # tiny file, over 100 MB inside
    api = client_for(writer)
    before = sae_dir_files()

    tracemalloc.start()
    try:
        response = post_import(api, {"local_path": str(folder), "hook": HOOK})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    error = assert_refused(response, 400, "INVALID_SAE")
    assert "100:1" in error["message"] and "refused" in error["message"]
    assert error["details"]["member"].endswith(".npy")
    assert peak < 16 * 2**20, f"the request allocated {peak / 2**20:.1f} MiB: something was decompressed"
    assert SaeRow.objects.count() == 0
    assert sae_dir_files() == before


# --- 4. cfg.json nested too deeply, or too large -------------------------------------------------------


@pytest.mark.parametrize("kind", ["nested_100000_deep", "nested_33_deep", "over_1_mib"])
def test_a_cfg_json_nested_too_deeply_or_too_large_is_invalid(writer, client_for, sae_folder, kind):
    folder = sae_folder(f"cfg-{kind}")
    save_saelens(random_sae("standard"), folder, hook_name=HOOK, model_name="tiny-gpt2")
    cfg = json.loads((folder / "cfg.json").read_text())
    if kind == "nested_100000_deep":
        n = 100_000
        text = '{"a":' * n + "1" + "}" * n
        assert len(text.encode()) < 1 << 20  # under the size limit: only the depth refuses it
    elif kind == "nested_33_deep":  # parses fine; one level more than MAX_CFG_DEPTH (32)
        nested = 1
        for _ in range(32):
            nested = {"a": nested}
        text = json.dumps({**cfg, "extra": nested})
    else:  # an otherwise valid cfg.json padded over 1 MiB
        text = json.dumps({**cfg, "padding": "x" * (1 << 20)})
    (folder / "cfg.json").write_text(text)
    before = sae_dir_files()
    error = assert_refused(
        post_import(client_for(writer), {"local_path": str(folder), "hook": HOOK}), 400, "INVALID_SAE"
    )
    assert "cfg.json" in error["message"]
    assert ("bytes" if kind == "over_1_mib" else "nest") in error["message"]
    assert SaeRow.objects.count() == 0
    assert sae_dir_files() == before


# --- 5. non-finite weights, refused by the worker -----------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_decoder_weights_fail_the_import_and_leave_no_folder(
    writer, client_for, sae_folder, value
):
    folder = sae_folder("non-finite")
    sae = random_sae("standard")
    with torch.no_grad():
        sae.W_dec[3, 5] = value
    save_saelens(sae, folder, hook_name=HOOK, model_name="tiny-gpt2")
    body = run_import(client_for(writer), {"local_path": str(folder)})
    assert body["status"] == "failed", body
    row = SaeRow.objects.get(pk=body["id"])
    assert row.error_code == "INVALID_SAE"
    assert "non-finite" in row.error_message.lower() and "W_dec" in row.error_message
    assert not (Path(settings.SAE_DIR) / row.id).exists()
    assert not row.directory.exists()


# --- 6. identical files imported again --------------------------------------------------------------


def test_reimporting_identical_files_returns_the_earlier_row(tiny_model, writer, client_for, sae_folder):
    folder = sae_folder("twice")
    save_saelens(random_sae("topk", k=8), folder, hook_name=HOOK, model_name="tiny-gpt2")
    api = client_for(writer)
    request = {"local_path": str(folder), "model_id": tiny_model.id}
    first = run_import(api, request)
    assert first["status"] == "completed", first
    stored = sae_dir_files()

    again = post_import(api, {**request, "name": "again"})
    assert again.status_code == 200, again.content
    assert again.json()["id"] == first["id"] and again.json()["status"] == "completed"
    run_worker(name="import-worker", device="cpu", burst=True)
    assert SaeRow.objects.count() == 1
    assert sae_dir_files() == stored

    other = make_user("otto-other", "model:write")
    tiny_model.shared = True  # so that the other user may name it too: the very same request
    tiny_model.save(update_fields=["shared"])
    theirs = post_import(client_for(other), request)
    assert theirs.status_code == 202, theirs.content
    assert theirs.json()["id"] != first["id"] and theirs.json()["owner"] == other.username
    assert SaeRow.objects.count() == 2


# --- 7. hook names from cfg.json ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hook_name",
    [
        "module:model.layers." + "x" * 380,  # a well-shaped module path, 400 characters long
        "blocks.0.hook_resid_post; DROP TABLE",
    ],
    ids=["400_characters", "not_hook_shaped"],
)
def test_a_bad_hook_name_in_cfg_json_is_refused(writer, client_for, sae_folder, hook_name):
    folder = sae_folder("bad-hook")
    save_saelens(random_sae("standard"), folder, hook_name=HOOK, model_name="tiny-gpt2")
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg["metadata"]["hook_name"] = hook_name
    (folder / "cfg.json").write_text(json.dumps(cfg))
    if hook_name.startswith("module:"):
        assert len(hook_name) == 400
    before = sae_dir_files()
    error = assert_refused(post_import(client_for(writer), {"local_path": str(folder)}), 400, "INVALID_HOOK")
    if len(hook_name) > 80:
        assert hook_name not in json.dumps(error)  # quoted cut short, never echoed whole
    assert SaeRow.objects.count() == 0
    assert sae_dir_files() == before


# --- 8. the web reads no arrays; the worker writes the SAELens folder ------------------------------------


def test_the_web_only_queues_the_worker_writes_the_saelens_folder(tiny_model, writer, client_for, sae_folder):
    folder = sae_folder("queued-then-written")
    original = random_sae("jumprelu", seed=7)
    save_saelens(original, folder, hook_name=HOOK, model_name="tiny-gpt2")
    api = client_for(writer)
    response = post_import(api, {"local_path": str(folder), "model_id": tiny_model.id})
    assert response.status_code == 202, response.content
    sae_id = response.json()["id"]
    row = SaeRow.objects.get(pk=sae_id)
    assert row.status == "queued"
    assert (row.d_in, row.d_sae, row.architecture) == (D_IN, D_SAE, "jumprelu")  # from headers alone
    assert not (Path(settings.SAE_DIR) / sae_id).exists()

    run_worker(name="import-worker", device="cpu", burst=True)
    row.refresh_from_db()
    assert row.status == "completed", (row.error_code, row.error_message)
    stored = Path(settings.SAE_DIR) / sae_id
    assert (stored / "cfg.json").is_file() and (stored / "sae_weights.safetensors").is_file()
    imported, described = load_saelens(stored)
    assert described["hook_name"] == HOOK
    x = torch.randn(200, D_IN)
    torch.testing.assert_close(imported.encode(x), original.encode(x))


# --- 9. the memory budget ---------------------------------------------------------------------------------


def test_an_import_over_the_memory_budget_is_refused(writer, client_for, sae_folder, settings):
    settings.JOB_MEMORY_LIMIT_GB = 0.0001
    folder = sae_folder("over-budget")
    save_saelens(random_sae("standard"), folder, hook_name=HOOK, model_name="tiny-gpt2")
    before = sae_dir_files()
    error = assert_refused(
        post_import(client_for(writer), {"local_path": str(folder)}), 400, "MEMORY_BUDGET_EXCEEDED"
    )
    assert error["details"]["estimate_bytes"] > error["details"]["limit_bytes"]
    assert error["details"]["limit_bytes"] <= int(0.0001 * 2**30)
    assert SaeRow.objects.count() == 0
    assert sae_dir_files() == before


# --- 10. a SAELens folder sent in the request (POST /api/saes/upload) -------------------------------------


def uploaded_folders() -> list[str]:
    root = Path(settings.SAE_UPLOAD_DIR)
    return sorted(path.name for path in root.iterdir()) if root.exists() else []


def upload(api, folder: Path, **fields):
    with open(folder / "cfg.json", "rb") as cfg, open(folder / "sae_weights.safetensors", "rb") as weights:
        return api.post("/api/saes/upload", {"cfg": cfg, "weights": weights, **fields}, format="multipart")


def test_an_uploaded_folder_imports_as_the_original_and_its_files_go_after(
    tiny_model, writer, client_for, tmp_path
):
    original = random_sae("jumprelu", seed=11)
    save_saelens(original, tmp_path, hook_name=HOOK, model_name="tiny-gpt2")
    api = client_for(writer)
    response = upload(api, tmp_path, model_id=tiny_model.id, name="from my laptop")
    assert response.status_code == 202, response.content
    sae_id = response.json()["id"]
    assert response.json()["status"] == "queued" and response.json()["name"] == "from my laptop"
    assert len(uploaded_folders()) == 1  # waiting for the worker

    run_worker(name="import-worker", device="cpu", burst=True)
    row = SaeRow.objects.get(pk=sae_id)
    assert row.status == "completed", (row.error_code, row.error_message)
    imported, described = load_saelens(Path(settings.SAE_DIR) / sae_id)
    assert described["hook_name"] == HOOK
    x = torch.randn(200, D_IN)
    torch.testing.assert_close(imported.encode(x), original.encode(x))
    assert uploaded_folders() == []

    again = upload(api, tmp_path, model_id=tiny_model.id)  # the same files: the earlier row
    assert again.status_code == 200 and again.json()["id"] == sae_id
    assert uploaded_folders() == [] and SaeRow.objects.count() == 1


@pytest.mark.parametrize("weights", ["missing", "pickle", "lying header"])
def test_a_bad_upload_is_refused_and_leaves_nothing(writer, client_for, tmp_path, weights):
    save_saelens(random_sae("standard", seed=3), tmp_path, hook_name=HOOK, model_name="tiny-gpt2")
    api = client_for(writer)
    before = sae_dir_files()
    with open(tmp_path / "cfg.json", "rb") as cfg:
        if weights == "missing":
            response = api.post("/api/saes/upload", {"cfg": cfg}, format="multipart")
            assert_refused(response, 400, "VALIDATION_ERROR")
            assert "weights" in response.json()["error"]["details"]["fields"]
        else:
            path = tmp_path / "sae_weights.safetensors"
            if weights == "pickle":
                torch.save({"W_enc": torch.zeros(D_IN, D_SAE)}, path)  # what an upload must never unpickle
            else:
                write_safetensors(
                    path, {"W_enc": {"dtype": "F32", "shape": [D_IN, D_SAE], "data_offsets": [0, 10**9]}}, b""
                )
            with open(path, "rb") as handle:
                response = api.post("/api/saes/upload", {"cfg": cfg, "weights": handle}, format="multipart")
            assert_refused(response, 400, "INVALID_SAE", paths=[tmp_path, settings.SAE_UPLOAD_DIR])
    assert not SaeRow.objects.exists() and sae_dir_files() == before and uploaded_folders() == []


@pytest.mark.parametrize("sparsity", ["pickle", "another width", "another tensor"])
def test_an_uploaded_sparsity_is_checked_as_a_safetensors_file_like_the_weights(
    writer, client_for, tmp_path, sparsity
):
    """Each file of an upload is checked by its own format: ``sparsity`` too (a pickle sent under
    that name was once stored), from its header, before any row is written."""
    save_saelens(random_sae("standard", seed=3), tmp_path, hook_name=HOOK, model_name="tiny-gpt2")
    path = tmp_path / "sparsity.safetensors"
    if sparsity == "pickle":
        torch.save({"sparsity": torch.zeros(D_SAE)}, path)
    else:
        from safetensors.torch import save_file

        name, width = ("sparsity", D_SAE + 1) if sparsity == "another width" else ("density", D_SAE)
        save_file({name: torch.zeros(width)}, path)
    api = client_for(writer)
    before = sae_dir_files()
    with open(path, "rb") as handle:
        response = upload(api, tmp_path, sparsity=handle)
    error = assert_refused(response, 400, "INVALID_SAE", paths=[tmp_path, settings.SAE_UPLOAD_DIR])
    assert "sparsity.safetensors" in error["message"]
    assert not SaeRow.objects.exists() and sae_dir_files() == before and uploaded_folders() == []


# --- 11. identical requests at the same moment ------------------------------------------------------


@pytest.mark.parametrize("door", ["upload", "import"])
def test_identical_imports_at_the_same_moment_make_one_row(
    tiny_model, writer, client_for, tmp_path, sae_folder, door
):
    """Four identical uploads (or imports of one folder) sent together: one row, which every answer
    names (one 202, the rest 200); the uploads' extra folders are removed."""
    folder = tmp_path if door == "upload" else sae_folder("at-once")
    save_saelens(random_sae("topk", k=8), folder, hook_name=HOOK, model_name="tiny-gpt2")

    def send():
        api = client_for(writer)
        if door == "upload":
            return upload(api, folder, model_id=tiny_model.id)
        return post_import(api, {"local_path": str(folder), "model_id": tiny_model.id})

    answers = at_once(send)
    assert sorted(answer.status_code for answer in answers) == [200, 200, 200, 202], [
        a.content for a in answers
    ]
    assert SaeRow.objects.count() == 1
    assert {answer.json()["id"] for answer in answers} == {SaeRow.objects.get().id}
    if door == "upload":
        assert len(uploaded_folders()) == 1  # the one import's, waiting for its worker
