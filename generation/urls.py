from django.urls import path

from generation import apis
from generation.openapi import GenerateOperation, described
from mistudio.job_apis import api_routes

urlpatterns = [
    path("generate", described(apis.generate, GenerateOperation), name="generate"),
    path("generate/sweep", apis.sweep, name="generate-sweep"),
    path("generations", apis.GenerationListApi.as_view(), name="generation-list"),
    *api_routes(apis.GENERATION_API),
]
