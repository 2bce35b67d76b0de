"""A model's snapshot found complete in the huggingface_hub cache, without the network."""

from __future__ import annotations

import glob
from pathlib import Path

from engine.hub.metadata import files_to_download


def _complete_cached_snapshot(repo_id: str, revision: str | None, cache_dir: Path) -> Path | None:
    """The snapshot of ``repo_id`` at ``revision`` if every file a download fetches is in the cache.

    Uses no network: the commit comes from the cached ref, the expected files from the tree listing
    that ``snapshot_download`` cached, and ``snapshot_download(local_files_only=True)`` checks them.
    """
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        tree = get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)
    except CachedRepoTreeNotFoundError:
        return None
    wanted = files_to_download(entry.path for entry in tree)
    if not any(path.endswith(".safetensors") for path in wanted):
        return None
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=True,
            allow_patterns=[glob.escape(path) for path in wanted],
        )
    except LocalEntryNotFoundError:  # also IncompleteSnapshotError
        return None
    return Path(snapshot)
