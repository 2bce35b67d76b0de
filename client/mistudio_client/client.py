"""The client: one HTTP session to a miStudio server, and its resources.

    from mistudio_client import Client
    mi = Client()                       # MISTUDIO_URL, MISTUDIO_TOKEN (or Client(url, token))
    model = mi.models.get("demo-gpt2")
    job = mi.extractions.start(model, dataset, hooks=["blocks.2.hook_resid_post"])
    cache = job.wait().cache()          # a progress bar while it runs
    x = cache["blocks.2.hook_resid_post"][1000:2000]   # fetches those rows only, as numpy

Every call speaks the public REST API only (``/api/…``); every error answer becomes a typed
exception (:mod:`mistudio_client.errors`).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mistudio_client.errors import ApiError, MistudioError, VersionMismatch, error_from_response
from mistudio_client.jobs import Job

API_VERSION = 1
DEFAULT_URL = "http://127.0.0.1:8000"


def _id(row: Any) -> str:
    """A row's id from a row object, a state dict or the id itself."""
    if isinstance(row, str):
        return row
    if isinstance(row, dict):
        return row["id"]
    return row.id


class Client:
    """A miStudio server: ``url`` and ``token`` (an API token, from the account page), by default
    from ``MISTUDIO_URL`` and ``MISTUDIO_TOKEN``. The server's API version is checked first
    (:class:`VersionMismatch` when it is not this client's)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 120.0,
        check_version: bool = True,
    ) -> None:
        self.url = (url or os.environ.get("MISTUDIO_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("MISTUDIO_TOKEN")
        if not token:
            raise MistudioError(
                "No API token: pass token= or set MISTUDIO_TOKEN (the account page shows yours)."
            )
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Token {token}"}, timeout=timeout
        )
        self.models = Models(self)
        self.datasets = Datasets(self)
        self.extractions = Extractions(self)
        self.caches = Caches(self)
        self.saes = Saes(self)
        self.features = Features(self)
        self.graphs = Graphs(self)
        self.steering_vectors = SteeringVectors(self)
        self.server: dict[str, Any] = self.handshake() if check_version else {}

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- HTTP ------------------------------------------------------------------------------------

    def request(self, method: str, path: str, *, raw: bool = False, **kwargs: Any) -> Any:
        """``method`` ``/api/{path}``: the JSON answer (the bytes with ``raw``); errors raised typed."""
        response = self._http.request(method, f"/api/{path.lstrip('/')}", **kwargs)
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = None
            raise error_from_response(response.status_code, body, response.headers)
        if raw:
            return response.content
        return response.json() if response.content else None

    def handshake(self) -> dict[str, Any]:
        """The server's ``version`` and ``api_version``; a different API version is refused."""
        root = self.request("GET", "")
        version = root.get("api_version")
        if version != API_VERSION:
            raise VersionMismatch(
                f"The server at {self.url} speaks API version {version!r}; this client speaks {API_VERSION}: "
                "install the client that matches the server (pip install <server checkout>/client)."
            )
        return {"version": root.get("version"), "api_version": version}

    def job(self, job_id: str) -> Job:
        """Reattach to a job by its id (``ext_…``, ``sae_…``, ``ag_…``, ``fa_…``, ``sv_…``)."""
        return Job.for_id(self, job_id)

    # --- generation ------------------------------------------------------------------------------

    def generate(
        self,
        model: Any,
        prompt: str,
        *,
        capture: Sequence[str] = (),
        interventions: Sequence[Any] = (),
        max_tokens: int = 32,
        temperature: float = 0.0,
        **parameters: Any,
    ) -> Generation:
        """One generation (``POST /api/generate``): the text, the token ids and, for each hook in
        ``capture``, its activations over prompt and completion as a [tokens, width] array.
        ``interventions`` are :mod:`mistudio_client.interventions` builders or their dicts."""
        body: dict[str, Any] = {
            "model_id": _id(model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            **parameters,
        }
        extension: dict[str, Any] = {}
        if capture:
            extension.update(capture=list(capture), store=False)
        if interventions:
            extension["interventions"] = [
                item.to_dict() if hasattr(item, "to_dict") else item for item in interventions
            ]
        if extension:
            body["mistudio"] = extension
        answer = self.request("POST", "generate", json=body)
        activations = {}
        captured = answer.get("activations") or {}
        for hook, values in (captured.get("values") or {}).items():
            activations[hook] = np.asarray(values, dtype=np.float32)
        return Generation(
            text=answer["output_text"],
            input_token_ids=answer.get("input_token_ids", []),
            output_token_ids=answer.get("output_token_ids", []),
            finish_reason=answer.get("finish_reason"),
            activations=activations,
            raw=answer,
        )


@dataclass
class Generation:
    """A generation's text, its prompt's and completion's token ids, and the captured activations
    (hook → [prompt + completion tokens, width])."""

    text: str
    input_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None
    activations: dict[str, np.ndarray] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


class _Resource:
    def __init__(self, client: Client) -> None:
        self.client = client


# --- models ----------------------------------------------------------------------------------------


class Models(_Resource):
    """``/api/models``: list, register, load, unload, wait until ready."""

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "models", params={"limit": 500, **filters})["models"]

    def get(self, model: Any) -> dict[str, Any]:
        """A model by id, or by its unique name."""
        reference = _id(model)
        if not reference.startswith("m_"):
            matches = [row for row in self.list(search=reference) if row["name"] == reference]
            if len(matches) != 1:
                raise MistudioError(f"{len(matches)} models are named {reference!r}.")
            return matches[0]
        return self.client.request("GET", f"models/{reference}")

    def register(
        self, identifier: str, *, source: str = "huggingface", name: str = "", **options: Any
    ) -> dict:
        body = {"source": source, "model_identifier": identifier, "name": name, **options}
        return self.client.request("POST", "models", json=body)

    def load(self, model: Any, *, wait: bool = True, timeout: float = 1800) -> dict[str, Any]:
        row = self.client.request("POST", f"models/{_id(self.get(model))}/load", json={})
        return self.wait_ready(row, timeout=timeout) if wait else row

    def unload(self, model: Any) -> dict[str, Any]:
        return self.client.request("POST", f"models/{_id(self.get(model))}/unload", json={})

    def hook_points(self, model: Any) -> list[dict[str, Any]]:
        """Every canonical hook point of the model with its shape."""
        return self.client.request("GET", f"models/{_id(self.get(model))}/hook-points")["hook_points"]

    def tokenize(self, model: Any, texts: Sequence[str], *, special_tokens: bool = True) -> list[list[dict]]:
        """How the model's tokenizer splits each text: ``[[{"id", "text"}, …], …]``."""
        body = {"texts": list(texts), "special_tokens": special_tokens}
        return self.client.request("POST", f"models/{_id(self.get(model))}/tokenize", json=body)["tokens"]

    def patching(
        self, model: Any, clean: str, corrupted: str, answer: str, wrong_answer: str, **options: Any
    ):
        """The activation-patching grid (hook points x positions) of two prompts of equal length, as
        the API answers it, with ``grid`` and ``normalized`` as numpy arrays."""
        body = {
            "clean": clean,
            "corrupted": corrupted,
            "answer": answer,
            "wrong_answer": wrong_answer,
            **options,
        }
        result = self.client.request("POST", f"models/{_id(self.get(model))}/patching", json=body)
        result["grid"] = np.asarray(result["grid"], dtype=np.float64)
        result["normalized"] = np.asarray(
            [[np.nan if value is None else value for value in row] for row in result["normalized"]],
            dtype=np.float64,
        )
        return result

    def logit_lens(self, model: Any, prompt: str, *, top: int = 5) -> dict[str, Any]:
        """The top next-token predictions after every block at every position."""
        return self.client.request(
            "POST", f"models/{_id(self.get(model))}/logit-lens", json={"prompt": prompt, "top": top}
        )

    def workers(self) -> list[dict[str, Any]]:
        """The live workers: their devices, memory and the models they hold."""
        return self.client.request("GET", "workers")["workers"]

    def wait_ready(self, model: Any, *, timeout: float = 1800, interval: float = 0.5) -> dict[str, Any]:
        """Poll the model until it is ``ready`` (``JobFailed``-like error when it fails)."""
        deadline = time.monotonic() + timeout
        while True:
            row = self.get(model)
            if row["status"] == "ready":
                return row
            if row["status"] == "failed":
                raise MistudioError(
                    f"model {row['id']} failed: {row.get('error_code')}: {row.get('error_message')}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"model {row['id']} is still {row['status']}")
            time.sleep(interval)


# --- datasets --------------------------------------------------------------------------------------


class Datasets(_Resource):
    """``/api/datasets``: upload texts (a list, a file, a pandas column)."""

    def upload(self, texts: Iterable[str] | str | Path, *, name: str, shared: bool = False) -> dict[str, Any]:
        """Texts as a dataset: a list of strings (or a pandas Series), one sample each, or a file
        (plain text, JSONL, CSV or Parquet, read by the server)."""
        if isinstance(texts, (str, Path)) and Path(texts).is_file():
            path = Path(texts)
            with open(path, "rb") as handle:
                files = {"file": (path.name, handle.read())}
            return self.client.request(
                "POST", "datasets", files=files, data={"name": name, "shared": str(shared).lower()}
            )
        import json

        lines = "\n".join(json.dumps({"text": str(text)}) for text in texts).encode()
        files = {"file": (f"{name or 'texts'}.jsonl", lines)}
        data = {"name": name, "format": "jsonl", "shared": str(shared).lower()}
        return self.client.request("POST", "datasets", files=files, data=data)

    def get(self, dataset: Any) -> dict[str, Any]:
        return self.client.request("GET", f"datasets/{_id(dataset)}")

    def list(self) -> list[dict[str, Any]]:
        return self.client.request("GET", "datasets")["datasets"]


# --- extraction and caches ---------------------------------------------------------------------------


class Extractions(_Resource):
    """``/api/models/{id}/extract-activations``: start, then wait (a :class:`Job`)."""

    def start(self, model: Any, dataset: Any, *, hooks: Sequence[str] | None = None, **options: Any) -> Job:
        body = {"dataset_id": _id(dataset), **options}
        if hooks is not None:
            body["hooks"] = list(hooks)
        answer = self.client.request("POST", f"models/{_id(model)}/extract-activations", json=body)
        if answer.get("cached"):
            return Job.done(self.client, "extraction", answer.get("extraction_id"), answer)
        return Job(self.client, "extraction", answer["extraction_id"])


class Caches(_Resource):
    """``/api/activation-caches``: a cache's hooks as lazy arrays."""

    def get(self, cache: Any) -> Cache:
        return Cache(self.client, self.client.request("GET", f"activation-caches/{_id(cache)}"))


class Cache:
    """A completed activation cache: ``cache[hook]`` is a :class:`HookArray`."""

    def __init__(self, client: Client, state: dict[str, Any]) -> None:
        self.client, self.state, self.id = client, state, state["id"]

    @property
    def hooks(self) -> list[str]:
        return list(self.state["hooks"])

    def __getitem__(self, hook: str) -> HookArray:
        shapes = self.state.get("activation_shapes") or {}
        if hook not in shapes:
            raise KeyError(f"{hook!r} is not in the cache (it has {', '.join(shapes)})")
        return HookArray(self.client, self.id, hook, tuple(shapes[hook]), self.state.get("dtype", "float32"))


# At most this many values per request (the server's own limit is 4M).
SLICE_VALUES = 4_000_000


class HookArray:
    """One hook of a cache, [tokens, width], read lazily: slicing rows fetches only those rows
    (as ``.npy``, at most 4M values a request, several requests for more); ``np.asarray`` reads it
    all; :meth:`to_torch` gives a tensor; :meth:`chunks` streams it."""

    def __init__(self, client: Client, cache_id: str, hook: str, shape: tuple[int, ...], dtype: str) -> None:
        self.client, self.cache_id, self.hook, self.shape, self.dtype = client, cache_id, hook, shape, dtype

    def __len__(self) -> int:
        return self.shape[0]

    def _rows(self, start: int, stop: int) -> np.ndarray:
        step = max(1, SLICE_VALUES // max(1, self.shape[1]))
        parts = []
        for begin in range(start, stop, step):
            end = min(stop, begin + step)
            data = self.client.request(
                "GET",
                f"activation-caches/{self.cache_id}/slice",
                raw=True,
                params={"hook": self.hook, "start": begin, "stop": end, "output": "npy"},
            )
            parts.append(np.load(io.BytesIO(data), allow_pickle=False))
        return np.concatenate(parts) if parts else np.zeros((0, self.shape[1]), dtype=np.float32)

    def __getitem__(self, index: Any) -> np.ndarray:
        rows, rest = (index, ()) if not isinstance(index, tuple) else (index[0], index[1:])
        if isinstance(rows, (int, np.integer)):
            row = int(rows) + (self.shape[0] if rows < 0 else 0)
            return self._rows(row, row + 1)[0][rest] if rest else self._rows(row, row + 1)[0]
        if not isinstance(rows, slice):
            raise TypeError("index a hook's rows with an int or a slice")
        start, stop, step = rows.indices(self.shape[0])
        values = self._rows(start, stop)[::step] if stop > start else self._rows(0, 0)
        return values[(slice(None), *rest)] if rest else values

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self._rows(0, self.shape[0])
        return values if dtype is None else values.astype(dtype)

    def chunks(self, rows: int = 65536) -> Iterable[np.ndarray]:
        for start in range(0, self.shape[0], rows):
            yield self._rows(start, min(self.shape[0], start + rows))

    def to_torch(self, start: int = 0, stop: int | None = None):
        import torch

        return torch.from_numpy(self._rows(start, self.shape[0] if stop is None else stop))


# --- SAEs and features -----------------------------------------------------------------------------


class Saes(_Resource):
    """``/api/saes``: train on a cache, wait, evaluate, export, and read as SAELens."""

    def train(self, cache: Any, hook: str, **hyperparameters: Any) -> Job:
        answer = self.client.request(
            "POST", "saes", json={"cache_id": _id(cache), "hook": hook, **hyperparameters}
        )
        return Job(self.client, "sae", answer["id"])

    def get(self, sae: Any) -> dict[str, Any]:
        return self.client.request("GET", f"saes/{_id(sae)}")

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "saes", params=filters)["saes"]

    def evaluate(self, sae: Any, *, cache: Any = None) -> dict[str, Any]:
        body = {} if cache is None else {"cache_id": _id(cache)}
        return self.client.request("POST", f"saes/{_id(sae)}/evaluate", json=body)

    def export(self, sae: Any, folder: str | Path) -> Path:
        """The SAE's SAELens folder (``cfg.json``, ``sae_weights.safetensors``, …) in ``folder``."""
        import tarfile

        data = self.client.request("GET", f"saes/{_id(sae)}/export", raw=True)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            for member in archive.getmembers():
                name = Path(member.name)
                if not member.isfile() or name.is_absolute() or ".." in name.parts:
                    continue
                target = folder.joinpath(*name.parts[1:])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.extractfile(member).read())
        return folder

    def to_saelens(self, sae: Any, folder: str | Path):
        """The SAE as a ``sae_lens.SAE`` (the ``saelens`` extra), through its exported folder."""
        from sae_lens import SAE

        return SAE.load_from_disk(str(self.export(sae, folder)))


