from django.urls import path

from evaluations import apis
from evaluations.models import BenchRun
from mistudio.job_apis import job_routes

urlpatterns = [
    path("saebench", apis.BenchListApi.as_view(), name="bench-list"),
    path("saebench/compare", apis.BenchCompareApi.as_view(), name="bench-compare"),  # before a run's routes
    *job_routes(BenchRun),
    path("saebench/<str:run_id>/results", apis.BenchResultsApi.as_view(), name="bench-results"),
    path("saebench/<str:run_id>/export", apis.BenchExportApi.as_view(), name="bench-export"),
]
