"""What the schema says of the API's errors: every operation may answer a 4xx or a 503 with the one
error body (``mistudio.errors.error_body``), so that a client (and the schema fuzz's status-code and
body checks) knows every status it can get and the shape of each. A 500 is never documented: the
API must not answer one."""

from __future__ import annotations

from typing import Any

ERROR_COMPONENT = "Error"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An error: its code (a constant a client may branch on), a message for a person, "
    "details (field errors under fields, a retry's wait...) and when it happened.",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "details": {"type": "object", "additionalProperties": {}},
                "timestamp": {"type": "string", "format": "date-time"},
            },
            "required": ["code", "message", "details"],
        }
    },
    "required": ["error"],
}

# The statuses every operation may answer besides its own: a refusal of the request (4XX: bad
# input, no such row, not allowed, over a limit...) and a service that is unavailable for a while.
ERROR_STATUSES = {
    "4XX": "The request was refused (bad input, no such row, not allowed, a conflict, a limit).",
    "503": "A database, Redis or worker is unavailable for now: try again shortly.",
}


def error_responses(result: dict[str, Any], generator, request, public) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the error answers beside each operation's own."""
    result.setdefault("components", {}).setdefault("schemas", {})[ERROR_COMPONENT] = ERROR_SCHEMA
    reference = {"$ref": f"#/components/schemas/{ERROR_COMPONENT}"}
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status, description in ERROR_STATUSES.items():
                content = {"application/json": {"schema": reference}}
                responses.setdefault(status, {"description": description, "content": content})
    return result
