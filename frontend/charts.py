"""Server-side SVG charts: the activation browser's value histogram and per-hook norm chart, and
the line charts of an SAE's training curves.

Plain functions from numbers to SVG markup: no JavaScript, no chart library. Each chart is sized
by its ``viewBox`` (it scales to its container) and coloured only through CSS classes
(``.chart .bar-fill``, ``.line``, ``.dot``, ``.axis``, ``.grid-line``), so the light and dark
themes both apply. Every label goes through ``escape``; hover text is an SVG ``<title>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from html import escape

from django.utils.safestring import SafeString, mark_safe

HISTOGRAM_SIZE = (600, 250)
NORM_CHART_SIZE = (600, 250)
LINE_CHART_SIZE = (600, 240)

# Where a hook sits inside one transformer block, in the order the residual stream meets it.
_BLOCK_SITE_ORDER = {
    "hook_resid_pre": 0,
    "hook_attn_out": 1,
    "hook_resid_mid": 2,
    "mlp.hook_post": 3,
    "hook_mlp_out": 4,
    "hook_resid_post": 5,
}
_BLOCK_HOOK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_ANY_NUMBER = re.compile(r"(?:^|[.:_])(\d+)(?=$|[._])")


def hook_sort_key(name: str) -> tuple[float, int, str]:
    """Orders hooks as the model computes them: embedding, block 0 … block n, final norm.

    Raw ``module:<path>`` hooks go by the first layer number in their path.
    """
    if name == "hook_embed":
        return (-1, 0, name)
    match = _BLOCK_HOOK.match(name)
    if match:
        return (int(match[1]), _BLOCK_SITE_ORDER.get(match[2], len(_BLOCK_SITE_ORDER)), name)
    if name.startswith("ln_final"):
        return (math.inf, 0, name)
    number = _ANY_NUMBER.search(name)
    if number:
        return (int(number[1]), len(_BLOCK_SITE_ORDER) + 1, name)
    return (math.inf, 1, name)


def short_hook_name(name: str, limit: int = 16) -> str:
    """A hook name short enough for an axis label: ``blocks.3.hook_resid_post`` → ``3 resid_post``."""
    match = _BLOCK_HOOK.match(name)
    if name == "hook_embed":
        short = "embed"
    elif match:
        site = match[2].replace("mlp.hook_post", "mlp_post").replace("hook_", "")
        short = f"{match[1]} {site}"
    elif name.startswith("ln_final"):
        short = "ln_final"
    else:
        short = re.sub(r"^(module:)?(transformer\.|model\.|gpt_neox\.)?", "", name)
    return short if len(short) <= limit else short[: limit - 1] + "…"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten) covering ``[low, high]``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if high < low:
        low, high = high, low
    if high == low:
        return [low]
    raw = (high - low) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(factor * magnitude for factor in (1, 2, 2.5, 5, 10) if factor * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value = first + len(ticks) * step
    return ticks


def covering_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """:func:`nice_ticks` widened by a step at either end where needed, so that the first tick is at
    or below ``low`` and the last at or above ``high``: an axis over them holds every value."""
    ticks = nice_ticks(low, high, count)
    if len(ticks) < 2:
        step = abs(low) * 0.1 or 1.0
        return [low - step, low + step] if not ticks else [ticks[0] - step, ticks[0] + step]
    step = ticks[1] - ticks[0]
    if ticks[0] > low + step * 1e-9:
        ticks.insert(0, ticks[0] - step)
    if ticks[-1] < high - step * 1e-9:
        ticks.append(ticks[-1] + step)
    return ticks


def format_value(value: float, step: float | None = None) -> str:
    """A tick label: as many decimals as the tick step needs, compact above ten thousand."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 10_000:
        for divisor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= divisor:
                return f"{value / divisor:.3g}{suffix}"
    if step:
        exponent = math.floor(math.log10(step))
        mantissa = step / 10**exponent  # a 2.5-times step needs one more decimal
        extra = 0 if abs(mantissa - round(mantissa)) < 1e-9 else 1
        return f"{value:.{max(0, min(6, extra - exponent))}f}"
    return f"{value:.4g}"


def format_count(count: float) -> str:
    return format_value(count) if count >= 10_000 else f"{count:,.0f}"


