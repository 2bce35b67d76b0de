"""The one error type of the engine modules (inspection, hub, loading)."""

from typing import Any


class EngineError(Exception):
    """A refusal or failure with a stable ``code`` and a ``message`` that is safe to show users
    (never a token or a path on this machine); ``transient`` says whether trying again may help."""

    def __init__(
        self, code: str, message: str, details: dict[str, Any] | None = None, *, transient: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}
        self.transient = transient

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"
