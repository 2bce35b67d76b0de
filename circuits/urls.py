from django.urls import path

from circuits import apis

urlpatterns = [
    path("graphs", apis.GraphListApi.as_view(), name="graph-list"),
    path("graphs/<str:graph_id>", apis.GraphDetailApi.as_view(), name="graph-detail"),
    path("graphs/<str:graph_id>/cancel", apis.GraphCancelApi.as_view(), name="graph-cancel"),
    path("graphs/<str:graph_id>/nodes", apis.GraphNodesApi.as_view(), name="graph-nodes"),
    path("graphs/<str:graph_id>/export", apis.GraphExportApi.as_view(), name="graph-export"),
    path("graphs/<str:graph_id>/intervene", apis.GraphInterveneApi.as_view(), name="graph-intervene"),
]
