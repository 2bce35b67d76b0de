"""The request JSON of an intervention, checked and normalised field by field.

Every intervention kind of :mod:`engine.interventions` reads its request object through these
checks, so one shape (``mistudio.interventions``, documented in docs/api.md, "Interventions") gives
one error for one mistake whichever front door it came through. Stored things an object names by
id (an SAE, a steering vector, an activation cache) are described by :class:`References`, which
the apps implement (the engine knows no database); building the engine's intervention from a
normalised spec loads them through :class:`Resolver`.

Every problem is an ``INVALID_INTERVENTION`` naming the intervention by its index and the field
(``interventions[i].field``); a missing stored thing is the references' own error (a 404).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from engine.errors import EngineError

MAX_POSITIONS = 4096
MAX_INDICES = 4096
MAX_VECTOR = 65_536
# The largest magnitude of a vector component, coefficient or clamp value: far beyond any
# activation a model produces, and far inside float32 (1e300 would become infinity there).
MAX_MAGNITUDE = 1e6
UNITS = ("max_activation", "raw")
POSITION_KINDS = ("all", "prompt", "generated")


class InterventionError(EngineError):
    """An intervention that cannot apply (``INVALID_INTERVENTION``, naming it by its index)."""


def invalid_intervention(index: int, message: str, **details: Any) -> InterventionError:
    return InterventionError(
        "INVALID_INTERVENTION", f"Intervention {index}: {message}", {"intervention": index, **details}
    )


class SaeDescription(Protocol):
    """What a request needs to know of an SAE (or transcoder): where it reads and writes, its sizes."""

    id: str
    d_in: int
    d_sae: int
    hook_name_out: str | None

    @property
    def feature_hook(self) -> str: ...

    @property
    def feature_width(self) -> int: ...


class VectorDescription(Protocol):
    """What a request needs to know of a stored steering vector."""

    id: str
    hook_name: str
    width: int


class References(Protocol):
    """The model's hook points (``widths``; None for a ``module:`` path, whose width shows when it
    runs) and the stored things a request may name, as one user sees them (the apps implement it).

    ``sae`` and ``steering_vector`` raise their own not-found error; ``mean_source`` checks that a
    cache holds ``hook`` at ``width`` and gives its id, raising :class:`InterventionError` else."""

    widths: dict[str, int | None]

    def sae(self, index: int, sae_id: str) -> SaeDescription: ...

    def steering_vector(self, index: int, vector_id: str) -> VectorDescription: ...

    def feature_scale(self, sae_id: str, feature: int) -> float | None: ...

    def mean_source(self, index: int, cache_id: Any, hook: str, width: int | None) -> str: ...


class Resolver(Protocol):
    """Loads what a normalised spec names by id, in a worker: modules and tensors."""

    def sae(self, sae_id: str) -> Any: ...

    def steering_vector(self, vector_id: str) -> Any: ...

    def means(self, cache_id: str, hook: str, sae: Any = None) -> Any: ...


def invalid(index: int, message: str, field: str | None = None) -> InterventionError:
    """``INVALID_INTERVENTION`` for intervention ``index``, naming the field at fault if any."""
    if field is None:
        return invalid_intervention(index, message)
    return invalid_intervention(index, message, fields={f"interventions[{index}].{field}": [message]})


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) <= MAX_MAGNITUDE
    )


@dataclass(frozen=True)
class Target:
    """Where a request object intervenes, and the stored things it names (their descriptions)."""

    hook: str
    width: int | None
    positions: str | list[int]
    sae: SaeDescription | None = None
    stored: VectorDescription | None = None

    def spec(self, kind: str) -> dict[str, Any]:
        """The normalised spec's common part, in the order the API has always given it."""
        spec: dict[str, Any] = {"type": kind}
        if self.sae is not None:
            spec["sae"] = self.sae.id
        if self.stored is not None:
            spec["steering_vector"] = self.stored.id
        spec["hook"] = self.hook
        spec["positions"] = self.positions
        return spec


def target(
    index: int, item: dict, *, kind: str, fields: frozenset[str], refs: References, transcoders: bool = False
) -> Target:
    """The common part of request object ``item`` of ``kind`` (which takes ``fields``, and a
    transcoder's features where ``transcoders``): its SAE or stored vector, hook point (by default
    where they read) and positions, checked together."""
    unknown = sorted(set(item) - fields)
    if unknown:
        raise invalid(index, f"{kind} takes no {', '.join(unknown)}.", unknown[0])
    sae = _named(index, item, "sae", "an SAE", refs.sae) if "sae" in item else None
    stored = (
        _named(index, item, "steering_vector", "a steering vector", refs.steering_vector)
        if "steering_vector" in item
        else None
    )
    if sae is not None and sae.hook_name_out and not transcoders:
        raise invalid(
            index,
            f"{sae.id} is a transcoder: its features can be added at {sae.hook_name_out}; clamping and "
            "ablating them is for SAEs.",
            "sae",
        )
    return Target(
        **_hook(index, item, sae, stored, refs), positions=positions(index, item), sae=sae, stored=stored
    )


