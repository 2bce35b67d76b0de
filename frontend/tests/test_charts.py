"""The server-side SVG charts: what they draw for ordinary, empty, NaN and constant data, escaping,
the layer order of the norm chart, and the training-curve line chart. Pure functions: no database,
no model."""

import math
import re
import xml.etree.ElementTree as ElementTree

import numpy as np
import pytest

from frontend.charts import (
    HISTOGRAM_SIZE,
    format_value,
    histogram_svg,
    hook_sort_key,
    line_chart_svg,
    nice_ticks,
    norm_chart_svg,
    scatter_chart_svg,
    short_hook_name,
)

SVG = "{http://www.w3.org/2000/svg}"


def parse(markup: str) -> ElementTree.Element:
    """The chart as XML: it must be well-formed, whatever went into its labels."""
    return ElementTree.fromstring(str(markup))  # noqa: S314  (our own output)


def bars(markup: str) -> list[ElementTree.Element]:
    return [rect for rect in parse(markup).iter(f"{SVG}rect") if rect.get("class") == "bar-fill"]


def test_one_bar_per_bin_with_heights_proportional_to_counts():
    values = np.random.default_rng(0).standard_normal(5000)
    counts, edges = np.histogram(values, bins=60)
    chart = histogram_svg(counts.tolist(), edges.tolist())
    drawn = bars(chart)
    assert len(drawn) == 60
    assert [int(bar.get("data-count")) for bar in drawn] == counts.tolist()
    heights = np.array([float(bar.get("height")) for bar in drawn])
    ratio = heights[counts > 0] / counts[counts > 0]
    assert np.allclose(ratio, ratio[0], rtol=1e-3) and heights[counts == 0].tolist() == [0.0] * int(
        (counts == 0).sum()
    )
    # Bars sit on one baseline and march left to right without overlapping.
    bottoms = {round(float(bar.get("y")) + float(bar.get("height")), 2) for bar in drawn}
    assert len(bottoms) == 1
    lefts = [float(bar.get("x")) for bar in drawn]
    assert lefts == sorted(lefts)
    root = parse(chart)
    assert root.get("viewBox") == "0 0 {} {}".format(*HISTOGRAM_SIZE) and "chart" in root.get("class").split()
    # Each bin names its range and count on hover.
    titles = [group.find(f"{SVG}title").text for group in root.iter(f"{SVG}g") if group.get("class") == "bin"]
    assert len(titles) == 60 and f"{counts[30]:,} value" in titles[30]


def test_axis_ticks_and_labels():
    chart = histogram_svg([1, 4, 2], [-1.0, 0.0, 1.0, 2.0])
    texts = [text.text for text in parse(chart).iter(f"{SVG}text")]
    assert "activation value" in texts and "count" in texts
    assert {"-1.0", "0.0", "1.0", "2.0"} <= set(texts)  # x ticks
    assert "4" in texts and "0" in texts  # y ticks
    assert 'class="zero-line"' in chart  # the range straddles zero


def test_log_scale_heights_follow_log_counts():
    counts = [1, 10, 100, 1000]
    drawn = bars(histogram_svg(counts, [0, 1, 2, 3, 4], log_scale=True))
    heights = [float(bar.get("height")) for bar in drawn]
    expected = [math.log10(1 + count) for count in counts]
    assert heights == pytest.approx([height / expected[-1] * heights[-1] for height in expected], rel=1e-3)


@pytest.mark.parametrize(
    ("counts", "edges"),
    [
        ([], [0.0]),  # no bins
        ([0, 0, 0], [0.0, 1.0, 2.0, 3.0]),  # nothing counted (an empty cache)
        ([3, 1], [float("nan"), 0.5, 1.0]),  # edges from NaN data
        ([3, 1], [0.0, float("inf"), 1.0]),
        ([3, 1], [0.0, 0.5]),  # edges that do not match the counts
    ],
)
def test_no_data_draws_an_empty_chart_not_an_error(counts, edges):
    chart = histogram_svg(counts, edges)
    assert "chart-empty" in chart and "No finite values to plot" in chart and bars(chart) == []


def test_nan_counts_and_constant_data():
    # A NaN count (never from the store, but charts take what they are given) draws as zero.
    drawn = bars(histogram_svg([2, float("nan"), 2], [0, 1, 2, 3]))
    assert [float(bar.get("height")) for bar in drawn][1] == 0.0
    # Constant data: numpy puts every value in one bin of a unit-wide range around the constant.
    counts, edges = np.histogram(np.full(100, 3.5), bins=10)
    drawn = bars(histogram_svg(counts.tolist(), edges.tolist()))
    assert len(drawn) == 10 and sum(int(bar.get("data-count")) for bar in drawn) == 100
    assert sorted(float(bar.get("height")) > 0 for bar in drawn) == [False] * 9 + [True]


