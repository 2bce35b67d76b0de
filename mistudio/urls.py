"""URLs: pages, admin, REST API under /api/, WebSockets in routing.py, /healthz, /metrics."""

from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from django.views.generic import RedirectView
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularJSONAPIView
from rest_framework.decorators import api_view, permission_classes
from rest_framework.response import Response
from rest_framework.reverse import reverse

from mistudio import __version__
from mistudio.errors import json_error_response
from mistudio.health import healthz
from mistudio.job_apis import job_kinds_index
from mistudio.metrics import metrics
from mistudio.permissions import CanRead
from mistudio.serializers import ApiRootOutputSerializer

# The REST API's version: a client refuses a server of another one (mistudio-client checks it first).
API_VERSION = 1


@extend_schema(responses={200: ApiRootOutputSerializer})
@api_view(["GET"])
@permission_classes([CanRead])
def api_root(request, format=None):
    """The API's entry point: the server's version, the API's version (a client checks it first),
    links to each collection, and the kinds of job (their id prefixes and paths)."""
    return Response(
        {
            "version": __version__,
            "api_version": API_VERSION,
            **{
                name: reverse(name, request=request, format=format)
                for name in [
                    "model-list",
                    "dataset-list",
                    "extraction-list",
                    "cache-list",
                    "sae-list",
                    "worker-list",
                    "schema",
                ]
            },
            "jobs": job_kinds_index(),
        }
    )


@csrf_exempt  # it changes nothing: any method gets the JSON 404, never the CSRF failure page
def api_not_found(request, unmatched: str = ""):
    return json_error_response(404, "NOT_FOUND", "No such API endpoint.")


api_patterns = [
    path("", api_root, name="api-root"),
    path("", include("models_app.urls")),
    path("", include("activations.urls")),
    path("", include("generation.urls")),
    path("", include("saes.urls")),
    path("", include("features.urls")),
    path("", include("steering.urls")),
    path("", include("circuits.urls")),
    path("", include("evaluations.urls")),
    path("schema/", SpectacularJSONAPIView.as_view(), name="schema"),
    path("<path:unmatched>", api_not_found),
]

urlpatterns = [
    path("admin/rq/", include("django_rq.urls")),  # queue dashboard, staff only
    path("admin/", admin.site.urls),
    path("api/", include(api_patterns)),
    path("v1/", include("generation.openai_urls")),
    path("healthz", healthz, name="healthz"),
    # Browsers ask for /favicon.ico on every page whatever the page links: answered, never a 404.
    path(
        "favicon.ico",
        RedirectView.as_view(
            url=static("frontend/favicon.svg"), permanent=True, http_method_names=["get", "head"]
        ),
    ),
    path("metrics", metrics, name="metrics"),  # Prometheus; METRICS_TOKEN or staff / model:admin
    path("", include("frontend.urls")),
]
