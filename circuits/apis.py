"""REST API for attribution graphs (thin views)."""

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from circuits import selectors, services
from circuits.models import AttributionGraph
from circuits.serializers import (
    GraphListOutputSerializer,
    GraphOutputSerializer,
    GraphViewOutputSerializer,
    InterventionResultOutputSerializer,
    SubgraphExportOutputSerializer,
    SubgraphListOutputSerializer,
    SubgraphOutputSerializer,
    graph_state,
    subgraph_state,
)
from generation.services import generation_model
from mistudio.errors import ApplicationError
from mistudio.job_apis import JobApi
from mistudio.permissions import CanRead, CanWrite
from mistudio.serializers import StrictSerializer
from mistudio.throttling import GraphViewThrottle, WorkerCallThrottle
from saes.selectors import completed_sae, group_get


class ThresholdSerializer(StrictSerializer):
    node_threshold = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    edge_threshold = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    subgraph = serializers.CharField(
        max_length=64,
        required=False,
        help_text="A saved subgraph of this graph: its pins, supernodes, thresholds",
    )


class GraphListApi(APIView):
    """The attribution graphs you can see, or attribute a prompt (202: a job on the model's worker)."""

    permission_classes = [CanWrite]

    class FilterSerializer(StrictSerializer):
        model_id = serializers.CharField(max_length=64, required=False)

    class InputSerializer(StrictSerializer):
        model_id = serializers.CharField(max_length=500)
        prompt = serializers.CharField(max_length=services.MAX_PROMPT_CHARACTERS, trim_whitespace=False)
        transcoder_ids = serializers.ListField(
            child=serializers.CharField(max_length=64), required=False, max_length=256
        )
        sae_group_id = serializers.CharField(max_length=64, required=False)
        max_feature_nodes = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
        max_n_logits = serializers.IntegerField(min_value=1, max_value=50, default=10)
        desired_logit_prob = serializers.FloatField(min_value=0.01, max_value=1.0, default=0.95)
        batch_size = serializers.IntegerField(min_value=1, max_value=1024, default=32)
        # What the graph explains, instead of the top logits: these tokens' logits, or one target,
        # the first token's logit minus the second's. Each text must be one token of the model.
        target_tokens = serializers.ListField(
            child=serializers.CharField(max_length=100, trim_whitespace=False), required=False,
            min_length=1, max_length=services.MAX_TARGET_TOKENS,
        )  # fmt: skip
        target_difference = serializers.ListField(
            child=serializers.CharField(max_length=100, trim_whitespace=False), required=False,
            min_length=2, max_length=2,
        )  # fmt: skip
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)

    @extend_schema(
        operation_id="api_graphs_list",
        parameters=[FilterSerializer],
        responses={200: GraphListOutputSerializer},
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        graphs = selectors.graph_list(user=request.user, model_id=filters.validated_data.get("model_id"))
        rows = [graph_state(row, viewer=request.user) for row in graphs[:500]]
        return Response({"graphs": rows, "total": graphs.count()})

    @extend_schema(request=InputSerializer, responses={202: GraphOutputSerializer})
    def post(self, request):
        graph = graph_from_body(request.user, request.data)
        return Response(graph_state(graph, viewer=request.user), status=status.HTTP_202_ACCEPTED)


def graph_from_body(user, body) -> AttributionGraph:
    """The graph ``POST /api/graphs``'s body asks for, queued (the new-graph page posts the same)."""
    data = GraphListApi.InputSerializer(data=body)
    data.is_valid(raise_exception=True)
    values = dict(data.validated_data)
    model = generation_model(user=user, model_ref=values.pop("model_id"))
    values["transcoders"] = graph_transcoders(
        user, values.pop("transcoder_ids", None), values.pop("sae_group_id", None)
    )
    return services.graph_request(owner=user, model=model, **values)


def graph_transcoders(user, transcoder_ids: list[str] | None, group_id: str | None):
    """The transcoders a request names: a list of SAE ids (layer 0 first) or an SAE group's."""
    if (transcoder_ids is None) == (group_id is None):
        raise ApplicationError(
            "TRANSCODERS_REQUIRED", "Give transcoder_ids (one per layer, layer 0 first) or sae_group_id.",
            details={"fields": {"transcoder_ids": ["Or sae_group_id."]}},
        )  # fmt: skip
    if group_id is not None:
        return services.transcoders_of_group(group_get(user=user, group_id=group_id))
    return [completed_sae(user=user, sae_id=sae_id) for sae_id in transcoder_ids]


GRAPH_API = JobApi(
    route="graphs/<str:graph_id>",
    name="graph",
    component="Graph",
    row="graph",
    find=selectors.graph_get,
    body=lambda graph, request: graph_state(graph, viewer=request.user),
    update=services.graph_update,
    update_fields={
        "name": serializers.CharField(max_length=500, required=False, allow_blank=True),
        "shared": serializers.BooleanField(required=False),
        "pinned": serializers.JSONField(required=False),
        "supernodes": serializers.JSONField(required=False),
        "node_threshold": serializers.FloatField(min_value=0.0, max_value=1.0, required=False),
        "edge_threshold": serializers.FloatField(min_value=0.0, max_value=1.0, required=False),
    },
    delete=services.graph_delete,
    cancel=services.graph_cancel,
    cancel_doc="Cancel a graph being computed (its owner or an admin).",
)


def _graph_view(request, graph_id: str, *, export: bool) -> tuple[AttributionGraph, HttpResponse]:
    graph = selectors.completed_graph(user=request.user, graph_id=graph_id)
    thresholds = ThresholdSerializer(data=request.query_params)
    thresholds.is_valid(raise_exception=True)
    services.graph_view_prepare(graph=graph, actor=request.user)
    values = dict(thresholds.validated_data)
    if "subgraph" in values:
        subgraph = selectors.subgraph_get(user=request.user, subgraph_id=values["subgraph"])
        if subgraph.graph_id != graph.id:
            raise ApplicationError("SUBGRAPH_NOT_FOUND", "No such subgraph of this graph.", status=404)
        values["subgraph"] = subgraph
    body = selectors.graph_view(user=request.user, graph=graph, export=export, **values)
    return graph, HttpResponse(body, content_type="application/json")


class GraphNodesApi(APIView):
    """The graph pruned at the thresholds (the graph's own by default): its nodes and links in the
    Neuronpedia graph JSON, feature nodes labelled with what you may see."""

    permission_classes = [CanRead]
    throttle_classes = [GraphViewThrottle]

    @extend_schema(parameters=[ThresholdSerializer], responses={200: GraphViewOutputSerializer})
    def get(self, request, graph_id: str):
        return _graph_view(request, graph_id, export=False)[1]


class GraphExportApi(APIView):
    """The graph as a file that Neuronpedia's graph viewer and circuit-tracer's local server load."""

    permission_classes = [CanRead]
    throttle_classes = [GraphViewThrottle]

    @extend_schema(parameters=[ThresholdSerializer], responses={200: GraphViewOutputSerializer})
    def get(self, request, graph_id: str):
        graph, response = _graph_view(request, graph_id, export=True)
        response["Content-Disposition"] = f'attachment; filename="{graph.id}.json"'
        return response


class GraphInterveneApi(APIView):
    """Set or ablate features in the graph's replacement model and read the new top logits."""

    permission_classes = [CanWrite]
    throttle_classes = [WorkerCallThrottle]

    class InputSerializer(StrictSerializer):
        interventions = serializers.ListField(
            child=serializers.DictField(), max_length=services.MAX_INTERVENTIONS
        )
        top = serializers.IntegerField(min_value=1, max_value=50, default=10)

    @extend_schema(request=InputSerializer, responses={200: InterventionResultOutputSerializer})
    def post(self, request, graph_id: str):
        graph = selectors.graph_get(user=request.user, graph_id=graph_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(services.graph_intervene(graph=graph, actor=request.user, **data.validated_data))


class SubgraphFields(StrictSerializer):
    """A subgraph's fields (each defaults to the graph row's reading at creation)."""

    name = serializers.CharField(max_length=500)
    notes = serializers.CharField(max_length=10_000, required=False, allow_blank=True)
    annotations = serializers.DictField(
        child=serializers.CharField(max_length=services.MAX_ANNOTATION_CHARACTERS, allow_blank=True),
        required=False,
    )
    pinned = serializers.JSONField(required=False)
    supernodes = serializers.JSONField(required=False)
    node_threshold = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    edge_threshold = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    shared = serializers.BooleanField(required=False)


class GraphSubgraphListApi(APIView):
    """A graph's saved subgraphs you may see, or save one (yours; 201)."""

    permission_classes = [CanWrite]

    @extend_schema(responses={200: SubgraphListOutputSerializer})
    def get(self, request, graph_id: str):
        graph = selectors.graph_get(user=request.user, graph_id=graph_id)
        return Response(
            {
                "subgraphs": [
                    subgraph_state(row) for row in selectors.subgraph_list(user=request.user, graph=graph)
                ]
            }
        )

    @extend_schema(request=SubgraphFields, responses={201: SubgraphOutputSerializer})
    def post(self, request, graph_id: str):
        graph = selectors.graph_get(user=request.user, graph_id=graph_id)
        data = SubgraphFields(data=request.data)
        data.is_valid(raise_exception=True)
        subgraph = services.subgraph_create(graph=graph, actor=request.user, **data.validated_data)
        return Response(subgraph_state(subgraph), status=status.HTTP_201_CREATED)


class SubgraphApi(APIView):
    """A saved subgraph: read it, change it or delete it (its owner)."""

    permission_classes = [CanWrite]

    class ChangeSerializer(SubgraphFields):
        name = serializers.CharField(max_length=500, required=False)

    @extend_schema(responses={200: SubgraphOutputSerializer})
    def get(self, request, subgraph_id: str):
        return Response(subgraph_state(selectors.subgraph_get(user=request.user, subgraph_id=subgraph_id)))

    @extend_schema(request=ChangeSerializer, responses={200: SubgraphOutputSerializer})
    def patch(self, request, subgraph_id: str):
        subgraph = selectors.subgraph_get(user=request.user, subgraph_id=subgraph_id)
        data = self.ChangeSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        subgraph = services.subgraph_update(subgraph=subgraph, actor=request.user, **data.validated_data)
        return Response(subgraph_state(subgraph))

    @extend_schema(responses={204: None})
    def delete(self, request, subgraph_id: str):
        subgraph = selectors.subgraph_get(user=request.user, subgraph_id=subgraph_id)
        services.subgraph_delete(subgraph=subgraph, actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class SubgraphExportApi(APIView):
    """The subgraph in Neuronpedia's subgraph form (the body its ``/api/graph/subgraph/save`` takes)."""

    permission_classes = [CanRead]

    @extend_schema(responses={200: SubgraphExportOutputSerializer})
    def get(self, request, subgraph_id: str):
        subgraph = selectors.subgraph_get(user=request.user, subgraph_id=subgraph_id)
        response = Response(selectors.subgraph_export(subgraph))
        response["Content-Disposition"] = f'attachment; filename="{subgraph.id}.json"'
        return response
