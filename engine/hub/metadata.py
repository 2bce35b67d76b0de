"""Hub ids, the files a download takes, and a model's metadata read without its weights."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.hub.configuration import _credential, _hub_endpoint, _offline_mode, _silent_progress_bar
from engine.hub.errors import HubError, _hub_errors, _offline_error

if TYPE_CHECKING:
    from huggingface_hub.hf_api import ModelInfo

# One part of a repo id: letters, digits, '.', '_' and '-', not starting or ending with '.' or '-'.
_HUB_ID_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
HUB_ID_PATTERN = re.compile(rf"(?!.*(?:--|\.\.))(?:{_HUB_ID_PART}/)?{_HUB_ID_PART}")

# The files a model needs to load with transformers; pickled weights (*.bin, *.pt, ...) never.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "tokenizer*"]
UNSAFE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# The names transformers writes; a repo that has them may also carry other safetensors files
# (Mistral's consolidated.safetensors) that would double the download.
_TRANSFORMERS_WEIGHTS_NAME = re.compile(r"model(?:-\d+-of-\d+)?\.safetensors")


def validate_hub_id(repo_id: str) -> str:
    """``repo_id`` if it is a well-formed ``name`` or ``owner/name``; else ``HubError('INVALID_MODEL_ID')``.

    Stricter than the Hub itself, because the id also ends up in folder names and URLs.
    """
    if not isinstance(repo_id, str) or not HUB_ID_PATTERN.fullmatch(repo_id):
        raise HubError(
            "INVALID_MODEL_ID",
            "A Hub model id is 'name' or 'owner/name': letters, digits, '.', '_' and '-', at most 96 "
            "characters each, not starting or ending with '.' or '-', without '--' or '..'.",
        )
    return repo_id


@dataclass
class HubFile:
    """One file of a Hub repository: its path inside the repo and its size in bytes."""

    path: str
    size: int


@dataclass
class HubModelMetadata:
    """What the Hub says about a model at one commit, read without downloading its weights.

    ``tensor_shapes`` maps each tensor name to its ``(shape, dtype)``, dtype as safetensors spells
    it (``"F32"``, ``"BF16"``, ...), read from the headers of the weight files that
    :func:`download_model` would fetch.
    """

    repo_id: str
    revision: str
    config: dict[str, Any]
    files: list[HubFile]
    tensor_shapes: dict[str, tuple[list[int], str]]

    @property
    def download_size(self) -> int:
        """Bytes :func:`download_model` fetches for this model (with an empty cache)."""
        sizes = {file.path: file.size for file in self.files}
        return sum(sizes[path] for path in files_to_download(sizes))


def files_to_download(repo_files: Iterable[str]) -> list[str]:
    """The files of a repo that :func:`download_model` fetches, in repo order.

    Top-level files matching :data:`DOWNLOAD_PATTERNS`, never pickled weights. Sub-folders hold
    other formats or copies (``onnx/``, ``original/``) that transformers does not load. When the
    repo has transformers' own weight names (``model.safetensors``, ``model-00001-of-00002...``),
    other safetensors files are left out.
    """
    candidates = [
        path
        for path in repo_files
        if "/" not in path
        and not path.endswith(UNSAFE_WEIGHT_SUFFIXES)
        and any(fnmatch(path, pattern) for pattern in DOWNLOAD_PATTERNS)
    ]
    if any(_TRANSFORMERS_WEIGHTS_NAME.fullmatch(path) for path in candidates):
        candidates = [
            path
            for path in candidates
            if not path.endswith(".safetensors") or _TRANSFORMERS_WEIGHTS_NAME.fullmatch(path)
        ]
    return candidates


def hub_metadata(repo_id: str, *, revision: str | None, token: str | None) -> HubModelMetadata:
    """Files, config and tensor shapes of ``repo_id`` at ``revision`` (default branch if None).

    Reads the file list with sizes and the resolved commit (one API call), downloads
    ``config.json`` into a throw-away folder, and reads the safetensors headers with HTTP range
    requests. Every later request is pinned to the resolved commit, so the answer is consistent
    even if the branch moves meanwhile.
    """
    from huggingface_hub import HfApi, hf_hub_download

    validate_hub_id(repo_id)
    if _offline_mode():
        raise _offline_error(repo_id, revision, cached=False)
    endpoint = _hub_endpoint()
    credential = _credential(token)
    api = HfApi(endpoint=endpoint)
    with _hub_errors(repo_id, revision):
        info = api.model_info(repo_id, revision=revision, files_metadata=True, token=credential)
        sizes = _repo_file_sizes(info)
        wanted = files_to_download(sizes)
        _check_weights(repo_id, sizes, wanted)
        if "config.json" not in sizes:
            raise HubError(
                "INVALID_MODEL",
                f"'{repo_id}' has no config.json, so transformers cannot load it.",
                details={"repo_id": repo_id, "revision": revision},
            )
        with tempfile.TemporaryDirectory(prefix="mistudio-hub-") as scratch:
            config_path = hf_hub_download(
                repo_id,
                "config.json",
                revision=info.sha,
                cache_dir=scratch,
                token=credential,
                endpoint=endpoint,
                tqdm_class=_silent_progress_bar(),
            )
            config = json.loads(Path(config_path).read_text(encoding="utf-8"))
        tensor_shapes: dict[str, tuple[list[int], str]] = {}
        for weights_file in (path for path in wanted if path.endswith(".safetensors")):
            header = api.parse_safetensors_file_metadata(
                repo_id, weights_file, revision=info.sha, token=credential
            )
            for name, tensor in header.tensors.items():
                tensor_shapes[name] = (list(tensor.shape), tensor.dtype)
    return HubModelMetadata(
        repo_id=repo_id,
        revision=info.sha,
        config=config,
        files=[HubFile(path=path, size=size) for path, size in sizes.items()],
        tensor_shapes=tensor_shapes,
    )


def _check_weights(repo_id: str, repo_files: Iterable[str], wanted: list[str]) -> None:
    if any(path.endswith(".safetensors") for path in wanted):
        return
    if any(path.endswith(UNSAFE_WEIGHT_SUFFIXES) for path in repo_files):
        raise HubError(
            "UNSAFE_WEIGHTS",
            f"'{repo_id}' has weights only in pickle formats (.bin, .pt, .ckpt), which can run code "
            "when loaded; miStudio loads safetensors weights only.",
            details={"repo_id": repo_id},
        )
    raise HubError(
        "INVALID_MODEL",
        f"'{repo_id}' has no safetensors weights at its top level.",
        details={"repo_id": repo_id},
    )


def _repo_file_sizes(info: ModelInfo) -> dict[str, int]:
    return {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}
