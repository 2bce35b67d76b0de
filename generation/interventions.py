"""The intervention spec of a generation request: validated when the request comes in, stored on
its rows as JSON, resolved into the engine's :class:`~engine.interventions.Intervention` by the
worker that generates.

One JSON shape for every front door (``mistudio.interventions`` in ``/api/generate`` and the
``/v1`` endpoints' ``extra_body``, the playground, ``play``'s ``/steer``, ``generate --steer``);
documented in docs/api.md, "Interventions". Every problem is a 400 ``INVALID_INTERVENTION``
naming the intervention by its index (404 ``SAE_NOT_FOUND`` for an SAE the user cannot see).

An SAE named by an intervention belongs to the ``saes`` app, above this one: it registers how
to describe one for a user and how to load one in a worker (:func:`register_sae_source`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import budgets
from engine.interventions import KINDS, POSITION_KINDS, Intervention
from mistudio.errors import ApplicationError

MAX_INTERVENTIONS = 16
MAX_POSITIONS = 4096
MAX_INDICES = 4096
MAX_VECTOR = 65_536
# The largest magnitude of a vector component, coefficient or clamp value: far beyond any
# activation a model produces, and far inside float32 (1e300 would become infinity there).
MAX_MAGNITUDE = 1e6
_FIELDS = {
    "add": {
        "type",
        "hook",
        "positions",
        "vector",
        "steering_vector",
        "sae",
        "feature",
        "coefficient",
        "normalize",
        "unit",
        "unit_scale",
    },
    # unit_scale is the server's (validating a validated spec again gives it back): never read.
    "clamp_feature": {"type", "hook", "positions", "sae", "feature", "value", "unit", "unit_scale"},
    "ablate": {"type", "hook", "positions", "sae", "features", "neurons", "mean_from"},
    "replace": {"type", "hook", "positions", "vector"},
}


@dataclass(frozen=True)
class SaeReference:
    """What a request needs to know of an SAE: where it reads and its sizes."""

    id: str
    hook_name: str
    d_in: int
    d_sae: int
    # A transcoder's output hook and width: where its features write (None for an SAE).
    hook_name_out: str | None = None
    d_out: int | None = None

    @property
    def feature_hook(self) -> str:
        return self.hook_name_out or self.hook_name

    @property
    def feature_width(self) -> int:
        return self.d_out or self.d_in


@dataclass(frozen=True)
class _Source:
    describe: Callable[[Any, str], SaeReference | None]  # (user, sae id) -> reference if visible
    load: Callable[[str], Any]  # sae id -> engine SparseAutoencoder, in a worker


@dataclass(frozen=True)
class VectorReference:
    """What a request needs to know of a stored steering vector."""

    id: str
    hook_name: str
    width: int


_sae_source: _Source | None = None
_vector_source: _Source | None = None
# (user, sae id, feature) -> the feature's max activation in the newest analysis the user sees
_feature_scale: Callable[[Any, str, int], float | None] | None = None
UNITS = ("max_activation", "raw")


def register_sae_source(
    describe: Callable[[Any, str], SaeReference | None], load: Callable[[str], Any]
) -> None:
    global _sae_source
    _sae_source = _Source(describe, load)


def register_vector_source(
    describe: Callable[[Any, str], VectorReference | None], load: Callable[[str], Any]
) -> None:
    """How the ``steering`` app describes a vector for a user and loads it (a [width] tensor)."""
    global _vector_source
    _vector_source = _Source(describe, load)


def register_feature_scale(scale: Callable[[Any, str, int], float | None]) -> None:
    """How the ``features`` app tells a feature's max activation (the ``max_activation`` unit)."""
    global _feature_scale
    _feature_scale = scale


def feature_scale(user, sae_id: str, feature: int) -> float | None:
    """The feature's max activation in the newest completed analysis ``user`` sees (None: none,
    or a feature that never fired)."""
    scale = _feature_scale(user, sae_id, feature) if _feature_scale is not None else None
    return scale if scale is not None and math.isfinite(scale) and scale > 0 else None