def _line(css_class: str, x1: float, x2: float, y1: float, y2: float) -> str:
    return f'<line class="{css_class}" x1="{x1:.2f}" x2="{x2:.2f}" y1="{y1:.2f}" y2="{y2:.2f}"/>'


def _text(
    text: str, x: float, y: float, *, anchor: str = "middle", css_class: str = "", rotate: float = 0
) -> str:
    """A label (escaped here, once); rotated labels turn around their anchor point."""
    css = f' class="{css_class}"' if css_class else ""
    if rotate:
        place = f'transform="translate({x:.2f} {y:.2f}) rotate({rotate:g})"'
    else:
        place = f'x="{x:.2f}" y="{y:.2f}"'
    return f'<text{css} {place} text-anchor="{anchor}">{escape(text)}</text>'


def _svg(
    width: int, height: int, label: str, body: list[str], extra_class: str = "", data: str = ""
) -> SafeString:
    """The chart element; every piece of ``body`` (and ``data``, its ``data-*`` attributes) was
    built from numbers and escaped text."""
    classes = f"chart {extra_class}".strip()
    markup = (
        f'<svg class="{classes}"{data} viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(label)}" preserveAspectRatio="xMidYMid meet" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(label)}</title>{''.join(body)}</svg>"
    )
    return mark_safe(markup)  # noqa: S308  (labels escaped above and in _text)


def _empty_chart(width: int, height: int, label: str, message: str) -> SafeString:
    body = [
        f'<rect class="chart-frame" x="0.5" y="0.5" width="{width - 1}" height="{height - 1}" rx="8"/>',
        _text(message, width / 2, height / 2, css_class="chart-message"),
    ]
    return _svg(width, height, label, body, "chart-empty")


def _y_axis(
    body: list[str], ticks: list[float], y_of, *, left: float, right: float, labels: list[str]
) -> None:
    for tick, text in zip(ticks, labels, strict=True):
        y = y_of(tick)
        body.append(_line("grid-line", left, right, y, y))
        body.append(_text(text, left - 6, y + 4, anchor="end"))


def histogram_svg(
    counts: Sequence[float],
    edges: Sequence[float],
    *,
    label: str = "Histogram of activation values",
    x_label: str = "activation value",
    log_scale: bool = False,
    size: tuple[int, int] = HISTOGRAM_SIZE,
) -> SafeString:
    """One ``rect.bar-fill`` per bin (zero-height for empty bins), heights proportional to the counts
    (to ``log10(1 + count)`` with ``log_scale``), each with a ``<title>`` naming its range and count
    and ``data-count``.

    ``edges`` has one more value than ``counts``, as numpy's histogram gives them. No finite edges
    or nothing counted draws a "no data" chart instead.
    """
    width, height = size
    counts = [count if isinstance(count, int | float) and math.isfinite(count) else 0 for count in counts]
    edges = [float(edge) for edge in edges]
    total = sum(counts)
    if (
        not counts
        or len(edges) != len(counts) + 1
        or not all(math.isfinite(edge) for edge in edges)
        or edges[-1] <= edges[0]
        or total <= 0
    ):
        return _empty_chart(width, height, label, "No finite values to plot")

    left, right, top, bottom = 58, 14, 14, 44
    plot_width, plot_height = width - left - right, height - top - bottom
    base = top + plot_height
    low, high = edges[0], edges[-1]

    def x_of(value: float) -> float:
        return left + (value - low) / (high - low) * plot_width

    largest = max(counts)
    if log_scale:
        scale_top = math.log10(1 + largest)
        y_ticks = [float(10**power) for power in range(0, math.floor(scale_top) + 1)]

        def height_of(count: float) -> float:
            return math.log10(1 + count) / scale_top * plot_height

    else:
        y_ticks = nice_ticks(0, largest, 4)
        scale_top = max(largest, y_ticks[-1])

        def height_of(count: float) -> float:
            return count / scale_top * plot_height

    body: list[str] = []
    _y_axis(
        body,
        y_ticks,
        lambda tick: base - height_of(tick),
        left=left,
        right=left + plot_width,
        labels=[format_count(tick) for tick in y_ticks],
    )
    x_ticks = nice_ticks(low, high, 6)
    step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else None
    for tick in x_ticks:
        x = x_of(tick)
        body.append(_line("axis", x, x, base, base + 5))
        body.append(_text(format_value(tick, step), x, base + 18))
    gap = 1.0 if plot_width / len(counts) > 3 else 0.0
    for index, count in enumerate(counts):
        x0, x1 = x_of(edges[index]), x_of(edges[index + 1])
        bar_height = height_of(count)
        closing = "]" if index == len(counts) - 1 else ")"
        plural = "" if count == 1 else "s"
        tip = (
            f"[{edges[index]:.4g}, {edges[index + 1]:.4g}{closing}: "
            f"{count:,.0f} value{plural} ({count / total * 100:.2f} %)"
        )
        body.append(
            f'<g class="bin"><title>{escape(tip)}</title>'
            f'<rect class="bar-hit" x="{x0:.2f}" y="{top}" width="{max(0.0, x1 - x0):.2f}" '
            f'height="{plot_height}"/>'
            f'<rect class="bar-fill" x="{x0 + gap / 2:.2f}" y="{base - bar_height:.3f}" '
            f'width="{max(0.5, x1 - x0 - gap):.2f}" height="{bar_height:.3f}" data-count="{count:.0f}"/></g>'
        )
    if low < 0 < high:  # where the sign flips: most activation distributions straddle it
        body.append(_line("zero-line", x_of(0.0), x_of(0.0), top, base))
    body.append(_line("axis", left, left + plot_width, base, base))
    body.append(_text(x_label, left + plot_width / 2, height - 6, css_class="axis-label"))
    y_label = "count (log scale)" if log_scale else "count"
    body.append(_text(y_label, 14, top + plot_height / 2, css_class="axis-label", rotate=-90))
    return _svg(width, height, label, body, "histogram log-scale" if log_scale else "histogram")


