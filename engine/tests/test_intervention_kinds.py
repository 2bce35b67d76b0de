"""The registered intervention kinds without Django: each reads the API's JSON into a normalised
spec (checked against the stored things a ``References`` describes), builds itself from that spec
(what it names loaded by a ``Resolver``), and says what it does. The references here are the
engine's own protocol filled from dicts: the apps fill it from their rows."""

from dataclasses import dataclass, field

import pytest
import torch

from engine import interventions
from engine.intervention_json import InterventionError
from engine.interventions import KINDS, REGISTRY, Ablate, Add, ClampFeature, Replace
from engine.testing.tiny_saes import random_sae

HOOK = "blocks.0.hook_resid_post"
OUT = "blocks.1.hook_resid_post"
WIDTH = 4


@dataclass(frozen=True)
class Sae:
    id: str
    hook_name: str
    d_in: int
    d_sae: int
    hook_name_out: str | None = None

    @property
    def feature_hook(self) -> str:
        return self.hook_name_out or self.hook_name

    @property
    def feature_width(self) -> int:
        return self.d_in


@dataclass(frozen=True)
class Vector:
    id: str
    hook_name: str
    width: int


class NotFound(Exception):
    pass


@dataclass(frozen=True)
class References:
    widths: dict = field(default_factory=lambda: {HOOK: WIDTH, OUT: WIDTH, "module:mlp": None})
    saes: dict = field(
        default_factory=lambda: {
            "sae-1": Sae("sae-1", HOOK, WIDTH, 16),
            "tc-1": Sae("tc-1", HOOK, WIDTH, 16, hook_name_out=OUT),
        }
    )
    vectors: dict = field(default_factory=lambda: {"vec-1": Vector("vec-1", OUT, WIDTH)})

    def sae(self, index, sae_id):
        if sae_id not in self.saes:
            raise NotFound(sae_id)
        return self.saes[sae_id]

    def steering_vector(self, index, vector_id):
        return self.vectors[vector_id]

    def feature_scale(self, sae_id, feature):
        return 2.0 if feature == 1 else None

    def mean_source(self, index, cache_id, hook, width):
        return cache_id


@dataclass(frozen=True)
class Resolver:
    saes: dict = field(default_factory=lambda: {"sae-1": random_sae(WIDTH)})

    def sae(self, sae_id):
        return self.saes[sae_id]

    def steering_vector(self, vector_id):
        return torch.arange(WIDTH, dtype=torch.float32)

    def means(self, cache_id, hook, sae=None):
        return torch.full((WIDTH if sae is None else sae.shape.d_sae,), 0.25)


def normalized(item, index=0):
    return interventions.normalized_json(index, item, References())


def test_every_kind_is_registered_by_its_type_name():
    assert KINDS == ("add", "clamp_feature", "ablate", "replace")
    assert [REGISTRY[kind] for kind in KINDS] == [Add, ClampFeature, Ablate, Replace]
    assert {cls.swept for cls in REGISTRY.values()} == {"coefficient", "value", None}


@pytest.mark.parametrize(
    ("item", "spec"),
    [
        (
            {"type": "add", "hook": HOOK, "vector": [1, 2, 3, 4], "positions": [3, 0, 3]},
            {"type": "add", "hook": HOOK, "positions": [0, 3], "vector": [1.0, 2.0, 3.0, 4.0],
             "coefficient": 1.0, "normalize": False},
        ),
        (
            {"type": "add", "sae": "sae-1", "feature": 1, "coefficient": 3},
            {"type": "add", "sae": "sae-1", "hook": HOOK, "positions": "all", "feature": 1,
             "unit": "max_activation", "unit_scale": 2.0, "coefficient": 3.0, "normalize": False},
        ),
        (
            {"type": "add", "steering_vector": "vec-1", "normalize": True},
            {"type": "add", "steering_vector": "vec-1", "hook": OUT, "positions": "all", "coefficient": 1.0,
             "normalize": True},
        ),
        (
            {"type": "clamp_feature", "sae": "sae-1", "feature": 2, "value": 0},
            {"type": "clamp_feature", "sae": "sae-1", "hook": HOOK, "positions": "all", "feature": 2,
             "unit": "raw", "unit_scale": 1.0, "value": 0.0},
        ),
        (
            {"type": "ablate", "hook": "module:mlp", "neurons": [9, 2, 2], "mean_from": "cache-1"},
            {"type": "ablate", "hook": "module:mlp", "positions": "all", "neurons": [2, 9],
             "mean_from": "cache-1"},
        ),
        (
            {"type": "replace", "hook": HOOK, "vector": [0, 0, 0, 1], "positions": "prompt"},
            {"type": "replace", "hook": HOOK, "positions": "prompt", "vector": [0.0, 0.0, 0.0, 1.0]},
        ),
    ],
)  # fmt: skip
def test_a_request_object_becomes_its_kinds_normalised_spec(item, spec):
    assert normalized(item) == spec
    assert normalized(spec) == spec  # validating a validated spec gives it back


