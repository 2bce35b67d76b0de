from django.urls import path

from steering import apis

urlpatterns = [
    path("steering-vectors", apis.VectorListApi.as_view(), name="steering-vector-list"),
    path("steering-vectors/import", apis.VectorImportApi.as_view(), name="steering-vector-import"),
    path("steering-vectors/<str:vector_id>", apis.VectorDetailApi.as_view(), name="steering-vector-detail"),
    path(
        "steering-vectors/<str:vector_id>/cancel",
        apis.VectorCancelApi.as_view(),
        name="steering-vector-cancel",
    ),
    path(
        "steering-vectors/<str:vector_id>/export",
        apis.VectorExportApi.as_view(),
        name="steering-vector-export",
    ),
    path("models/<str:model_id>/patching", apis.PatchingApi.as_view(), name="model-patching"),
    path("models/<str:model_id>/logit-lens", apis.LogitLensApi.as_view(), name="model-logit-lens"),
]
