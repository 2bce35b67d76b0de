from django.urls import path

from features import apis, explanation_apis
from features.models import ExplanationJob, FeatureAnalysis
from mistudio.job_apis import job_routes

urlpatterns = [
    path("saes/<str:sae_id>/analyses", apis.AnalysisListApi.as_view(), name="analysis-list"),
    *job_routes(FeatureAnalysis),
    path("saes/<str:sae_id>/features", apis.FeatureListApi.as_view(), name="feature-list"),
    path("saes/<str:sae_id>/features/export", apis.FeatureExportApi.as_view(), name="feature-export"),
    path("saes/<str:sae_id>/features/search", apis.FeatureSearchApi.as_view(), name="feature-search"),
    path("saes/<str:sae_id>/features/<int:index>", apis.FeatureDetailApi.as_view(), name="feature-detail"),
    path(
        "saes/<str:sae_id>/features/<int:index>/explanations/<int:explanation_id>/accept",
        explanation_apis.ExplanationAcceptApi.as_view(),
        name="explanation-accept",
    ),
    path(
        "saes/<str:sae_id>/explanations",
        explanation_apis.ExplanationJobListApi.as_view(),
        name="explanation-list",
    ),
    *job_routes(ExplanationJob),
    path(
        "saes/<str:sae_id>/explanations/<str:job_id>/results",
        explanation_apis.ExplanationResultsApi.as_view(),
        name="explanation-results",
    ),
    path("explainers", explanation_apis.ExplainerListApi.as_view(), name="explainer-list"),
    path("saes/<str:sae_id>/encode", apis.FeatureEncodeApi.as_view(), name="feature-encode"),
]
