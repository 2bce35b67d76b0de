"""Interventions: writes into a model's activations at hook points while it runs.

One frozen dataclass per kind, registered by its ``type`` name (:data:`KINDS`). An instance is
resolved: its vectors and SAE are tensors and modules, its hook point a name of the model's
vocabulary (``engine.hooks``). Each kind reads the API's JSON shape (``normalized_json``, against
:class:`~engine.intervention_json.References` the apps implement), builds itself from the stored,
normalised spec (``from_json``, loading through a :class:`~engine.intervention_json.Resolver`),
checks itself against the hook points' widths (``check``) and applies its maths (``apply``):

* :class:`Add`: ``x + coefficient * vector`` (with ``normalize``, the vector scaled to unit norm
  and then to each token's own norm: ``x + coefficient * |x| * v / |v|``);
* :class:`ClampFeature`: an SAE feature set to ``value``, the SAE's reconstruction error kept:
  ``x + (value - f_i(x)) * W_dec[i]`` (decoding is linear, so this is encode -> set -> decode plus
  the error ``x - decode(encode(x))``; clamping a feature to its own value changes nothing);
* :class:`Ablate`: neurons (entries of ``x``) or SAE features set to zero or to a mean (``means``);
* :class:`Replace`: ``x`` set to ``vector`` (activation patching).

Each applies at ``positions`` of its row's sequence: ``all``, ``prompt`` (the prompt's tokens),
``generated`` (tokens fed back after being generated) or a list of absolute positions (0 is the
prompt's first token). An intervention applies to its own row of a batch only: picking rows and
tokens is :mod:`engine.intervention_runtime`'s (:class:`Interventions`, importable from here too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine import intervention_json as json_shape
from engine.intervention_json import (
    MAX_VECTOR,
    POSITION_KINDS,
    InterventionError,
    References,
    Resolver,
    invalid_intervention,
)
from engine.intervention_runtime import Interventions, position_mask

__all__ = [
    "KINDS",
    "POSITION_KINDS",
    "Ablate",
    "Add",
    "ClampFeature",
    "Intervention",
    "InterventionError",
    "Interventions",
    "Replace",
    "check_interventions",
    "feature_values",
    "from_json",
    "intervention_kind",
    "invalid_intervention",
    "normalized_json",
    "position_mask",
    "summary",
]

REGISTRY: dict[str, type[Intervention]] = {}
KINDS: tuple[str, ...] = ()


def register_intervention(cls: type[Intervention]) -> type[Intervention]:
    """Class decorator: ``cls`` is the intervention of JSON ``type`` ``cls.kind``."""
    global KINDS
    REGISTRY[cls.kind] = cls
    KINDS = tuple(REGISTRY)
    return cls


def intervention_kind(kind: Any) -> type[Intervention] | None:
    """The class registered for JSON ``type`` ``kind`` (None: no such kind)."""
    return REGISTRY.get(kind) if isinstance(kind, str) else None


@dataclass(frozen=True)
class Intervention:
    """Where and when an intervention writes: its hook point, its positions, and its place in the
    request (``index``, for errors). Subclasses add what they write and how."""

    kind: ClassVar[str]
    # The JSON fields a request object of this kind may hold.
    fields: ClassVar[frozenset[str]]
    # The field a strength sweep varies (None: this kind cannot be swept).
    swept: ClassVar[str | None] = None

    hook: str
    positions: str | tuple[int, ...] = "all"
    index: int = field(default=0, compare=False, kw_only=True)

    @classmethod
    def normalized_json(cls, index: int, item: dict, refs: References) -> dict[str, Any]:
        """The validated, normalised spec of request object ``item`` (stored on the rows)."""
        raise NotImplementedError

    @classmethod
    def from_json(cls, spec: dict[str, Any], index: int, resolver: Resolver) -> Intervention:
        """The engine's intervention for a normalised spec, what it names loaded by ``resolver``."""
        raise NotImplementedError

    @classmethod
    def summary(cls, spec: dict[str, Any]) -> str:
        """What a normalised spec of this kind does, in a few words (``add sae_1#812 x 8``)."""
        return cls.kind

    def check(self, widths: dict[str, int | None]) -> None:
        """Shapes and values against the hook points' widths (None: a ``module:`` path, whose
        width shows when it runs); ``INVALID_INTERVENTION`` else."""
        if self.hook not in widths:
            raise self.invalid(f"unknown hook point {self.hook!r}.", hook=self.hook)
        if isinstance(self.positions, str):
            if self.positions not in POSITION_KINDS:
                raise self.invalid(
                    f"positions must be one of {', '.join(POSITION_KINDS)} or a list of positions."
                )
        elif not self.positions or any(position < 0 for position in self.positions):
            raise self.invalid("positions must list positions >= 0.")
        self.check_values(widths[self.hook])

    def check_values(self, width: int | None) -> None:
        """The kind's own checks against its hook's width."""

    def needed_width(self, width: int) -> int:
        """The width this intervention needs where its hook has ``width`` (``width`` when it fits)."""
        raise NotImplementedError

    def fit(self, width: int) -> None:
        """Refuse an intervention that does not fit the width its hook has here (a ``module:``
        hook's width shows only when it runs): a clear ``INVALID_INTERVENTION``, not an error deep
        in torch."""
        needed = self.needed_width(width)
        if needed != width:
            raise self.invalid(
                f"{self.hook} has a width of {width} here; the intervention needs {needed}.",
                width=width, needs=needed,
            )  # fmt: skip

    def apply(self, x: Any) -> Any:
        """The intervention on rows ``x`` [tokens, width] (a copy: ``x`` is left alone)."""
        raise NotImplementedError

    def invalid(self, message: str, **details: Any) -> InterventionError:
        return invalid_intervention(self.index, message, **details)


