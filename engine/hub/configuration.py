"""How engine.hub calls huggingface_hub: the endpoint, offline mode, the credential, silent bars."""

from __future__ import annotations

import functools
import os
from typing import Any

_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def _hub_endpoint() -> str:
    """``HF_ENDPOINT`` as it is now; huggingface_hub's own copy is frozen at its import."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _offline_mode() -> bool:
    from huggingface_hub import constants

    from_environment = any(
        os.environ.get(name, "").upper() in _TRUE_VALUES
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    return constants.HF_HUB_OFFLINE or from_environment


def _credential(token: str | None) -> str | bool:
    """What huggingface_hub's ``token=`` gets: the token, or False (never the machine's saved login)."""
    return token or False


@functools.cache
def _silent_progress_bar() -> type:
    """A tqdm class for huggingface_hub's bars that shows nothing: workers report through callbacks."""
    from tqdm.std import tqdm

    class SilentProgressBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    return SilentProgressBar
