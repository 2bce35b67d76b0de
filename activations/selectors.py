"""Read queries for datasets, extractions and caches (API, pages, commands)."""

import functools
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from django.conf import settings
from django.db.models import Case, CharField, F, OuterRef, Q, QuerySet, Subquery, When
from safetensors.numpy import save as safetensors_save

from activations.model_structure import skeleton
from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.services import job_state
from activations.store import ActivationStore, CacheError, iter_files
from engine.hooks import list_hook_points
from mistudio.access import check_may_change, completed_row, is_admin, visible_row, visible_rows
from mistudio.errors import ApplicationError
from mistudio.events import register_group_kind
from mistudio.jobs import JobStatus
from mistudio.streaming import tar_stream
from models_app.models import LanguageModel
from models_app.services import local_model_folder, model_gguf_copy

MANIFEST_FILE = "manifest.json"


def dataset_list(*, user) -> QuerySet[Dataset]:
    """Datasets the user may see: own, shared and system ones (all for ``model:admin``)."""
    return visible_rows(Dataset.objects.select_related("owner"), user, shareable=True)


def dataset_choices(*, user, limit: int | None = None) -> list[Dataset]:
    """The datasets a form offers ``user``: their own first, then shared and system ones, newest
    first in each (a form preselects the first: never another user's newest)."""
    mine = getattr(user, "pk", None)
    found = dataset_list(user=user).order_by("-created_at")
    return sorted(found[:limit] if limit else found, key=lambda dataset: dataset.owner_id != mine)


def dataset_get(*, user, dataset_id: str) -> Dataset:
    return visible_row(dataset_list(user=user), dataset_id, code="DATASET_NOT_FOUND", what="dataset")


def dataset_get_to_change(*, user, dataset_id: str) -> Dataset:
    """The dataset, if the user may change it (404 when invisible, 403 ``NOT_OWNER`` when not theirs)."""
    dataset = dataset_get(user=user, dataset_id=dataset_id)
    check_may_change(dataset, user, what="dataset")
    return dataset


def hook_points(model: LanguageModel) -> dict[str, Any]:
    """Every canonical hook point with the shape one sample of ``n`` tokens gives it."""

    points = [
        {"name": info.name, "layer": info.layer, "shape": ["n_tokens", info.width]}
        for info in list_hook_points(skeleton(model))
    ]
    return {
        "model_id": model.id,
        "num_layers": model.num_layers,
        "hook_points": points,
        "also_accepted": [
            "module:<dotted.path> of any named module",
            "layer_indices: [i, …] = blocks.{i}.hook_resid_post",
        ],
    }


def extraction_list(*, user) -> QuerySet[ExtractionJob]:
    """The user's own extraction jobs (all for ``model:admin``)."""
    return visible_rows(ExtractionJob.objects.all(), user, shareable=False)


def extraction_get(*, user, extraction_id: str, model_id: str | None = None) -> ExtractionJob:
    jobs = extraction_list(user=user).filter(pk=extraction_id)
    if model_id is not None:
        jobs = jobs.filter(model_id=model_id)
    job = jobs.first()
    if job is None:
        raise ApplicationError("EXTRACTION_NOT_FOUND", "No such extraction.", status=404)
    return job


def extraction_estimate_seconds(job: ExtractionJob) -> float:
    """From the throughput of this model's last finished extraction, else a conservative guess."""
    if job.cached:
        return 0.0
    tokens = (job.total_samples or 0) * min(job.max_length, 128)
    return round(tokens / model_tokens_per_second(job.model_id) + 2.0, 1)


def model_tokens_per_second(model_id: str | None) -> float:
    """The throughput of the model's last finished extraction, else a conservative guess."""
    previous = (
        ExtractionJob.objects.filter(model_id=model_id, status=JobStatus.COMPLETED, cached=False)
        .exclude(tokens_per_second=None)
        .order_by("-finished_at")
        .first()
    )
    return previous.tokens_per_second if previous and previous.tokens_per_second else 2000.0


