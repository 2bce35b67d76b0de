"""Every operation of the server's OpenAPI schema has a client call or a reason to have none
(mistudio_client.coverage), and the table names no operation the server no longer has."""

import pytest
from mistudio_client.coverage import NOT_YET, OPERATIONS

pytestmark = pytest.mark.django_db


def schema_operations() -> set[str]:
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    return {
        f"{method.upper()} {path}"
        for path, item in schema["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    }


def test_every_operation_has_a_client_call_or_a_reason():
    operations = schema_operations()
    assert operations - set(OPERATIONS) == set(), "add the new operations to mistudio_client.coverage"
    assert set(OPERATIONS) - operations == set(), "the coverage table names operations that no longer exist"
    covered = [operation for operation, how in OPERATIONS.items() if how != NOT_YET]
    assert len(covered) >= 30
