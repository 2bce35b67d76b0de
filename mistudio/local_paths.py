"""Local paths a client names, confined to configured roots (LOCAL_MODEL_ROOTS, LOCAL_DATA_ROOTS)."""

from pathlib import Path

from mistudio.errors import ApplicationError


def path_inside_roots(raw_path: str, roots: list[Path], *, setting: str) -> Path:
    """The real path behind ``raw_path`` if it exists and lies inside one of ``roots``.

    Symlinks are followed before the check, so a link pointing out of a root is refused. The path
    is taken literally: no URL-decoding, no ``~`` expansion, relative paths refused. Messages name
    the setting, never a server path.
    """
    if not raw_path or "\x00" in raw_path or not raw_path.startswith("/"):
        raise ApplicationError("INVALID_LOCAL_PATH", "The local path must be absolute, without NUL bytes.")
    path = Path(raw_path).resolve()
    if not any(path.is_relative_to(root) for root in roots):
        raise ApplicationError(
            "INVALID_LOCAL_PATH", f"The local path is outside the configured roots ({setting})."
        )
    if not path.exists():
        raise ApplicationError("INVALID_LOCAL_PATH", "The local path does not exist.")
    return path


def path_shown(path: Path | str, roots: list[Path]) -> str:
    """How a path under a configured root is shown to clients: relative to its root, never the
    server's absolute path (a folder outside every root shows as its name alone)."""
    path = Path(path)
    for root in roots:
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return path.name