def _finite_vector(item: Add | Replace, width: int | None) -> None:
    import torch

    if item.vector is None or item.vector.dim() != 1 or (width is not None and len(item.vector) != width):
        got = None if item.vector is None else list(item.vector.shape)
        raise item.invalid(f"the vector must have the hook's width {width}.", width=width, got=got)
    if not bool(torch.isfinite(item.vector).all()):
        raise item.invalid("the vector has non-finite values.")


def _check_features(item: ClampFeature | Ablate, width: int | None) -> None:
    if width is not None and item.sae.shape.d_in != width:
        raise item.invalid(
            f"the SAE reads a width of {item.sae.shape.d_in}, the hook has {width}.", width=width
        )
    if not item.features or any(not 0 <= f < item.sae.shape.d_sae for f in item.features):
        raise item.invalid(f"features must be in [0, {item.sae.shape.d_sae}).")


def _finite_amount(value: float, item: Intervention) -> None:
    if not math.isfinite(value):
        raise item.invalid("coefficient and value must be finite numbers.")


def _shift_features(sae: Any, features: tuple[int, ...], x: Any, target: Callable[[Any], Any]) -> Any:
    """``x`` with SAE ``features`` moved from their values to ``target(values)`` along their
    decoder rows (the reconstruction error kept)."""
    current = feature_values(sae, x, features)  # [tokens, n]
    directions = sae.W_dec[list(features)]  # [n, width]
    return x + ((target(current) - current) @ directions).to(x.dtype)


def _raw(spec: dict[str, Any], name: str) -> float:
    """An add's coefficient or a clamp's value in the activation's own units."""
    return spec[name] * spec.get("unit_scale", 1.0)


@register_intervention
@dataclass(frozen=True, kw_only=True)
class Add(Intervention):
    """``x + coefficient * vector``: a literal vector, a stored steering vector, or an SAE
    feature's decoder row (its coefficient then in units of the feature's max activation)."""

    kind: ClassVar[str] = "add"
    fields: ClassVar[frozenset[str]] = frozenset(
        # unit_scale is the server's (validating a validated spec again gives it back): never read.
        {"type", "hook", "positions", "vector", "steering_vector", "sae", "feature", "coefficient",
         "normalize", "unit", "unit_scale"}
    )  # fmt: skip
    swept: ClassVar[str | None] = "coefficient"

    vector: Any = None  # [width]
    coefficient: float = 1.0
    normalize: bool = False

    @classmethod
    def normalized_json(cls, index: int, item: dict, refs: References) -> dict[str, Any]:
        # A transcoder's features write at its output hook: they can be added there.
        where = json_shape.target(index, item, kind=cls.kind, fields=cls.fields, refs=refs, transcoders=True)
        spec = where.spec(cls.kind)
        if "vector" in item:
            spec["vector"] = json_shape.vector(index, item, where)
        if ("vector" in spec) + (where.sae is not None) + (where.stored is not None) != 1:
            raise json_shape.invalid(
                index, "add takes one of vector, steering_vector, or sae and feature.", "vector"
            )
        if where.sae is not None:
            spec["feature"] = json_shape.feature(index, item, where.sae)
        spec.update(json_shape.unit(index, item, spec, refs))
        spec["coefficient"] = json_shape.amount(index, item, "coefficient", 1.0)
        if not isinstance(item.get("normalize", False), bool):
            raise json_shape.invalid(index, "normalize must be true or false.", "normalize")
        spec["normalize"] = item.get("normalize", False)
        return spec

    @classmethod
    def from_json(cls, spec: dict[str, Any], index: int, resolver: Resolver) -> Add:
        import torch

        if "vector" in spec:
            vector = torch.tensor(spec["vector"], dtype=torch.float32)
        elif "steering_vector" in spec:
            vector = resolver.steering_vector(spec["steering_vector"])
        else:
            vector = resolver.sae(spec["sae"]).W_dec[spec["feature"]].detach()
        return cls(
            spec["hook"], json_shape.positions_of(spec), index=index, vector=vector,
            coefficient=_raw(spec, "coefficient"), normalize=spec.get("normalize", False),
        )  # fmt: skip

    @classmethod
    def summary(cls, spec: dict[str, Any]) -> str:
        if "feature" in spec:
            what = f"{spec['sae']}#{spec['feature']}"
        elif "steering_vector" in spec:
            what = f"steering vector {spec['steering_vector']}"
        else:
            what = f"a vector of {len(spec['vector'])}"
        return f"add {what} x {spec['coefficient']:g}{' (normalised)' if spec.get('normalize') else ''}"

    def check_values(self, width: int | None) -> None:
        _finite_amount(self.coefficient, self)
        _finite_vector(self, width)

    def needed_width(self, width: int) -> int:
        return len(self.vector)

    def apply(self, x: Any) -> Any:
        vector = self.vector.to(device=x.device, dtype=x.dtype)
        if self.normalize:
            direction = vector / vector.norm().clamp_min(1e-12)
            return x + self.coefficient * x.norm(dim=-1, keepdim=True) * direction
        return x + self.coefficient * vector


