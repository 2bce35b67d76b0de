from django.urls import path

from circuits import apis
from circuits.models import AttributionGraph
from mistudio.job_apis import job_routes

urlpatterns = [
    path("graphs", apis.GraphListApi.as_view(), name="graph-list"),
    *job_routes(AttributionGraph),
    path("graphs/<str:graph_id>/nodes", apis.GraphNodesApi.as_view(), name="graph-nodes"),
    path("graphs/<str:graph_id>/export", apis.GraphExportApi.as_view(), name="graph-export"),
    path("graphs/<str:graph_id>/intervene", apis.GraphInterveneApi.as_view(), name="graph-intervene"),
    path("graphs/<str:graph_id>/subgraphs", apis.GraphSubgraphListApi.as_view(), name="graph-subgraphs"),
    path("subgraphs/<str:subgraph_id>", apis.SubgraphApi.as_view(), name="subgraph"),
    path("subgraphs/<str:subgraph_id>/export", apis.SubgraphExportApi.as_view(), name="subgraph-export"),
]
