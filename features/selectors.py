"""Read queries of analyses, features and labels, for the API, pages, commands and snapshots.

A feature's dashboard is read from its analysis's ``features.safetensors``: row ``index`` of each
array, sliced from the file without reading the rest (the cache is never touched).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from django.db.models import Exists, F, OuterRef, Q, QuerySet, Subquery

from activations.selectors import model_folder, token_strings, tokenizer_for
from features.models import Explanation, ExplanationJob, Feature, FeatureAnalysis, FeatureLabel
from features.serializers import analysis_state, explanation_state, feature_summary, label_state
from mistudio.access import visible_row, visible_rows
from mistudio.errors import ApplicationError
from mistudio.events import register_group_kind
from saes.models import SparseAutoencoder
from saes.selectors import sae_list

SORTS = {
    "index": ("index",),
    "density": ("density", "index"),
    "-density": ("-density", "index"),
    "max_activation": ("max_activation", "index"),
    "-max_activation": ("-max_activation", "index"),
    # The best score among the feature's explanations the reader may see (unexplained last).
    "score": ("best_score", "index"),
    "-score": ("-best_score", "index"),
}


# --- analyses --------------------------------------------------------------------------------------


def analysis_list(*, user, sae: SparseAutoencoder | None = None) -> QuerySet[FeatureAnalysis]:
    """Analyses the user may see, of SAEs they may see."""
    analyses = visible_rows(
        FeatureAnalysis.objects.select_related("owner", "sae"), user, shareable=True
    ).filter(sae__in=sae_list(user=user))
    return analyses if sae is None else analyses.filter(sae=sae)


def analysed_sae_ids(*, user) -> set[str]:
    """Ids of the SAEs with a completed analysis the user may see (the SAE list links their features)."""
    completed = analysis_list(user=user).filter(status=FeatureAnalysis.Status.COMPLETED)
    return set(completed.order_by().values_list("sae_id", flat=True).distinct())


def analysis_get(*, user, sae: SparseAutoencoder, analysis_id: str) -> FeatureAnalysis:
    return visible_row(
        analysis_list(user=user, sae=sae),
        analysis_id,
        code="ANALYSIS_NOT_FOUND",
        what="feature analysis of this SAE",
    )


def current_analysis(*, user, sae: SparseAutoencoder, analysis_id: str | None = None) -> FeatureAnalysis:
    """The analysis named, or the newest completed one the user may see (404 ``NO_ANALYSIS``)."""
    if analysis_id:
        analysis = analysis_get(user=user, sae=sae, analysis_id=analysis_id)
        if analysis.status != FeatureAnalysis.Status.COMPLETED:
            raise ApplicationError("ANALYSIS_NOT_READY", f"The analysis is {analysis.status}.", status=409)
        return analysis
    analysis = (
        analysis_list(user=user, sae=sae)
        .filter(status=FeatureAnalysis.Status.COMPLETED)
        .order_by("-finished_at")
        .first()
    )
    if analysis is None:
        raise ApplicationError(
            "NO_ANALYSIS", "This SAE has no completed feature analysis yet: run one first.", status=404
        )
    return analysis


def feature_max_activation(user, sae_id: str, feature: int) -> float | None:
    """The feature's max activation in the newest completed analysis of the SAE that ``user`` may
    see (the unit of a steering coefficient); None without one."""
    sae = sae_list(user=user).filter(pk=sae_id).first()
    if sae is None:
        return None
    try:
        analysis = current_analysis(user=user, sae=sae)
    except ApplicationError:
        return None
    row = Feature.objects.filter(analysis=analysis, index=feature).values_list("max_activation", flat=True)
    return next(iter(row), None)


# --- labels ----------------------------------------------------------------------------------------


def visible_labels(*, user, sae: SparseAutoencoder) -> QuerySet[FeatureLabel]:
    return visible_rows(FeatureLabel.objects.select_related("owner"), user, shareable=True).filter(sae=sae)


def label_for(labels: list[FeatureLabel], user) -> FeatureLabel | None:
    """The label a user sees on a feature: their own, else the newest shared one."""
    own = [label for label in labels if label.owner_id == getattr(user, "pk", None)]
    return (own or sorted(labels, key=lambda label: label.updated_at, reverse=True) or [None])[0]


def labels_by_index(*, user, sae: SparseAutoencoder, indices: list[int]) -> dict[int, FeatureLabel | None]:
    grouped: dict[int, list[FeatureLabel]] = {}
    for label in visible_labels(user=user, sae=sae).filter(index__in=indices):
        grouped.setdefault(label.index, []).append(label)
    return {index: label_for(labels, user) for index, labels in grouped.items()}


# --- explanations ------------------------------------------------------------------------------


def explanation_job_list(*, user, analysis: FeatureAnalysis | None = None) -> QuerySet[ExplanationJob]:
    """Explanation jobs the user may see: of analyses they may see, their own or shared."""
    jobs = visible_rows(ExplanationJob.objects.select_related("owner", "analysis"), user, shareable=True)
    jobs = jobs.filter(analysis__in=analysis_list(user=user))
    return jobs if analysis is None else jobs.filter(analysis=analysis)


def visible_explanations(*, user, analysis: FeatureAnalysis) -> QuerySet[Explanation]:
    """The explanations of ``analysis`` that ``user`` may see (those of jobs they may see)."""
    return Explanation.objects.filter(
        analysis=analysis, job__in=explanation_job_list(user=user, analysis=analysis)
    )


def feature_explanations(*, user, analysis: FeatureAnalysis, index: int) -> list[Explanation]:
    """A feature's explanations the user may see, best score first (unscored and failed last)."""
    return ranked(visible_explanations(user=user, analysis=analysis).filter(index=index))


