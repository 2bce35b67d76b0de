"""Attribution-graph workflows: a request (a job on the model's worker), the owner's changes (name,
sharing, pinned nodes, supernodes, thresholds), cancel, delete, interventions (answered by the
model's worker) and the bounded view of a graph made before views were (made by a worker). Every
front door (API, pages, admin, ``manage.py attribute_prompt``) calls these."""

from __future__ import annotations

import re
from dataclasses import asdict, replace
from typing import Any

from django.db import transaction

from activations.selectors import model_files_missing, model_folder, token_strings, tokenizer_for
from circuits.models import AttributionGraph, Subgraph
from circuits.selectors import graph_files_missing
from engine import budgets
from engine.attribution import AttributionConfig, attribution_tokens
from engine.attribution.graph import TENSORS_FILENAME
from engine.attribution.prunable import VIEW_FILENAME
from engine.generation.params import config_context_length
from engine.hooks import layer_of_transcoder_hooks
from mistudio import jobs
from mistudio.access import OPERATOR, check_may_change, reach
from mistudio.budgets import memory_budget, memory_budget_check
from mistudio.errors import ApplicationError
from mistudio.text import check_label_text
from mistudio.workers import call_worker, read_heartbeats
from models_app.models import LanguageModel
from models_app.services import model_heads, model_host, model_job_queue, model_worker_name
from saes.models import SparseAutoencoder

MAX_PROMPT_CHARACTERS = 8000
MAX_GRAPH_TOKENS = 1024
MAX_PINNED = 500
MAX_ANNOTATION_CHARACTERS = 2_000
MAX_SUPERNODES = 100
MAX_INTERVENTIONS = 64
INTERVENTION_WAIT_SECONDS = 120
VIEW_WAIT_SECONDS = 120
# Without a measured L0, the active features a transcoder is assumed to have per token.
ASSUMED_ACTIVE_PER_TOKEN = 64
_NODE_ID = re.compile(r"^(E|\d+)_\d+_\d+$")


def transcoder_layer(sae: SparseAutoencoder) -> int | None:
    """The layer whose MLP ``sae`` stands in for (it reads that MLP's input and predicts its
    output), or None when it is no such transcoder."""
    return layer_of_transcoder_hooks(sae.hook_name, sae.hook_name_out)


def check_transcoder_set(model: LanguageModel, transcoders: list[SparseAutoencoder]) -> None:
    """One completed MLP transcoder of ``model`` per layer, in layer order, or one cross-layer
    transcoder over all its layers (400 ``INVALID_TRANSCODERS`` saying what is wrong otherwise)."""
    problems = []
    if any(sae.is_cross_layer for sae in transcoders):
        if len(transcoders) != 1:
            problems.append("a cross-layer transcoder replaces every MLP alone: give only its id")
        elif transcoders[0].n_layers != model.num_layers:
            clt_layers = transcoders[0].n_layers
            problems.append(f"{model.name} has {model.num_layers} layers and the CLT {clt_layers}")
    elif len(transcoders) != (model.num_layers or 0):
        problems.append(
            f"{model.name} has {model.num_layers} layers and {len(transcoders)} transcoders were given"
        )
    for position, sae in enumerate(transcoders):
        layer = 0 if sae.is_cross_layer else transcoder_layer(sae)
        if layer != position:
            problems.append(
                f"{sae.id} reads {sae.hook_name} and writes {sae.hook_name_out or 'its input'}, not layer "
                f"{position}'s MLP input and output"
            )
        if sae.model_id != model.id:
            problems.append(f"{sae.id} belongs to another model")
    if problems:
        raise ApplicationError(
            "INVALID_TRANSCODERS",
            "An attribution graph needs one transcoder per layer, each from that layer's MLP input to its "
            "output: " + "; ".join(problems[:5]) + ".",
            details={"problems": problems[:20]},
        )


def transcoders_of_group(group) -> list[SparseAutoencoder]:
    """The MLP transcoders among a group's members, in layer order (one per layer)."""
    members = [sae for sae in group.members.all() if transcoder_layer(sae) is not None]
    return sorted(members, key=transcoder_layer)


def prompt_tokens(model: LanguageModel, prompt: str) -> tuple[list[int], list[str]]:
    """The ids attributed (a special token first) and their text, with the model's tokenizer."""
    if not prompt.strip() or len(prompt) > MAX_PROMPT_CHARACTERS:
        raise ApplicationError(
            "INVALID_PROMPT", f"The prompt must be 1 to {MAX_PROMPT_CHARACTERS} characters.",
            details={"fields": {"prompt": ["1 to 8000 characters."]}},
        )  # fmt: skip
    folder = model_folder(model)
    if folder is None:
        raise model_files_missing(model)
    tokenizer = tokenizer_for(str(folder))
    tokens = attribution_tokens(tokenizer, prompt)
    context = min(MAX_GRAPH_TOKENS, config_context_length(model.config or {}) or MAX_GRAPH_TOKENS)
    if len(tokens) > context:
        raise ApplicationError(
            "PROMPT_TOO_LONG",
            f"The prompt is {len(tokens)} tokens (with the special token first); at most {context} fit.",
            details={"tokens": len(tokens), "limit": context},
        )
    if len(tokens) < 2:
        raise ApplicationError("INVALID_PROMPT", "The prompt needs at least one token.")
    return tokens, token_strings(tokenizer, tokens)


