"""The one JSON shape of an attribution graph row: the API, its events and snapshots show these."""

from typing import Any

from rest_framework import serializers

from circuits.models import AttributionGraph, Subgraph
from mistudio.access import AUDIENCE, linked_id
from mistudio.serializers import JobOutputSerializer, OutputSerializer
from saes.models import SparseAutoencoder


def iso(value) -> str | None:
    return value.isoformat() if value else None


def graph_state(graph: AttributionGraph, *, viewer=AUDIENCE) -> dict[str, Any]:
    """A graph row as ``GET /api/graphs/{id}`` shows it to ``viewer``: its transcoders' ids only
    where they may see those SAEs (None in their place otherwise)."""
    return {
        "id": graph.id,
        "name": graph.name,
        "model_id": graph.model_id,
        "transcoder_ids": [
            linked_id(viewer, graph, SparseAutoencoder, sae_id) for sae_id in graph.transcoders
        ],
        "prompt": graph.prompt,
        "tokens": graph.token_strings,
        "config": graph.config,
        "summary": graph.summary,
        "pinned": graph.pinned,
        "supernodes": graph.supernodes,
        "node_threshold": graph.node_threshold,
        "edge_threshold": graph.edge_threshold,
        "status": graph.status,
        "progress": graph.progress,
        "eta_seconds": graph.eta_seconds,
        "memory_estimate_bytes": graph.memory_estimate_bytes,
        "host_worker": graph.host_worker,
        "error_code": graph.error_code,
        "error_message": graph.error_message,
        "owner": graph.owner.username if graph.owner_id else None,
        "shared": graph.shared,
        "created_at": iso(graph.created_at),
        "started_at": iso(graph.started_at),
        "finished_at": iso(graph.finished_at),
    }


def graph_event_state(graph: AttributionGraph) -> dict[str, Any]:
    return graph_state(graph)


class GraphOutputSerializer(JobOutputSerializer):
    """:func:`graph_state`."""

    id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    model_id = serializers.CharField(allow_null=True)
    transcoder_ids = serializers.ListField(
        child=serializers.CharField(allow_null=True), help_text="None where the caller may not see it"
    )
    prompt = serializers.CharField(allow_blank=True)
    tokens = serializers.ListField(child=serializers.CharField(allow_blank=True))
    config = serializers.DictField()
    summary = serializers.DictField()
    pinned = serializers.ListField(child=serializers.CharField())
    supernodes = serializers.ListField(child=serializers.ListField(child=serializers.CharField()))
    node_threshold = serializers.FloatField()
    edge_threshold = serializers.FloatField()
    eta_seconds = serializers.FloatField(allow_null=True)
    memory_estimate_bytes = serializers.IntegerField()


class GraphListOutputSerializer(OutputSerializer):
    """``GET /api/graphs``: the newest 500 and how many there are."""

    graphs = GraphOutputSerializer(many=True)
    total = serializers.IntegerField()


class GraphViewOutputSerializer(OutputSerializer):
    """A graph pruned at thresholds, in Neuronpedia's graph JSON (``engine.attribution.neuronpedia``);
    ``mistudio`` (not in an export) adds the viewer's transcoder ids and the view's thresholds."""

    metadata = serializers.DictField()
    qParams = serializers.DictField()  # Neuronpedia's name
    nodes = serializers.ListField(child=serializers.DictField())
    links = serializers.ListField(child=serializers.DictField())
    mistudio = serializers.DictField(required=False)


class LogitOutputSerializer(OutputSerializer):
    token_id = serializers.IntegerField()
    token = serializers.CharField(allow_blank=True)
    probability = serializers.FloatField()
    logit = serializers.FloatField()


class InterventionResultOutputSerializer(OutputSerializer):
    """``POST /api/graphs/{id}/intervene``: the interventions with the values they replaced, and the
    top next-token logits before and after."""

    interventions = serializers.ListField(child=serializers.DictField())
    before = LogitOutputSerializer(many=True)
    after = LogitOutputSerializer(many=True)


def subgraph_state(subgraph: Subgraph) -> dict[str, Any]:
    """A saved subgraph as ``GET /api/subgraphs/{id}`` shows it."""
    return {
        "id": subgraph.id,
        "graph_id": subgraph.graph_id,
        "name": subgraph.name,
        "notes": subgraph.notes,
        "annotations": subgraph.annotations,
        "pinned": subgraph.pinned,
        "supernodes": subgraph.supernodes,
        "node_threshold": subgraph.node_threshold,
        "edge_threshold": subgraph.edge_threshold,
        "owner": subgraph.owner.username if subgraph.owner_id else None,
        "shared": subgraph.shared,
        "created_at": iso(subgraph.created_at),
        "updated_at": iso(subgraph.updated_at),
    }


class SubgraphOutputSerializer(OutputSerializer):
    id = serializers.CharField()
    graph_id = serializers.CharField()
    name = serializers.CharField()
    notes = serializers.CharField(allow_blank=True)
    annotations = serializers.DictField(child=serializers.CharField(allow_blank=True))
    pinned = serializers.ListField(child=serializers.CharField())
    supernodes = serializers.ListField(child=serializers.ListField(child=serializers.CharField()))
    node_threshold = serializers.FloatField()
    edge_threshold = serializers.FloatField()
    owner = serializers.CharField(allow_null=True)
    shared = serializers.BooleanField()
    created_at = serializers.CharField()
    updated_at = serializers.CharField()


class SubgraphListOutputSerializer(OutputSerializer):
    subgraphs = SubgraphOutputSerializer(many=True)


class SubgraphExportOutputSerializer(OutputSerializer):
    """Neuronpedia's subgraph form (its ``/api/graph/subgraph/save`` body)."""

    modelId = serializers.CharField()
    slug = serializers.CharField()
    displayName = serializers.CharField()
    pinnedIds = serializers.ListField(child=serializers.CharField())
    supernodes = serializers.ListField(child=serializers.ListField(child=serializers.CharField()))
    clerps = serializers.ListField(child=serializers.ListField(child=serializers.CharField()))
    pruningThreshold = serializers.FloatField()
    densityThreshold = serializers.FloatField(allow_null=True)
