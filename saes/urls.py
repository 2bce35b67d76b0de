from django.urls import path

from saes import apis

urlpatterns = [
    path("saes", apis.SaeListApi.as_view(), name="sae-list"),
    path("saes/import", apis.SaeImportApi.as_view(), name="sae-import"),
    path("saes/upload", apis.SaeUploadApi.as_view(), name="sae-upload"),
    path("saes/import-transcoders", apis.TranscoderSetImportApi.as_view(), name="sae-import-transcoders"),
    path("saes/groups", apis.SaeGroupListApi.as_view(), name="sae-group-list"),
    path("saes/groups/<str:group_id>", apis.SaeGroupDetailApi.as_view(), name="sae-group-detail"),
    path("saes/groups/<str:group_id>/cancel", apis.SaeGroupCancelApi.as_view(), name="sae-group-cancel"),
    path("saes/<str:sae_id>", apis.SaeDetailApi.as_view(), name="sae-detail"),
    path("saes/<str:sae_id>/cancel", apis.SaeCancelApi.as_view(), name="sae-cancel"),
    path("saes/<str:sae_id>/evaluate", apis.SaeEvaluateApi.as_view(), name="sae-evaluate"),
    path("saes/<str:sae_id>/export", apis.SaeExportApi.as_view(), name="sae-export"),
]