MAX_TARGET_TOKENS = 10


def target_ids(model: LanguageModel, texts: list[str], field: str) -> tuple[int, ...]:
    """The token id of each text (exactly one token each, as circuit-tracer asks of target
    strings; 400 ``INVALID_TARGET`` naming the text and what it became otherwise)."""
    tokenizer = tokenizer_for(str(model_folder(model)))
    ids = []
    for text in texts:
        found = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(found) != 1:
            pieces = [tokenizer.decode([token]) for token in found]
            raise ApplicationError(
                "INVALID_TARGET",
                f"{text!r} is {len(found)} tokens ({pieces!r}), not one: give single tokens (mind the "
                "leading space a word after another has).",
                details={"fields": {field: [f"{text!r} is not one token."]}},
            )
        ids.append(int(found[0]))
    return tuple(ids)


def graph_estimate(
    model: LanguageModel, transcoders: list[SparseAutoencoder], tokens: int, config: AttributionConfig
):
    """The job's peak memory (``engine.budgets.attribution``), with the active features a
    transcoder has per token taken from its evaluation's L0 when it has one."""
    layers = model.num_layers or len(transcoders)
    per_token = [
        min(sae.d_sae, int(2 * ((sae.evaluation or {}).get("l0") or ASSUMED_ACTIVE_PER_TOKEN / 2)) + 1)
        for sae in transcoders
        for _ in range(sae.n_layers or 1)  # a cross-layer transcoder's features at each layer
    ]
    active = sum(per_token) * tokens
    feature_rows = min(config.max_feature_nodes or active, active)
    return budgets.attribution(
        tokens=tokens, hidden=model.hidden_size or 0, layers=layers, heads=model_heads(model),
        d_sae=max(sae.d_sae for sae in transcoders), batch_size=config.batch_size, feature_rows=feature_rows,
        active=active, logits=config.max_n_logits,
    )  # fmt: skip


def graph_request(
    *,
    owner,
    model: LanguageModel,
    transcoders: list[SparseAutoencoder],
    prompt: str,
    max_feature_nodes: int | None = None,
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    batch_size: int = 32,
    target_tokens: list[str] | None = None,
    target_difference: list[str] | None = None,
    name: str = "",
    shared: bool = False,
) -> AttributionGraph:
    """Queue the attribution graph of ``prompt`` through ``transcoders`` (one per layer, each one
    ``owner`` may use; or one cross-layer transcoder). It explains the top logits, or the logits
    of ``target_tokens``, or ``target_difference``: its first token's logit minus its second's
    (texts of one token each, 400 ``INVALID_TARGET`` otherwise). The graph's matrices are kept
    within the worker's memory budget: past it, fewer feature nodes are kept (the most
    influential), never a failure."""
    check_label_text(name, field="name")
    actor = owner or OPERATOR
    transcoders = [reach(actor, sae) for sae in transcoders]
    for sae in transcoders:
        if sae.status != SparseAutoencoder.Status.COMPLETED:
            raise ApplicationError("SAE_NOT_READY", f"The transcoder {sae.id} is {sae.status}.", status=409)
    check_transcoder_set(model, transcoders)
    if target_tokens is not None and target_difference is not None:
        raise ApplicationError("INVALID_TARGET", "Give target_tokens or target_difference, not both.")
    tokens, strings = prompt_tokens(model, prompt)
    config = AttributionConfig(
        max_n_logits=max_n_logits, desired_logit_prob=desired_logit_prob, batch_size=batch_size,
        max_feature_nodes=max_feature_nodes,
        target_tokens=target_ids(model, target_tokens, "target_tokens") if target_tokens else None,
        target_difference=(
            target_ids(model, target_difference, "target_difference") if target_difference else None
        ),
    )  # fmt: skip
    worker = model_worker_name(model)
    estimate = graph_estimate(model, transcoders, len(tokens), config)
    limit = memory_budget(worker_name=worker)
    if limit is not None:
        # Everything but the graph's matrices must fit as it is; the matrices take what is left
        # (the job keeps fewer feature nodes, the most influential, when they would need more).
        fixed = estimate.total - estimate.parts["the graph's matrices"]
        memory_budget_check(
            budgets.MemoryEstimate({**estimate.parts, "the graph's matrices": 0}),
            what="this attribution graph", worker_name=worker,
        )  # fmt: skip
        matrices = min(estimate.parts["the graph's matrices"], limit - fixed)
        estimate = budgets.MemoryEstimate({**estimate.parts, "the graph's matrices": matrices})
        config = replace(config, matrix_limit_bytes=limit - fixed)
    with transaction.atomic():
        jobs.job_admit(owner=owner, tokens=len(tokens) * batch_size)
        graph = AttributionGraph.objects.create(
            name=name,
            model=model,
            transcoders=[sae.id for sae in transcoders],
            prompt=prompt,
            tokens=tokens,
            token_strings=strings,
            config=asdict(config),
            memory_estimate_bytes=estimate.total,
            owner=owner if getattr(owner, "is_authenticated", False) else None,
            shared=shared,
        )
        jobs.job_submit(graph, queue=model_job_queue(model.id))
    return graph