def _referenced(
    user, index: int, item: dict, field: str, source: _Source | None, *, noun: str, article: str, code: str
) -> Any:
    """The stored thing ``item[field]`` names, described for ``user``: 400 ``INVALID_INTERVENTION``
    when it is not an id, 404 ``code`` when ``user`` sees no such thing."""
    if not isinstance(item[field], str):
        raise _error(index, f"{field} must be {article} {noun} id.", field)
    found = source.describe(user, item[field]) if source is not None else None
    if found is None:
        raise ApplicationError(
            code,
            f"Intervention {index}: no {noun} {item[field]!r}.",
            details={"intervention": index},
            status=404,
        )
    return found


def _error(index: int, message: str, field: str | None = None) -> ApplicationError:
    details: dict[str, Any] = {"intervention": index}
    if field is not None:
        details["fields"] = {f"interventions[{index}].{field}": [message]}
    return ApplicationError(
        "INVALID_INTERVENTION", f"Intervention {index}: {message}", details=details, status=400
    )


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) <= MAX_MAGNITUDE
    )


def _indices(index: int, item: dict, field: str, limit: int) -> list[int]:
    values = item.get(field)
    if not isinstance(values, list) or not values or len(values) > MAX_INDICES:
        raise _error(index, f"{field} must be a list of 1 to {MAX_INDICES} indices.", field)
    if not all(_integer(value) and 0 <= value < limit for value in values):
        raise _error(index, f"{field} must be integers in [0, {limit}).", field)
    return sorted(set(values))


def interventions_request(raw: Any, *, widths: dict[str, int], user) -> list[dict[str, Any]]:
    """The validated, normalised spec of ``raw`` (a list of intervention objects) for a model whose
    hook points have ``widths`` (``module:`` paths: None, their width shows when they run)."""
    if raw in (None, []):
        return []
    if not isinstance(raw, list) or len(raw) > MAX_INTERVENTIONS:
        raise ApplicationError(
            "INVALID_INTERVENTION",
            f"interventions must be a list of at most {MAX_INTERVENTIONS} objects.",
            status=400,
        )
    return [_checked(index, item, widths, user) for index, item in enumerate(raw)]


