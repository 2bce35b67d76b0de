"""HubError, and the translation of huggingface_hub's and the network's exceptions into it."""

from __future__ import annotations

import contextlib
import errno
import json
from collections.abc import Iterator
from typing import Any

from engine.errors import EngineError


class HubError(EngineError):
    """A failure talking to the Hub or preparing a model from it.

    ``code`` is stable and machine-readable (``MODEL_NOT_FOUND_ON_HUB``, ``HUB_OFFLINE``,
    ``HUB_UNREACHABLE``, ``HUB_ERROR``, ``GATED_MODEL``, ``INSUFFICIENT_DISK``,
    ``DOWNLOAD_CANCELLED``, ``UNSAFE_WEIGHTS``, ``INVALID_MODEL``, ``INVALID_MODEL_ID``);
    ``message`` is for people and never holds the token or a path on this machine; ``transient``
    says whether trying again later may succeed (network failures, Hub downtime).
    """


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """Turn huggingface_hub's and the network's exceptions into :class:`HubError`.

    Messages are written here rather than taken from the exceptions, which carry URLs and paths.
    """
    import httpx2
    from huggingface_hub import errors as hub_errors

    details: dict[str, Any] = {"repo_id": repo_id, "revision": revision}
    at_revision = f" at revision '{revision}'" if revision else ""
    try:
        yield
    except HubError:
        raise
    except hub_errors.OfflineModeIsEnabled as error:
        raise _offline_error(repo_id, revision, cached=False) from error
    except hub_errors.GatedRepoError as error:
        raise _gated_error(repo_id, details, error.response.status_code) from error
    except hub_errors.RevisionNotFoundError as error:
        raise HubError(
            "MODEL_NOT_FOUND_ON_HUB",
            f"The Hub has '{repo_id}' but no revision '{revision or 'main'}'.",
            details=details,
        ) from error
    except hub_errors.RepositoryNotFoundError as error:
        raise HubError(
            "MODEL_NOT_FOUND_ON_HUB",
            f"There is no model '{repo_id}' on the Hub (or it is private to others).",
            details=details,
        ) from error
    except hub_errors.RemoteEntryNotFoundError as error:
        raise HubError(
            "MODEL_NOT_FOUND_ON_HUB",
            f"A file of '{repo_id}'{at_revision} has disappeared from the Hub.",
            details=details,
        ) from error
    except hub_errors.HfHubHTTPError as error:
        raise _http_error(repo_id, details, error.response.status_code) from error
    except (
        hub_errors.RevisionResolutionError,
        hub_errors.LocalEntryNotFoundError,
        httpx2.TransportError,
    ) as error:
        # LocalEntryNotFoundError: hf_hub_download could not reach the Hub and has no cached copy.
        raise _unreachable_error(repo_id, details) from error
    except hub_errors.FileMetadataError as error:
        raise HubError(
            "HUB_ERROR",
            "The Hub endpoint answered without the headers of a Hugging Face Hub; check HF_ENDPOINT "
            "and any proxy.",
            details=details,
        ) from error
    except (hub_errors.SafetensorsParsingError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HubError(
            "INVALID_MODEL",
            f"'{repo_id}'{at_revision} has a config.json or safetensors header that cannot be read.",
            details=details,
        ) from error
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise _disk_full_error(repo_id) from error
        raise


def _http_error(repo_id: str, details: dict[str, Any], status: int) -> HubError:
    details = {**details, "http_status": status}
    if status in (401, 403):
        return _gated_error(repo_id, details, status)
    if status == 404:
        return HubError(
            "MODEL_NOT_FOUND_ON_HUB", f"There is no model '{repo_id}' on the Hub.", details=details
        )
    if status in (408, 429) or status >= 500:
        return _unreachable_error(repo_id, details)
    return HubError(
        "HUB_ERROR", f"The Hub refused a request for '{repo_id}' (HTTP {status}).", details=details
    )


def _gated_error(repo_id: str, details: dict[str, Any], status: int) -> HubError:
    return HubError(
        "GATED_MODEL",
        f"'{repo_id}' is gated on the Hub: accept its conditions on the model page and give miStudio "
        "a token of that account (HF_TOKEN)." + (" The token given was refused." if status == 403 else ""),
        details={**details, "http_status": status},
    )


def _unreachable_error(repo_id: str, details: dict[str, Any]) -> HubError:
    return HubError(
        "HUB_UNREACHABLE",
        f"The Hub could not be reached for '{repo_id}'; try again later.",
        details=details,
        transient=True,
    )


def _offline_error(repo_id: str, revision: str | None, *, cached: bool) -> HubError:
    reason = " and the model is not completely in the cache" if cached else ""
    return HubError(
        "HUB_OFFLINE",
        f"Hub access is switched off (HF_HUB_OFFLINE){reason}, so '{repo_id}' cannot be fetched.",
        details={"repo_id": repo_id, "revision": revision},
    )


def _disk_full_error(repo_id: str) -> HubError:
    return HubError(
        "INSUFFICIENT_DISK",
        f"The disk of the model cache filled up while downloading '{repo_id}'.",
        details={"repo_id": repo_id},
    )