@register_intervention
@dataclass(frozen=True, kw_only=True)
class ClampFeature(Intervention):
    """SAE ``features`` set to ``value``, the SAE's reconstruction error kept."""

    kind: ClassVar[str] = "clamp_feature"
    fields: ClassVar[frozenset[str]] = frozenset(
        {"type", "hook", "positions", "sae", "feature", "value", "unit", "unit_scale"}
    )
    swept: ClassVar[str | None] = "value"

    sae: Any = None
    features: tuple[int, ...] = ()
    value: float = 0.0

    @classmethod
    def normalized_json(cls, index: int, item: dict, refs: References) -> dict[str, Any]:
        where = json_shape.target(index, item, kind=cls.kind, fields=cls.fields, refs=refs)
        if where.sae is None:
            raise json_shape.invalid(index, "clamp_feature needs an sae and a feature.", "sae")
        spec = where.spec(cls.kind)
        spec["feature"] = json_shape.feature(index, item, where.sae)
        spec.update(json_shape.unit(index, item, spec, refs))
        spec["value"] = json_shape.amount(index, item, "value")
        return spec

    @classmethod
    def from_json(cls, spec: dict[str, Any], index: int, resolver: Resolver) -> ClampFeature:
        return cls(
            spec["hook"], json_shape.positions_of(spec), index=index, sae=resolver.sae(spec["sae"]),
            features=(spec["feature"],), value=_raw(spec, "value"),
        )  # fmt: skip

    @classmethod
    def summary(cls, spec: dict[str, Any]) -> str:
        return f"clamp {spec['sae']}#{spec['feature']} = {spec['value']:g}"

    def check_values(self, width: int | None) -> None:
        _finite_amount(self.value, self)
        _check_features(self, width)

    def needed_width(self, width: int) -> int:
        return self.sae.shape.d_in

    def apply(self, x: Any) -> Any:
        return _shift_features(
            self.sae, self.features, x, lambda current: current.new_full(current.shape, self.value)
        )