def cache_list(*, user, filters: dict[str, str] | None = None) -> QuerySet[ActivationCache]:
    """Caches the user made, or that their own extractions reused (all for ``model:admin``), each
    with the dataset this user is shown for it (see :func:`with_shown_dataset`); the ``dataset``
    filter matches that one."""
    reused = ExtractionJob.objects.filter(owner_id=user.pk, cache__isnull=False).values("cache_id")
    caches = visible_rows(ActivationCache.objects.all(), user, shareable=False, also=Q(pk__in=reused))
    caches = with_shown_dataset(caches, user=user)
    filters = filters or {}
    if "model" in filters:
        caches = caches.filter(model_id=filters["model"])
    if "dataset" in filters:
        caches = caches.filter(shown_dataset_id=filters["dataset"])
    if "status" in filters:
        caches = caches.filter(status=filters["status"])
    return caches


def with_shown_dataset(caches: QuerySet[ActivationCache], *, user) -> QuerySet[ActivationCache]:
    """Annotates ``shown_dataset_id`` and ``shown_dataset_name``: the dataset ``user`` is told a
    cache was made over.

    A cache is reused by everyone who asks for its key, and its key holds the content hash of
    the samples, not a dataset: so a user is shown the cache's own dataset only if they may see
    that dataset (theirs, shared, a system one; every one for an admin), else the dataset of
    their own latest extraction that reused the cache (the same samples, under their name),
    else none. A reuse therefore never names, nor identifies, another user's private dataset.
    """
    readable = Q(dataset_id__in=dataset_list(user=user).values("pk"))
    own_reuse = ExtractionJob.objects.filter(
        cache_id=OuterRef("pk"), owner_id=user.pk, dataset__isnull=False
    ).order_by("-created_at")
    return caches.annotate(
        shown_dataset_id=Case(
            When(readable, then=F("dataset_id")),
            default=Subquery(own_reuse.values("dataset_id")[:1]),
            output_field=CharField(),
        ),
        shown_dataset_name=Case(
            When(readable, then=F("dataset__name")),
            default=Subquery(own_reuse.values("dataset__name")[:1]),
            output_field=CharField(),
        ),
    )


def cache_get(*, user, cache_id: str) -> ActivationCache:
    return visible_row(cache_list(user=user), cache_id, code="CACHE_NOT_FOUND", what="activation cache")


def cache_get_to_change(*, user, cache_id: str) -> ActivationCache:
    """The cache, if the user made it (a reused cache is read-only for its other users)."""
    cache = cache_get(user=user, cache_id=cache_id)
    check_may_change(cache, user, what="activation cache")
    return cache


def completed_cache(*, user, cache_id: str) -> ActivationCache:
    return completed_row(cache_get(user=user, cache_id=cache_id), code="CACHE_NOT_READY", what="cache")


def cache_manifest(cache: ActivationCache, *, user) -> dict[str, Any] | None:
    """The cache's manifest as ``user`` may read it (``cache`` comes from :func:`cache_list`).

    Its provenance names the dataset this user is shown (:func:`with_shown_dataset`); the dataset
    recorded by the extraction that wrote the cache stays only for that extraction's owner (or an
    admin) once the dataset is deleted, and is blanked for anyone else. A local model in its key
    is named relative to its root, also in caches written before keys went path-free.
    """
    path = cache.directory / MANIFEST_FILE
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    provenance = manifest.get("provenance")
    if isinstance(provenance, dict) and "dataset_id" in provenance:
        if cache.shown_dataset_id is not None:
            provenance.update(dataset_id=cache.shown_dataset_id, dataset_name=cache.shown_dataset_name)
        elif cache.dataset_id is not None or not (is_admin(user) or cache.owner_id == user.pk):
            provenance.update(dataset_id=None, dataset_name=None)
    model_key = manifest.get("key", {}).get("model") if isinstance(manifest.get("key"), dict) else None
    if isinstance(model_key, dict) and model_key.get("source") == LanguageModel.Source.LOCAL:
        model_key["identifier"] = cache.model.display_identifier
    return manifest


def cache_manifest_bytes(cache: ActivationCache, *, user) -> bytes:
    """:func:`cache_manifest` as the ``manifest.json`` file a download gives ``user``."""
    return (json.dumps(cache_manifest(cache, user=user), indent=2) + "\n").encode()