def ranked(explanations: QuerySet[Explanation]) -> list[Explanation]:
    return sorted(
        explanations,
        key=lambda row: (row.error_code != "", -(row.score if row.score is not None else -1), -row.pk),
    )


# --- the feature list ------------------------------------------------------------------------------


def feature_list(
    *, user, sae: SparseAutoencoder, analysis: FeatureAnalysis, filters: dict[str, Any]
) -> QuerySet[Feature]:
    """The analysis's features, filtered (``density_min`` / ``density_max``, ``dead``, ``labelled``,
    ``q``: label, notes or automatic label text, ``token``: an activating token of its top
    examples) and sorted (``sort``: one of :data:`SORTS`)."""
    features = Feature.objects.filter(analysis=analysis)
    if filters.get("density_min") is not None:
        features = features.filter(density__gte=filters["density_min"])
    if filters.get("density_max") is not None:
        features = features.filter(density__lte=filters["density_max"])
    if filters.get("dead") is not None:
        features = features.filter(density=0) if filters["dead"] else features.exclude(density=0)
    labels = visible_labels(user=user, sae=sae)
    if filters.get("labelled") is not None:
        labelled = Exists(labels.filter(index=OuterRef("index")).exclude(label=""))
        features = features.filter(labelled if filters["labelled"] else ~labelled)
    if filters.get("q"):
        text = filters["q"].strip()
        matching = labels.filter(Q(label__icontains=text) | Q(notes__icontains=text)).values("index")
        features = features.filter(Q(auto_label__icontains=text) | Q(index__in=matching))
    if filters.get("token"):
        features = features.filter(top_tokens__icontains=f"|{filters['token'].strip().lower()}|")
    sort = filters.get("sort") or "index"
    if (
        sort in ("score", "-score")
        or filters.get("score_min") is not None
        or filters.get("explained") is not None
    ):
        best = (
            visible_explanations(user=user, analysis=analysis)
            .filter(index=OuterRef("index"), score__isnull=False)
            .order_by("-score")
            .values("score")[:1]
        )
        features = features.annotate(best_score=Subquery(best))
        if filters.get("score_min") is not None:
            features = features.filter(best_score__gte=filters["score_min"])
        if filters.get("explained") is not None:
            features = features.filter(best_score__isnull=not filters["explained"])
        if sort in ("score", "-score"):
            field = F("best_score")
            return features.order_by(
                field.asc(nulls_last=True) if sort == "score" else field.desc(nulls_last=True), "index"
            )
    return features.order_by(*SORTS[sort])


