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
]
