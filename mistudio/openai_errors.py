"""OpenAI's error shape for the ``/v1`` routes: ``{"error": {"message", "type", "param", "code"}}``.

The routes themselves live with generation; the shape lives here so that project-wide layers
(the API error middleware) can answer in it without importing an app.
"""

from typing import Any

from django.http import JsonResponse

from mistudio.errors import ApplicationError, with_retry_after

OPENAI_PATH_PREFIX = "/v1/"


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def first_field_error(errors: Any, path: str = "") -> tuple[str | None, str | None]:
    """The first (field path, message) in DRF's nested error structure, e.g. ``messages[0].role``."""
    if isinstance(errors, dict):
        for key, value in errors.items():
            if key == "non_field_errors":
                return first_field_error(value, path)
            name = f"{path}.{key}" if path else str(key)
            found = first_field_error(value, name)
            if found != (None, None):
                return found
        return None, None
    if isinstance(errors, list):
        for index, value in enumerate(errors):
            if isinstance(value, (dict, list)):
                found = first_field_error(value, f"{path}[{index}]")
                if found != (None, None):
                    return found
            elif value:
                return path or None, str(value)
        return None, None
    return path or None, str(errors)


def openai_error_body(error: ApplicationError) -> dict[str, Any]:
    """OpenAI's error object; our code stays in ``code``, the first invalid field goes to ``param``."""
    param, detail = first_field_error(error.details.get("fields") or {})
    message = error.message
    if detail:
        message = f"{param}: {detail}" if param else detail
    if param is None and error.code in ("MODEL_NOT_FOUND", "MODEL_NOT_LOADED", "AMBIGUOUS_MODEL"):
        param = "model"
    return {"message": message, "type": error_type(error.status), "param": param, "code": error.code}


def openai_error_response(error: ApplicationError) -> JsonResponse:
    return with_retry_after(JsonResponse({"error": openai_error_body(error)}, status=error.status), error)