def _node_ids(values: Any, field: str, limit: int) -> list[str]:
    if (
        not isinstance(values, list)
        or len(values) > limit
        or not all(isinstance(value, str) and _NODE_ID.match(value) for value in values)
    ):
        raise ApplicationError(
            "INVALID_NODES", f"{field} must be at most {limit} node ids such as 3_1207_5 or E_262_0.",
            details={"fields": {field: ["Node ids."]}},
        )  # fmt: skip
    return list(dict.fromkeys(values))


def _supernodes(values: Any) -> list[list[str]]:
    if not isinstance(values, list) or len(values) > MAX_SUPERNODES:
        raise ApplicationError(
            "INVALID_NODES", f"supernodes must be a list of at most {MAX_SUPERNODES} groups."
        )
    groups = []
    for group in values:
        if not isinstance(group, list) or len(group) < 2 or not isinstance(group[0], str):
            raise ApplicationError(
                "INVALID_NODES", "Each supernode is [name, node id, ...] with at least one node.",
                details={"fields": {"supernodes": ["[name, node id, ...]"]}},
            )  # fmt: skip
        check_label_text(group[0], field="supernode name")
        groups.append([group[0], *_node_ids(group[1:], "supernodes", MAX_PINNED)])
    return groups


def checked_reading(changes: dict[str, Any]) -> dict[str, Any]:
    """A reading of a graph (a graph row's own, or a subgraph's) checked: pinned node ids,
    supernodes ([name, node id, ...]), prune thresholds (fractions in [0, 1]), and a subgraph's
    notes and per-node annotations (node id to text); 400 otherwise."""
    if "pinned" in changes:
        changes["pinned"] = _node_ids(changes["pinned"], "pinned", MAX_PINNED)
    if "supernodes" in changes:
        changes["supernodes"] = _supernodes(changes["supernodes"])
    for field in ("node_threshold", "edge_threshold"):
        if field in changes and not 0.0 <= float(changes[field]) <= 1.0:
            raise ApplicationError("INVALID_THRESHOLD", f"{field} must be between 0 and 1.")
    if "annotations" in changes:
        notes = changes["annotations"]
        fits = isinstance(notes, dict) and len(notes) <= MAX_PINNED
        if not fits or not all(
            isinstance(text, str) and len(text) <= MAX_ANNOTATION_CHARACTERS for text in notes.values()
        ):
            raise ApplicationError(
                "INVALID_NODES",
                f"annotations map at most {MAX_PINNED} node ids to texts of at most "
                f"{MAX_ANNOTATION_CHARACTERS:,} characters.",
            )
        _node_ids(list(notes), "annotations", MAX_PINNED)
    return changes


def graph_update(*, graph: AttributionGraph, actor, **changes: Any) -> AttributionGraph:
    """Change the owner's fields: name, shared, and its reading (:func:`checked_reading`)."""
    jobs.job_update(graph, actor=actor, changes=checked_reading(changes))
    return graph


def subgraph_create(*, graph: AttributionGraph, actor, name: str, **fields: Any) -> Subgraph:
    """Save a reading of ``graph`` (one the actor may see) as the actor's subgraph: ``name``, and
    ``notes``, ``annotations``, ``pinned``, ``supernodes``, the thresholds and ``shared``, each
    defaulting to what the graph row holds now (what its page shows)."""
    check_label_text(name, field="name")
    if not name.strip():
        raise ApplicationError(
            "INVALID_NAME", "A subgraph needs a name.", details={"fields": {"name": ["Required."]}}
        )
    if graph.status != AttributionGraph.Status.COMPLETED:
        raise ApplicationError("GRAPH_NOT_READY", f"The graph is {graph.status}.", status=409)
    reading = {
        field: getattr(graph, field) for field in ("pinned", "supernodes", "node_threshold", "edge_threshold")
    }
    fields = checked_reading({**reading, **fields})
    owner = actor if getattr(actor, "is_authenticated", False) else None
    return Subgraph.objects.create(graph=graph, owner=owner, name=name, **fields)