class Features(_Resource):
    """``/api/saes/{id}/features``: list and filter, a feature's dashboard, encode a text."""

    def list(self, sae: Any, **filters: Any) -> dict[str, Any]:
        return self.client.request("GET", f"saes/{_id(sae)}/features", params=filters)

    def get(self, sae: Any, index: int) -> dict[str, Any]:
        return self.client.request("GET", f"saes/{_id(sae)}/features/{int(index)}")

    def label(
        self, sae: Any, index: int, label: str, *, notes: str | None = None, shared: bool | None = None
    ) -> dict:
        """Your label (and notes) on a feature; an empty label and notes remove it."""
        body = {
            "label": label,
            **({} if notes is None else {"notes": notes}),
            **({} if shared is None else {"shared": shared}),
        }
        return self.client.request("PATCH", f"saes/{_id(sae)}/features/{int(index)}", json=body)

    def encode(self, sae: Any, text: str, *, top: int = 10) -> tuple[np.ndarray, dict[str, Any]]:
        """The SAE's features on ``text``: a [tokens, features] array (the ``top`` per token the server
        returns, zeros elsewhere) and the whole answer (tokens, per-feature summary)."""
        answer = self.client.request("POST", f"saes/{_id(sae)}/encode", json={"text": text, "top": top})
        width = int(self.client.request("GET", f"saes/{_id(sae)}")["d_sae"])
        values = np.zeros((len(answer["tokens"]), width), dtype=np.float32)
        for position, active in enumerate(answer["per_token"]):
            for item in active:
                values[position, item["index"]] = item["value"]
        return values, answer


