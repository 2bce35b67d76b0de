"""Every API route demands authentication, and every error has the documented body."""

import re

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient
from rest_framework.views import APIView

pytestmark = pytest.mark.django_db

ERROR_KEYS = {"code", "message", "details", "timestamp"}
HTTP_METHODS = ["get", "post", "put", "patch", "delete"]


def api_routes() -> list[tuple[str, str]]:
    """(path, method) for every DRF view under /api/, found by walking the URL configuration."""
    routes = []

    def walk(patterns, prefix: str) -> None:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern):
                view_class = getattr(pattern.callback, "cls", None)
                if view_class is None or not issubclass(view_class, APIView) or not route.startswith("api/"):
                    continue
                path = "/" + re.sub(
                    r"<(?:(\w+):)?\w+>",
                    lambda match: "1" if match.group(1) == "int" else "x_placeholder",
                    route,
                )
                routes.extend((path, method) for method in HTTP_METHODS if hasattr(view_class, method))

    walk(get_resolver().url_patterns, "")
    return routes


ROUTES = api_routes()


def assert_error_body(response, code: str) -> None:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert body["error"]["code"] == code
    assert body["error"]["timestamp"].endswith("Z")


def test_the_walk_finds_the_api():
    paths = {path for path, _ in ROUTES}
    assert {
        "/api/",
        "/api/models",
        "/api/models/x_placeholder/load",
        "/api/datasets",
        "/api/schema/",
    } <= paths


@pytest.mark.smoke
@pytest.mark.parametrize(("path", "method"), ROUTES)
def test_every_api_route_answers_401_without_credentials(path, method):
    response = getattr(APIClient(), method)(path, data={}, format="json")
    assert response.status_code == 401, (path, method, response.content[:200])
    assert response["WWW-Authenticate"].startswith("Token")
    assert_error_body(response, "UNAUTHENTICATED")


@pytest.mark.parametrize(("path", "method"), ROUTES)
def test_a_wrong_token_is_401(path, method):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    response = getattr(client, method)(path, data={}, format="json")
    assert response.status_code == 401
    assert_error_body(response, "UNAUTHENTICATED")


def test_a_reader_cannot_load(reader, client_for, tiny_gpt2_folder):
    from models_app.services import model_register

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None)
    response = client_for(reader).post(f"/api/models/{model.id}/load", {}, format="json")
    assert response.status_code == 403
    assert_error_body(response, "PERMISSION_DENIED")


def test_a_user_without_role_sees_nothing(client_for, db):
    from conftest import make_user

    nobody = make_user("nora-norole", None)
    response = client_for(nobody).get("/api/models")
    assert response.status_code == 403
    assert_error_body(response, "PERMISSION_DENIED")


def test_validation_errors_name_the_field(reader, client_for):
    response = client_for(reader).get("/api/models", {"status": "dancing", "limit": 0})
    assert response.status_code == 400
    assert_error_body(response, "VALIDATION_ERROR")
    assert set(response.json()["error"]["details"]["fields"]) == {"status", "limit"}


def test_unknown_model_is_404(reader, client_for):
    response = client_for(reader).get("/api/models/m_doesnotexist")
    assert response.status_code == 404
    assert_error_body(response, "MODEL_NOT_FOUND")


def test_unknown_api_path_is_a_json_404(reader, client_for):
    response = client_for(reader).get("/api/no/such/thing")
    assert response.status_code == 404
    assert_error_body(response, "NOT_FOUND")


def test_malformed_json_is_400(writer, client_for, tiny_gpt2_folder):
    from models_app.services import model_register

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None)
    response = client_for(writer).generic(
        "POST", f"/api/models/{model.id}/load", "{not json", content_type="application/json"
    )
    assert response.status_code == 400
    assert_error_body(response, "MALFORMED_REQUEST")


def test_session_authentication_works_for_pages_and_api(reader):
    client = APIClient()
    signed_in = client.post("/login/", {"username": "rita-reader", "password": "rita-reader-password"})
    assert signed_in.status_code == 302
    assert client.get("/api/models").status_code == 200


def test_admin_and_queue_dashboard_are_for_staff_only(reader, admin_client):
    from django.test import Client

    signed_in_reader = Client()
    signed_in_reader.force_login(reader)
    assert signed_in_reader.get("/admin/rq/").status_code == 302  # to the admin login
    response = admin_client.get("/admin/rq/")
    assert response.status_code == 200 and b"mistudio-test" in response.content
    assert admin_client.get("/admin/models_app/languagemodel/").status_code == 200
