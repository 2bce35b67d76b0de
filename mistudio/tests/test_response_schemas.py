"""The schema says what every operation answers, and the rows' JSON is what it says.

Every 2xx answer of every operation in ``/api/schema/`` must be described: a JSON body as an object
with its properties (a list answer as its wrapper's), a file as binary, no content only for 204. A
new ``responses={200: dict}`` (a bare object) fails here.

Then each row's one JSON shape (its ``*_state()`` builder, as the API, events and snapshots use it),
built from real rows with the defaults a fresh row has (mostly nulls), must validate against the
schema's component for it and name exactly its properties: the output serializers describe the
builders, and a key added to one but not the other fails here. The fuzz test
(``test_schema_fuzz.py``) checks the answers of the running API against the same schema.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from django.db import models
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator

from circuits.serializers import graph_state
from features.models import Explanation, Feature, FeatureLabel
from features.serializers import analysis_state, explanation_job_state, explanation_state, feature_summary
from generation.selectors import generation_state
from mistudio.tests.test_deleted_users import olga, rows_of  # noqa: F401  (olga: a fixture)
from saes.serializers import sae_group_state, sae_state
from steering.serializers import vector_state

pytestmark = pytest.mark.django_db

BINARY_TYPES = {"application/x-tar", "application/octet-stream"}
STREAM_TYPES = {"text/event-stream"}  # server-sent events, described in the operation's prose


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return SchemaGenerator().get_schema(request=None, public=True)


def resolved(schema: dict[str, Any], openapi: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with a top-level ``$ref`` followed."""
    while "$ref" in schema:
        schema = openapi["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def json_schema(node: Any, openapi: dict[str, Any]) -> Any:
    """An OpenAPI 3.0 schema as JSON Schema: references inlined, ``nullable`` as a null type."""
    if isinstance(node, list):
        return [json_schema(item, openapi) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return json_schema(resolved(node, openapi), openapi)
    converted = {key: json_schema(value, openapi) for key, value in node.items() if key != "nullable"}
    if node.get("nullable"):
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


def described(schema: dict[str, Any], openapi: dict[str, Any]) -> bool:
    """Whether a JSON answer's schema says what is in it: properties, items that have them, or
    alternatives (``oneOf``) that each do."""
    schema = resolved(schema, openapi)
    if schema.get("type") == "array":
        return described(schema.get("items", {}), openapi)
    if "oneOf" in schema:
        return all(described(choice, openapi) for choice in schema["oneOf"])
    return bool(schema.get("properties"))


def answer_problems(operation: dict[str, Any], openapi: dict[str, Any]) -> list[str]:
    answers = {
        code: answer for code, answer in operation.get("responses", {}).items() if code.startswith("2")
    }
    if not answers:
        return ["no 2xx answer"]
    problems = []
    for code, answer in answers.items():
        content = answer.get("content", {})
        if not content:
            if code != "204":
                problems.append(f"{code}: no content")
            continue
        for media, body in content.items():
            schema = body.get("schema", {})
            if media in BINARY_TYPES:
                if schema.get("format") != "binary":
                    problems.append(f"{code} {media}: not a file")
            elif media in STREAM_TYPES:
                if schema.get("type") != "string":
                    problems.append(f"{code} {media}: not a stream")
            elif not described(schema, openapi):
                problems.append(f"{code} {media}: a bare object")
    return problems


def test_every_operation_says_what_it_answers(openapi):
    problems = [
        f"{method.upper()} {path} {problem}"
        for path, operations in openapi["paths"].items()
        for method, operation in operations.items()
        for problem in answer_problems(operation, openapi)
    ]
    assert len(openapi["paths"]) >= 25  # the whole API was read
    assert not problems, "\n".join(problems)


def conforms(state: dict[str, Any], component: str, openapi: dict[str, Any]) -> None:
    schema = openapi["components"]["schemas"][component]
    jsonschema.validate(state, json_schema(schema, openapi), format_checker=jsonschema.FormatChecker())
    assert set(schema.get("required", [])) <= set(state) <= set(schema["properties"]), (
        f"{component}: missing {sorted(set(schema.get('required', [])) - set(state))}, "
        f"undescribed {sorted(set(state) - set(schema['properties']))}"
    )


def filled(row: models.Model) -> models.Model:
    """``row`` with a value in each of its nullable plain fields (a row that ran: its times,
    throughput, scores...), saved."""
    values = {models.FloatField: 1.5, models.IntegerField: 3, models.DateTimeField: timezone.now()}
    for field in row._meta.concrete_fields:
        if field.null and not field.is_relation:
            kind = next((kind for kind in values if isinstance(field, kind)), None)
            if kind is not None:
                setattr(row, field.attname, values[kind])
    row.save()
    return row


@pytest.mark.parametrize("ran", [False, True], ids=["fresh", "ran"])
def test_each_rows_json_is_what_the_schema_says(openapi, writer, olga, ran):  # noqa: F811
    from circuits.models import AttributionGraph
    from features.models import ExplanationJob, FeatureAnalysis
    from generation.models import Generation
    from saes.models import SaeGroup, SparseAutoencoder
    from steering.models import SteeringVector

    rows = rows_of(writer, olga)
    sae, group = rows[SparseAutoencoder][0], rows[SaeGroup][0]
    sae.group, sae.group_index = group, 0
    sae.save()
    analysis, job = rows[FeatureAnalysis][1], rows[ExplanationJob][0]
    feature = Feature.objects.create(
        analysis=analysis, index=5, density=0.1, max_activation=2.0, mean_activation=1.0
    )
    label = FeatureLabel.objects.get(sae=sae, index=5)
    explanation = Explanation.objects.create(
        job=job,
        analysis=analysis,
        index=5,
        text="a",
        explainer_model="m",
        scorer_model="m",
        prompt_version="1",
    )
    best = {"id": explanation.pk, "text": "a", "score": None, "explainer_model": "m"}
    vector, generation = rows[SteeringVector][0], rows[Generation][0]
    if ran:
        for row in (sae, group, analysis, job, explanation, vector, generation, rows[AttributionGraph][0]):
            filled(row)
    shapes = [
        (sae_state(sae, viewer=writer), "SaeOutput"),
        (sae_state(sae, viewer=writer, with_history=False), "SaeOutput"),
        (sae_group_state(group, viewer=writer), "SaeGroupOutput"),
        (analysis_state(analysis, viewer=writer), "AnalysisOutput"),
        (explanation_job_state(job, viewer=writer), "ExplanationJobOutput"),
        (explanation_state(explanation, prompt=True), "ExplanationOutput"),
        (explanation_state(explanation), "ExplanationOutput"),
        ({**feature_summary(feature, label), "explanation": best}, "FeatureRowOutput"),
        ({**feature_summary(feature), "explanation": None}, "FeatureRowOutput"),
        (graph_state(rows[AttributionGraph][0], viewer=writer), "GraphOutput"),
        (vector_state(vector, viewer=writer), "VectorOutput"),
        (vector_state(vector, viewer=writer, with_prompts=False), "VectorOutput"),
        (generation_state(generation), "GenerationOutput"),
        (generation_state(generation, whole=False), "GenerationSummaryOutput"),
    ]
    for state, component in shapes:
        conforms(state, component, openapi)
