from django.urls import path

from activations import apis
from activations.models import ExtractionJob
from mistudio.job_apis import job_routes

urlpatterns = [
    path("datasets", apis.DatasetListApi.as_view(), name="dataset-list"),
    path("datasets/<str:dataset_id>", apis.DatasetDetailApi.as_view(), name="dataset-detail"),
    path("datasets/<str:dataset_id>/samples", apis.DatasetSamplesApi.as_view(), name="dataset-samples"),
    path("models/<str:model_id>/hook-points", apis.HookPointsApi.as_view(), name="model-hook-points"),
    path("models/<str:model_id>/tokenize", apis.TokenizeApi.as_view(), name="model-tokenize"),
    path(
        "models/<str:model_id>/extract-activations",
        apis.ExtractActivationsApi.as_view(),
        name="model-extract",
    ),
    path("extractions", apis.ExtractionListApi.as_view(), name="extraction-list"),
    *job_routes(ExtractionJob),
    path("activation-caches", apis.CacheListApi.as_view(), name="cache-list"),
    path("activation-caches/<str:cache_id>", apis.CacheDetailApi.as_view(), name="cache-detail"),
    path("activation-caches/<str:cache_id>/download", apis.CacheDownloadApi.as_view(), name="cache-download"),
    path("activation-caches/<str:cache_id>/slice", apis.CacheSliceApi.as_view(), name="cache-slice"),
    path("activation-caches/<str:cache_id>/stats", apis.CacheStatsApi.as_view(), name="cache-stats"),
    path("activation-caches/<str:cache_id>/top-k", apis.CacheTopKApi.as_view(), name="cache-top-k"),
]
