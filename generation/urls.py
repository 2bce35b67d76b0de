from django.urls import path

from generation import apis

urlpatterns = [
    path("generate", apis.generate, name="generate"),
    path("generate/sweep", apis.sweep, name="generate-sweep"),
    path("generate/<str:generation_id>/cancel", apis.GenerationCancelApi.as_view(), name="generation-cancel"),
    path("generations", apis.GenerationListApi.as_view(), name="generation-list"),
    path("generations/<str:generation_id>", apis.GenerationDetailApi.as_view(), name="generation-detail"),
]
