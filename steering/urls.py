from django.urls import path

from mistudio.job_apis import job_routes
from steering import apis
from steering.models import SteeringVector

urlpatterns = [
    path("steering-vectors", apis.VectorListApi.as_view(), name="steering-vector-list"),
    path("steering-vectors/import", apis.VectorImportApi.as_view(), name="steering-vector-import"),
    *job_routes(SteeringVector),
    path(
        "steering-vectors/<str:vector_id>/export",
        apis.VectorExportApi.as_view(),
        name="steering-vector-export",
    ),
    path("models/<str:model_id>/patching", apis.PatchingApi.as_view(), name="model-patching"),
    path("models/<str:model_id>/logit-lens", apis.LogitLensApi.as_view(), name="model-logit-lens"),
]