def norm_chart_svg(
    norms: Mapping[str, float],
    *,
    current: str | None = None,
    href_for: Callable[[str], str] | None = None,
    label: str = "Mean L2 norm per token, by hook",
    size: tuple[int, int] = NORM_CHART_SIZE,
) -> SafeString:
    """A line with one ``circle.dot`` per hook, hooks in layer order (:func:`hook_sort_key`), x labels
    the shortened hook names. Each dot carries ``data-hook`` and ``data-value`` (the exact value)
    and a ``<title>``; ``href_for(hook)`` makes it a link; ``current`` is drawn highlighted.
    A hook whose value is not finite (an empty cache) keeps its label but gets no dot.
    """
    width, height = size
    hooks = sorted(norms, key=hook_sort_key)
    values = {hook: float(norms[hook]) for hook in hooks}
    finite = [value for value in values.values() if math.isfinite(value)]
    if not hooks or not finite:
        return _empty_chart(width, height, label, "No norms to plot")

    rotate = len(hooks) > 8
    left, right, top = 58, 24, 16
    bottom = 84 if rotate else 40
    plot_width, plot_height = width - left - right, height - top - bottom
    base = top + plot_height
    y_ticks = nice_ticks(0, max(finite) or 1.0, 4)
    y_top = max(max(finite), y_ticks[-1]) or 1.0
    step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else None

    def x_of(index: int) -> float:  # a category axis: each hook in the middle of its slot
        return left + (index + 0.5) * plot_width / len(hooks)

    def y_of(value: float) -> float:
        return base - value / y_top * plot_height

    body: list[str] = []
    _y_axis(
        body,
        y_ticks,
        y_of,
        left=left,
        right=left + plot_width,
        labels=[format_value(tick, step) for tick in y_ticks],
    )
    body.append(_line("axis", left, left + plot_width, base, base))
    # One polyline per run of finite values, so a missing value is a gap, not a dip to zero.
    runs: list[list[str]] = [[]]
    for index, hook in enumerate(hooks):
        if math.isfinite(values[hook]):
            runs[-1].append(f"{x_of(index):.2f},{y_of(values[hook]):.2f}")
        elif runs[-1]:
            runs.append([])
    body.extend(f'<polyline class="line" points="{" ".join(run)}"/>' for run in runs if len(run) > 1)
    for index, hook in enumerate(hooks):
        x = x_of(index)
        name = short_hook_name(hook)
        if rotate:
            body.append(_text(name, x, base + 12, anchor="end", css_class="x-label", rotate=-40))
        else:
            body.append(_text(name, x, base + 18, css_class="x-label"))
        value = values[hook]
        if not math.isfinite(value):
            continue
        classes, radius = ("dot current", 6.5) if hook == current else ("dot", 4.5)
        dot = (
            f'<circle class="{classes}" cx="{x:.2f}" cy="{y_of(value):.2f}" r="{radius}" '
            f'data-hook="{escape(hook)}" data-value="{value!r}">'
            f"<title>{escape(hook)}: mean L2 norm {value:.4g}</title></circle>"
        )
        if href_for is not None:
            dot = f'<a href="{escape(href_for(hook))}" aria-label="{escape(hook)}">{dot}</a>'
        body.append(dot)
    body.append(_text("mean ‖x‖₂", 14, top + plot_height / 2, css_class="axis-label", rotate=-90))
    return _svg(width, height, label, body, "norm-chart")


