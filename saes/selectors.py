"""Read queries of SAE rows, for the API, pages, commands and WebSocket snapshots."""

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from django.db.models import Prefetch, QuerySet

from generation.interventions import SaeReference
from mistudio.access import check_may_change, completed_row, visible_row, visible_rows
from mistudio.errors import ApplicationError
from mistudio.events import register_group_kind
from mistudio.streaming import tar_stream
from saes.models import SaeEvaluation, SaeGroup, SparseAutoencoder
from saes.serializers import sae_group_state, sae_state

# What an export holds: the SAELens folder, never the training checkpoint.
EXPORTED_FILES = ("cfg.json", "sae_weights.safetensors", "sparsity.safetensors")
CIRCUIT_TRACER_FOLDER = "circuit_tracer"
# A cross-layer transcoder's files, in circuit-tracer's layout (engine.sae.clt), in its row's folder.
CLT_FOLDER = "clt"


def sae_list(*, user, filters: dict[str, Any] | None = None) -> QuerySet[SparseAutoencoder]:
    """SAEs the user may see: their own, shared ones and system ones (all for ``model:admin``)."""
    active_evaluations = Prefetch(
        "evaluations",
        queryset=SaeEvaluation.objects.filter(status__in=SaeEvaluation.ACTIVE).order_by("-created_at"),
        to_attr="active_evaluations",
    )
    saes = visible_rows(
        SparseAutoencoder.objects.select_related("owner", "model").prefetch_related(active_evaluations),
        user,
        shareable=True,
    )
    filters = filters or {}
    for name, field in (
        ("model", "model_id"),
        ("cache", "cache_id"),
        ("status", "status"),
        ("hook", "hook_name"),
    ):
        if filters.get(name):
            saes = saes.filter(**{field: filters[name]})
    return saes


def sae_get(*, user, sae_id: str) -> SparseAutoencoder:
    return visible_row(sae_list(user=user), sae_id, code="SAE_NOT_FOUND", what="SAE")


def sae_get_to_change(*, user, sae_id: str) -> SparseAutoencoder:
    """The SAE, if the user may change it (404 when invisible, 403 ``NOT_OWNER`` when not theirs)."""
    sae = sae_get(user=user, sae_id=sae_id)
    check_may_change(sae, user, what="SAE")
    return sae


def completed_sae(*, user, sae_id: str) -> SparseAutoencoder:
    return completed_row(sae_get(user=user, sae_id=sae_id), code="SAE_NOT_READY", what="SAE")


def sae_reference(user, sae_id: str) -> SaeReference | None:
    """What an intervention needs of a completed single-layer SAE the user can see; None otherwise
    (a cross-layer transcoder's features are steered through attribution graphs for now)."""
    sae = sae_list(user=user).filter(pk=sae_id, status=SparseAutoencoder.Status.COMPLETED).first()
    if sae is None or sae.is_cross_layer:
        return None
    return SaeReference(
        id=sae.id, hook_name=sae.hook_name, d_in=sae.d_in, d_sae=sae.d_sae,
        hook_name_out=sae.hook_name_out or None, d_out=sae.d_out,
    )  # fmt: skip


# (user, SAE) -> (file name, bytes) or None: files other apps add to an export (features: labels).
_export_extras: list[Callable[[Any, SparseAutoencoder], tuple[str, bytes] | None]] = []


def register_export_extra(extra: Callable[[Any, SparseAutoencoder], tuple[str, bytes] | None]) -> None:
    _export_extras.append(extra)


# (SAE row, its import folder) -> None: what other apps read from an import (features: labels).
_import_extras: list[Callable[[SparseAutoencoder, Path], None]] = []


def register_import_extra(imported: Callable[[SparseAutoencoder, Path], None]) -> None:
    _import_extras.append(imported)


def import_extras() -> tuple[Callable[[SparseAutoencoder, Path], None], ...]:
    return tuple(_import_extras)


def sae_export_files(sae: SparseAutoencoder, *, user) -> list[tuple[str, Path, bytes | None]]:
    """What an export holds: (file name, file, replacement bytes or None) for the SAELens folder,
    then the registered extras (``labels.json``: the labels ``user`` sees). A cross-layer
    transcoder's are its circuit-tracer files (``clt/W_enc_0.safetensors`` …)."""
    if sae.is_cross_layer:
        files = sorted((sae.directory / CLT_FOLDER).glob("W_*.safetensors"))
        if len(files) != 2 * (sae.n_layers or 0):
            raise ApplicationError("SAE_FILES_MISSING", "The SAE's files are missing.", status=409)
        return [(f"{CLT_FOLDER}/{path.name}", path, None) for path in files]
    files = [sae.directory / name for name in EXPORTED_FILES]
    if not files[0].is_file() or not files[1].is_file():
        raise ApplicationError("SAE_FILES_MISSING", "The SAE's files are missing.", status=409)
    entries: list[tuple[str, Path, bytes | None]] = [
        (path.name, path, None) for path in files if path.is_file()
    ]
    # A transcoder's circuit-tracer file, written beside the SAELens folder when it trained.
    for path in sorted((sae.directory / CIRCUIT_TRACER_FOLDER).glob("layer_*.safetensors")):
        entries.append((f"{CIRCUIT_TRACER_FOLDER}/{path.name}", path, None))
    for extra in _export_extras:
        if (found := extra(user, sae)) is not None:
            entries.append((found[0], files[0], found[1]))
    return entries


def sae_export_stream(sae: SparseAutoencoder, *, user, files=None) -> Iterator[bytes]:
    """The SAE as a tar of its SAELens folder, ``<id>/cfg.json``, the safetensors files and extras
    (``files``: :func:`sae_export_files` already read)."""
    files = sae_export_files(sae, user=user) if files is None else files
    return tar_stream((f"{sae.id}/{name}", path, data) for name, path, data in files)


def sae_snapshot(user, key: str | None) -> dict[str, Any] | None:
    sae = sae_list(user=user).filter(pk=key).first()
    return None if sae is None else sae_state(sae, viewer=user)


def sae_visible(user, key: str) -> bool:
    return sae_list(user=user).filter(pk=key).exists()


def group_list(*, user) -> QuerySet[SaeGroup]:
    """Groups the user may see: their own, shared ones and system ones (all for ``model:admin``)."""
    return visible_rows(SaeGroup.objects.select_related("owner", "model"), user, shareable=True)


def group_get(*, user, group_id: str) -> SaeGroup:
    return visible_row(group_list(user=user), group_id, code="SAE_GROUP_NOT_FOUND", what="SAE group")


def group_snapshot(user, key: str | None) -> dict[str, Any] | None:
    group = group_list(user=user).filter(pk=key).first()
    return None if group is None else sae_group_state(group, viewer=user)


def group_visible(user, key: str) -> bool:
    return group_list(user=user).filter(pk=key).exists()


def register_event_groups() -> None:
    register_group_kind("sae", keyed=True, snapshot=sae_snapshot, visible=sae_visible)
    register_group_kind("sae_group", keyed=True, snapshot=group_snapshot, visible=group_visible)
