"""Template filters for the numbers researchers read: bytes and parameter counts."""

from django import template

register = template.Library()


@register.filter
def bytes_human(value) -> str:
    if value in (None, ""):
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


@register.filter
def params_human(value) -> str:
    if value in (None, ""):
        return "—"
    count = float(value)
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= threshold:
            return f"{count / threshold:.1f}{suffix}"
    return f"{count:.0f}"