def _named(index: int, item: dict, field: str, noun: str, describe: Any) -> Any:
    if not isinstance(item[field], str):
        raise invalid(index, f"{field} must be {noun} id.", field)
    return describe(index, item[field])


def _hook(index: int, item: dict, sae: Any, stored: Any, refs: References) -> dict[str, Any]:
    default = sae.feature_hook if sae is not None else stored.hook_name if stored is not None else None
    hook = item.get("hook", default)
    widths = refs.widths
    if not isinstance(hook, str) or hook not in widths:
        raise invalid(index, f"hook must be a hook point of the model, not {hook!r}.", "hook")
    width = widths[hook]
    if sae is not None and width is not None and sae.feature_width != width:
        raise invalid(
            index, f"the SAE's features have a width of {sae.feature_width}; {hook} has {width}.", "sae"
        )
    if stored is not None and width is not None and stored.width != width:
        raise invalid(
            index, f"the vector has a width of {stored.width}; {hook} has {width}.", "steering_vector"
        )
    return {"hook": hook, "width": width}


def positions(index: int, item: dict) -> str | list[int]:
    value = item.get("positions", "all")
    if isinstance(value, list):
        if not value or len(value) > MAX_POSITIONS or not all(is_integer(p) and p >= 0 for p in value):
            raise invalid(index, f"positions must list 1 to {MAX_POSITIONS} positions >= 0.", "positions")
        return sorted(set(value))
    if value not in POSITION_KINDS:
        raise invalid(
            index, f"positions must be {', '.join(POSITION_KINDS)} or a list of positions.", "positions"
        )
    return value


def vector(index: int, item: dict, where: Target) -> list[float]:
    """A literal vector of the hook's width, as floats."""
    values = item["vector"]
    if not isinstance(values, list) or not values or len(values) > MAX_VECTOR:
        raise invalid(index, "vector must be a list of numbers.", "vector")
    if not all(is_number(value) for value in values):
        raise invalid(index, f"vector must hold numbers of magnitude at most {MAX_MAGNITUDE:g}.", "vector")
    if where.width is not None and len(values) != where.width:
        raise invalid(
            index, f"vector has {len(values)} values; {where.hook} has a width of {where.width}.", "vector"
        )
    return [float(value) for value in values]


def feature(index: int, item: dict, sae: SaeDescription) -> int:
    value = item.get("feature")
    if not is_integer(value) or not 0 <= value < sae.d_sae:
        raise invalid(index, f"feature must be an integer in [0, {sae.d_sae}).", "feature")
    return value


def amount(index: int, item: dict, field: str, default: float | None = None) -> float:
    """A coefficient or clamp value: a number of bounded magnitude."""
    value = item.get(field, default)
    if not is_number(value):
        raise invalid(index, f"{field} must be a number of magnitude at most {MAX_MAGNITUDE:g}.", field)
    return float(value)


def indices(index: int, item: dict, field: str, limit: int) -> list[int]:
    values = item.get(field)
    if not isinstance(values, list) or not values or len(values) > MAX_INDICES:
        raise invalid(index, f"{field} must be a list of 1 to {MAX_INDICES} indices.", field)
    if not all(is_integer(value) and 0 <= value < limit for value in values):
        raise invalid(index, f"{field} must be integers in [0, {limit}).", field)
    return sorted(set(values))


def unit(index: int, item: dict, spec: dict[str, Any], refs: References) -> dict[str, Any]:
    """An SAE feature's coefficient (add) or value (clamp) is in units of its max activation when
    an analysis gives one: the default then, and ``unit: "raw"`` takes the number as it is. The
    spec records the unit and its scale (the raw number is the given one times ``unit_scale``)."""
    if "feature" not in spec:
        if item.get("unit", "raw") != "raw":
            raise invalid(index, "unit max_activation needs an sae and a feature.", "unit")
        return {}
    chosen = item.get("unit")
    if chosen is not None and chosen not in UNITS:
        raise invalid(index, f"unit must be one of {', '.join(UNITS)}.", "unit")
    scale = refs.feature_scale(spec["sae"], spec["feature"]) if chosen != "raw" else None
    if chosen == "max_activation" and scale is None:
        raise invalid(
            index,
            f"no completed analysis of {spec['sae']} gives feature {spec['feature']} a max activation: "
            'analyse the SAE, or give unit "raw".',
            "unit",
        )
    return {"unit": "max_activation" if scale is not None else "raw", "unit_scale": scale or 1.0}


def positions_of(spec: dict[str, Any]) -> str | tuple[int, ...]:
    """A stored spec's positions as the engine takes them."""
    return spec["positions"] if isinstance(spec["positions"], str) else tuple(spec["positions"])
