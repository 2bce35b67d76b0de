from django.contrib.auth import views as auth_views
from django.urls import path
from drf_spectacular.views import SpectacularSwaggerSplitView

from frontend.access import reader_required
from frontend.views import (
    account,
    activations,
    datasets,
    explanations,
    feature_encode,
    features,
    graphs,
    models,
    playground,
    probes,
    sae_groups,
    saebench,
    saes,
    workers,
)

app_name = "frontend"
urlpatterns = [
    path("", models.model_list_page, name="models"),
    path("models/<str:model_id>/", models.model_detail_page, name="model"),
    path("models/<str:model_id>/patching/", probes.patching_page, name="model-patching"),
    path("models/<str:model_id>/logit-lens/", probes.logit_lens_page, name="model-logit-lens"),
    path("datasets/", datasets.dataset_list_page, name="datasets"),
    path("datasets/<str:dataset_id>/", datasets.dataset_detail_page, name="dataset"),
    path("activations/", activations.cache_list_page, name="caches"),
    path("activations/<str:cache_id>/", activations.cache_browser_page, name="cache"),
    path("saes/", saes.sae_list_page, name="saes"),
    path("saes/import/", saes.sae_import_page, name="sae-import"),
    path("saes/compare/", saebench.sae_compare_page, name="sae-compare"),
    path("saes/groups/new/", sae_groups.sae_group_new_page, name="sae-group-new"),
    path("saes/groups/<str:group_id>/", sae_groups.sae_group_page, name="sae-group"),
    path("saes/<str:sae_id>/", saes.sae_detail_page, name="sae"),
    path("saes/<str:sae_id>/analyses/", features.analysis_action_page, name="sae-analyses"),
    path("saes/<str:sae_id>/features/", features.feature_list_page, name="features"),
    path("saes/<str:sae_id>/features/<int:index>/", features.feature_detail_page, name="feature"),
    path("saes/<str:sae_id>/encode/", feature_encode.feature_encode_page, name="feature-encode"),
    path("saes/<str:sae_id>/explanations/new/", explanations.explanation_new_page, name="explanation-new"),
    path(
        "saes/<str:sae_id>/explanations/<str:job_id>/",
        explanations.explanation_job_page,
        name="explanation-job",
    ),
    path(
        "saes/<str:sae_id>/features/<int:index>/explanations/<int:explanation_id>/accept/",
        explanations.explanation_accept_page,
        name="explanation-accept",
    ),
    path("graphs/", graphs.graph_list_page, name="graphs"),
    path("graphs/<str:graph_id>/", graphs.graph_page, name="graph"),
    path("playground/", playground.playground_page, name="playground"),
    path("workers/", workers.workers_page, name="workers"),
    path("account/token/", account.api_token_page, name="api-token"),
    # The interactive API documentation is a page (sign-in, role), the schema it reads is API.
    path(
        "docs/api/", reader_required(SpectacularSwaggerSplitView.as_view(url_name="schema")), name="api-docs"
    ),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
]