def _checked(index: int, item: Any, widths: dict[str, int], user) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _error(index, "must be an object.")
    kind = item.get("type")
    if kind not in KINDS:
        raise _error(index, f"type must be one of {', '.join(KINDS)}.", "type")
    unknown = sorted(set(item) - _FIELDS[kind])
    if unknown:
        raise _error(index, f"{kind} takes no {', '.join(unknown)}.", unknown[0])
    spec: dict[str, Any] = {"type": kind}

    sae = None
    if "sae" in item:
        if kind == "replace":
            raise _error(index, "sae must be an SAE id.", "sae")
        sae = _referenced(
            user, index, item, "sae", _sae_source, noun="SAE", article="an", code="SAE_NOT_FOUND"
        )
        spec["sae"] = sae.id
    stored = None
    if "steering_vector" in item:
        stored = _referenced(
            user, index, item, "steering_vector", _vector_source,
            noun="steering vector", article="a", code="STEERING_VECTOR_NOT_FOUND",
        )  # fmt: skip
        spec["steering_vector"] = stored.id
    if sae is not None and sae.hook_name_out and kind != "add":
        raise _error(
            index,
            f"{sae.id} is a transcoder: its features can be added at {sae.hook_name_out}; clamping and "
            "ablating them is for SAEs.",
            "sae",
        )
    default_hook = sae.feature_hook if sae is not None else stored.hook_name if stored is not None else None
    hook = item.get("hook", default_hook)
    if not isinstance(hook, str) or hook not in widths:
        raise _error(index, f"hook must be a hook point of the model, not {hook!r}.", "hook")
    width = widths[hook]
    spec["hook"] = hook
    if sae is not None and width is not None and sae.feature_width != width:
        raise _error(
            index, f"the SAE's features have a width of {sae.feature_width}; {hook} has {width}.", "sae"
        )
    if stored is not None and width is not None and stored.width != width:
        raise _error(
            index, f"the vector has a width of {stored.width}; {hook} has {width}.", "steering_vector"
        )

    positions = item.get("positions", "all")
    if isinstance(positions, list):
        if (
            not positions
            or len(positions) > MAX_POSITIONS
            or not all(_integer(p) and p >= 0 for p in positions)
        ):
            raise _error(index, f"positions must list 1 to {MAX_POSITIONS} positions >= 0.", "positions")
        positions = sorted(set(positions))
    elif positions not in POSITION_KINDS:
        raise _error(
            index, f"positions must be {', '.join(POSITION_KINDS)} or a list of positions.", "positions"
        )
    spec["positions"] = positions

    if kind in ("add", "replace") and "vector" in item:
        vector = item["vector"]
        if not isinstance(vector, list) or not vector or len(vector) > MAX_VECTOR:
            raise _error(index, "vector must be a list of numbers.", "vector")
        if not all(_number(value) for value in vector):
            raise _error(index, f"vector must hold numbers of magnitude at most {MAX_MAGNITUDE:g}.", "vector")
        if width is not None and len(vector) != width:
            raise _error(index, f"vector has {len(vector)} values; {hook} has a width of {width}.", "vector")
        spec["vector"] = [float(value) for value in vector]
    if kind == "replace" and "vector" not in spec:
        raise _error(index, "replace needs a vector.", "vector")
    if kind in ("add", "clamp_feature"):
        if kind == "add" and ("vector" in spec) + (sae is not None) + (stored is not None) != 1:
            raise _error(index, "add takes one of vector, steering_vector, or sae and feature.", "vector")
        if sae is not None:
            feature = item.get("feature")
            if not _integer(feature) or not 0 <= feature < sae.d_sae:
                raise _error(index, f"feature must be an integer in [0, {sae.d_sae}).", "feature")
            spec["feature"] = feature
        elif kind == "clamp_feature":
            raise _error(index, "clamp_feature needs an sae and a feature.", "sae")
    if "feature" in spec:
        _unit(index, item, spec, user)
    elif item.get("unit", "raw") != "raw":
        raise _error(index, "unit max_activation needs an sae and a feature.", "unit")
    if kind == "add":
        coefficient = item.get("coefficient", 1.0)
        if not _number(coefficient):
            raise _error(
                index, f"coefficient must be a number of magnitude at most {MAX_MAGNITUDE:g}.", "coefficient"
            )
        if not isinstance(item.get("normalize", False), bool):
            raise _error(index, "normalize must be true or false.", "normalize")
        spec["coefficient"] = float(coefficient)
        spec["normalize"] = item.get("normalize", False)
    if kind == "clamp_feature":
        if not _number(item.get("value")):
            raise _error(index, f"value must be a number of magnitude at most {MAX_MAGNITUDE:g}.", "value")
        spec["value"] = float(item["value"])
    if kind == "ablate":
        if sae is not None:
            spec["features"] = _indices(index, item, "features", sae.d_sae)
        elif "neurons" in item and width is not None:
            spec["neurons"] = _indices(index, item, "neurons", width)
        elif "neurons" in item:
            spec["neurons"] = _indices(index, item, "neurons", MAX_VECTOR)
        else:
            raise _error(index, "ablate needs neurons, or an sae and features.", "neurons")
        if "mean_from" in item:
            spec["mean_from"] = _mean_source(index, item["mean_from"], hook, width, user)
    return spec


