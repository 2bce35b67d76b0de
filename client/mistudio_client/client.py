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
import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mistudio_client.errors import ApiError, MistudioError, VersionMismatch, error_from_response
from mistudio_client.jobs import Job

API_VERSION = 1
DEFAULT_URL = "http://127.0.0.1:8000"


def _layer(row: dict[str, Any]) -> int | None:
    """The block an SAE row reads from (``blocks.3.…`` → 3), if its hook says."""
    match = re.match(r"blocks\.(\d+)\.", row.get("hook_name") or "")
    return int(match.group(1)) if match else None


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
        self.generations = Generations(self)
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
            self.raise_for(response)
        if raw:
            return response.content
        return response.json() if response.content else None

    @staticmethod
    def raise_for(response: httpx.Response) -> None:
        """The typed error of an error answer (:mod:`mistudio_client.errors`)."""
        try:
            body = response.json()
        except ValueError:
            body = None
        raise error_from_response(response.status_code, body, response.headers)

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

    def job(self, job_id: str, *, sae: Any = None) -> Job:
        """Reattach to a job by its id (``ext_…``, ``sae_…``, ``grp_…``, ``ag_…``, ``sv_…``; an analysis
        ``fa_…`` or an explanation job ``xj_…`` with its ``sae``)."""
        return Job.for_id(self, job_id, sae=None if sae is None else _id(sae))

    def explainers(self) -> dict[str, Any]:
        """The endpoints an explanation job may call (never their keys), and the prompts' version."""
        return self.request("GET", "explainers")

    # --- generation ------------------------------------------------------------------------------

    def generate(self, model: Any, prompt: str, **options: Any) -> Generation:
        """One generation (``POST /api/generate``): the text, the token ids and, for each hook in
        ``capture=[…]``, its activations over prompt and completion as a [tokens, width] array.
        ``interventions=[…]`` are :mod:`mistudio_client.interventions` builders or their dicts;
        ``max_tokens`` (32), ``temperature`` (0: greedy) and any other field of the API's body."""
        body = _generation_body(model, prompt, **options)
        return Generation.from_answer(self.request("POST", "generate", json=body))

    def stream(self, model: Any, prompt: str, **options: Any) -> GenerationStream:
        """:meth:`generate` (the same arguments), streamed: iterate over the result for each token
        as the model makes it (``{"index", "token_id", "text"}``); the whole :class:`Generation`
        is then ``.result``. Leaving the loop early stops the generation on the server."""
        return GenerationStream(self, {**_generation_body(model, prompt, **options), "stream": True})


def _generation_body(
    model: Any,
    prompt: str,
    *,
    capture: Sequence[str] = (),
    interventions: Sequence[Any] = (),
    max_tokens: int = 32,
    temperature: float = 0.0,
    **parameters: Any,
) -> dict[str, Any]:
    """``POST /api/generate``'s body: capture (returned, not stored) and interventions go in the
    ``mistudio`` extension."""
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
    return body


class GenerationStream:
    """A streamed generation (:meth:`Client.stream`): its tokens as they come, then ``result``."""

    def __init__(self, client: Client, body: dict[str, Any]) -> None:
        self.client, self.body = client, body
        self.request_id: str | None = None
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self.client._http.stream("POST", "/api/generate", json=self.body) as response:
            if response.status_code >= 400:
                response.read()
                self.client.raise_for(response)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: ") :])
                kind = event.pop("type", None)
                if kind == "started":
                    self.request_id = event.get("request_id")
                elif kind == "token":
                    yield event
                elif kind == "done":
                    self.result = Generation.from_answer(event)
                    return
                elif kind == "error":
                    raise error_from_response(500, event, response.headers)


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

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> Generation:
        captured = (answer.get("activations") or {}).get("values") or {}
        return cls(
            text=answer["output_text"],
            input_token_ids=answer.get("input_token_ids", []),
            output_token_ids=answer.get("output_token_ids", []),
            finish_reason=answer.get("finish_reason"),
            activations={hook: np.asarray(values, dtype=np.float32) for hook, values in captured.items()},
            raw=answer,
        )


