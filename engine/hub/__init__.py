"""Model metadata and downloads from the Hugging Face Hub, through ``huggingface_hub``.

Two entry points, both importable without Django and both raising only :class:`HubError`:

* :func:`hub_metadata` reads what registering a model needs (the commit sha, the file list with
  sizes, ``config.json`` and the safetensors headers) without downloading any weights.
* :func:`download_model` puts the model's files into the ``huggingface_hub`` cache layout under a
  given folder and returns the snapshot folder ``transformers`` loads from.

Configuration, read on every call rather than at import time:

* ``HF_ENDPOINT`` chooses the Hub. ``huggingface_hub`` reads it only once, when it is imported
  (into ``huggingface_hub.constants.ENDPOINT``), so this package reads the variable itself and hands
  the endpoint explicitly to every ``huggingface_hub`` call. Setting the variable before a call is
  enough; nothing in ``huggingface_hub.constants`` needs patching.
* ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``), from the environment or from
  ``huggingface_hub.constants.HF_HUB_OFFLINE``: no request is made; a download is served from the
  cache if its snapshot is complete there.
* ``token=None`` means anonymous. The process's ``HF_TOKEN`` or saved login is deliberately not
  used, so which credential reaches the Hub is always the caller's decision. The token goes to
  ``huggingface_hub`` only and never into a message, a log line or an exception.

How downloads work. ``huggingface_hub`` 2.4 writes each download to a process-unique
``<etag>.<random>.incomplete`` file and deletes it when the download fails, so an interrupted
``hf_hub_download`` starts again from zero. A model download here is long (gigabytes), cancellable
and retried after network errors, so the bytes of each file are fetched with ``huggingface_hub``'s
own ``get_hf_file_metadata`` (the HEAD call) and ``http_get`` (the streaming GET with its retry and
``Range`` logic) into ``blobs/<etag>.incomplete``, which survives a cancel or a crash and is resumed
with a ``Range`` request on the next call. Once every blob is in place, ``snapshot_download`` builds
the snapshot folder, the ref and the tree listing as usual; it finds every blob present and
downloads nothing. The file handed to ``http_get`` reports each chunk written (progress) and checks
for cancellation after writing it, so progress and cancellation have the granularity of
``huggingface_hub``'s download chunk (``constants.DOWNLOAD_CHUNK_SIZE``, 10 MiB).
"""

from engine.hub.download import (
    DISK_SPACE_MARGIN_BYTES,
    LOCK_POLL_SECONDS,
    PROGRESS_INTERVAL_SECONDS,
    download_model,
)
from engine.hub.errors import HubError
from engine.hub.metadata import (
    DOWNLOAD_PATTERNS,
    HUB_ID_PATTERN,
    UNSAFE_WEIGHT_SUFFIXES,
    HubFile,
    HubModelMetadata,
    files_to_download,
    hub_metadata,
    validate_hub_id,
)

__all__ = [
    "DISK_SPACE_MARGIN_BYTES",
    "DOWNLOAD_PATTERNS",
    "HUB_ID_PATTERN",
    "LOCK_POLL_SECONDS",
    "PROGRESS_INTERVAL_SECONDS",
    "UNSAFE_WEIGHT_SUFFIXES",
    "HubError",
    "HubFile",
    "HubModelMetadata",
    "download_model",
    "files_to_download",
    "hub_metadata",
    "validate_hub_id",
]