def _unit(index: int, item: dict, spec: dict[str, Any], user) -> None:
    """An SAE feature's coefficient (add) or value (clamp) is in units of its max activation when
    an analysis gives one: the default then, and ``unit: "raw"`` takes the number as it is. The
    spec records the unit and its scale (the raw number is the given one times ``unit_scale``)."""
    unit = item.get("unit")
    if unit is not None and unit not in UNITS:
        raise _error(index, f"unit must be one of {', '.join(UNITS)}.", "unit")
    scale = feature_scale(user, spec["sae"], spec["feature"]) if unit != "raw" else None
    if unit == "max_activation" and scale is None:
        raise _error(
            index,
            f"no completed analysis of {spec['sae']} gives feature {spec['feature']} a max activation: "
            'analyse the SAE, or give unit "raw".',
            "unit",
        )
    spec["unit"] = "max_activation" if scale is not None else "raw"
    spec["unit_scale"] = scale if scale is not None else 1.0


def raw_amount(spec: dict[str, Any]) -> float:
    """An add's coefficient or a clamp's value in the activation's own units."""
    amount = spec["coefficient"] if spec["type"] == "add" else spec["value"]
    return amount * spec.get("unit_scale", 1.0)


def measure_request(raw: Any, specs: list[dict[str, Any]], *, widths: dict[str, int], user) -> dict[str, Any]:
    """Which SAE feature a generation's effect is measured on: ``raw`` (``{"sae", "feature"}``),
    or else the first SAE feature its interventions add or clamp; {} for none."""
    if raw is None:
        for spec in specs:
            if spec["type"] in ("add", "clamp_feature") and "feature" in spec:
                return {"sae": spec["sae"], "feature": spec["feature"], "hook": spec["hook"]}
        return {}
    if not isinstance(raw, dict) or set(raw) - {"sae", "feature"} or "sae" not in raw:
        raise ApplicationError(
            "INVALID_MEASURE", 'measure must be {"sae": <SAE id>, "feature": <index>}.', status=400
        )
    sae = _sae_source.describe(user, raw["sae"]) if _sae_source and isinstance(raw["sae"], str) else None
    if sae is None:
        raise ApplicationError("SAE_NOT_FOUND", f"No SAE {raw['sae']!r}.", status=404)
    feature = raw.get("feature")
    if not _integer(feature) or not 0 <= feature < sae.d_sae:
        raise ApplicationError(
            "INVALID_MEASURE", f"measure.feature must be an integer in [0, {sae.d_sae}).", status=400
        )
    if sae.hook_name not in widths or (widths[sae.hook_name] not in (None, sae.d_in)):
        raise ApplicationError(
            "INVALID_MEASURE", f"The SAE reads {sae.hook_name}, which this model does not have.", status=400
        )
    return {"sae": sae.id, "feature": feature, "hook": sae.hook_name}


def _mean_source(index: int, cache_id: Any, hook: str, width: int | None, user) -> str:
    """The id of a completed cache the user can see that holds ``hook`` at its width: mean
    ablation takes its means from there."""
    from activations.selectors import completed_cache

    if not isinstance(cache_id, str):
        raise _error(index, "mean_from must be an activation cache id.", "mean_from")
    try:
        cache = completed_cache(user=user, cache_id=cache_id)
    except ApplicationError as error:
        raise _error(index, f"mean_from: {error.message}", "mean_from") from None
    stored = (cache.activation_shapes.get(hook) or [0, None])[1]
    if hook not in cache.hooks or (width is not None and stored != width):
        raise _error(
            index, f"the cache {cache.id} holds no {hook} activations to take means from.", "mean_from"
        )
    return cache.id


def interventions_memory(specs: list[dict[str, Any]], *, user) -> budgets.MemoryEstimate | None:
    """The largest estimated peak of the mean ablations of a validated spec (their means are
    computed from a cache on the worker before the first token); None when there are none."""
    estimates = []
    for spec in specs:
        if spec["type"] != "ablate" or "mean_from" not in spec:
            continue
        sae = _sae_source.describe(user, spec["sae"]) if "sae" in spec and _sae_source else None
        estimates.append(
            budgets.mean_ablation(d_in=sae.d_in, d_sae=sae.d_sae)
            if sae is not None
            else budgets.mean_ablation(d_in=MAX_VECTOR, d_sae=None)
        )
    return max(estimates, key=lambda estimate: estimate.total, default=None)


