"""The client's resources for SAEs and what is built on them: ``mi.saes`` (train, groups, import and
upload, evaluate, export), ``mi.features`` (analyses, dashboards, search, labels, explanations,
encoding), ``mi.steering_vectors`` and ``mi.graphs`` (attribution graphs)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from mistudio_client.errors import MistudioError
from mistudio_client.jobs import Job
from mistudio_client.resources import _id, _layer, _poll, _Resource

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

    def transcoder_set(self, model: Any) -> list[dict[str, Any]]:
        """One completed transcoder per layer of ``model``, in layer order: what an attribution
        graph takes. Each layer's newest completed transcoder (cancelled, failed and running ones
        left out); ``MistudioError`` naming the layers that have none."""
        state = self.client.models.get(model)
        completed = [
            row for row in self.list(model=state["id"])
            if row.get("hook_name_out") and row.get("status") == "completed" and _layer(row) is not None
        ]  # fmt: skip
        chosen: dict[int, dict[str, Any]] = {}
        for row in sorted(completed, key=lambda row: row.get("created_at") or ""):
            chosen[_layer(row)] = row  # the newest last
        missing = [layer for layer in range(state.get("num_layers") or 0) if layer not in chosen]
        if missing or not chosen:
            raise MistudioError(
                f"{state['name']} has no completed transcoder at layer(s) {missing or 'any'}: train one "
                "per layer (mi.saes.train_group(..., transcoders=[...])) or import a set "
                "(mi.saes.import_transcoders)."
            )
        return [chosen[layer] for layer in sorted(chosen)]

    def evaluate(
        self, sae: Any, *, cache: Any = None, wait: bool = True, timeout: float = 3600
    ) -> dict[str, Any]:
        """Evaluate on the held-out part of a cache (default: the training cache) with CE loss
        recovered; with ``wait``, the evaluation's metrics once it ends (else the 202 answer)."""
        body = {} if cache is None else {"cache_id": _id(cache)}
        answer = self.client.request("POST", f"saes/{_id(sae)}/evaluate", json=body)
        if not wait:
            return answer
        row = _poll(
            lambda: self.get(sae),
            lambda row: row.get("evaluation_status"),
            timeout=timeout,
            interval=0.5,
            what=lambda row: f"the evaluation of {_id(sae)} is still {row['evaluation_status']}",
        )
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

    def stop_group(self, group: Any) -> dict:
        """Stop a running group early and keep it: its members are evaluated and saved from what
        they have learnt (its job then completes); a queued group is cancelled."""
        return self.client.request("POST", f"saes/groups/{_id(group)}/stop")

    def delete_group(self, group: Any) -> None:
        """Delete an ended group (its member SAEs stay; delete those with :meth:`delete`)."""
        self._delete(f"saes/groups/{_id(group)}")

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

    def analyze(
        self,
        sae: Any,
        *,
        cache: Any = None,
        dataset: Any = None,
        sample_count: int | None = None,
        max_length: int | None = None,
        shared: bool = False,
    ) -> Job:
        """Analyse the SAE's features over a cache, or over a dataset read straight through the
        SAE's model (no cache written; ``sample_count`` samples of ``max_length`` tokens). Neither:
        its training cache, else its training dataset through the model. An ``fa_…`` job."""
        body: dict[str, Any] = {"shared": shared}
        for name, value in (("cache_id", cache), ("dataset_id", dataset)):
            if value is not None:
                body[name] = _id(value)
        for name, value in (("sample_count", sample_count), ("max_length", max_length)):
            if value is not None:
                body[name] = value
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
        return self._download(f"saes/{_id(sae)}/features/export", path)

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
        self,
        graph: Any,
        *,
        node_threshold: float | None = None,
        edge_threshold: float | None = None,
        subgraph: Any = None,
    ) -> dict:
        """The graph pruned at the thresholds, in the Neuronpedia graph JSON (as ``subgraph``, a
        saved one of it, reads it: its pins, supernodes, thresholds and annotations)."""
        params = {
            key: value
            for key, value in (
                ("node_threshold", node_threshold),
                ("edge_threshold", edge_threshold),
                ("subgraph", _id(subgraph) if subgraph is not None else None),
            )
            if value is not None
        }
        return self.client.request("GET", f"graphs/{_id(graph)}/nodes", params=params)

    def subgraphs(self, graph: Any) -> list[dict[str, Any]]:
        """The graph's saved subgraphs you may see."""
        return self.client.request("GET", f"graphs/{_id(graph)}/subgraphs")["subgraphs"]

    def save_subgraph(self, graph: Any, name: str, **fields: Any) -> dict[str, Any]:
        """Save a reading of the graph (``notes``, ``annotations`` {node id: text}, ``pinned``,
        ``supernodes``, thresholds, ``shared``; each defaults to the graph's own)."""
        return self.client.request("POST", f"graphs/{_id(graph)}/subgraphs", json={"name": name, **fields})

    def subgraph(self, subgraph: Any) -> dict[str, Any]:
        return self.client.request("GET", f"subgraphs/{_id(subgraph)}")

    def update_subgraph(self, subgraph: Any, **fields: Any) -> dict[str, Any]:
        return self._update(f"subgraphs/{_id(subgraph)}", fields)

    def delete_subgraph(self, subgraph: Any) -> None:
        self._delete(f"subgraphs/{_id(subgraph)}")

    def export_subgraph(self, subgraph: Any) -> dict[str, Any]:
        """The subgraph in Neuronpedia's subgraph form (its ``/api/graph/subgraph/save`` body)."""
        return self.client.request("GET", f"subgraphs/{_id(subgraph)}/export")

    def intervene(
        self, graph: Any, interventions: Sequence[dict[str, Any]], *, top: int = 10
    ) -> dict[str, Any]:
        """``[{"layer", "position", "feature", "value"}]`` in the graph's replacement model: the top
        logits before and after."""
        body = {"interventions": list(interventions), "top": top}
        return self.client.request("POST", f"graphs/{_id(graph)}/intervene", json=body)

    def export(self, graph: Any, path: str | Path) -> Path:
        """The graph JSON that Neuronpedia's viewer and circuit-tracer's local server load."""
        return self._download(f"graphs/{_id(graph)}/export", path)


