"""The attribution job's body, interventions and graph views, run by a worker."""

from __future__ import annotations

import copy
import time
from typing import Any

from activations.selectors import token_strings
from circuits.models import AttributionGraph
from circuits.selectors import graph_files_missing
from circuits.view_memory import stored_nodes_cap
from engine.configs import config_from_dict
from mistudio.errors import ApplicationError
from mistudio.events import ProgressThrottle
from mistudio.job_runner import JobContext, job_task
from mistudio.jobs import job_publish
from mistudio.workers import answer_call, worker_task
from models_app.tasks import model_in_this_worker, model_loaded_here
from saes.tasks import sae_module_by_id


def graph_transcoders(graph: AttributionGraph, model: Any) -> Any:
    """The graph's transcoders (layer 0 first; a cross-layer transcoder alone) on the model's
    device, in its dtype: the worker's cached modules where they already are, copies otherwise
    (the cache keeps its float32 ones)."""
    from engine.sae.clt import CrossLayerTranscoder

    parameter = next(model.parameters())
    modules = []
    for sae_id in graph.transcoders:
        module = sae_module_by_id(sae_id)
        if module.W_enc.dtype != parameter.dtype or module.W_enc.device != parameter.device:
            module = copy.deepcopy(module).to(device=parameter.device, dtype=parameter.dtype)
        modules.append(module)
    if len(modules) == 1 and isinstance(modules[0], CrossLayerTranscoder):
        return modules[0]
    return modules


@job_task(AttributionGraph, timeout=6 * 3600)
def run_attribution(graph: AttributionGraph, job: JobContext) -> None:
    """Attribute the graph's prompt (``engine.attribution.attribute``) and store the graph and its
    bounded view (what the web shows)."""
    from engine.attribution import AttributionConfig, attribute

    if graph.model_id is None:
        raise ApplicationError("MODEL_NOT_FOUND", "The graph's model is gone.")
    loaded = model_in_this_worker(graph.model_id, graph, purpose="an attribution graph")
    transcoders = graph_transcoders(graph, loaded.model)
    config = config_from_dict(AttributionConfig, graph.config)
    throttle = ProgressThrottle(min_step=2.0, min_interval=0.5)

    def progress(done: int, total: int) -> None:
        job.check_cancel()
        percent = 100 * done / max(1, total)
        if throttle.ready(percent, final=done == total):
            job_publish(graph, "progress", graph.mark_progress(done=done, total=total))

    started = time.monotonic()
    result = attribute(loaded.model, transcoders, graph.tokens, config, progress=progress)
    seconds = time.monotonic() - started
    job.check_cancel()
    result.save(graph.directory)
    view = save_graph_view(graph, result)
    kept = view.prune(min(graph.node_threshold, view.max_node_threshold), graph.edge_threshold)
    logit_ids = result.logit_tokens.tolist()
    target = result.info.get("target")
    if target:  # its tokens' text beside their ids
        target = {**target, "token_strings": token_strings(loaded.tokenizer, target["tokens"])}
    summary = {
        **result.info,
        "seconds": round(seconds, 3),
        "nodes": result.n_nodes,
        "pruned_nodes": int(kept.nodes.sum()),
        "pruned_edges": int(kept.edges.sum()),
        "view": view.info,
        "completeness_error": result.completeness_error(),
        **({"target": target} if target else {}),
        "logits": [
            {"token_id": token, "token": text, "probability": round(float(probability), 6)}
            for token, text, probability in zip(
                logit_ids,
                token_strings(loaded.tokenizer, logit_ids),
                result.logit_probabilities.tolist(),
                strict=True,
            )
        ],
    }
    job_publish(graph, "completed", graph.mark_completed(summary=summary))


def save_graph_view(graph: AttributionGraph, full: Any):
    """Make and save the bounded view of ``full`` (the row's engine graph) that the web prunes
    (``engine.attribution.prunable``), sized to the web's memory budget for graph views."""
    from engine.attribution import PrunableGraph

    view = PrunableGraph.of(full, max_nodes=stored_nodes_cap(full.n_positions + full.n_logits))
    view.info = {"stored_nodes": view.n_stored, "max_node_threshold": view.max_node_threshold}
    if "target" in full.info:  # what the logit nodes stand for, when not the top logits
        view.info["target"] = full.info["target"]
    view.save(graph.directory)
    return view


@worker_task(timeout=600)
def make_graph_view(request_id: str, graph_id: str) -> None:
    """The view of a graph made before views were, for ``services.graph_view_prepare``."""

    def compute() -> dict[str, Any]:
        from engine.attribution import AttributionGraph as EngineGraph
        from engine.attribution.prunable import VIEW_FILENAME

        graph = AttributionGraph.objects.get(pk=graph_id)
        if not (graph.directory / VIEW_FILENAME).is_file():  # another call made it meanwhile
            try:
                full = EngineGraph.load(graph.directory)
            except (OSError, ValueError, KeyError):
                raise graph_files_missing() from None
            save_graph_view(graph, full)
        return {"graph_id": graph_id}

    answer_call(request_id, compute, failure_code="GRAPH_VIEW_FAILED")


@worker_task(timeout=600)
def run_intervention(request_id: str, graph_id: str, interventions: list[dict[str, Any]], top: int) -> None:
    def compute() -> dict[str, Any]:
        import torch

        from engine.attribution.intervention import FeatureIntervention, intervene

        graph = AttributionGraph.objects.get(pk=graph_id)
        loaded = model_loaded_here(graph.model_id)
        transcoders = graph_transcoders(graph, loaded.model)
        chosen = [FeatureIntervention(**item) for item in interventions]
        try:
            result = intervene(loaded.model, transcoders, graph.tokens, chosen)
        except ValueError as error:
            raise ApplicationError("INVALID_INTERVENTIONS", str(error)) from None

        def top_logits(logits) -> list[dict[str, Any]]:
            probabilities = torch.softmax(logits.float(), -1)
            values, ids = probabilities.topk(top)
            texts = token_strings(loaded.tokenizer, ids.tolist())
            return [
                {
                    "token_id": int(token),
                    "token": text,
                    "probability": round(float(p), 6),
                    "logit": float(logits[token]),
                }
                for token, text, p in zip(ids.tolist(), texts, values.tolist(), strict=True)
            ]

        return {
            "interventions": [
                {**item, "previous": previous}
                for item, previous in zip(interventions, result.previous_values, strict=True)
            ],
            "before": top_logits(result.logits_before),
            "after": top_logits(result.logits_after),
        }

    answer_call(request_id, compute, failure_code="INTERVENTION_FAILED")