def subgraph_update(*, subgraph: Subgraph, actor, **changes: Any) -> Subgraph:
    check_may_change(subgraph, actor, what="subgraph")
    if "name" in changes:
        check_label_text(changes["name"], field="name")
    for field, value in checked_reading(changes).items():
        setattr(subgraph, field, value)
    subgraph.save()
    return subgraph


def subgraph_delete(*, subgraph: Subgraph, actor) -> None:
    check_may_change(subgraph, actor, what="subgraph")
    subgraph.delete()


def graph_cancel(*, graph: AttributionGraph, actor) -> AttributionGraph:
    return jobs.job_cancel(graph, actor=actor)


def graph_delete(*, graph: AttributionGraph, actor) -> None:
    """Delete the row; its files follow on commit. A graph being computed must be cancelled first."""
    check_may_change(graph, actor, what="attribution graph")
    if graph.status in AttributionGraph.ACTIVE:
        raise ApplicationError("GRAPH_BUSY", "The graph is being computed; cancel it first.", status=409)
    graph.delete()


def graph_intervene(
    *, graph: AttributionGraph, actor, interventions: list[dict[str, Any]], top: int = 10
) -> dict:
    """Set or ablate features of the graph's transcoders in the replacement model (frozen attention
    and norms, errors held) and read the new top logits, on the model's worker. Each intervention
    is ``{"layer", "position", "feature", "value"}`` (value 0 ablates)."""
    if graph.status != AttributionGraph.Status.COMPLETED:
        raise ApplicationError("GRAPH_NOT_READY", f"The graph is {graph.status}.", status=409)
    if graph.model is None:
        raise ApplicationError("MODEL_NOT_FOUND", "The graph's model is gone.", status=404)
    reach(actor, graph.model)
    n_layers = 0
    for sae_id in graph.transcoders:
        sae = SparseAutoencoder.objects.filter(pk=sae_id).first()
        if sae is None:
            raise ApplicationError("SAE_NOT_FOUND", "One of the graph's transcoders is gone.", status=404)
        reach(actor, sae)
        n_layers += sae.n_layers or 1
    if not isinstance(interventions, list) or not 1 <= len(interventions) <= MAX_INTERVENTIONS:
        raise ApplicationError("INVALID_INTERVENTIONS", f"Give 1 to {MAX_INTERVENTIONS} interventions.")
    checked = []
    for item in interventions:
        try:
            layer, position, feature = (int(item[key]) for key in ("layer", "position", "feature"))
            value = float(item.get("value", 0.0))
        except (KeyError, TypeError, ValueError):
            raise ApplicationError(
                "INVALID_INTERVENTIONS", "Each intervention is {layer, position, feature, value}."
            ) from None
        if not (0 <= layer < n_layers and 0 <= position < len(graph.tokens) and feature >= 0
                and abs(value) < 1e6):  # fmt: skip
            raise ApplicationError("INVALID_INTERVENTIONS", "An intervention is outside the graph.")
        checked.append({"layer": layer, "position": position, "feature": feature, "value": value})
    worker = model_host(graph.model)
    return call_worker(
        worker, "circuits.tasks.run_intervention", graph.id, checked, max(1, min(int(top), 50)),
        wait_seconds=INTERVENTION_WAIT_SECONDS, owner=actor,
    )  # fmt: skip


def graph_view_prepare(*, graph: AttributionGraph, actor=None) -> None:
    """Have a worker make the bounded view of a completed graph that has none (one made before
    views were; the job makes it for every new graph), so that the web never reads a graph's full
    matrix: the graph's own worker when it is alive, else any (503 ``NO_WORKER`` when none is).
    Nothing to do when the view is there; 409 ``GRAPH_FILES_MISSING`` when the graph is gone too."""
    if (graph.directory / VIEW_FILENAME).is_file():
        return
    if not (graph.directory / TENSORS_FILENAME).is_file():
        raise graph_files_missing()
    alive = [beat["name"] for beat in read_heartbeats()]
    if not alive:
        raise ApplicationError(
            "NO_WORKER",
            "This graph's view is made by a worker (it was computed before views were kept), and no worker "
            "is running: start one (python manage.py worker).",
            status=503,
            details={"retry_after_seconds": 30},
        )
    worker = graph.host_worker if graph.host_worker in alive else alive[0]
    call_worker(
        worker, "circuits.tasks.make_graph_view", graph.id, wait_seconds=VIEW_WAIT_SECONDS, owner=actor
    )
