"""The client's intervention builders against the server's OpenAPI ``Intervention`` component
(``/api/schema/``, one component per kind the engine registers): every builder's object is valid
there, and the component refuses what the server refuses by shape."""

import jsonschema_rs
import numpy as np
import pytest
from mistudio_client import Ablate, Add, AddFeature, AddSteeringVector, ClampFeature, Replace

pytestmark = pytest.mark.django_db

HOOK = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module")
def schema(django_db_blocker) -> dict:
    from drf_spectacular.generators import SchemaGenerator

    with django_db_blocker.unblock():
        return SchemaGenerator().get_schema(request=None, public=True)


@pytest.fixture(scope="module")
def intervention(schema) -> jsonschema_rs.Validator:
    return jsonschema_rs.validator_for(
        {"$ref": "#/components/schemas/Intervention", "components": schema["components"]}
    )


BUILT = [
    Add(HOOK, np.arange(4, dtype=np.float32), coefficient=4.0, normalize=True, positions=[0, 2]),
    AddFeature("sae-1", 812, coefficient=2.0, positions="generated"),
    AddFeature({"id": "sae-1"}, 3),
    AddSteeringVector("vec-1", coefficient=-3.0),
    AddSteeringVector({"id": "vec-1"}, hook=HOOK, positions="prompt"),
    ClampFeature("sae-1", 812, value=0.0),
    Ablate(sae="sae-1", features=[3, 9]),
    Ablate(hook="blocks.1.hook_mlp_out", neurons=[17], mean_from="cache-1"),
    Replace(HOOK, [0.5, -1.0, 2.0], positions=[4]),
]


@pytest.mark.parametrize("built", BUILT, ids=lambda built: type(built).__name__)
def test_every_builder_makes_a_valid_intervention(intervention, built):
    body = built.to_dict()
    errors = [error.message for error in intervention.iter_errors(body)]
    assert not errors, (body, errors)


@pytest.mark.parametrize(
    "body",
    [
        {"type": "steer", "hook": HOOK, "vector": [1.0]},  # no such kind
        {"type": "clamp_feature", "sae": "sae-1", "feature": 3},  # no value
        {"type": "replace", "vector": [1.0]},  # no hook
        {"type": "add", "hook": HOOK, "vector": []},  # an empty vector
        {"type": "add", "hook": HOOK, "vector": [1.0], "positions": "later"},
        {"type": "ablate", "hook": HOOK, "neurons": [-1]},
        {"type": "add", "hook": HOOK, "vector": [1e300]},  # beyond the largest magnitude
    ],
)
def test_the_component_refuses_what_the_server_refuses_by_shape(intervention, body):
    assert not intervention.is_valid(body)


def test_each_registered_kind_has_a_component_with_its_fields(schema):
    from engine.interventions import REGISTRY

    components = schema["components"]["schemas"]
    mapping = components["Intervention"]["discriminator"]["mapping"]
    assert set(mapping) == set(REGISTRY)
    for kind, cls in REGISTRY.items():
        component = components[mapping[kind].rsplit("/", 1)[1]]
        # unit_scale is the server's own field of a normalised spec, never read from a request
        assert set(component["properties"]) == cls.fields - {"unit_scale"}, kind


def _component(schema: dict, holder: dict) -> dict:
    """The component a property refers to (``$ref``, or drf-spectacular's ``allOf: [$ref]``)."""
    reference = holder["$ref"] if "$ref" in holder else holder["allOf"][0]["$ref"]
    return schema["components"]["schemas"][reference.rsplit("/", 1)[1]]


def test_generate_describes_its_interventions_with_the_component(schema):
    body = schema["paths"]["/api/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    capture = _component(schema, _component(schema, body)["properties"]["mistudio"])
    assert capture["properties"]["interventions"]["items"] == {"$ref": "#/components/schemas/Intervention"}