class _Resource:
    def __init__(self, client: Client) -> None:
        self.client = client

    def _update(self, path: str, fields: dict[str, Any]) -> dict[str, Any]:
        """PATCH ``path`` with the fields given (None: left as it is)."""
        body = {name: value for name, value in fields.items() if value is not None}
        return self.client.request("PATCH", path, json=body)

    def _delete(self, path: str) -> None:
        self.client.request("DELETE", path)


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
        """Load the model on a worker (a model already loaded is left as it is) and, with ``wait``,
        return its row once it is ready."""
        row = self.get(model)
        try:
            row = self.client.request("POST", f"models/{row['id']}/load", json={})
        except ApiError as error:
            if error.code not in ("ALREADY_LOADED", "ALREADY_LOADING"):
                raise
        return self.wait_ready(row, timeout=timeout) if wait else row

    def unload(self, model: Any) -> dict[str, Any]:
        return self.client.request("POST", f"models/{_id(self.get(model))}/unload", json={})

    def cancel(self, model: Any) -> dict[str, Any]:
        """Stop a load (or a download) that is queued or running."""
        return self.client.request("POST", f"models/{_id(self.get(model))}/cancel", json={})

    def update(self, model: Any, **fields: Any) -> dict[str, Any]:
        """Change a model you own (``name``, ``shared``, …, as ``PATCH /api/models/{id}`` takes)."""
        return self._update(f"models/{_id(self.get(model))}", fields)

    def delete(self, model: Any) -> None:
        self._delete(f"models/{_id(self.get(model))}")

    def memory_estimate(self, model: Any, **parameters: Any) -> dict[str, Any]:
        """What loading the model (and extracting with ``parameters``) would take, per device."""
        return self.client.request("GET", f"models/{_id(self.get(model))}/memory-estimate", params=parameters)

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

        lines = "\n".join(json.dumps({"text": str(text)}) for text in texts).encode()
        files = {"file": (f"{name or 'texts'}.jsonl", lines)}
        data = {"name": name, "format": "jsonl", "shared": str(shared).lower()}
        return self.client.request("POST", "datasets", files=files, data=data)

    def get(self, dataset: Any) -> dict[str, Any]:
        return self.client.request("GET", f"datasets/{_id(dataset)}")

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "datasets", params=filters)["datasets"]

    def samples(self, dataset: Any, *, offset: int = 0, limit: int = 20) -> dict[str, Any]:
        """A page of the dataset's samples (at most 100)."""
        params = {"offset": offset, "limit": limit}
        return self.client.request("GET", f"datasets/{_id(dataset)}/samples", params=params)

    def update(self, dataset: Any, *, name: str | None = None, shared: bool | None = None) -> dict[str, Any]:
        return self._update(f"datasets/{_id(dataset)}", {"name": name, "shared": shared})

    def delete(self, dataset: Any) -> None:
        self._delete(f"datasets/{_id(dataset)}")


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

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "extractions", params=filters)["extractions"]