def feature_page(
    *,
    user,
    sae: SparseAutoencoder,
    analysis: FeatureAnalysis,
    filters: dict[str, Any],
    page: int,
    page_size: int,
) -> dict[str, Any]:
    features = feature_list(user=user, sae=sae, analysis=analysis, filters=filters)
    total = features.count()
    rows = list(features[(page - 1) * page_size : page * page_size])
    indices = [row.index for row in rows]
    labels = labels_by_index(user=user, sae=sae, indices=indices)
    best = best_explanations(user=user, analysis=analysis, indices=indices)
    return {
        "analysis_id": analysis.id,
        "total": total,
        "page": page,
        "page_size": page_size,
        "features": [
            {**feature_summary(row, labels.get(row.index)), "explanation": best.get(row.index)}
            for row in rows
        ],
    }


def best_explanations(*, user, analysis: FeatureAnalysis, indices: list[int]) -> dict[int, dict[str, Any]]:
    """Per feature, its best-scored explanation the user may see (text, score, model), if any."""
    best: dict[int, dict[str, Any]] = {}
    rows = visible_explanations(user=user, analysis=analysis).filter(index__in=indices, error_code="")
    for row in rows.order_by(F("score").desc(nulls_last=True), "-pk"):
        best.setdefault(
            row.index,
            {"id": row.pk, "text": row.text, "score": row.score, "explainer_model": row.explainer_model},
        )
    return best


# --- one feature's dashboard -----------------------------------------------------------------------


class FeatureFile:
    """Row ``index`` of the arrays of ``features.safetensors``, sliced without reading the rest."""

    def __init__(self, analysis: FeatureAnalysis):
        from safetensors import safe_open

        try:
            self._file = safe_open(str(analysis.data_path), framework="numpy")
        except (OSError, ValueError):
            raise ApplicationError(
                "ANALYSIS_FILES_MISSING", "The analysis's files are missing or damaged.", status=409
            ) from None
        self.names = set(self._file.keys())

    def row(self, name: str, index: int) -> np.ndarray | None:
        return self._file.get_slice(name)[index] if name in self.names else None

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._file.get_slice(name)[start:stop]


def analysis_tokenizer(sae: SparseAutoencoder):
    """The SAE's model's tokenizer, or None when its files are not on this machine (ids shown)."""
    if sae.model is None:
        return None
    folder = model_folder(sae.model)
    try:
        return tokenizer_for(str(folder)) if folder is not None else None
    except (OSError, ValueError):
        return None


def _examples(
    data: FeatureFile,
    prefix: str,
    index: int,
    tokenizer,
    *,
    before: int,
    maximum: float,
    intervals: int | None,
) -> list[dict[str, Any]]:
    rows = data.row(f"{prefix}_rows", index)
    values = data.row(f"{prefix}_values", index)
    context = data.row(f"{prefix}_context", index).astype(np.float32)
    context_tokens = data.row(f"{prefix}_context_tokens", index)
    samples, positions = data.row(f"{prefix}_sample", index), data.row(f"{prefix}_position", index)
    examples = []
    seen: set[tuple[int, ...]] = set()
    for slot, row in enumerate(rows):
        if row < 0:
            continue
        present = context_tokens[slot] >= 0
        # A context the same as a stronger example's (a repeated sample) says nothing new: left out.
        window = (int(present[:before].sum()), *(int(token) for token in context_tokens[slot][present]))
        if window in seen:
            continue
        seen.add(window)
        example = {
            "row": int(row),
            "value": float(values[slot]),
            "sample_index": int(samples[slot]),
            "position": int(positions[slot]),
            "token_ids": [int(token) for token in context_tokens[slot][present]],
            "tokens": token_strings(tokenizer, context_tokens[slot][present]),
            "values": [round(float(value), 5) for value in context[slot][present]],
            "center": int(present[:before].sum()),
        }
        if intervals:
            interval = min(intervals - 1, max(0, int(np.ceil(values[slot] / maximum * intervals)) - 1))
            example["interval"] = [
                round(maximum * interval / intervals, 6),
                round(maximum * (interval + 1) / intervals, 6),
            ]
        examples.append(example)
    return examples


