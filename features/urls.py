from django.urls import path

from features import apis

urlpatterns = [
    path("saes/<str:sae_id>/analyses", apis.AnalysisListApi.as_view(), name="analysis-list"),
    path(
        "saes/<str:sae_id>/analyses/<str:analysis_id>",
        apis.AnalysisDetailApi.as_view(),
        name="analysis-detail",
    ),
    path(
        "saes/<str:sae_id>/analyses/<str:analysis_id>/cancel",
        apis.AnalysisCancelApi.as_view(),
        name="analysis-cancel",
    ),
    path("saes/<str:sae_id>/features", apis.FeatureListApi.as_view(), name="feature-list"),
    path("saes/<str:sae_id>/features/export", apis.FeatureExportApi.as_view(), name="feature-export"),
    path("saes/<str:sae_id>/features/<int:index>", apis.FeatureDetailApi.as_view(), name="feature-detail"),
    path("saes/<str:sae_id>/encode", apis.FeatureEncodeApi.as_view(), name="feature-encode"),
]