class SteeringVectors(_Resource):
    """``/api/steering-vectors``: a difference of means of two prompt lists (a job), or import."""

    def create(
        self, model: Any, hook: str, positive: Sequence[str], negative: Sequence[str], **options: Any
    ) -> Job:
        body = {
            "model_id": _id(model),
            "hook_name": hook,
            "positive": list(positive),
            "negative": list(negative),
            **options,
        }
        return Job(self.client, "vector", self.client.request("POST", "steering-vectors", json=body)["id"])

    def get(self, vector: Any) -> dict[str, Any]:
        return self.client.request("GET", f"steering-vectors/{_id(vector)}")

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "steering-vectors", params=filters)["vectors"]

    def values(self, vector: Any) -> np.ndarray:
        """The vector itself (its exported safetensors file, read without torch)."""
        from mistudio_client.safetensors import read_safetensors

        data = self.client.request("GET", f"steering-vectors/{_id(vector)}/export", raw=True)
        return read_safetensors(data)["vector"]


# --- attribution graphs ----------------------------------------------------------------------------


class Graphs(_Resource):
    """``/api/graphs``: attribute a prompt through transcoders, read, intervene, export."""

    def attribute(
        self,
        model: Any,
        prompt: str,
        *,
        transcoders: Sequence[Any] | None = None,
        group: Any = None,
        **options: Any,
    ) -> Job:
        body: dict[str, Any] = {"model_id": _id(model), "prompt": prompt, **options}
        if group is not None:
            body["sae_group_id"] = _id(group)
        else:
            body["transcoder_ids"] = [_id(sae) for sae in transcoders or []]
        return Job(self.client, "graph", self.client.request("POST", "graphs", json=body)["id"])

    def get(self, graph: Any) -> dict[str, Any]:
        return self.client.request("GET", f"graphs/{_id(graph)}")

    def nodes(
        self, graph: Any, *, node_threshold: float | None = None, edge_threshold: float | None = None
    ) -> dict:
        """The graph pruned at the thresholds, in the Neuronpedia graph JSON."""
        params = {
            key: value
            for key, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold))
            if value is not None
        }
        return self.client.request("GET", f"graphs/{_id(graph)}/nodes", params=params)

    def intervene(
        self, graph: Any, interventions: Sequence[dict[str, Any]], *, top: int = 10
    ) -> dict[str, Any]:
        """``[{"layer", "position", "feature", "value"}]`` in the graph's replacement model: the top
        logits before and after."""
        body = {"interventions": list(interventions), "top": top}
        return self.client.request("POST", f"graphs/{_id(graph)}/intervene", json=body)

    def export(self, graph: Any, path: str | Path) -> Path:
        """The graph JSON that Neuronpedia's viewer and circuit-tracer's local server load."""
        path = Path(path)
        path.write_bytes(self.client.request("GET", f"graphs/{_id(graph)}/export", raw=True))
        return path


__all__ = ["API_VERSION", "ApiError", "Cache", "Client", "Generation", "HookArray"]
