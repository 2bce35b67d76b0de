"""An analysis's features as one JSON document in the field names of sae-dashboard's Neuronpedia
export (documented in docs/api.md), written feature by feature."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

from activations.models import ActivationCache
from features.models import Explanation, FeatureAnalysis
from features.selectors import Dashboards
from mistudio.access import linked_id
from saes.models import SparseAutoencoder

EXPORT_SCHEMA = "mistudio.features/1"


def _neuronpedia_feature(detail: dict[str, Any], prompts: int) -> dict[str, Any]:
    """One feature in the field names of sae-dashboard's Neuronpedia export (documented in docs/api.md)."""
    logits = detail["logit_effects"] or {"top": [], "bottom": [], "histogram": {"counts": [], "edges": []}}

    def centres(edges: list[float]) -> list[float]:
        return [round((low + high) / 2, 6) for low, high in itertools.pairwise(edges)]

    def activation(example: dict[str, Any], interval: list[float] | None) -> dict[str, Any]:
        return {
            "bin_min": interval[0] if interval else -1,
            "bin_max": interval[1] if interval else -1,
            "tokens": example["tokens"],
            "values": example["values"],
            "qualifying_token_index": example["center"],
        }

    label = detail["label"]
    return {
        "feature_index": detail["index"],
        "frac_nonzero": detail["density"],
        "max_activation": detail["max_activation"],
        "mean_activation": detail["mean_activation"],
        "pos_str": [entry["token"] for entry in logits["top"]],
        "pos_values": [entry["value"] for entry in logits["top"]],
        "neg_str": [entry["token"] for entry in logits["bottom"]],
        "neg_values": [entry["value"] for entry in logits["bottom"]],
        "freq_hist_data_bar_heights": detail["histogram"]["counts"],
        "freq_hist_data_bar_values": centres(detail["histogram"]["edges"]),
        "logits_hist_data_bar_heights": logits["histogram"]["counts"],
        "logits_hist_data_bar_values": centres(logits["histogram"]["edges"]),
        "topk_cos_sim_indices": [entry["index"] for entry in detail["similar"]],
        "topk_cos_sim_values": [entry["cosine"] for entry in detail["similar"]],
        "n_prompts_total": prompts,
        "activations": [activation(example, None) for example in detail["top_examples"]]
        + [activation(example, example["interval"]) for example in detail["interval_examples"]],
        # Neuronpedia's explanations: the reader's label first (a person's), then the scored ones.
        "explanations": (
            [{"description": label["label"], "typeName": "label"}] if label and label["label"] else []
        )
        + [
            {
                "description": explanation["text"],
                "score": explanation["score"],
                "scores": {name: explanation[column] for name, column in Explanation.SCORE_COLUMNS.items()},
                "explanationModelName": explanation["explainer_model"],
                "typeName": explanation["prompt_version"],
            }
            for explanation in detail["explanations"]
            if not explanation["error_code"]
        ],
        "auto_label": detail["auto_label"],
    }


def analysis_export_stream(*, user, sae: SparseAutoencoder, analysis: FeatureAnalysis) -> Iterator[bytes]:
    """Every feature's dashboard as one JSON document, written feature by feature."""
    head = {
        "schema": EXPORT_SCHEMA,
        "model_id": sae.model_name,
        "sae_id": sae.id,
        "hook_name": sae.hook_name,
        "d_sae": sae.d_sae,
        "analysis_id": analysis.id,
        "cache_id": linked_id(user, analysis, ActivationCache, analysis.cache_id),
        "tokens": analysis.tokens,
    }
    prompts = analysis.cache.sample_count if analysis.cache is not None else None
    dashboards = Dashboards(user=user, sae=sae, analysis=analysis, preload=True)  # missing files: 409 now

    def chunks() -> Iterator[bytes]:
        yield (json.dumps(head)[:-1] + ', "features": [').encode()
        for index in range(sae.d_sae):
            detail = dashboards.detail(index)
            yield ((", " if index else "") + json.dumps(_neuronpedia_feature(detail, prompts))).encode()
        yield b"]}"

    return chunks()
