"""Template filters for the numbers researchers read: bytes, parameter counts, measured values."""

from django import template

register = template.Library()


# A model's status as the pages name it: "pending" is a model registered and never loaded.
MODEL_STATUS_LABELS = {"pending": "not loaded"}


@register.filter
def model_status(value) -> str:
    """The same as ``mi.modelStatus`` in app.js."""
    return MODEL_STATUS_LABELS.get(value, value)


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


@register.filter
def significant(value, digits: int = 4) -> str:
    """A measured number to ``digits`` significant digits (``0.000123``, ``1.235e+04``): losses
    span orders of magnitude that a fixed number of decimals would round away."""
    if value in (None, ""):
        return "—"
    return f"{float(value):.{int(digits)}g}"


@register.filter
def percent(value, digits: int = 3) -> str:
    """A fraction as a percentage to ``digits`` significant digits (``0.00123`` → ``0.123 %``):
    feature densities span orders of magnitude too."""
    if value in (None, ""):
        return "—"
    return f"{float(value) * 100:.{int(digits)}g} %"
