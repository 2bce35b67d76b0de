from django.urls import path

from models_app import apis

urlpatterns = [
    path("models", apis.ModelListApi.as_view(), name="model-list"),
    path("models/<str:model_id>", apis.ModelDetailApi.as_view(), name="model-detail"),
    path("models/<str:model_id>/load", apis.ModelLoadApi.as_view(), name="model-load"),
    path("models/<str:model_id>/unload", apis.ModelUnloadApi.as_view(), name="model-unload"),
    path("models/<str:model_id>/cancel", apis.ModelCancelLoadApi.as_view(), name="model-cancel"),
    path("models/<str:model_id>/memory-estimate", apis.ModelMemoryEstimateApi.as_view(), name="model-memory"),
    path("workers", apis.WorkerListApi.as_view(), name="worker-list"),
]
