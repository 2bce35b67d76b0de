"""bench/gpu.py's table: one row per measurement with its seconds, tokens/s, its ratio to the bare
forward pass and, where one is set, its goal (the least ratio against a yardstick) judged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from extraction_costs import ExtractionCosts

GOAL_TMPFS_VS_FORWARD = 0.7
GOAL_CACHE_DIRECTORY_VS_BOUND = 0.85
GOAL_EXTRACTION_VS_PEERS = 1.5
GOAL_DECODE_VS_GENERATE = 0.9


@dataclass(frozen=True)
class Row:
    measurement: str
    seconds: float | None = None
    # Tokens per second; None when it did not run.
    rate: float | None = None
    # rate / the bare forward's rate, for the rows timed over the extraction's tokens.
    forward_ratio: float | None = None
    # What the goal compares with, in words (with that side's rate), or why the row has no rate.
    against: str = "-"
    ratio: float | None = None
    # The least ratio that meets the goal; None for a row without one.
    goal: float | None = None


def rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:,.0f}"


def number_text(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def verdict(ratio: float | None, goal: float | None) -> str:
    if goal is None:
        return "-"
    if ratio is None:
        return f"≥ {goal:.2f}: n/a"
    return f"≥ {goal:.2f}: {'met' if ratio >= goal else 'MISSED'}"


def markdown_table(rows: Sequence[Row]) -> str:
    lines = [
        "| measurement | seconds | tokens/s | x bare forward | against | ratio | goal |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        cells = (
            row.measurement,
            number_text(row.seconds, 3),
            rate_text(row.rate),
            number_text(row.forward_ratio, 2),
            row.against,
            number_text(row.ratio, 2),
            verdict(row.ratio, row.goal),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_of(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def peer_text(label: str, outcome: float | str) -> str:
    """A peer in the "against" column: its rate, or why it has none ("not installed", ...)."""
    return f"{label} {outcome}" if isinstance(outcome, str) else f"{label} {outcome:,.0f}"


PEER_MEASUREMENTS = {
    "nnsight": "nnsight trace + save, to host memory",
    "TransformerLens": "TransformerLens run_with_cache, to host memory",
}


def table_rows(
    costs: ExtractionCosts,
    *,
    deepest: int,
    hooks: int,
    peers: dict[str, float | str],
    decode: float | None,
    generate: float | None,
    sae: float | None,
    sae_shape: str,
) -> list[Row]:
    """The table's rows. ``peers`` maps a peer's label to its seconds over the same tokens or to
    why it has none; ``decode``, ``generate`` and ``sae`` are tokens/s (None: that part failed)."""
    tokens = costs.tokens
    forward = tokens / costs.forward

    def timed(
        measurement: str, seconds: float, *, against: str = "-", yardstick: float | None = None,
        goal: float | None = None,
    ) -> Row:  # fmt: skip
        """A row timed over the extraction's tokens; its ratio is against ``yardstick`` (tokens/s)."""
        rate = tokens / seconds
        return Row(measurement, seconds, rate, rate / forward, against, ratio_of(rate, yardstick), goal)

    extraction = f"extraction, {hooks} hooks"
    rows = [
        timed(f"bare forward to block {deepest}", costs.forward),
        timed("extract(), batches dropped (forward + device-to-host copies)", costs.dropped),
    ]
    if costs.tmpfs is None:
        rows.append(
            Row(f"{extraction}, cache on tmpfs", against=costs.tmpfs_note, goal=GOAL_TMPFS_VS_FORWARD)
        )
    else:
        rows.append(
            timed(
                f"{extraction}, cache on tmpfs ({costs.tmpfs_note})",
                costs.tmpfs,
                against=f"bare forward: {forward:,.0f}",
                yardstick=forward,
                goal=GOAL_TMPFS_VS_FORWARD,
            )
        )
    rows.append(
        Row(
            f"write + fsync of {costs.bandwidth_bytes / 2**30:.2f} GiB in the cache directory: "
            f"{costs.bandwidth / 1e9:.2f} GB/s ÷ {costs.bytes_per_token:,.0f} B/token",
            costs.bandwidth_bytes / costs.bandwidth,
            costs.disk_bound,
            costs.disk_bound / forward,
        )
    )
    on_disk = timed(
        f"{extraction}, cache directory ({costs.cache_directory_path})", costs.cache_directory,
        against=f"min(bare forward, disk): {costs.bound:,.0f}", yardstick=costs.bound,
        goal=GOAL_CACHE_DIRECTORY_VS_BOUND,
    )  # fmt: skip
    rows.append(on_disk)
    rates: dict[str, float | str] = {}
    for label, outcome in peers.items():
        measurement = PEER_MEASUREMENTS.get(label, label)
        if isinstance(outcome, str):
            rows.append(Row(measurement, against=outcome))
            rates[label] = outcome
        else:
            rows.append(timed(measurement, outcome))
            rates[label] = tokens / outcome
    best_peer = max((rate for rate in rates.values() if not isinstance(rate, str)), default=None)
    rows.append(
        Row(
            f"{extraction}, cache directory, against the peers",
            rate=on_disk.rate,
            against="better of " + ", ".join(peer_text(label, rate) for label, rate in rates.items()),
            ratio=ratio_of(on_disk.rate, best_peer),
            goal=GOAL_EXTRACTION_VS_PEERS,
        )
    )
    rows.append(
        Row(
            "decode, greedy",
            rate=decode,
            against=f"model.generate: {rate_text(generate)}" if decode is not None else "failed",
            ratio=ratio_of(decode, generate),
            goal=GOAL_DECODE_VS_GENERATE,
        )
    )
    rows.append(Row(f"SAE training, {sae_shape}", rate=sae, against="-" if sae is not None else "failed"))
    return rows
