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

import os
from typing import Any

import httpx

from mistudio_client.errors import ApiError, MistudioError, VersionMismatch, error_from_response
from mistudio_client.generation import Generation, GenerationStream, _generation_body
from mistudio_client.jobs import Job
from mistudio_client.resources import Caches, Datasets, Extractions, Generations, Models, _id
from mistudio_client.saes import Features, Graphs, SaeBench, Saes, SteeringVectors

API_VERSION = 1
DEFAULT_URL = "http://127.0.0.1:8000"


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
        self.saebench = SaeBench(self)
        self.steering_vectors = SteeringVectors(self)
        self.generations = Generations(self)
        self._job_kinds: dict[str, dict[str, str]] | None = None
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
        self._job_kinds = root.get("jobs")
        version = root.get("api_version")
        if version != API_VERSION:
            raise VersionMismatch(
                f"The server at {self.url} speaks API version {version!r}; this client speaks {API_VERSION}: "
                "install the client that matches the server (pip install <server checkout>/client)."
            )
        return {"version": root.get("version"), "api_version": version}

    def job_kinds(self) -> dict[str, dict[str, str]]:
        """The server's kinds of job: kind -> its ``id_prefix``, ``path`` and ``cancel_path`` under
        ``/api/`` (parameters in braces) and its ``id_parameter``; read from ``GET /api/`` once."""
        if self._job_kinds is None:
            self._job_kinds = self.request("GET", "").get("jobs") or {}
        return self._job_kinds

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


__all__ = ["API_VERSION", "ApiError", "Client"]