class Dashboards:
    """Reads dashboards of one analysis: its file opened once, the tokenizer once, and (``preload``,
    for the export) every Feature row and visible label read once instead of per feature."""

    def __init__(self, *, user, sae: SparseAutoencoder, analysis: FeatureAnalysis, preload: bool = False):
        self.user, self.sae, self.analysis = user, sae, analysis
        self.data = FeatureFile(analysis)
        self.tokenizer = analysis_tokenizer(sae)
        self.before = analysis.config.get("context_before", 8)
        self.intervals = analysis.config.get("intervals", 5)
        self._features: dict[int, Feature] | None = None
        self._labels: dict[int, list[FeatureLabel]] | None = None
        self._explanations: dict[int, list[Explanation]] | None = None
        if preload:
            self._features = {row.index: row for row in Feature.objects.filter(analysis=analysis)}
            self._labels = {}
            for label in visible_labels(user=user, sae=sae):
                self._labels.setdefault(label.index, []).append(label)
            self._explanations = {}
            for explanation in ranked(visible_explanations(user=user, analysis=analysis).defer("prompt")):
                self._explanations.setdefault(explanation.index, []).append(explanation)

    def features(self, indices: list[int]) -> dict[int, Feature]:
        if self._features is not None:
            return {index: self._features[index] for index in indices if index in self._features}
        return {row.index: row for row in Feature.objects.filter(analysis=self.analysis, index__in=indices)}

    def labels(self, index: int) -> list[FeatureLabel]:
        if self._labels is not None:
            return self._labels.get(index, [])
        return list(visible_labels(user=self.user, sae=self.sae).filter(index=index))

    def explanations(self, index: int) -> list[Explanation]:
        if self._explanations is not None:
            return self._explanations.get(index, [])
        return feature_explanations(user=self.user, analysis=self.analysis, index=index)

    def detail(self, index: int) -> dict[str, Any]:
        """Everything a feature's dashboard shows, as JSON."""
        sae, data, tokenizer = self.sae, self.data, self.tokenizer
        if not 0 <= index < sae.d_sae:
            raise ApplicationError(
                "FEATURE_NOT_FOUND", f"The SAE has features 0 to {sae.d_sae - 1}.", status=404
            )
        feature = self.features([index]).get(index)
        if feature is None:
            raise ApplicationError("FEATURE_NOT_FOUND", "The analysis has no such feature.", status=404)
        labels = self.labels(index)
        maximum = float(feature.max_activation)
        histogram = data.row("histogram", index)
        bins = len(histogram)
        detail: dict[str, Any] = {
            "sae_id": sae.id,
            "analysis_id": self.analysis.id,
            **feature_summary(feature, label_for(labels, self.user)),
            "nonzero_count": int(data.row("nonzero_count", index)),
            "tokens": self.analysis.tokens,
            "histogram": {
                "counts": [int(count) for count in histogram],
                "edges": [round(maximum * edge / bins, 6) for edge in range(bins + 1)],
            },
            "top_examples": _examples(
                data, "top", index, tokenizer, before=self.before, maximum=maximum, intervals=None
            ),
            "interval_examples": _examples(
                data,
                "interval",
                index,
                tokenizer,
                before=self.before,
                maximum=maximum or 1.0,
                intervals=self.intervals,
            ),
            "logit_effects": None,
            "similar": [],
            "labels": [
                {**label_state(label), "mine": label.owner_id == getattr(self.user, "pk", None)}
                for label in labels
            ],
            "explanations": [
                explanation_state(row, prompt=self._explanations is None) for row in self.explanations(index)
            ],
        }
        if "logit_top_ids" in data.names:
            detail["logit_effects"] = self._logit_effects(index)
        neighbour_ids = [int(neighbour) for neighbour in data.row("neighbour_ids", index)]
        neighbours = self.features(neighbour_ids)
        detail["similar"] = [
            {
                "index": neighbour,
                "cosine": round(float(cosine), 5),
                "density": neighbours[neighbour].density if neighbour in neighbours else None,
                "auto_label": neighbours[neighbour].auto_label if neighbour in neighbours else "",
            }
            for neighbour, cosine in zip(neighbour_ids, data.row("neighbour_cosines", index), strict=True)
            # A dead feature (it never fired on the analysed tokens) is no neighbour worth opening.
            if neighbour not in neighbours or neighbours[neighbour].density > 0
        ]
        return detail

    def _logit_effects(self, index: int) -> dict[str, Any]:
        data = self.data
        low, high = (float(value) for value in data.row("logit_range", index))
        counts = data.row("logit_histogram", index)
        effects: dict[str, Any] = {}
        for direction in ("top", "bottom"):
            ids = data.row(f"logit_{direction}_ids", index)
            effects[direction] = [
                {"token_id": int(token), "token": text, "value": round(float(value), 5)}
                for token, text, value in zip(
                    ids,
                    token_strings(self.tokenizer, ids),
                    data.row(f"logit_{direction}_values", index),
                    strict=True,
                )
            ]
        effects["histogram"] = {
            "counts": [int(count) for count in counts],
            "edges": [round(low + (high - low) * edge / len(counts), 6) for edge in range(len(counts) + 1)],
        }
        return effects