def line_chart_svg(
    points: Sequence[tuple[float, float]],
    *,
    label: str,
    x_label: str,
    y_label: str,
    log_y: bool = False,
    size: tuple[int, int] = LINE_CHART_SIZE,
) -> SafeString:
    """A ``polyline.line`` through ``(x, y)`` points in x order (a training curve: tokens seen → a
    metric), with y ticks, x ticks and a ``circle.dot.last`` on the newest point (its ``<title>``
    and ``data-value`` give the exact value). ``data-points`` on the ``<svg>`` counts what was
    drawn. Points with a non-finite value (or ``y <= 0`` on a log axis) are left out, breaking the
    line; nothing left to draw gives a "no data" chart.
    """
    width, height = size
    usable = [
        (float(x), float(y))
        for x, y in points
        if x is not None
        and y is not None
        and math.isfinite(float(x))
        and math.isfinite(float(y))
        and (not log_y or float(y) > 0)
    ]
    if not usable:
        return _empty_chart(width, height, label, "No points yet")
    usable.sort(key=lambda point: point[0])

    left, right, top, bottom = 62, 18, 14, 42
    plot_width, plot_height = width - left - right, height - top - bottom
    base = top + plot_height
    xs = [x for x, _ in usable]
    x_low, x_high = min(0.0, xs[0]), xs[-1]
    x_ticks = nice_ticks(x_low, x_high if x_high > x_low else x_low + 1, 5)
    x_high = max(x_high, x_ticks[-1]) if x_ticks else x_high
    x_span = (x_high - x_low) or 1.0

    def x_of(value: float) -> float:
        return left + (value - x_low) / x_span * plot_width

    ys = [y for _, y in usable]
    if log_y:
        low_power, high_power = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
        high_power = max(high_power, low_power + 1)
        y_ticks = [float(10**power) for power in range(low_power, high_power + 1)]
        y_labels = [f"{tick:g}" for tick in y_ticks]

        def y_of(value: float) -> float:
            share = (math.log10(value) - low_power) / (high_power - low_power)
            return base - share * plot_height

    else:
        y_low, y_high = min(0.0, min(ys)), max(ys)
        if y_high <= y_low:
            y_high = y_low + (abs(y_low) or 1.0)
        y_ticks = nice_ticks(y_low, y_high, 4)
        y_low, y_high = min(y_low, y_ticks[0]), max(y_high, y_ticks[-1])
        step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else None
        y_labels = [format_value(tick, step) for tick in y_ticks]

        def y_of(value: float) -> float:
            return base - (value - y_low) / (y_high - y_low) * plot_height

    body: list[str] = []
    _y_axis(body, y_ticks, y_of, left=left, right=left + plot_width, labels=y_labels)
    body.append(_line("axis", left, left + plot_width, base, base))
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else None
    for tick in x_ticks:
        x = x_of(tick)
        body.append(_line("axis", x, x, base, base + 5))
        body.append(_text(format_value(tick, x_step) if tick else "0", x, base + 18))
    coordinates = " ".join(f"{x_of(x):.2f},{y_of(y):.2f}" for x, y in usable)
    if len(usable) > 1:
        body.append(f'<polyline class="line" points="{coordinates}"/>')
    last_x, last_y = usable[-1]
    body.append(
        f'<circle class="dot last" cx="{x_of(last_x):.2f}" cy="{y_of(last_y):.2f}" r="4" '
        f'data-value="{last_y!r}"><title>{escape(f"{y_label} {last_y:.4g} at {last_x:,.0f} {x_label}")}'
        "</title></circle>"
    )
    body.append(_text(x_label, left + plot_width / 2, height - 6, css_class="axis-label"))
    axis_name = f"{y_label} (log scale)" if log_y else y_label
    body.append(_text(axis_name, 14, top + plot_height / 2, css_class="axis-label", rotate=-90))
    classes = "line-chart log-scale" if log_y else "line-chart"
    return _svg(width, height, label, body, classes, data=f' data-points="{len(usable)}"')


