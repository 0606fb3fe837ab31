"""Altair charts of the shaped frames (no Streamlit, no data shaping: see `traces`)."""

from __future__ import annotations

import math

import altair as alt
import pandas as pd

from dashboard.traces.replay import replay_points

KIND_COLORS = {  # waterfall rows, by span kind
    "vLLM request": "#d4d4d4",
    "waiting for device KV room": "#eeca3b",  # before a deferred lookup: no span, the lookup's deferral attributes
    "lookup": "#8c8c8c",
    "load": "#4c78a8",
    "group.scan": "#72b7b2",
    "copy load": "#f58518",
    "store": "#b279a2",
    "copy store": "#e45756",
    "copy load failed": "#1f1f1f",  # a worker's copy that failed: vLLM recomputed (a load) or dropped it (a store)
    "copy store failed": "#1f1f1f",
}
DIRECTION_COLORS = alt.Scale(domain=["load", "store"], range=["#f58518", "#e45756"])


def hit_rate_over_time(frame: pd.DataFrame, bucket_s: float) -> alt.Chart:
    """Token hit rate per arrival bucket; the line breaks where buckets without requests lie."""
    return (
        alt.Chart(frame)
        .mark_line(point=True, interpolate="step-after")
        .encode(
            x=alt.X("t_s:Q", title="seconds since the first request"),
            detail="run:N",  # one line per stretch of consecutive buckets
            y=alt.Y("hit_rate:Q", title="token hit rate", axis=alt.Axis(format="%"),
                    scale=alt.Scale(domain=[0, 1])),
            tooltip=[
                alt.Tooltip("t_s:Q", title=f"bucket start (s), {bucket_s:g} s wide", format=".3f"),
                alt.Tooltip("hit_rate:Q", title="hit rate", format=".1%"),
                alt.Tooltip("requests:Q", title="requests"),
                alt.Tooltip("tokens_queried:Q", title="tokens queried"),
                alt.Tooltip("tokens_hit:Q", title="tokens hit"),
            ],
        )
        .properties(height=240)
    )


# Below this many milliseconds (1 µs) the latency axis is linear, above it logarithmic: a 0 ms copy still draws.
_LATENCY_LINEAR_BELOW_MS = 0.001


def latency_ticks(ms: pd.Series) -> list[float]:
    """Decades (1 µs, 10 µs, ... in ms) from the one at or below the smallest positive value to the one at or
    above the largest: a log axis's own ticks crowd or vanish over a few decades."""
    positive = ms[ms > 0]
    if positive.empty:
        return [0.0, _LATENCY_LINEAR_BELOW_MS]
    low = max(math.floor(math.log10(positive.min())), round(math.log10(_LATENCY_LINEAR_BELOW_MS)))
    high = max(math.ceil(math.log10(positive.max())), low + 1)
    return [10.0 ** k for k in range(low, high + 1)]


def latency_distribution(frame: pd.DataFrame) -> alt.Chart:
    """Box plot (min to max whiskers) of request load times and of load copy durations per group, on a
    logarithmic axis: copies take microseconds where a request's load, which waits for the engine step that
    runs its copies, can take tens of milliseconds, and a linear axis would draw the copies as one line at 0."""
    ticks = latency_ticks(frame["ms"]) if len(frame) else [0.0, _LATENCY_LINEAR_BELOW_MS]
    # from 0 (the axis's linear part) where a value lies below the first tick: 0 ms, or under 1 µs
    low = 0.0 if not len(frame) or frame["ms"].min() < ticks[0] else ticks[0]
    return (
        alt.Chart(frame)
        .mark_boxplot(extent="min-max", size=22)
        .encode(
            x=alt.X("ms:Q", title="milliseconds (log)",
                    scale=alt.Scale(type="symlog", constant=_LATENCY_LINEAR_BELOW_MS, domain=[low, ticks[-1]]),
                    axis=alt.Axis(values=ticks, format=".3~r")),
            y=alt.Y("series:N", title=None, sort=["request load"], axis=alt.Axis(labelLimit=260)),
            color=alt.value("#4c78a8"),
        )
        .properties(height=alt.Step(44))
    )


def copy_throughput(frame: pd.DataFrame) -> alt.Chart:
    """Σ bytes / Σ transfer time (the slowest worker's) per group and direction."""
    data = frame.assign(group="g" + frame["group_index"].astype(str) + " " + frame["group_kind"].astype(str))
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("gb_per_s:Q", title="GB/s (Σ bytes / Σ slowest worker's time)"),
            y=alt.Y("group:N", title=None),
            yOffset=alt.YOffset("direction:N"),
            color=alt.Color("direction:N", scale=DIRECTION_COLORS, legend=alt.Legend(orient="top", title=None)),
            tooltip=[
                "group:N",
                "direction:N",
                alt.Tooltip("gb_per_s:Q", title="GB/s", format=".2f"),
                alt.Tooltip("p50_gb_per_s:Q", title="median per transfer, GB/s", format=".2f"),
                alt.Tooltip("copies:Q"),
                alt.Tooltip("bytes:Q", format=","),
            ],
        )
        .properties(height=alt.Step(26))
    )