def feature_detail(*, user, sae: SparseAutoencoder, analysis: FeatureAnalysis, index: int) -> dict[str, Any]:
    """Everything a feature's dashboard shows, as JSON (``GET /api/saes/{id}/features/{index}``)."""
    return Dashboards(user=user, sae=sae, analysis=analysis).detail(index)


def with_feature_names(*, user, sae: SparseAutoencoder, result: dict[str, Any]) -> dict[str, Any]:
    """A live encoding's result with each feature's label and automatic label (from the newest
    analysis the user may see; none before the first)."""
    indices = {entry["index"] for entry in result["overall"]}
    indices |= {entry["index"] for row in result["per_token"] for entry in row}
    try:
        analysis = current_analysis(user=user, sae=sae)
    except ApplicationError:
        analysis = None
    automatic = (
        dict(Feature.objects.filter(analysis=analysis, index__in=indices).values_list("index", "auto_label"))
        if analysis
        else {}
    )
    labels = labels_by_index(user=user, sae=sae, indices=list(indices))
    names = {
        index: {
            "auto_label": automatic.get(index, ""),
            "label": labels[index].label if labels.get(index) else "",
        }
        for index in indices
    }
    return {
        **result,
        "analysis_id": analysis.id if analysis else None,
        "overall": [{**entry, **names[entry["index"]]} for entry in result["overall"]],
        "features": {str(index): names[index] for index in sorted(indices)},
    }


# --- events ----------------------------------------------------------------------------------------


def analysis_snapshot(user, key: str | None) -> dict[str, Any] | None:
    analysis = analysis_list(user=user).filter(pk=key).first()
    return None if analysis is None else analysis_state(analysis, viewer=user)


def register_event_groups() -> None:
    register_group_kind(
        "analysis",
        keyed=True,
        snapshot=analysis_snapshot,
        visible=lambda user, key: analysis_list(user=user).filter(pk=key).exists(),
    )
