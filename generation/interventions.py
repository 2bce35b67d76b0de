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
from dataclasses import dataclass, field
from typing import Any, NoReturn

from engine import budgets
from engine import interventions as kinds
from engine.intervention_json import (
    MAX_MAGNITUDE,
    MAX_VECTOR,
    UNITS,
    InterventionError,
    invalid,
    is_integer,
)
from engine.interventions import Intervention
from mistudio.errors import ApplicationError

__all__ = ["MAX_MAGNITUDE", "MAX_VECTOR", "UNITS", "SaeReference", "VectorReference"]

MAX_INTERVENTIONS = 16


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


@dataclass(frozen=True)
class _UserReferences:
    """The stored things a request may name, as ``user`` sees them, and the model's hook points:
    what the engine's intervention kinds check a request against."""

    user: Any
    widths: dict[str, int | None]

    def sae(self, index: int, sae_id: str) -> SaeReference:
        found = _sae_source.describe(self.user, sae_id) if _sae_source is not None else None
        if found is None:
            _not_found(index, "SAE", sae_id, "SAE_NOT_FOUND")
        return found

    def steering_vector(self, index: int, vector_id: str) -> VectorReference:
        found = _vector_source.describe(self.user, vector_id) if _vector_source is not None else None
        if found is None:
            _not_found(index, "steering vector", vector_id, "STEERING_VECTOR_NOT_FOUND")
        return found

    def feature_scale(self, sae_id: str, feature: int) -> float | None:
        return feature_scale(self.user, sae_id, feature)

    def mean_source(self, index: int, cache_id: Any, hook: str, width: int | None) -> str:
        return _mean_source(index, cache_id, hook, width, self.user)


def _not_found(index: int, noun: str, key: str, code: str) -> NoReturn:
    raise ApplicationError(
        code, f"Intervention {index}: no {noun} {key!r}.", details={"intervention": index}, status=404
    )


def interventions_request(raw: Any, *, widths: dict[str, int], user) -> list[dict[str, Any]]:
    """The validated, normalised spec of ``raw`` (a list of intervention objects) for a model whose
    hook points have ``widths`` (``module:`` paths: None, their width shows when they run): each
    object checked by its kind (``engine.interventions``)."""
    if raw in (None, []):
        return []
    if not isinstance(raw, list) or len(raw) > MAX_INTERVENTIONS:
        raise ApplicationError(
            "INVALID_INTERVENTION",
            f"interventions must be a list of at most {MAX_INTERVENTIONS} objects.",
            status=400,
        )
    references = _UserReferences(user, widths)
    try:
        return [kinds.normalized_json(index, item, references) for index, item in enumerate(raw)]
    except InterventionError as error:
        raise ApplicationError(error.code, error.message, details=error.details, status=400) from None


def swept_amount(intervention: Any) -> str | None:
    """The field a strength sweep varies in request object ``intervention`` (an add's
    ``coefficient``, a clamp's ``value``); None when its kind cannot be swept."""
    kind = kinds.intervention_kind(intervention.get("type")) if isinstance(intervention, dict) else None
    return kind.swept if kind is not None else None


def measure_request(raw: Any, specs: list[dict[str, Any]], *, widths: dict[str, int], user) -> dict[str, Any]:
    """Which SAE feature a generation's effect is measured on: ``raw`` (``{"sae", "feature"}``),
    or else the first SAE feature its interventions add or clamp; {} for none."""
    if raw is None:
        for spec in specs:
            if "feature" in spec:  # an SAE feature an add or clamp writes
                return with_scale(
                    {"sae": spec["sae"], "feature": spec["feature"], "hook": spec["hook"]}, user=user
                )
        return {}
    if not isinstance(raw, dict) or set(raw) - {"sae", "feature"} or "sae" not in raw:
        raise ApplicationError(
            "INVALID_MEASURE", 'measure must be {"sae": <SAE id>, "feature": <index>}.', status=400
        )
    sae = _sae_source.describe(user, raw["sae"]) if _sae_source and isinstance(raw["sae"], str) else None
    if sae is None:
        raise ApplicationError("SAE_NOT_FOUND", f"No SAE {raw['sae']!r}.", status=404)
    feature = raw.get("feature")
    if not is_integer(feature) or not 0 <= feature < sae.d_sae:
        raise ApplicationError(
            "INVALID_MEASURE", f"measure.feature must be an integer in [0, {sae.d_sae}).", status=400
        )
    if sae.hook_name not in widths or (widths[sae.hook_name] not in (None, sae.d_in)):
        raise ApplicationError(
            "INVALID_MEASURE", f"The SAE reads {sae.hook_name}, which this model does not have.", status=400
        )
    return with_scale({"sae": sae.id, "feature": feature, "hook": sae.hook_name}, user=user)


def with_scale(measure: dict[str, Any], *, user) -> dict[str, Any]:
    """The measure with its feature's max activation (``scale``; None without an analysis): the
    effect's mean is then also said as a fraction of it, a unit that compares across features."""
    return {**measure, "scale": feature_scale(user, measure["sae"], measure["feature"])}


def _mean_source(index: int, cache_id: Any, hook: str, width: int | None, user) -> str:
    """The id of a completed cache the user can see that holds ``hook`` at its width: mean
    ablation takes its means from there."""
    from activations.selectors import completed_cache

    if not isinstance(cache_id, str):
        raise invalid(index, "mean_from must be an activation cache id.", "mean_from")
    try:
        cache = completed_cache(user=user, cache_id=cache_id)
    except ApplicationError as error:
        raise invalid(index, f"mean_from: {error.message}", "mean_from") from None
    stored = (cache.activation_shapes.get(hook) or [0, None])[1]
    if hook not in cache.hooks or (width is not None and stored != width):
        raise invalid(
            index, f"the cache {cache.id} holds no {hook} activations to take means from.", "mean_from"
        )
    return cache.id


def interventions_memory(specs: list[dict[str, Any]], *, user) -> budgets.MemoryEstimate | None:
    """The largest estimated peak of the mean ablations of a validated spec (their means are
    computed from a cache on the worker before the first token); None when there are none."""
    estimates = []
    for spec in specs:
        if "mean_from" not in spec:  # only an ablation to means takes them
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


@dataclass(frozen=True)
class _WorkerResolver:
    """Loads what stored specs name, in a worker: each SAE once, on ``device``."""

    device: Any = None
    modules: dict[str, Any] = field(default_factory=dict)

    def sae(self, sae_id: str) -> Any:
        if sae_id not in self.modules:
            self.modules[sae_id] = loaded_sae(sae_id, self.device)
        return self.modules[sae_id]

    def steering_vector(self, vector_id: str) -> Any:
        if _vector_source is None:
            raise ApplicationError("STEERING_VECTOR_NOT_FOUND", "No steering vectors here.", status=404)
        return _vector_source.load(vector_id)

    def means(self, cache_id: str, hook: str, sae: Any = None) -> Any:
        return cache_means(cache_id, hook, sae)


def resolved_interventions(specs: list[dict[str, Any]], device: Any = None) -> list[Intervention]:
    """The engine's interventions for a stored spec, with SAEs loaded (once each) on ``device``."""
    resolver = _WorkerResolver(device)
    return [kinds.from_json(spec, index, resolver) for index, spec in enumerate(specs)]
