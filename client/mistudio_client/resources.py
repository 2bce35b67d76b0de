"""The client's resources, one per part of the API (``mi.models``, ``mi.datasets``, …): each
method is one route, its JSON answered as dicts and its arrays as numpy; long work returns a
:class:`~mistudio_client.jobs.Job`."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mistudio_client.arrays import Cache
from mistudio_client.errors import ApiError, MistudioError
from mistudio_client.jobs import Job

if TYPE_CHECKING:
    from mistudio_client.client import Client


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


class _Resource:
    def __init__(self, client: Client) -> None:
        self.client = client

    def _update(self, path: str, fields: dict[str, Any]) -> dict[str, Any]:
        """PATCH ``path`` with the fields given (None: left as it is)."""
        body = {name: value for name, value in fields.items() if value is not None}
        return self.client.request("PATCH", path, json=body)

    def _delete(self, path: str) -> None:
        self.client.request("DELETE", path)

    def _download(self, route: str, path: str | Path) -> Path:
        """``GET route``'s bytes in the file ``path``."""
        path = Path(path)
        path.write_bytes(self.client.request("GET", route, raw=True))
        return path


def _poll(read, pending, *, timeout: float, interval: float, what) -> dict[str, Any]:
    """``read()`` every ``interval`` s while ``pending(row)``: the last row; ``TimeoutError`` with
    ``what(row)`` after ``timeout`` s (the work goes on on the server)."""
    deadline = time.monotonic() + timeout
    while pending(row := read()):
        if time.monotonic() > deadline:
            raise TimeoutError(what(row))
        time.sleep(interval)
    return row


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
        row = _poll(
            lambda: self.get(model),
            lambda row: row["status"] not in ("ready", "failed"),
            timeout=timeout,
            interval=interval,
            what=lambda row: f"model {row['id']} is still {row['status']}",
        )
        if row["status"] == "failed":
            raise MistudioError(
                f"model {row['id']} failed: {row.get('error_code')}: {row.get('error_message')}"
            )
        return row


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


class Generations(_Resource):
    """``/api/generations``: the generations you made (their text, tokens and captured caches)."""

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "generations", params=filters)["results"]

    def get(self, generation: Any) -> dict[str, Any]:
        return self.client.request("GET", f"generations/{_id(generation)}")

    def cancel(self, generation: Any) -> dict[str, Any]:
        """Stop a generation that is still running (another thread's, or a stream's)."""
        return self.client.request("POST", f"generate/{_id(generation)}/cancel", json={})