# --- SAEBench --------------------------------------------------------------------------------------


class SaeBench(_Resource):
    """``/api/saebench``: judge SAEs by SAEBench's metrics (a job), compare them, export the results."""

    def run(
        self,
        saes: Sequence[Any] | None = None,
        *,
        group: Any = None,
        methods: Sequence[str] | None = None,
        dataset: Any = None,
        probing_dataset: Any = None,
        **options: Any,
    ) -> Job:
        """Judge ``saes`` (or a ``group``'s members) by ``methods`` (default: the core metrics) over
        ``dataset`` (default: the group's text); ``probing_dataset`` (a labelled dataset) for sparse
        probing. ``options``: ``core`` / ``sparse_probing`` settings, ``name``, ``shared``."""
        body: dict[str, Any] = dict(options)
        if group is not None:
            body["sae_group_id"] = _id(group)
        else:
            body["sae_ids"] = [_id(sae) for sae in saes or []]
        if methods is not None:
            body["methods"] = list(methods)
        if dataset is not None:
            body["dataset_id"] = _id(dataset)
        if probing_dataset is not None:
            body["probing_dataset_id"] = _id(probing_dataset)
        return Job(self.client, "bench", self.client.request("POST", "saebench", json=body)["id"])

    def get(self, run: Any) -> dict[str, Any]:
        return self.client.request("GET", f"saebench/{_id(run)}")

    def list(self, **filters: Any) -> list[dict[str, Any]]:
        return self.client.request("GET", "saebench", params=filters)["runs"]

    def update(self, run: Any, **fields: Any) -> dict[str, Any]:
        return self._update(f"saebench/{_id(run)}", fields)

    def delete(self, run: Any) -> None:
        self._delete(f"saebench/{_id(run)}")

    def results(self, run: Any) -> list[dict[str, Any]]:
        """Each (SAE, method) result the run finished, for the SAEs you may see."""
        return self.client.request("GET", f"saebench/{_id(run)}/results")["results"]

    def compare(
        self,
        saes: Sequence[Any] | None = None,
        *,
        group: Any = None,
        run: Any = None,
        sort: str | None = None,
        descending: bool = True,
    ) -> dict[str, Any]:
        """Every method's newest numbers per SAE (``columns`` and ``rows``), sorted by a column key."""
        params: dict[str, Any] = {"descending": descending}
        if run is not None:
            params["run_id"] = _id(run)
        elif group is not None:
            params["sae_group_id"] = _id(group)
        else:
            params["sae_ids"] = ",".join(_id(sae) for sae in saes or [])
        if sort is not None:
            params["sort"] = sort
        return self.client.request("GET", "saebench/compare", params=params)

    def export(self, run: Any, sae: Any, method: str = "core") -> dict[str, Any]:
        """One SAE's result in SAEBench's results JSON."""
        return self.client.request(
            "GET", f"saebench/{_id(run)}/export", params={"sae_id": _id(sae), "method": method}
        )