@register_intervention
@dataclass(frozen=True, kw_only=True)
class Ablate(Intervention):
    """``neurons`` of the hook, or ``features`` of an ``sae``, set to zero or to ``means``
    ([width] for neurons, [d_sae] for features)."""

    kind: ClassVar[str] = "ablate"
    fields: ClassVar[frozenset[str]] = frozenset(
        {"type", "hook", "positions", "sae", "features", "neurons", "mean_from"}
    )

    neurons: tuple[int, ...] = ()
    sae: Any = None
    features: tuple[int, ...] = ()
    means: Any = None  # None: to zero

    @classmethod
    def normalized_json(cls, index: int, item: dict, refs: References) -> dict[str, Any]:
        where = json_shape.target(index, item, kind=cls.kind, fields=cls.fields, refs=refs)
        spec = where.spec(cls.kind)
        if where.sae is not None:
            spec["features"] = json_shape.indices(index, item, "features", where.sae.d_sae)
        elif "neurons" in item:
            limit = where.width if where.width is not None else MAX_VECTOR
            spec["neurons"] = json_shape.indices(index, item, "neurons", limit)
        else:
            raise json_shape.invalid(index, "ablate needs neurons, or an sae and features.", "neurons")
        if "mean_from" in item:
            spec["mean_from"] = refs.mean_source(index, item["mean_from"], where.hook, where.width)
        return spec

    @classmethod
    def from_json(cls, spec: dict[str, Any], index: int, resolver: Resolver) -> Ablate:
        sae = resolver.sae(spec["sae"]) if "sae" in spec else None
        means = resolver.means(spec["mean_from"], spec["hook"], sae) if "mean_from" in spec else None
        return cls(
            spec["hook"], json_shape.positions_of(spec), index=index, sae=sae,
            features=tuple(spec.get("features", ())), neurons=tuple(spec.get("neurons", ())), means=means,
        )  # fmt: skip

    @classmethod
    def summary(cls, spec: dict[str, Any]) -> str:
        which = "features" if "features" in spec else "neurons"
        return f"ablate {which} {spec[which]}"

    def check_values(self, width: int | None) -> None:
        import torch

        if self.sae is not None:
            _check_features(self, width)
        elif not self.neurons or any(
            not 0 <= n < (width if width is not None else math.inf) for n in self.neurons
        ):
            raise self.invalid(f"neurons must be in [0, {width}).")
        expected = self.sae.shape.d_sae if self.sae is not None else width
        if self.means is not None and (
            (expected is not None and tuple(self.means.shape) != (expected,))
            or not bool(torch.isfinite(self.means).all())
        ):
            raise self.invalid(f"the means must be {expected} finite numbers.")

    def needed_width(self, width: int) -> int:
        if self.sae is not None:
            return self.sae.shape.d_in
        if self.means is not None:
            return len(self.means)
        return width if max(self.neurons) < width else max(self.neurons) + 1

    def apply(self, x: Any) -> Any:
        if self.sae is not None:
            return _shift_features(self.sae, self.features, x, self._feature_targets)
        out = x.clone()
        neurons = list(self.neurons)
        out[:, neurons] = 0 if self.means is None else self.means.to(device=x.device, dtype=x.dtype)[neurons]
        return out

    def _feature_targets(self, current: Any) -> Any:
        if self.means is None:
            return current.new_zeros(current.shape)
        means = self.means.to(device=current.device, dtype=current.dtype)
        return means[list(self.features)].expand_as(current)


@register_intervention
@dataclass(frozen=True, kw_only=True)
class Replace(Intervention):
    """``x`` set to ``vector`` (activation patching)."""

    kind: ClassVar[str] = "replace"
    fields: ClassVar[frozenset[str]] = frozenset({"type", "hook", "positions", "vector"})

    vector: Any = None  # [width]

    @classmethod
    def normalized_json(cls, index: int, item: dict, refs: References) -> dict[str, Any]:
        where = json_shape.target(index, item, kind=cls.kind, fields=cls.fields, refs=refs)
        if "vector" not in item:
            raise json_shape.invalid(index, "replace needs a vector.", "vector")
        return {**where.spec(cls.kind), "vector": json_shape.vector(index, item, where)}

    @classmethod
    def from_json(cls, spec: dict[str, Any], index: int, resolver: Resolver) -> Replace:
        import torch

        vector = torch.tensor(spec["vector"], dtype=torch.float32)
        return cls(spec["hook"], json_shape.positions_of(spec), index=index, vector=vector)

    def check_values(self, width: int | None) -> None:
        _finite_vector(self, width)

    def needed_width(self, width: int) -> int:
        return len(self.vector)

    def apply(self, x: Any) -> Any:
        return self.vector.to(device=x.device, dtype=x.dtype).expand_as(x).clone()


def normalized_json(index: int, item: Any, refs: References) -> dict[str, Any]:
    """The validated, normalised spec of request object ``item`` (intervention ``index``), checked
    by the kind its ``type`` names."""
    if not isinstance(item, dict):
        raise json_shape.invalid(index, "must be an object.")
    kind = intervention_kind(item.get("type"))
    if kind is None:
        raise json_shape.invalid(index, f"type must be one of {', '.join(KINDS)}.", "type")
    return kind.normalized_json(index, item, refs)


def from_json(spec: dict[str, Any], index: int, resolver: Resolver) -> Intervention:
    """The engine's intervention for a normalised spec (see :func:`normalized_json`)."""
    return REGISTRY[spec["type"]].from_json(spec, index, resolver)


def summary(spec: dict[str, Any]) -> str:
    """What a normalised spec does, in a few words, as its kind says it."""
    return REGISTRY[spec["type"]].summary(spec)


def check_interventions(interventions: Sequence[Intervention], widths: dict[str, int | None]) -> None:
    """Each intervention against the hook points' widths (see :meth:`Intervention.check`)."""
    for item in interventions:
        item.check(widths)


def feature_values(sae: Any, x: Any, features: tuple[int, ...]) -> Any:
    """``encode(x)[..., features]`` [tokens, n]; one encoder column each where the activation of a
    feature depends on its own pre-activation only (not TopK's choice among all): the SAE's
    architecture decides."""
    return sae.kind.feature_values(sae, x, features)
