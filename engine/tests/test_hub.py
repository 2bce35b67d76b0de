"""Hub metadata and downloads through the real huggingface_hub code path, against a local stand-in Hub."""

import collections
import hashlib
import json
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

from engine import hub
from engine.hub import HubError, download_model, files_to_download, hub_metadata, validate_hub_id
from engine.testing.hub_standin import LocalHub

GATED_TOKEN = "hf_gatekeeper_0123456789abcdef"
DiskUsage = collections.namedtuple("DiskUsage", "total used free")


@pytest.fixture(scope="module")
def source_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model folders to publish: a tiny GPT-2, a 17 MB one, and a repo with pickled weights only."""
    from engine.testing.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("source-models")
    tiny = build_tiny_model("gpt2", root / "tiny", size="tiny", seed=0)
    small = build_tiny_model("gpt2", root / "small", size="small", seed=1)
    pickles = root / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_bytes((tiny / "config.json").read_bytes())
    (pickles / "pytorch_model.bin").write_bytes(b"\x80\x04pickled weights" * 64)
    return {"tiny": tiny, "small": small, "pickles": pickles}


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test settings switch the Hub off (HF_HUB_OFFLINE=1); these tests talk to the local one."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def local_hub(
    tmp_path: Path, source_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[LocalHub]:
    with LocalHub(tmp_path / "hub", gated={"acme/gated": GATED_TOKEN}) as server:
        server.add_repo("acme/tiny", source_models["tiny"])
        server.add_repo("acme/small", source_models["small"])
        server.add_repo("acme/gated", source_models["tiny"])
        server.add_repo("acme/pickles", source_models["pickles"])
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def go_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both switches: ours reads the variable, huggingface_hub's own requests read its constant."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def raised(call, *args, **kwargs) -> HubError:
    with pytest.raises(HubError) as caught:
        call(*args, **kwargs)
    return caught.value


# --- Repo ids ------------------------------------------------------------------------------------


@pytest.mark.parametrize("repo_id", ["gpt2", "openai-community/gpt2", "meta-llama/Llama-3.2-1B"])
def test_validate_hub_id_accepts_real_ids(repo_id: str) -> None:
    assert validate_hub_id(repo_id) == repo_id


@pytest.mark.parametrize(
    "repo_id",
    ["../x", "a/b/c", "", "a b", "/abs", "x" * 200, "a\x00b", "a%2F..", "a--b", "-a", "a.", "gpt2\n"],
)
def test_validate_hub_id_rejects_malformed_ids(repo_id: str) -> None:
    assert raised(validate_hub_id, repo_id).code == "INVALID_MODEL_ID"


def test_files_to_download_keeps_transformers_files_only() -> None:
    repo_files = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "consolidated.safetensors",  # Mistral's second copy of the weights
        "pytorch_model.bin",
        "tokenizer.model",
        "tokenizer.json",
        "original/params.json",
        "onnx/model.safetensors",
        "README.md",
    ]
    assert files_to_download(repo_files) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.model",
        "tokenizer.json",
    ]


# --- Metadata ------------------------------------------------------------------------------------


def test_metadata_reads_config_files_and_shapes_without_the_weights(
    local_hub: LocalHub, source_models: dict[str, Path]
) -> None:
    from safetensors import safe_open

    source = source_models["tiny"]
    metadata = hub_metadata("acme/tiny", revision=None, token=None)

    assert metadata.revision == local_hub.repos["acme/tiny"].main
    assert metadata.config == json.loads((source / "config.json").read_text())
    assert {file.path: file.size for file in metadata.files} == {
        path.name: path.stat().st_size for path in source.iterdir()
    }
    with safe_open(source / "model.safetensors", framework="pt") as weights:
        slices = {name: weights.get_slice(name) for name in weights.keys()}  # noqa: SIM118 - not a dict
        expected = {name: (list(tensor.get_shape()), tensor.get_dtype()) for name, tensor in slices.items()}
    assert metadata.tensor_shapes == expected
    assert metadata.download_size == folder_size(source)
    # Only the header range of the weights went over the wire; the tokenizer not at all.
    weights_size = (source / "model.safetensors").stat().st_size
    assert local_hub.served("acme/tiny", "model.safetensors") == 100_001 < weights_size
    assert local_hub.served("acme/tiny", "tokenizer.json") == 0
    assert hub_metadata("acme/tiny", revision=metadata.revision, token=None).revision == metadata.revision


# --- Downloads -----------------------------------------------------------------------------------


def test_download_gives_a_folder_transformers_loads_to_the_same_logits(
    local_hub: LocalHub, source_models: dict[str, Path], tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cache = tmp_path / "cache"
    folder = download_model("acme/tiny", revision=None, cache_dir=cache, token=None)

    commit = local_hub.repos["acme/tiny"].main
    assert folder == cache / "models--acme--tiny" / "snapshots" / commit
    assert (cache / "models--acme--tiny" / "refs" / "main").read_text() == commit
    downloaded = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True).eval()
    original = AutoModelForCausalLM.from_pretrained(source_models["tiny"], use_safetensors=True).eval()
    tokens = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(downloaded(tokens).logits, original(tokens).logits)


def test_progress_is_summed_over_files_monotonic_and_ends_at_the_total(
    local_hub: LocalHub, source_models: dict[str, Path], tmp_path: Path
) -> None:
    source = source_models["small"]
    weights_size = (source / "model.safetensors").stat().st_size
    local_hub.throttle_bytes_per_second = 20_000_000  # about a second for the 17 MB of weights
    reports: list[tuple[int, int]] = []

    download_model(
        "acme/small",
        revision=None,
        cache_dir=tmp_path / "cache",
        token=None,
        progress=lambda done, total: reports.append((done, total)),
    )

    total = folder_size(source)
    assert reports[-1] == (total, total)
    assert {reported_total for _, reported_total in reports} == {total}
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)
    other_files = total - weights_size
    assert any(other_files < done < total for done, _ in reports), "no report from inside the weights file"


def test_too_little_disk_is_refused_before_any_byte_is_downloaded(
    local_hub: LocalHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        hub.download.shutil, "disk_usage", lambda path: DiskUsage(total=10**9, used=10**9, free=1000)
    )

    error = raised(download_model, "acme/small", revision=None, cache_dir=tmp_path / "cache", token=None)

    assert error.code == "INSUFFICIENT_DISK"
    assert error.details["required_bytes"] > 17_000_000
    assert error.details["available_bytes"] == 0
    assert local_hub.bytes_served == {}


def test_a_download_cancelled_mid_file_resumes_where_it_stopped(
    local_hub: LocalHub, source_models: dict[str, Path], tmp_path: Path
) -> None:
    weights = source_models["small"] / "model.safetensors"
    weights_size = weights.stat().st_size
    cache = tmp_path / "cache"
    blobs = cache / "models--acme--small" / "blobs"
    local_hub.throttle_bytes_per_second = 20_000_000

    def weights_partly_there() -> bool:
        return any(path.stat().st_size >= 1_000_000 for path in blobs.glob("*.incomplete"))

    error = raised(
        download_model,
        "acme/small",
        revision=None,
        cache_dir=cache,
        token=None,
        should_cancel=weights_partly_there,
    )

    assert error.code == "DOWNLOAD_CANCELLED"
    (partial,) = blobs.glob("*.incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < weights_size
    assert partial.name == f"{sha256(weights)}.incomplete"

    reports: list[tuple[int, int]] = []
    folder = download_model(
        "acme/small",
        revision=None,
        cache_dir=cache,
        token=None,
        progress=lambda done, total: reports.append((done, total)),
    )

    _cancelled, resumed = local_hub.file_requests("acme/small", "model.safetensors")
    assert (resumed.range, resumed.status, resumed.bytes_sent) == (f"bytes={kept}-", 206, weights_size - kept)
    assert local_hub.served("acme/small", "model.safetensors") < 2 * weights_size
    assert reports[0][0] >= kept  # the bytes kept count as done from the start
    assert sha256(folder / "model.safetensors") == sha256(weights)
    assert not list(blobs.glob("*.incomplete"))


# --- Offline and unreachable ---------------------------------------------------------------------


def test_offline_a_complete_cache_is_used_without_the_hub(
    local_hub: LocalHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    folder = download_model("acme/tiny", revision=None, cache_dir=cache, token=None)
    local_hub.stop()
    go_offline(monkeypatch)
    reports: list[tuple[int, int]] = []

    cached = download_model(
        "acme/tiny",
        revision=None,
        cache_dir=cache,
        token=None,
        progress=lambda *report: reports.append(report),
    )
    assert cached == folder
    assert reports == [(folder_size(folder), folder_size(folder))]
    assert (
        raised(download_model, "acme/small", revision=None, cache_dir=cache, token=None).code == "HUB_OFFLINE"
    )
    assert raised(hub_metadata, "acme/tiny", revision=None, token=None).code == "HUB_OFFLINE"


def test_an_unreachable_hub_is_transient_unless_the_cache_is_complete(
    local_hub: LocalHub, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    folder = download_model("acme/tiny", revision=None, cache_dir=cache, token=None)
    local_hub.stop()

    assert download_model("acme/tiny", revision=None, cache_dir=cache, token=None) == folder
    for error in (
        raised(download_model, "acme/small", revision=None, cache_dir=cache, token=None),
        raised(hub_metadata, "acme/small", revision=None, token=None),
    ):
        assert (error.code, error.transient) == ("HUB_UNREACHABLE", True)


# --- Refusals ------------------------------------------------------------------------------------


def test_unknown_repos_and_revisions_are_not_found(local_hub: LocalHub, tmp_path: Path) -> None:
    assert raised(hub_metadata, "acme/missing", revision=None, token=None).code == "MODEL_NOT_FOUND_ON_HUB"
    assert (
        raised(download_model, "acme/missing", revision=None, cache_dir=tmp_path, token=None).code
        == "MODEL_NOT_FOUND_ON_HUB"
    )
    error = raised(hub_metadata, "acme/tiny", revision="no-such-branch", token=None)
    assert error.code == "MODEL_NOT_FOUND_ON_HUB"
    assert "revision" in error.message


def test_gated_repos_need_the_right_token_which_never_leaks(local_hub: LocalHub, tmp_path: Path) -> None:
    errors = [
        raised(hub_metadata, "acme/gated", revision=None, token=None),
        raised(download_model, "acme/gated", revision=None, cache_dir=tmp_path / "a", token=None),
        raised(hub_metadata, "acme/gated", revision=None, token="hf_wrong_token"),
        raised(download_model, "acme/gated", revision=None, cache_dir=tmp_path / "b", token="hf_wrong_token"),
    ]
    assert [error.code for error in errors] == ["GATED_MODEL"] * 4
    assert local_hub.served("acme/gated", "model.safetensors") == 0

    metadata = hub_metadata("acme/gated", revision=None, token=GATED_TOKEN)
    folder = download_model("acme/gated", revision=None, cache_dir=tmp_path / "c", token=GATED_TOKEN)
    assert metadata.config["model_type"] == "gpt2"
    assert (folder / "model.safetensors").exists()

    cancelled = raised(
        download_model,
        "acme/gated",
        revision=None,
        cache_dir=tmp_path / "d",
        token=GATED_TOKEN,
        should_cancel=lambda: True,
    )
    for error in [*errors, cancelled]:
        written = "".join(traceback.format_exception(error)) + json.dumps(error.details) + repr(error)
        assert GATED_TOKEN not in written and "hf_wrong_token" not in written
        assert str(tmp_path) not in error.message


def test_pickled_weights_are_refused_and_never_downloaded(local_hub: LocalHub, tmp_path: Path) -> None:
    assert raised(hub_metadata, "acme/pickles", revision=None, token=None).code == "UNSAFE_WEIGHTS"
    error = raised(download_model, "acme/pickles", revision=None, cache_dir=tmp_path, token=None)
    assert error.code == "UNSAFE_WEIGHTS"
    assert local_hub.served("acme/pickles", "pytorch_model.bin") == 0
    assert local_hub.file_requests("acme/pickles", "pytorch_model.bin", "HEAD") == []


def test_a_partial_file_that_arrived_whole_before_a_cancel_is_not_fetched_again(
    local_hub: LocalHub, source_models: dict[str, Path], tmp_path: Path
) -> None:
    weights = source_models["tiny"] / "model.safetensors"
    sha256 = hashlib.sha256(weights.read_bytes()).hexdigest()
    blobs = tmp_path / "cache" / "models--acme--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha256}.incomplete").write_bytes(weights.read_bytes())  # every byte, not yet renamed

    folder = download_model("acme/tiny", revision=None, cache_dir=tmp_path / "cache", token=None)

    assert local_hub.file_requests("acme/tiny", "model.safetensors") == []
    assert (folder / "model.safetensors").read_bytes() == weights.read_bytes()
    assert not (blobs / f"{sha256}.incomplete").exists()