def test_labels_are_escaped():
    hostile = '<script>alert("x")</script> & "quotes"'
    chart = histogram_svg([1, 2], [0, 1, 2], label=hostile, x_label=hostile)
    assert "<script>" not in chart and "&lt;script&gt;" in chart
    assert parse(chart).get("aria-label") == hostile
    norms = norm_chart_svg(
        {'blocks.0.hook_"><b>': 1.0, "hook_embed": 2.0}, href_for=lambda hook: f"?hook={hook}"
    )
    assert "<b>" not in norms
    assert {dot.get("data-hook") for dot in parse(norms).iter(f"{SVG}circle")} == {
        'blocks.0.hook_"><b>',
        "hook_embed",
    }


def test_the_norm_chart_orders_hooks_by_layer():
    norms = {
        "ln_final.hook_normalized": 9.0,
        "blocks.10.hook_resid_post": 8.0,
        "blocks.2.hook_resid_post": 4.0,
        "blocks.2.mlp.hook_post": 3.5,
        "blocks.2.hook_resid_pre": 3.0,
        "hook_embed": 1.0,
        "blocks.2.hook_attn_out": 0.5,
    }
    chart = norm_chart_svg(
        norms, current="blocks.2.hook_resid_post", href_for=lambda hook: f"/x/?hook={hook}"
    )
    dots = list(parse(chart).iter(f"{SVG}circle"))
    order = [dot.get("data-hook") for dot in dots]
    assert order == [
        "hook_embed",
        "blocks.2.hook_resid_pre",
        "blocks.2.hook_attn_out",
        "blocks.2.mlp.hook_post",
        "blocks.2.hook_resid_post",
        "blocks.10.hook_resid_post",  # 10 after 2: numbers, not strings
        "ln_final.hook_normalized",
    ]
    assert [float(dot.get("data-value")) for dot in dots] == [norms[hook] for hook in order]
    xs = [float(dot.get("cx")) for dot in dots]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    # Larger norms sit higher (smaller y); the current hook is highlighted; each dot links to its hook.
    ys = {dot.get("data-hook"): float(dot.get("cy")) for dot in dots}
    assert ys["ln_final.hook_normalized"] < ys["blocks.2.hook_resid_post"] < ys["hook_embed"]
    assert [dot.get("class") for dot in dots if "current" in dot.get("class")] == ["dot current"]
    links = [link.get("href") for link in parse(chart).iter(f"{SVG}a")]
    assert links[0] == "/x/?hook=hook_embed" and len(links) == len(norms)
    labels = [text.text for text in parse(chart).iter(f"{SVG}text") if text.get("class") == "x-label"]
    assert labels[:2] == ["embed", "2 resid_pre"] and labels[-1] == "ln_final"
    assert len(re.findall(r'class="line"', chart)) == 1


def test_the_norm_chart_skips_missing_values_and_handles_one_hook():
    chart = norm_chart_svg({"blocks.0.hook_resid_post": 2.0, "blocks.1.hook_resid_post": float("nan")})
    dots = list(parse(chart).iter(f"{SVG}circle"))
    assert [dot.get("data-hook") for dot in dots] == ["blocks.0.hook_resid_post"]
    assert "1 resid_post" in chart  # the label stays
    assert "chart-empty" in norm_chart_svg({"hook_embed": float("nan")})
    assert "chart-empty" in norm_chart_svg({})


def test_module_hooks_sort_by_their_layer_number_and_shorten():
    names = ["module:transformer.h.11.mlp", "module:transformer.h.2.attn", "hook_embed"]
    assert sorted(names, key=hook_sort_key) == [
        "hook_embed",
        "module:transformer.h.2.attn",
        "module:transformer.h.11.mlp",
    ]
    assert short_hook_name("module:transformer.h.11.mlp") == "h.11.mlp"
    assert short_hook_name("blocks.3.mlp.hook_post") == "3 mlp_post"
    assert len(short_hook_name("module:a.very.long.module.path.name.here", limit=12)) == 12


def test_ticks_are_round_numbers_covering_the_range():
    assert nice_ticks(0, 100, 4) == [0, 25, 50, 75, 100]
    assert nice_ticks(-3.7, 4.2, 6) == [-2, 0, 2, 4]
    assert nice_ticks(5, 5) == [5] and nice_ticks(0, float("nan")) == []
    assert (
        format_value(2.5, 2.5) == "2.5" and format_value(0.3, 0.1) == "0.3" and format_value(120000) == "120k"
    )


# --- line charts (training curves) ---------------------------------------------------------------------