class Caches(_Resource):
    """``/api/activation-caches``: a cache's hooks as lazy arrays, its statistics, top activations."""

    def get(self, cache: Any) -> Cache:
        return Cache(self.client, self.client.request("GET", f"activation-caches/{_id(cache)}"))

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "activation-caches", params=filters)["caches"]

    def delete(self, cache: Any) -> None:
        self._delete(f"activation-caches/{_id(cache)}")

    def stats(self, cache: Any, hook: str | None = None) -> dict[str, Any]:
        """Per-neuron mean, std, max and min and the mean token norm of each hook (or ``hook``)."""
        params = {} if hook is None else {"hook": hook}
        return self.client.request("GET", f"activation-caches/{_id(cache)}/stats", params=params)

    def top_k(self, cache: Any, hook: str, neuron: int, *, k: int = 20, context: int = 8) -> dict[str, Any]:
        """The ``k`` tokens on which ``neuron`` of ``hook`` is largest, each with its context."""
        params = {"hook": hook, "neuron": neuron, "k": k, "context": context}
        return self.client.request("GET", f"activation-caches/{_id(cache)}/top-k", params=params)


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
    (as safetensors bytes, at most 4M values a request, each copied once into the result);
    ``np.asarray`` reads it all; :meth:`to_torch` gives a tensor; :meth:`chunks` streams it."""

    def __init__(self, client: Client, cache_id: str, hook: str, shape: tuple[int, ...], dtype: str) -> None:
        self.client, self.cache_id, self.hook, self.shape, self.dtype = client, cache_id, hook, shape, dtype

    def __len__(self) -> int:
        return self.shape[0]

    def _fetch(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` in one request: a read-only view of the answer's bytes."""
        from mistudio_client.safetensors import read_safetensors

        data = self.client.request(
            "GET",
            f"activation-caches/{self.cache_id}/slice",
            raw=True,
            params={"hook": self.hook, "start": start, "stop": stop, "output": "safetensors"},
        )
        return read_safetensors(data, copy=False)["activations"]

    def _rows(self, start: int, stop: int) -> np.ndarray:
        step = max(1, SLICE_VALUES // max(1, self.shape[1]))
        spans = [(begin, min(stop, begin + step)) for begin in range(start, stop, step)]
        if not spans:
            return np.zeros((0, self.shape[1]), dtype=np.float32)
        first = self._fetch(*spans[0])  # its dtype is the answer's (float32 for a bfloat16 cache)
        if len(spans) == 1:
            return first.copy()
        values = np.empty((stop - start, self.shape[1]), dtype=first.dtype)
        values[: len(first)] = first
        for begin, end in spans[1:]:
            values[begin - start : end - start] = self._fetch(begin, end)
        return values

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

    def evaluate(
        self, sae: Any, *, cache: Any = None, wait: bool = True, timeout: float = 3600
    ) -> dict[str, Any]:
        """Evaluate on the held-out part of a cache (default: the training cache) with CE loss
        recovered; with ``wait``, the evaluation's metrics once it ends (else the 202 answer)."""
        body = {} if cache is None else {"cache_id": _id(cache)}
        answer = self.client.request("POST", f"saes/{_id(sae)}/evaluate", json=body)
        if not wait:
            return answer
        deadline = time.monotonic() + timeout
        while (row := self.get(sae)).get("evaluation_status"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the evaluation of {_id(sae)} is still {row['evaluation_status']}")
            time.sleep(0.5)
        return row.get("evaluation") or {}

    def update(self, sae: Any, *, name: str | None = None, shared: bool | None = None) -> dict[str, Any]:
        return self._update(f"saes/{_id(sae)}", {"name": name, "shared": shared})

    def delete(self, sae: Any) -> None:
        self._delete(f"saes/{_id(sae)}")

    def train_group(
        self,
        model: Any,
        dataset: Any,
        *,
        hooks: Sequence[str] = (),
        transcoders: Sequence[dict[str, Any]] = (),
        variants: Sequence[dict[str, Any]] = (),
        **options: Any,
    ) -> Job:
        """Many SAEs (one per hook or variant) and transcoders (``{"hook", "hook_out"}``) trained
        together from the model on the fly, one forward pass feeding them all (a ``grp_…`` job)."""
        body = {
            "model_id": _id(model),
            "dataset_id": _id(dataset),
            "hooks": list(hooks),
            "transcoders": list(transcoders),
            "variants": list(variants),
            **options,
        }
        return Job(self.client, "sae_group", self.client.request("POST", "saes/groups", json=body)["id"])

    def groups(self) -> list[dict[str, Any]]:
        return self.client.request("GET", "saes/groups")["groups"]

    def update_group(self, group: Any, *, name: str | None = None, shared: bool | None = None) -> dict:
        return self._update(f"saes/groups/{_id(group)}", {"name": name, "shared": shared})

    def import_folder(self, local_path: str, **options: Any) -> Job:
        """Import a SAELens folder or a Gemma Scope ``params.npz`` that is on the server, under its
        ``LOCAL_MODEL_ROOTS`` (``model_id``, ``hook``, ``format``, ``name``, ``shared``)."""
        body = {"local_path": str(local_path), **options}
        if "model_id" in body:
            body["model_id"] = _id(body["model_id"])
        return Job(self.client, "sae", self.client.request("POST", "saes/import", json=body)["id"])

    def upload(
        self,
        folder: str | Path,
        *,
        model: Any = None,
        hook: str | None = None,
        name: str = "",
        shared: bool = False,
    ) -> Job:
        """Send a SAELens folder of yours (``cfg.json``, ``sae_weights.safetensors``, and
        ``sparsity.safetensors`` if there) to the server and import it: an ``sae_…`` job, already
        completed when you had sent the same files before. ``sae.save_model(folder)`` in SAELens
        writes such a folder."""
        folder = Path(folder)
        names = {"cfg": "cfg.json", "weights": "sae_weights.safetensors", "sparsity": "sparsity.safetensors"}
        data = {"name": name, "shared": str(shared).lower()}
        if model is not None:
            data["model_id"] = _id(self.client.models.get(model))
        if hook:
            data["hook"] = hook
        with ExitStack() as files:
            handles = {
                field: files.enter_context(open(folder / filename, "rb"))
                for field, filename in names.items()
                if (folder / filename).is_file()
            }
            answer = self.client.request("POST", "saes/upload", files=handles, data=data)
        return Job(self.client, "sae", answer["id"], answer)

    def import_transcoders(self, local_path: str, model: Any, **options: Any) -> dict[str, Any]:
        """Import a circuit-tracer transcoder set (a folder on the server) as an SAE group."""
        body = {"local_path": str(local_path), "model_id": _id(model), **options}
        return self.client.request("POST", "saes/import-transcoders", json=body)

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
    """An SAE's features: analyses, list and filter, a feature's dashboard, search by meaning,
    labels, explanations (a language model explains and scores them), and encoding a text."""

    def analyze(self, sae: Any, *, cache: Any = None, shared: bool = False) -> Job:
        """Analyse the SAE's features on a cache (default: its training cache): an ``fa_…`` job."""
        body: dict[str, Any] = {"shared": shared, **({} if cache is None else {"cache_id": _id(cache)})}
        answer = self.client.request("POST", f"saes/{_id(sae)}/analyses", json=body)
        return Job(self.client, "analysis", answer["id"], sae=_id(sae))

    def analyses(self, sae: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", f"saes/{_id(sae)}/analyses")["analyses"]

    def analysis(self, sae: Any, analysis: Any) -> dict[str, Any]:
        return self.client.request("GET", f"saes/{_id(sae)}/analyses/{_id(analysis)}")

    def update_analysis(self, sae: Any, analysis: Any, *, shared: bool) -> dict[str, Any]:
        return self._update(f"saes/{_id(sae)}/analyses/{_id(analysis)}", {"shared": shared})

    def delete_analysis(self, sae: Any, analysis: Any) -> None:
        self._delete(f"saes/{_id(sae)}/analyses/{_id(analysis)}")

    def list(self, sae: Any, **filters: Any) -> dict[str, Any]:
        """A page of features of the newest analysis: ``sort`` (``index``, ``density``, …), ``dead``,
        ``labelled``, ``explained``, ``density_min``/``max``, ``q``, ``token``, ``page``, ``page_size``."""
        return self.client.request("GET", f"saes/{_id(sae)}/features", params=filters)

    def get(self, sae: Any, index: int) -> dict[str, Any]:
        """A feature's dashboard: top activations, density, logits, histogram, label, explanations."""
        return self.client.request("GET", f"saes/{_id(sae)}/features/{int(index)}")

    def export(self, sae: Any, path: str | Path) -> Path:
        """Every feature's dashboard as one JSON document (Neuronpedia-like fields)."""
        path = Path(path)
        path.write_bytes(self.client.request("GET", f"saes/{_id(sae)}/features/export", raw=True))
        return path

    def search(self, sae: Any, query: str, *, k: int = 20) -> dict[str, Any]:
        """Features whose explanations and top contexts mean what ``query`` says, best first."""
        params = {"q": query, "k": k}
        return self.client.request("GET", f"saes/{_id(sae)}/features/search", params=params)

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

    def explain(
        self,
        sae: Any,
        explainer_model: str,
        *,
        selection: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        dry_run: bool = False,
        **fields: Any,
    ) -> Job | dict[str, Any]:
        """Explain and score features with ``explainer_model`` (a model the server serves, or one of
        :meth:`Client.explainers`' endpoints with ``endpoint=``): an ``xj_…`` job; with ``dry_run``
        the plan (features, prompts, tokens) without starting it."""
        body = {"explainer_model": explainer_model, "dry_run": dry_run, **fields}
        if selection is not None:
            body["selection"] = selection
        if options is not None:
            body["options"] = options
        answer = self.client.request("POST", f"saes/{_id(sae)}/explanations", json=body)
        return answer if dry_run else Job(self.client, "explanation", answer["id"], sae=_id(sae))

    def explanation_jobs(self, sae: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", f"saes/{_id(sae)}/explanations")["jobs"]

    def update_explanation_job(self, sae: Any, job: Any, *, shared: bool) -> dict[str, Any]:
        return self._update(f"saes/{_id(sae)}/explanations/{_id(job)}", {"shared": shared})

    def explanations(self, sae: Any, job: Any, *, page: int = 1, page_size: int = 100, prompt: bool = False):
        """A page of an explanation job's results: each feature's explanation and its scores."""
        params = {"page": page, "page_size": page_size, "prompt": str(prompt).lower()}
        return self.client.request("GET", f"saes/{_id(sae)}/explanations/{_id(job)}/results", params=params)

    def accept_explanation(self, sae: Any, index: int, explanation_id: int, *, text: str | None = None):
        """An explanation (or your edit of its ``text``) as your label of the feature."""
        body = {} if text is None else {"text": text}
        path = f"saes/{_id(sae)}/features/{int(index)}/explanations/{int(explanation_id)}/accept"
        return self.client.request("POST", path, json=body)

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

    def upload(
        self, model: Any, hook: str, vector: Any, *, name: str = "", shared: bool = False
    ) -> dict[str, Any]:
        """A vector of your own (numpy or torch, [d_model]) as a steering vector of ``model``."""
        from mistudio_client.safetensors import write_safetensors

        values = np.asarray(vector.detach().cpu() if hasattr(vector, "detach") else vector, dtype=np.float32)
        files = {"file": ("vector.safetensors", write_safetensors({"vector": values}))}
        data = {"model_id": _id(model), "hook_name": hook, "name": name, "shared": str(shared).lower()}
        return self.client.request("POST", "steering-vectors/import", files=files, data=data)

    def update(self, vector: Any, *, name: str | None = None, shared: bool | None = None) -> dict[str, Any]:
        return self._update(f"steering-vectors/{_id(vector)}", {"name": name, "shared": shared})

    def delete(self, vector: Any) -> None:
        self._delete(f"steering-vectors/{_id(vector)}")


class Generations(_Resource):
    """``/api/generations``: the generations you made (their text, tokens and captured caches)."""

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "generations", params=filters)["results"]

    def get(self, generation: Any) -> dict[str, Any]:
        return self.client.request("GET", f"generations/{_id(generation)}")

    def cancel(self, generation: Any) -> dict[str, Any]:
        """Stop a generation that is still running (another thread's, or a stream's)."""
        return self.client.request("POST", f"generate/{_id(generation)}/cancel", json={})


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
            transcoders = list(transcoders or [])
            if all(isinstance(row, dict) and _layer(row) is not None for row in transcoders):
                transcoders.sort(key=_layer)  # SAE rows (mi.saes.list) in layer order
            body["transcoder_ids"] = [_id(sae) for sae in transcoders]
        return Job(self.client, "graph", self.client.request("POST", "graphs", json=body)["id"])

    def get(self, graph: Any) -> dict[str, Any]:
        return self.client.request("GET", f"graphs/{_id(graph)}")

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "graphs", params=filters)["graphs"]

    def update(self, graph: Any, **fields: Any) -> dict[str, Any]:
        """Change a graph you own (``name``, ``shared``)."""
        return self._update(f"graphs/{_id(graph)}", fields)

    def delete(self, graph: Any) -> None:
        self._delete(f"graphs/{_id(graph)}")

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