@pytest.mark.parametrize(
    ("item", "message", "field"),
    [
        ([], "must be an object.", None),
        ({"type": "scale"}, "type must be one of add, clamp_feature, ablate, replace.", "type"),
        ({"type": "replace", "hook": HOOK, "vector": [1] * 4, "sae": "sae-1"},
         "replace takes no sae.", "sae"),
        ({"type": "clamp_feature", "sae": "tc-1", "feature": 0, "value": 1},
         "tc-1 is a transcoder: its features can be added at blocks.1.hook_resid_post; clamping and "
         "ablating them is for SAEs.", "sae"),
        ({"type": "add", "hook": HOOK, "vector": [1] * 4, "sae": "sae-1", "feature": 0},
         "add takes one of vector, steering_vector, or sae and feature.", "vector"),
        ({"type": "add", "sae": "sae-1", "feature": 3, "unit": "max_activation"},
         "no completed analysis of sae-1 gives feature 3 a max activation: analyse the SAE, or give "
         'unit "raw".',
         "unit"),
        ({"type": "add", "hook": HOOK, "vector": [1] * 4, "unit": "max_activation"},
         "unit max_activation needs an sae and a feature.", "unit"),
        ({"type": "add", "hook": HOOK, "vector": [1] * 4, "normalize": 1}, "normalize must be true or false.",
         "normalize"),
        ({"type": "replace", "hook": HOOK}, "replace needs a vector.", "vector"),
        ({"type": "ablate", "sae": "sae-1", "features": [16]},
         "features must be integers in [0, 16).", "features"),
        ({"type": "add", "hook": "blocks.9.x", "sae": "sae-1", "feature": 0},
         "hook must be a hook point of the model, not 'blocks.9.x'.", "hook"),
    ],
)  # fmt: skip
def test_a_bad_request_object_is_refused_naming_it_and_its_field(item, message, field):
    with pytest.raises(InterventionError) as raised:
        normalized(item, index=2)
    assert raised.value.code == "INVALID_INTERVENTION"
    assert raised.value.message == f"Intervention 2: {message}"
    if field is not None:
        assert raised.value.details == {"intervention": 2, "fields": {f"interventions[2].{field}": [message]}}


def test_a_missing_stored_thing_is_the_references_own_error():
    with pytest.raises(NotFound):
        normalized({"type": "clamp_feature", "sae": "nope", "feature": 0, "value": 1})


def test_a_stored_spec_builds_its_kind_with_what_it_names_loaded():
    resolver = Resolver()
    specs = [
        normalized({"type": "add", "sae": "sae-1", "feature": 1, "coefficient": 3}),
        normalized({"type": "add", "steering_vector": "vec-1", "coefficient": -1}),
        normalized({"type": "clamp_feature", "sae": "sae-1", "feature": 1, "value": 0.5}),
        normalized({"type": "ablate", "sae": "sae-1", "features": [4], "mean_from": "cache-1"}),
        normalized({"type": "replace", "hook": HOOK, "vector": [0, 0, 1, 0], "positions": [2]}),
    ]
    add, stored, clamp, ablate, replace = (
        interventions.from_json(spec, index, resolver) for index, spec in enumerate(specs)
    )
    sae = resolver.sae("sae-1")
    assert isinstance(add, Add) and add.coefficient == 6.0  # 3 max activations of 2.0
    assert torch.equal(add.vector, sae.W_dec[1].detach())
    assert stored.hook == OUT and stored.index == 1 and torch.equal(stored.vector, torch.arange(4.0))
    assert isinstance(clamp, ClampFeature) and clamp.features == (1,) and clamp.value == 1.0
    assert clamp.sae is sae  # loaded once
    assert isinstance(ablate, Ablate) and ablate.features == (4,) and ablate.means.shape == (sae.shape.d_sae,)
    assert isinstance(replace, Replace) and replace.positions == (2,)
    widths = References().widths
    for item in (add, stored, clamp, ablate, replace):
        item.check(widths)
    assert [interventions.summary(spec) for spec in specs] == [
        "add sae-1#1 x 3",
        "add steering vector vec-1 x -1",
        "clamp sae-1#1 = 0.5",
        "ablate features [4]",
        "replace",
    ]


def test_ablating_neurons_to_their_means_writes_only_them():
    x = torch.arange(8.0).reshape(2, 4)
    ablated = Ablate(HOOK, neurons=(1, 3), means=torch.full((4,), -1.0)).apply(x)
    assert torch.equal(ablated, torch.tensor([[0.0, -1.0, 2.0, -1.0], [4.0, -1.0, 6.0, -1.0]]))
    assert torch.equal(x, torch.arange(8.0).reshape(2, 4))  # a copy