def open_store(cache: ActivationCache):

    try:
        return ActivationStore.open(cache.directory)
    except (CacheError, OSError):
        raise ApplicationError(
            "CACHE_CORRUPT", "The cache files are missing or damaged.", status=409
        ) from None


def cache_store(cache: ActivationCache, hook: str):
    store = open_store(cache)
    if hook not in store.hooks:
        raise ApplicationError(
            "INVALID_HOOK",
            f"The cache has no hook {hook!r}.",
            details={"invalid": [hook], "valid": store.hooks},
        )
    return store


def cache_file(cache: ActivationCache, relative: str) -> Path:
    """A file of the cache named as in ``iter_files`` (never a path outside it)."""

    files = {str(path.relative_to(cache.directory)): path for path in iter_files(cache.directory)}
    if relative not in files:
        raise ApplicationError(
            "FILE_NOT_FOUND", "No such file in this cache.", status=404, details={"files": sorted(files)}
        )
    return files[relative]


MAX_SLICE_VALUES = 4_000_000  # rows x width per slice request (16 MB of float32)
SLICE_OUTPUTS = ("json", "npy", "safetensors")


def cache_slice(cache: ActivationCache, *, hook: str, start: int, stop: int | None) -> tuple[np.ndarray, int]:
    """Rows ``[start, stop)`` of ``hook`` (``stop`` clipped to the rows there are) and that stop;
    ``INVALID_RANGE`` for an empty range, ``SLICE_TOO_LARGE`` past :data:`MAX_SLICE_VALUES`."""
    store = cache_store(cache, hook)
    rows, width = store.shape(hook)
    stop = min(rows if stop is None else stop, rows)
    if start >= stop:
        raise ApplicationError("INVALID_RANGE", f"The token range is empty (the hook has {rows} rows).")
    if (stop - start) * width > MAX_SLICE_VALUES:
        raise ApplicationError(
            "SLICE_TOO_LARGE", f"At most {MAX_SLICE_VALUES // width} rows per request for this hook."
        )
    return store.get(hook, start, stop), stop


def array_file_bytes(array: np.ndarray, output: str) -> bytes:
    """``array`` as a ``.npy`` file, or as a ``.safetensors`` file holding it as ``activations``."""
    array = np.ascontiguousarray(array)
    if output == "npy":
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()
    return safetensors_save({"activations": array})


JSON_ROWS_VALUES_PER_CHUNK = 8_192  # ~4 ms of encoding: other threads get the GIL between chunks


