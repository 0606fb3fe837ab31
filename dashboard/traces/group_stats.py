"""Per KV group: null blocks skipped, load latency, copy throughput, and the overview's group table."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from dashboard.traces.request_table import load_rows
from dashboard.traces.schema import (
    COPY,
    DIRECTIONS,
    GROUP_KEYS,
    LOAD,
    LOOKUP,
    STORE,
    PAST_TENSE,
    STATUS_ERROR,
    copies_of,
    duration_ok,
    group_label,
    scans_of,
)


def _observed_groupby(frame: pd.DataFrame, keys: list[str]):
    return frame.assign(group_kind=frame["group_kind"].astype(str)).groupby(keys, sort=True, observed=True)


def null_skip_by_group(spans: pd.DataFrame) -> pd.DataFrame:
    """Per group: scans, blocks scanned, skipped as null, loaded (pending), and the null-skip share."""
    cols = [*GROUP_KEYS, "scans", "blocks_scanned", "blocks_null_skipped", "blocks_loaded", "null_skip_share"]
    scans = scans_of(spans)
    if scans.empty:
        return pd.DataFrame(columns=cols)
    # a failed load's planned blocks reached no request (as kvscope_loaded_blocks_total counts)
    loads = load_rows(spans)
    failed = scans["owner_key"].isin(loads.loc[loads["failed"], "span_key"])
    scans = scans.assign(blocks_received=scans["blocks_pending"].where(~failed, 0))
    g = _observed_groupby(scans, GROUP_KEYS)
    out = pd.DataFrame({
        "scans": g.size(),
        "blocks_scanned": g["blocks_total"].sum(),
        "blocks_null_skipped": g["blocks_null_skipped"].sum(),
        "blocks_loaded": g["blocks_received"].sum(),
    })
    out["null_skip_share"] = out["blocks_null_skipped"].astype(float) / out["blocks_scanned"].astype(
        float
    ).where(out["blocks_scanned"] > 0)
    return out.reset_index()[cols]


QUANTILES = (0.5, 0.95, 0.99)


def _quantile_row(values: pd.Series) -> dict[str, float]:
    values = values.dropna().astype(float)
    if values.empty:
        return {"count": 0, "p50_ms": math.nan, "p95_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    q = np.percentile(values.to_numpy(), [q * 100 for q in QUANTILES], method="inverted_cdf")  # nearest rank
    return {"count": int(len(values)), "p50_ms": q[0], "p95_ms": q[1], "p99_ms": q[2],
            "max_ms": float(values.max())}


def load_latency_quantiles(spans: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """p50/p95/p99 (nearest rank: each is a value that occurred) of request load time, then of load copies
    per group."""
    rows = [{"scope": "request load (all groups)", "group_index": pd.NA, "group_kind": "",
             **_quantile_row(requests["load_ms"])}]
    copies = copies_of(spans, "load", timed=True)
    if not copies.empty:
        for (index, kind), grp in _observed_groupby(copies, GROUP_KEYS):
            rows.append({"scope": f"copy {group_label(index, kind)}", "group_index": index,
                         "group_kind": kind, **_quantile_row(grp["duration_ms"])})
    return pd.DataFrame(rows, columns=["scope", "group_index", "group_kind", "count", "p50_ms",
                                       "p95_ms", "p99_ms", "max_ms"])


def load_latency_distribution(spans: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """Long table (series, ms): request load times and load-copy durations per group."""
    parts = [pd.DataFrame({"series": "request load", "ms": requests["load_ms"].dropna().astype(float)})]
    copies = copies_of(spans, "load", timed=True)
    if not copies.empty:
        labels = "copy g" + copies["group_index"].astype(str) + " " + copies["group_kind"].astype(str)
        parts.append(pd.DataFrame({"series": labels, "ms": copies["duration_ms"].astype(float)}))
    return pd.concat(parts, ignore_index=True)


COPY_THROUGHPUT_DEFINITION = (
    "Copy throughput of a group and direction: Σ bytes / Σ transfer time (1 GB = 1e9 bytes), a transfer being "
    "one load's or store's copies of the group on every worker (tensor parallelism: one copy span per worker) "
    "and its time the slowest worker's, as the request view's copies per KV group count it; a transfer with a "
    "copy that failed on a worker, or ends before it starts, has no time and is left out; – where no transfer "
    "has one."
)


def copy_throughput(spans: pd.DataFrame) -> pd.DataFrame:
    """Per group and direction: copy spans, blocks, bytes, summed transfer time and throughput
    (`COPY_THROUGHPUT_DEFINITION`).

    The workers' copies are first taken together per transfer (load or store, group), as `group_copies` does:
    bytes summed, time the slowest worker's, unknown when any worker's duration cannot be trusted
    (`duration_ok`) or any worker's copy failed (the transfer did not complete; the others' share would be
    timed as the whole). `gb_per_s` is Σ bytes / Σ seconds over the timed transfers and `p50_gb_per_s` the
    median of their throughputs; copies and bytes count every copy that ran. A copy of no load or store is a
    transfer of its own. A group with no timed transfer has unknown (NaN) copy time and throughput.
    """
    cols = [*GROUP_KEYS, "direction", "copies", "blocks", "bytes", "copy_seconds", "gb_per_s", "p50_gb_per_s"]
    copies = spans[spans["name"] == COPY]  # failed ones too: a transfer with one has no time
    if copies.empty:
        return pd.DataFrame(columns=cols)
    ran = copies["status_code"] != STATUS_ERROR
    copies = copies.assign(
        direction=copies["copy_direction"].astype(str),
        transfer=copies["owner_key"].fillna(copies["span_key"]),
        ran=ran.astype(int),
        ran_blocks=copies["copy_blocks"].where(ran, 0),
        ran_bytes=copies["copy_bytes"].where(ran, 0),
        seconds=(copies["duration_ms"] / 1e3).where(duration_ok(copies) & ran),
    )
    per_transfer = _observed_groupby(copies, [*GROUP_KEYS, "direction", "transfer"])
    transfers = pd.DataFrame({
        "copies": per_transfer["ran"].sum(),
        "blocks": per_transfer["ran_blocks"].sum(),
        "bytes": per_transfer["ran_bytes"].sum(),
        # the slowest worker's; unknown when any worker's time is (it may have been the slowest)
        "seconds": per_transfer["seconds"].max().where(per_transfer["seconds"].count() == per_transfer.size()),
    })
    transfers = transfers[transfers["copies"] > 0]  # every worker's copy failed: nothing ran
    if transfers.empty:
        return pd.DataFrame(columns=cols)
    transfers["timed_bytes"] = transfers["bytes"].astype(float).where(transfers["seconds"].notna())
    transfers["gb_per_s"] = transfers["timed_bytes"] / transfers["seconds"].where(transfers["seconds"] > 0) / 1e9
    g = transfers.groupby(level=[*GROUP_KEYS, "direction"], sort=True)
    out = pd.DataFrame({
        "copies": g["copies"].sum(),
        "blocks": g["blocks"].sum(),
        "bytes": g["bytes"].sum(),
        "copy_seconds": g["seconds"].sum(min_count=1),  # NaN, not 0 s, when none is timed
        "timed_bytes": g["timed_bytes"].sum(min_count=1),
        "p50_gb_per_s": g["gb_per_s"].median(),
    })
    out["gb_per_s"] = out["timed_bytes"] / out["copy_seconds"].where(out["copy_seconds"] > 0) / 1e9
    return out.reset_index()[cols]


def group_summary(spans: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """One row per group for the overview: null skip, load copy latency and throughput. A group that only
    stored (no load scanned it yet: a cold start) has its row too, with no loads; where the files hold no
    scheduler span (only the workers' file read) its load counts are unknown, not 0."""
    skip = null_skip_by_group(spans)
    tp = copy_throughput(spans)
    groups = pd.concat([skip[GROUP_KEYS], tp[GROUP_KEYS]]).drop_duplicates()
    if groups.empty:
        return pd.DataFrame(columns=["group", *GROUP_KEYS])
    groups = groups.astype({"group_index": "Int64"}).sort_values(GROUP_KEYS)
    out = groups.merge(skip.astype({"group_index": "Int64"}), on=GROUP_KEYS, how="left")
    counts = ["scans", "blocks_scanned", "blocks_null_skipped", "blocks_loaded"]
    # a group no load scanned, where the scheduler's spans are in the files (a cold start): none of each; with
    # the workers' file alone, unknown
    scheduler_read = spans["name"].isin([LOOKUP, LOAD, STORE]).any()
    out[counts] = out[counts].fillna(0).astype("int64") if scheduler_read else out[counts].astype("Int64")
    lat = load_latency_quantiles(spans, requests).iloc[1:]
    lat = lat.assign(group_index=lat["group_index"].astype("Int64"))
    out = out.merge(lat[[*GROUP_KEYS, "p50_ms", "p95_ms", "p99_ms"]], on=GROUP_KEYS, how="left")
    tp = tp.astype({"group_index": "Int64"})
    for direction in DIRECTIONS:
        part = tp.loc[tp["direction"] == direction, [*GROUP_KEYS, "bytes", "gb_per_s"]]
        part = part.rename(columns={"bytes": f"bytes_{PAST_TENSE[direction]}", "gb_per_s": f"{direction}_gb_per_s"})
        out = out.merge(part, on=GROUP_KEYS, how="left")
    out.insert(0, "group", [group_label(i, k) for i, k in zip(out["group_index"], out["group_kind"])])
    return out