def waterfall(rows: pd.DataFrame) -> alt.Chart:
    """The spans of one request as bars on a shared time axis (short spans drawn at a visible width), the
    axis zoomable."""
    total = float(rows["end_ms"].max()) if len(rows) else 1.0
    data = rows.assign(
        visible_end=rows[["end_ms"]].max(axis=1).clip(lower=rows["start_ms"] + max(total, 1e-3) * 0.004),
        start_text=rows["start_ms"].map("{:.3f} ms".format),
        duration_text=rows["duration_ms"].map("{:.3f} ms".format),
    )
    kinds = [k for k in KIND_COLORS if k in set(data["kind"])] + sorted(set(data["kind"]) - set(KIND_COLORS))
    colors = [KIND_COLORS.get(k, "#bab0ac") for k in kinds]
    return (
        alt.Chart(data)
        .mark_bar(cornerRadius=2)
        .encode(
            x=alt.X("start_ms:Q", title="ms since the request's first span (or its wait for device KV room)"),
            x2="visible_end:Q",
            y=alt.Y("row:N", sort=list(data["row"]), title=None, axis=alt.Axis(labelLimit=320)),
            color=alt.Color("kind:N", scale=alt.Scale(domain=kinds, range=colors),
                            legend=alt.Legend(orient="bottom", title=None)),
            tooltip=[
                alt.Tooltip("row:N", title="span"),
                alt.Tooltip("start_text:N", title="start"),
                alt.Tooltip("duration_text:N", title="duration"),
                alt.Tooltip("attributes:N"),
            ],
        )
        .properties(height=alt.Step(24))
        # zoom and pan the time axis (wheel, drag; double-click resets): a 0.05 ms copy on a 900 ms axis is a sliver
        .interactive(bind_y=False)
    )


def replay_hit_rate(timeline: pd.DataFrame, step: int) -> alt.Chart:
    """Cumulative token hit rate over the requests arrived so far (x axis spans the whole replay), drawn through
    at most `replay_points`' limit of them (its shape and the current step kept)."""
    seen = replay_points(timeline, step, ["cum_hit_rate"])[["step", "request", "cum_hit_rate"]]
    x = alt.X("step:Q", title="requests arrived", scale=alt.Scale(domain=[1, max(len(timeline), 2)]))
    line = (
        alt.Chart(seen)
        .mark_line(point=alt.OverlayMarkDef(size=24))
        .encode(
            x=x,
            y=alt.Y("cum_hit_rate:Q", title="cumulative token hit rate", axis=alt.Axis(format="%"),
                    scale=alt.Scale(domain=[0, 1])),
            tooltip=["step:Q", "request:N", alt.Tooltip("cum_hit_rate:Q", title="hit rate", format=".1%")],
        )
    )
    return line.properties(height=220)


def byte_unit(n_bytes: float) -> tuple[str, float]:
    """The decimal unit (as `formatting.data_size` writes it) in which ``n_bytes`` reads from 1 to 999, and its size."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= size:
            return unit, size
    return "B", 1.0


def replay_traffic(timeline: pd.DataFrame, step: int) -> alt.Chart:
    """Cumulative bytes copied to and from the host tier, in the unit of the whole replay's total (the axis
    keeps its unit and its range, 0 to that total, while the replay runs), drawn through at most
    `replay_points`' limit of the steps so far."""
    # cumulative, so each run's lowest and highest are its first and last: ask for no extremes, and get
    # three times the runs (a finer staircase) within the same limit
    seen = replay_points(timeline, step, [])
    long = seen.melt(id_vars=["step"], value_vars=["cum_bytes_loaded", "cum_bytes_stored"],
                     var_name="direction", value_name="bytes")
    long["direction"] = long["direction"].map({"cum_bytes_loaded": "load", "cum_bytes_stored": "store"})
    total = timeline[["cum_bytes_loaded", "cum_bytes_stored"]].max().max() if len(timeline) else 0
    total = float(total) if pd.notna(total) else 0.0
    unit, size = byte_unit(total)
    long["amount"] = long["bytes"] / size
    return (
        alt.Chart(long)
        .mark_line(interpolate="step-after", point=alt.OverlayMarkDef(size=24))
        .encode(
            x=alt.X("step:Q", title="requests arrived", scale=alt.Scale(domain=[1, max(len(timeline), 2)])),
            # the whole replay's total from the first step: the axis stays put while the replay plays
            y=alt.Y("amount:Q", title=f"host traffic ({unit})", scale=alt.Scale(domain=[0, total / size or 1])),
            color=alt.Color("direction:N", scale=DIRECTION_COLORS,
                            legend=alt.Legend(orient="right", title=None)),
            tooltip=["step:Q", "direction:N", alt.Tooltip("amount:Q", title=unit, format=".3f")],
        )
        .properties(height=220)
    )


def live_series(frame: pd.DataFrame, y_title: str, y_format: str) -> alt.Chart:
    """Prometheus range-query series (columns time, value, series)."""
    return (
        alt.Chart(frame)
        .mark_line()
        .encode(
            x=alt.X("time:T", title=None, axis=alt.Axis(format="%H:%M")),
            y=alt.Y("value:Q", title=y_title, axis=alt.Axis(format=y_format)),
            color=alt.Color("series:N", legend=alt.Legend(orient="bottom", title=None)),
            tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"), "series:N",
                     alt.Tooltip("value:Q", format=y_format)],
        )
        .properties(height=240)
    )