def json_rows(header: dict[str, Any], array: np.ndarray) -> Iterator[bytes]:
    """``{**header, "values": [[…], …]}`` for a ``[rows, width]`` array as JSON, a block of rows per
    chunk (float32 values; NaN and ±inf, which JSON cannot say, as null)."""
    yield json.dumps(header)[:-1].encode() + b', "values": ['
    step = max(1, JSON_ROWS_VALUES_PER_CHUNK // max(1, array.shape[1]))
    for first in range(0, len(array), step):
        block = array[first : first + step].astype(np.float32)
        rows = block.tolist()
        if not np.isfinite(block).all():
            rows = [[value if math.isfinite(value) else None for value in row] for row in rows]
        yield (b"," if first else b"") + json.dumps(rows, allow_nan=False)[1:-1].encode()
    yield b"]}"


def cache_tar_stream(cache: ActivationCache, *, manifest: bytes | None = None) -> Iterator[bytes]:
    """A tar archive of the cache, produced chunk by chunk (memory flat whatever the shard size).

    ``manifest`` replaces the ``manifest.json`` on disk (a user's download holds the manifest as
    :func:`cache_manifest_bytes` gives it to them); without it, every file is as on disk.
    """
    entries = []
    for path in iter_files(cache.directory):
        relative = str(path.relative_to(cache.directory))
        replaced = manifest if manifest is not None and relative == MANIFEST_FILE else None
        entries.append((f"{cache.id}/{relative}", path, replaced))
    return tar_stream(entries)


def cache_stats(cache: ActivationCache, hook: str | None = None) -> dict[str, Any]:
    store = cache_store(cache, hook) if hook else open_store(cache)
    hooks = [hook] if hook else store.hooks
    result = {}
    for name in hooks:
        stats = store.stats(name)
        result[name] = {
            key: value.tolist() if hasattr(value, "tolist") else value for key, value in stats.items()
        }
    return {"cache_id": cache.id, "stats": result}


@functools.lru_cache(maxsize=8)
def tokenizer_for(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


MAX_TOKENIZE_TEXTS = 8
MAX_TOKENIZE_CHARACTERS = 4000


def text_tokens(
    model: LanguageModel, texts: list[str], *, special_tokens: bool
) -> list[list[dict[str, Any]]]:
    """How the model's tokenizer splits each text: ``[{"id", "text"}]`` per text, with the special
    tokens a prompt gets (BOS where the tokenizer adds one, as extraction and patching tokenize
    prompts) or without them (as one-token answers are read). No model load: its tokenizer files."""
    folder = model_folder(model)
    if folder is None:
        raise ApplicationError(
            "TOKENIZER_UNAVAILABLE", "The model's files are not on this machine (load it once).", status=409
        )
    tokenizer = _cached_tokenizer(str(folder))
    result = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=special_tokens).input_ids
        result.append(
            [
                {"id": token, "text": piece}
                for token, piece in zip(ids, token_strings(tokenizer, ids), strict=True)
            ]
        )
    return result


@functools.lru_cache(maxsize=8)
def _cached_tokenizer(folder: str):
    return tokenizer_for(folder)


def token_strings(tokenizer, token_ids) -> list[str]:
    """Each token as text; a token that is part of a character's UTF-8 bytes (which decodes alone
    to "\ufffd") as its bytes, ``<0xE2><0x80>``."""
    ids = [int(token) for token in token_ids]
    if tokenizer is None:
        return [f"#{token}" if token >= 0 else "" for token in ids]
    return [_token_text(tokenizer, token) if token >= 0 else "" for token in ids]


def _token_text(tokenizer, token: int) -> str:
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text
    piece = tokenizer.convert_ids_to_tokens(token)
    decoder = _byte_decoder()
    if isinstance(piece, str) and piece and all(character in decoder for character in piece):
        return "".join(f"<0x{decoder[character]:02X}>" for character in piece)
    return piece if isinstance(piece, str) and piece else text


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's characters back to the bytes they stand for (GPT-2, Llama 3 and others)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {character: byte for byte, character in bytes_to_unicode().items()}


def model_folder(model: LanguageModel) -> Path | None:
    """Where the model's files are on this machine (for its tokenizer), if they are: a local
    folder only while it and every entry of it stay inside ``LOCAL_MODEL_ROOTS``; a GGUF file's
    converted copy once a load made it."""
    if model.source == LanguageModel.Source.LOCAL:
        converted = model_gguf_copy(model)
        if converted is not None:
            return converted
        try:
            return local_model_folder(model.identifier)
        except ApplicationError:
            return None
    from huggingface_hub.file_download import repo_folder_name

    snapshot = settings.MODEL_CACHE_DIR / repo_folder_name(repo_id=model.identifier, repo_type="model")
    snapshot = snapshot / "snapshots" / model.commit_sha
    return snapshot if model.commit_sha and snapshot.is_dir() else None


def model_files_missing(model: LanguageModel) -> ApplicationError:
    """Why :func:`model_folder` found no files, naming the setting this process read (a command
    run without the server's environment reads other roots): never a path (errors reach users)."""
    if model.source == LanguageModel.Source.LOCAL:
        message = (
            "The model's folder is not under LOCAL_MODEL_ROOTS as this process reads it: run it with "
            "the server's settings (the same LOCAL_MODEL_ROOTS, or MISTUDIO_DATA_DIR for a converted "
            "GGUF), or load the model once."
        )
    else:
        message = "The model's files are not downloaded here (MODEL_CACHE_DIR): load the model once."
    return ApplicationError("MODEL_FILES_MISSING", message, status=409)


def cache_top_k(cache: ActivationCache, *, hook: str, neuron: int, k: int, context: int) -> dict[str, Any]:
    store = cache_store(cache, hook)
    width = store.shape(hook)[1]
    if neuron >= width:
        raise ApplicationError("INVALID_NEURON", f"The hook has {width} neurons (0 to {width - 1}).")
    rows = store.top_k(hook, neuron, k, context=context)
    folder = model_folder(cache.model)
    tokenizer = tokenizer_for(str(folder)) if folder is not None else None
    results = []
    for row in rows:
        clean = {name: value.tolist() if hasattr(value, "tolist") else value for name, value in row.items()}
        if tokenizer is not None:
            clean["context_tokens"] = tokenizer.convert_ids_to_tokens(clean["context_token_ids"])
            clean["token"] = tokenizer.convert_ids_to_tokens([clean["token_id"]])[0]
        results.append(clean)
    return {"cache_id": cache.id, "hook": hook, "neuron": neuron, "top_k": results}


def extraction_snapshot(user, key: str | None) -> dict[str, Any] | None:

    job = extraction_list(user=user).filter(pk=key).first()
    return None if job is None else job_state(job)


def register_event_groups() -> None:

    register_group_kind(
        "extraction",
        keyed=True,
        snapshot=extraction_snapshot,
        visible=lambda user, key: extraction_list(user=user).filter(pk=key).exists(),
    )


# --- Activation browser reads (per-sample views and highlighted contexts) --------------------------


def _sample_rows(store, sample_index: int):
    """Row numbers of one sample's stored tokens, in position order (public store API only)."""
    import numpy as np

    table = store.tokens()
    rows = np.flatnonzero(np.asarray(table["sample_index"]) == sample_index)
    return rows[np.argsort(np.asarray(table["position"])[rows], kind="stable")]


def _neuron_values(store, hook: str, neuron: int, rows) -> list[float]:
    """One neuron's values at the given rows; a contiguous run (the usual case) is one read."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == 0:
        return []
    if np.all(np.diff(rows) == 1):
        return store.get(hook, int(rows[0]), int(rows[-1]) + 1)[:, neuron].astype(np.float32).tolist()
    return [float(store.get(hook, int(row), int(row) + 1)[0, neuron]) for row in rows]


def cache_neuron_top_contexts(store, *, hook: str, neuron: int, k: int = 20, context: int = 8) -> list[dict]:
    """``store.top_k`` for one neuron, each row with ``context_values``: the neuron's value at every
    context token (what the browser colours the context by).

    The caller checks the hook and the neuron's range (``cache_store``; ``store.shape``).
    """
    import numpy as np

    table = store.tokens()
    samples, positions = np.asarray(table["sample_index"]), np.asarray(table["position"])
    results = store.top_k(hook, neuron, k, context=context)
    for row in results:
        # Stored in sample and position order (every extraction writes them so), the context is
        # the run of rows around the token; anything else falls back to looking the sample up.
        first = row["row"] - row["center"]
        last = first + len(row["context_positions"])
        rows = np.arange(first, last)
        if not (
            first >= 0
            and last <= len(samples)
            and np.all(samples[first:last] == row["sample_index"])
            and positions[first:last].tolist() == row["context_positions"]
        ):
            sample_rows = _sample_rows(store, row["sample_index"])
            wanted = set(row["context_positions"])
            rows = np.asarray([r for r in sample_rows if int(positions[r]) in wanted], dtype=np.int64)
        row["context_values"] = _neuron_values(store, hook, neuron, rows)
    return results


def cache_sample_neuron(store, *, hook: str, sample_index: int, neuron: int) -> dict[str, Any]:
    """One sample's stored tokens with one neuron's value at each: ``token_ids``, ``positions``,
    ``values`` and ``generated`` (per token 0/1 for a generation's cache, else ``None``)."""
    import numpy as np

    rows = _sample_rows(store, sample_index)
    table = store.tokens()
    generated = table.get("generated")
    return {
        "sample_index": sample_index,
        "token_ids": np.asarray(table["token_ids"])[rows].tolist(),
        "positions": np.asarray(table["position"])[rows].tolist(),
        "values": _neuron_values(store, hook, neuron, rows),
        "generated": None if generated is None else np.asarray(generated)[rows].tolist(),
    }
