"""Every operation of the server's OpenAPI schema has a client call or a reason to have none
(mistudio_client.coverage), each call named there exists, and the table names no operation the
server no longer has."""

import re

import pytest
from mistudio_client import Client, HookArray, Job
from mistudio_client.coverage import OPERATIONS
from mistudio_client.resources import Caches, Datasets, Extractions, Generations, Models
from mistudio_client.saes import Features, Graphs, SaeBench, Saes, SteeringVectors

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
    left_out = [operation for operation, how in OPERATIONS.items() if how.startswith("left out: ")]
    assert len(left_out) <= 3


RESOURCES = {
    "models": Models, "datasets": Datasets, "extractions": Extractions, "caches": Caches, "saes": Saes,
    "features": Features, "graphs": Graphs, "steering_vectors": SteeringVectors, "generations": Generations,
    "saebench": SaeBench,
}  # fmt: skip
CLASSES = {"Client": Client, "Job": Job, "HookArray": HookArray}


def test_each_call_the_table_names_exists():
    for operation, how in OPERATIONS.items():
        if how.startswith("left out: "):
            continue
        for call in re.findall(r"(?:Client|Job|HookArray)(?:\.\w+)+", how):
            owner, *names = call.split(".")
            target = CLASSES[owner]
            if owner == "Client" and len(names) == 2:
                target, names = RESOURCES[names[0]], names[1:]
            assert hasattr(target, names[0]), f"{operation}: {call} does not exist"