_MEANS: dict[tuple[str, str, int | None], Any] = {}  # a worker's cache means (caches never change)
MEANS_KEPT = 16


def cache_means(cache_id: str, hook: str, sae: Any = None) -> Any:
    """Mean over a cache's tokens of ``hook``'s activations ([width]), or of ``sae``'s features
    ([d_sae], the cache's rows encoded ``budgets.mean_encoding_rows`` at a time: memory stays flat
    whatever the cache's size); float32 on the CPU, kept per worker."""
    key = (cache_id, hook, None if sae is None else id(sae))
    if key not in _MEANS:
        if len(_MEANS) >= MEANS_KEPT:
            _MEANS.pop(next(iter(_MEANS)))
        chunk = budgets.mean_encoding_rows(sae.W_enc.shape[1]) if sae is not None else 0
        _MEANS[key] = _cache_means(cache_id, hook, sae, chunk=chunk)
    return _MEANS[key]


def _cache_means(cache_id: str, hook: str, sae: Any, *, chunk: int) -> Any:
    import torch

    from activations.models import ActivationCache
    from activations.selectors import cache_store
    from engine.sae.evaluation import mean_feature_activations

    store = cache_store(ActivationCache.objects.get(pk=cache_id), hook)
    if sae is None:
        return torch.from_numpy(store.stats(hook)["mean"]).float()
    chunks = (
        store.get(hook, start, start + chunk, as_torch=True) for start in range(0, store.num_tokens, chunk)
    )
    return mean_feature_activations(sae, chunks)


def loaded_sae(sae_id: str, device: Any = None) -> Any:
    """The engine module of an SAE row, on ``device`` (in a worker)."""
    if _sae_source is None:
        raise ApplicationError("SAE_NOT_FOUND", f"No SAE {sae_id!r}.", status=404)
    return _sae_source.load(sae_id).to(device or "cpu")


def resolved_interventions(specs: list[dict[str, Any]], device: Any = None) -> list[Intervention]:
    """The engine's interventions for a stored spec, with SAEs loaded (once each) on ``device``."""
    import torch

    modules: dict[str, Any] = {}

    def sae_of(spec: dict[str, Any]) -> Any:
        if spec["sae"] not in modules:
            modules[spec["sae"]] = loaded_sae(spec["sae"], device)
        return modules[spec["sae"]]

    interventions = []
    for index, spec in enumerate(specs):
        positions = spec["positions"] if isinstance(spec["positions"], str) else tuple(spec["positions"])
        common = {"kind": spec["type"], "hook": spec["hook"], "positions": positions, "index": index}
        kind = spec["type"]
        if kind in ("add", "replace"):
            if "vector" in spec:
                vector = torch.tensor(spec["vector"], dtype=torch.float32)
            elif "steering_vector" in spec:
                if _vector_source is None:
                    raise ApplicationError(
                        "STEERING_VECTOR_NOT_FOUND", "No steering vectors here.", status=404
                    )
                vector = _vector_source.load(spec["steering_vector"])
            else:
                vector = sae_of(spec).W_dec[spec["feature"]].detach()
            interventions.append(
                Intervention(
                    **common,
                    vector=vector,
                    coefficient=raw_amount(spec),
                    normalize=spec.get("normalize", False),
                )
            )
        elif kind == "clamp_feature":
            interventions.append(
                Intervention(**common, sae=sae_of(spec), features=(spec["feature"],), value=raw_amount(spec))
            )
        elif "sae" in spec:
            module = sae_of(spec)
            means = cache_means(spec["mean_from"], spec["hook"], module) if "mean_from" in spec else None
            interventions.append(
                Intervention(**common, sae=module, features=tuple(spec["features"]), means=means)
            )
        else:
            means = cache_means(spec["mean_from"], spec["hook"]) if "mean_from" in spec else None
            interventions.append(Intervention(**common, neurons=tuple(spec["neurons"]), means=means))
    return interventions
