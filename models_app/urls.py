from django.urls import path

from models_app import apis
from models_app.generation import apis as generation_apis

urlpatterns = [
    path("models", apis.ModelListApi.as_view(), name="model-list"),
    path("models/<str:model_id>", apis.ModelDetailApi.as_view(), name="model-detail"),
    path("models/<str:model_id>/load", apis.ModelLoadApi.as_view(), name="model-load"),
    path("models/<str:model_id>/unload", apis.ModelUnloadApi.as_view(), name="model-unload"),
    path("models/<str:model_id>/cancel", apis.ModelCancelLoadApi.as_view(), name="model-cancel"),
    path("models/<str:model_id>/memory-estimate", apis.ModelMemoryEstimateApi.as_view(), name="model-memory"),
    path("workers", apis.WorkerListApi.as_view(), name="worker-list"),
    path("generate", generation_apis.generate, name="generate"),
    path(
        "generate/<str:generation_id>/cancel",
        generation_apis.GenerationCancelApi.as_view(),
        name="generation-cancel",
    ),
    path("generations", generation_apis.GenerationListApi.as_view(), name="generation-list"),
    path(
        "generations/<str:generation_id>",
        generation_apis.GenerationDetailApi.as_view(),
        name="generation-detail",
    ),
]