def polyline_points(markup: str) -> list[tuple[float, float]]:
    line = next(node for node in parse(markup).iter(f"{SVG}polyline") if node.get("class") == "line")
    return [tuple(float(part) for part in pair.split(",")) for pair in line.get("points").split()]


def test_a_line_chart_draws_its_points_in_x_order_scaled_into_the_plot():
    points = [(256 * step, 1.0 / step) for step in range(1, 21)]
    chart = line_chart_svg(points[::-1], label="MSE", x_label="tokens", y_label="mse")
    root = parse(chart)
    assert root.get("data-points") == "20" and "line-chart" in root.get("class").split()
    drawn = polyline_points(chart)
    xs = [x for x, _ in drawn]
    assert xs == sorted(xs) and len(drawn) == 20
    # y falls as the value falls (SVG y grows downwards), linearly in the value
    ys = np.array([y for _, y in drawn])
    values = np.array([value for _, value in points])
    slope, intercept = np.polyfit(values, ys, 1)
    assert slope < 0 and np.abs(slope * values + intercept - ys).max() < 0.01  # coordinates have 2 decimals
    last = next(node for node in root.iter(f"{SVG}circle") if "last" in node.get("class").split())
    assert float(last.get("data-value")) == points[-1][1]
    assert (float(last.get("cx")), float(last.get("cy"))) == pytest.approx(drawn[-1], abs=0.01)
    assert "mse 0.05 at 5,120 tokens" in last.find(f"{SVG}title").text
    texts = [text.text for text in root.iter(f"{SVG}text")]
    assert "tokens" in texts and "mse" in texts


def test_a_log_scale_line_chart_spaces_decades_evenly_and_skips_what_it_cannot_draw():
    points = [(1, 1.0), (2, 0.1), (3, 0.0), (4, 0.01), (5, math.nan)]
    chart = line_chart_svg(points, label="MSE", x_label="tokens", y_label="mse", log_y=True)
    assert parse(chart).get("data-points") == "3"  # zero and NaN have no place on a log axis
    ys = [y for _, y in polyline_points(chart)]
    assert ys[0] - ys[1] == pytest.approx(ys[1] - ys[2])
    assert "mse (log scale)" in [text.text for text in parse(chart).iter(f"{SVG}text")]


@pytest.mark.parametrize("points", [[], [(1, math.nan)], [(None, 1.0)]])
def test_a_line_chart_with_nothing_to_draw_says_so(points):
    chart = line_chart_svg(points, label="L0 <b>", x_label="tokens", y_label="l0")
    assert "chart-empty" in parse(chart).get("class") and "No points yet" in str(chart)
    assert "<b>" not in str(chart)


def test_a_single_point_or_a_flat_line_still_draws():
    one = line_chart_svg([(100, 5.0)], label="L0", x_label="tokens", y_label="l0")
    assert parse(one).get("data-points") == "1" and not list(parse(one).iter(f"{SVG}polyline"))
    flat = line_chart_svg([(0, 0.0), (10, 0.0)], label="dead", x_label="tokens", y_label="dead")
    assert all(math.isfinite(value) for point in polyline_points(flat) for value in point)


def circles(svg: str) -> list[tuple[float, float]]:
    found = re.findall(r'<circle class="dot" cx="([\d.-]+)" cy="([\d.-]+)"', svg)
    return [(float(x), float(y)) for x, y in found]


@pytest.mark.parametrize("l0", [31.8, 32.0, 7.0, 128.0])
def test_a_group_whose_members_share_one_l0_is_drawn_inside_the_plot(l0):
    """Before: every TopK member at L0 31.8 sat at cx = 446 in a 440-wide plot (the axis ended at
    its last round tick, 30)."""
    width, height = 440, 280
    points = [(l0, 0.7 + step / 100, f"member {step}") for step in range(4)]
    svg = str(scatter_chart_svg(points, label="l", x_label="L0", y_label="ev", size=(width, height)))
    drawn = circles(svg)
    assert len(drawn) == 4
    assert all(62 <= x <= width - 18 and 14 <= y <= height - 42 for x, y in drawn), drawn
    assert 'data-x-scale="linear"' in svg


def test_l0_over_more_than_a_decade_is_drawn_on_a_log_axis():
    points = [(4.0, 0.5, "a"), (40.0, 0.8, "b"), (400.0, 0.9, "c")]
    svg = str(scatter_chart_svg(points, label="l", x_label="L0", y_label="ev", size=(440, 280)))
    assert 'data-x-scale="log"' in svg and "L0 (log scale)" in svg
    xs = [x for x, _ in circles(svg)]
    assert xs[1] - xs[0] == pytest.approx(xs[2] - xs[1], abs=0.05)  # equal ratios, equal steps
    assert all(62 <= x <= 440 - 18 for x in xs)
    assert 'class="line frontier"' in svg