def scatter_chart_svg(
    points: Sequence[tuple[float | None, float | None, str]],
    *,
    label: str,
    x_label: str,
    y_label: str,
    size: tuple[int, int] = LINE_CHART_SIZE,
) -> SafeString:
    """One ``circle.dot`` per ``(x, y, name)`` (an SAE of a group: its L0 against its explained
    variance), each titled with its name and values, the Pareto frontier (most y for the least x)
    joined by a ``polyline.frontier``. Points without both values are left out."""
    width, height = size
    usable = [
        (float(x), float(y), name)
        for x, y, name in points
        if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))
    ]
    if not usable:
        return _empty_chart(width, height, label, "No results yet")
    left, right, top, bottom = 62, 18, 14, 42
    plot_width, plot_height = width - left - right, height - top - bottom
    base = top + plot_height
    xs, ys = [x for x, _, _ in usable], [y for _, y, _ in usable]
    # L0 spanning a decade or more reads on a log axis; otherwise a linear one from 0. Either way
    # the axis covers every point (one L0 or many: the commonest group has every member at one).
    logarithmic = min(xs) > 0 and max(xs) / min(xs) >= 10
    if logarithmic:
        x_ticks = [
            10.0**power
            for power in range(math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs))) + 1)
        ]
        x_scale = math.log10
    else:
        x_ticks = covering_ticks(min(0.0, min(xs)), max(xs) if max(xs) > 0 else 1.0, 5)
        x_scale = float
    y_low, y_high = min(ys), max(ys)
    if y_high - y_low < 1e-9:
        y_low, y_high = y_low - 0.05, y_high + 0.05
    y_ticks = covering_ticks(y_low, y_high, 4)
    x_low, x_high = x_scale(x_ticks[0]), x_scale(x_ticks[-1])
    y_low, y_high = y_ticks[0], y_ticks[-1]

    def x_of(value: float) -> float:
        return left + (x_scale(value) - x_low) / ((x_high - x_low) or 1.0) * plot_width

    def y_of(value: float) -> float:
        return base - (value - y_low) / ((y_high - y_low) or 1.0) * plot_height

    body: list[str] = []
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else None
    _y_axis(
        body,
        y_ticks,
        y_of,
        left=left,
        right=left + plot_width,
        labels=[format_value(t, y_step) for t in y_ticks],
    )
    body.append(_line("axis", left, left + plot_width, base, base))
    x_step = None if logarithmic or len(x_ticks) < 2 else x_ticks[1] - x_ticks[0]
    for tick in x_ticks:
        body.append(_line("axis", x_of(tick), x_of(tick), base, base + 5))
        body.append(_text(format_value(tick, x_step) if tick else "0", x_of(tick), base + 18))
    frontier, best = [], -math.inf
    for x, y, _ in sorted(usable, key=lambda point: (point[0], -point[1])):
        if y > best:
            frontier.append((x, y))
            best = y
    if len(frontier) > 1:
        coordinates = " ".join(f"{x_of(x):.2f},{y_of(y):.2f}" for x, y in frontier)
        body.append(f'<polyline class="line frontier" points="{coordinates}"/>')
    for x, y, name in usable:
        body.append(
            f'<circle class="dot" cx="{x_of(x):.2f}" cy="{y_of(y):.2f}" r="5" data-value="{y!r}">'
            f"<title>{escape(f'{name}: {x_label} {x:.4g}, {y_label} {y:.4g}')}</title></circle>"
        )
    x_title = f"{x_label} (log scale)" if logarithmic else x_label
    body.append(_text(x_title, left + plot_width / 2, height - 6, css_class="axis-label"))
    body.append(_text(y_label, 14, top + plot_height / 2, css_class="axis-label", rotate=-90))
    scale = ' data-x-scale="log"' if logarithmic else ' data-x-scale="linear"'
    return _svg(width, height, label, body, "scatter-chart", data=f' data-points="{len(usable)}"{scale}')
