"""Attribution graphs over transcoders (circuit-tracer's method, on miStudio's hook runtime)."""

from engine.attribution.graph import AttributionGraph
from engine.attribution.prunable import PrunableGraph, prune
from engine.attribution.pruning import node_influence
from engine.attribution.tracing import (
    AttributionConfig,
    attribute,
    attribution_tokens,
    check_transcoders,
)

__all__ = [
    "AttributionConfig",
    "AttributionGraph",
    "PrunableGraph",
    "attribute",
    "attribution_tokens",
    "check_transcoders",
    "node_influence",
    "prune",
]
