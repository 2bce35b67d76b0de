"""Interventions for ``Client.generate``, as the API's ``mistudio.interventions`` objects:

Add("blocks.2.hook_resid_post", vector, coefficient=4.0)
AddFeature(sae, 812, coefficient=2.0)          # in units of the feature's max activation
AddSteeringVector(vector_row, coefficient=4.0)  # a stored steering vector, at its own hook
ClampFeature(sae, 812, value=0.0)
Ablate(sae=sae, features=[3, 9])  or  Ablate(hook="blocks.1.hook_mlp_out", neurons=[17])
Replace("blocks.0.hook_resid_post", vector)

Each builds the server's ``Intervention`` object of its ``type`` (the OpenAPI component at
``/api/schema/``; the client's tests check every builder against it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _plain(vector: Any) -> list[float]:
    return [float(value) for value in (vector.tolist() if hasattr(vector, "tolist") else vector)]


def _id(row: Any) -> str:
    return row if isinstance(row, str) else row["id"] if isinstance(row, dict) else row.id


@dataclass
class Add:
    """``x + coefficient · vector`` at ``hook`` (``normalize``: scaled by ‖x‖/‖v‖)."""

    hook: str
    vector: Any
    coefficient: float = 1.0
    normalize: bool = False
    positions: Any = "all"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "add",
            "hook": self.hook,
            "vector": _plain(self.vector),
            "coefficient": self.coefficient,
            "normalize": self.normalize,
            "positions": self.positions,
        }


@dataclass
class AddFeature:
    """Add an SAE feature's decoder row, ``coefficient`` in units of its max activation."""

    sae: Any
    feature: int
    coefficient: float = 1.0
    positions: Any = "all"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "add",
            "sae": _id(self.sae),
            "feature": int(self.feature),
            "coefficient": self.coefficient,
            "positions": self.positions,
        }


@dataclass
class AddSteeringVector:
    """Add a stored steering vector (an id or a row of ``Client.steering_vectors``) at its own hook
    (or ``hook``, of the same width): ``x + coefficient · v``."""

    vector: Any
    coefficient: float = 1.0
    normalize: bool = False
    hook: str | None = None
    positions: Any = "all"

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": "add",
            "steering_vector": _id(self.vector),
            "coefficient": self.coefficient,
            "normalize": self.normalize,
            "positions": self.positions,
        }
        if self.hook is not None:
            body["hook"] = self.hook
        return body


@dataclass
class ClampFeature:
    """Set an SAE feature to ``value`` (its reconstruction error kept)."""

    sae: Any
    feature: int
    value: float
    positions: Any = "all"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "clamp_feature",
            "sae": _id(self.sae),
            "feature": int(self.feature),
            "value": self.value,
            "positions": self.positions,
        }


@dataclass
class Ablate:
    """Zero neurons of a hook, or features of an SAE (``mean_from``: a cache's mean instead)."""

    hook: str | None = None
    neurons: list[int] | None = None
    sae: Any = None
    features: list[int] | None = None
    mean_from: Any = None
    positions: Any = "all"

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": "ablate", "positions": self.positions}
        if self.sae is not None:
            body.update(sae=_id(self.sae), features=[int(f) for f in self.features or []])
        else:
            body.update(hook=self.hook, neurons=[int(n) for n in self.neurons or []])
        if self.mean_from is not None:
            body["mean_from"] = _id(self.mean_from)
        return body


@dataclass
class Replace:
    """Set ``hook``'s activation to ``vector`` (activation patching)."""

    hook: str
    vector: Any
    positions: Any = "all"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "replace",
            "hook": self.hook,
            "vector": _plain(self.vector),
            "positions": self.positions,
        }
