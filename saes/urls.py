from django.urls import path

from mistudio.job_apis import job_routes
from saes import apis
from saes.models import SaeGroup, SparseAutoencoder

urlpatterns = [
    path("saes", apis.SaeListApi.as_view(), name="sae-list"),
    path("saes/import", apis.SaeImportApi.as_view(), name="sae-import"),
    path("saes/upload", apis.SaeUploadApi.as_view(), name="sae-upload"),
    path("saes/import-transcoders", apis.TranscoderSetImportApi.as_view(), name="sae-import-transcoders"),
    path("saes/groups", apis.SaeGroupListApi.as_view(), name="sae-group-list"),
    path("saes/groups/<str:group_id>/stop", apis.SaeGroupStopApi.as_view(), name="sae-group-stop"),
    *job_routes(SaeGroup),
    *job_routes(SparseAutoencoder),
    path("saes/<str:sae_id>/evaluate", apis.SaeEvaluateApi.as_view(), name="sae-evaluate"),
    path("saes/<str:sae_id>/export", apis.SaeExportApi.as_view(), name="sae-export"),
]
