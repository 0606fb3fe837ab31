"""One request's copy time per KV group, for each of its loads and stores.

Under tensor parallelism each worker copies its share of every block: one `kvscope.group.copy`
span per worker, group and transfer. A group's row counts those workers, sums their bytes, and
takes the slowest worker's copy time, the one the transfer waits for; its throughput is the summed
bytes over that time. A copy timed on another clock (it ends before it starts: `schema.duration_ok`)
or one that failed leaves the group's copy time and throughput unknown, never 0.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dashboard.traces.schema import COPY, LOAD, SCAN, STATUS_ERROR, STORE, duration_ok, group_label, moved_bytes

GROUP_COPY_DEFINITION = (
    "One row per KV group of the load or store: workers is the number of copy spans (one per worker under "
    "tensor parallelism), blocks the most any worker copied, bytes the sum over workers; copy time is the "
    "slowest worker's (the transfer waits for it) and throughput the summed bytes over that time. A copy "
    "that failed or ends before it starts (timed on another clock) leaves copy time and throughput unknown. "
    "A load's rows also show the group's null-skip scan: the blocks it scanned, the null placeholders it "
    "skipped (out-of-window sliding-window blocks, Mamba padding), the pending blocks it planned to load "
    "(what its copies should copy) and the index of the first of them."
)
_SCAN_COLUMNS = {"blocks_total": "scanned", "blocks_null_skipped": "null_skipped", "blocks_pending": "pending",
                 "blocks_start": "start_index"}  # a load's scan of the group, beside its copies
GROUP_SCAN_COLUMNS = tuple(_SCAN_COLUMNS.values())  # a load's rows only: a store scans nothing

GROUP_COPY_COLUMNS = ("transfer", "direction", "group", "group_index", "group_kind", "scanned", "null_skipped",
                      "pending", "start_index", "workers", "blocks", "bytes", "copy_ms", "gb_per_s", "slowest_rank",
                      "failed", "start_ns")


def request_group_copies(spans: pd.DataFrame, trace_id: str, request_id: str) -> pd.DataFrame:
    """Per load and store of the request (`transfer`: "load 1", "store 2", … in start order) and KV group:
    the workers' copies aggregated as `GROUP_COPY_DEFINITION` says."""
    own = spans[(spans["trace_id"] == trace_id) & (spans["request_id"] == request_id)
                & spans["name"].isin([LOAD, STORE])].sort_values(["start_ns", "span_key"], kind="stable")
    copies = spans[(spans["name"] == COPY) & spans["owner_key"].isin(own["span_key"])]
    if copies.empty:
        return pd.DataFrame(columns=list(GROUP_COPY_COLUMNS))
    kind = own["name"].astype(str).str.removeprefix("kvscope.")
    transfers = pd.DataFrame({"transfer": kind + " " + (kind.groupby(kind).cumcount() + 1).astype(str),
                              "direction": kind, "start_ns": own["start_ns"]}).set_index(own["span_key"])

    failed = (copies["status_code"] == STATUS_ERROR).to_numpy()
    copies = copies.assign(
        failed=failed,
        moved_bytes=moved_bytes(copies),
        timed_ms=copies["duration_ms"].where(duration_ok(copies) & ~failed),
        group_kind=copies["group_kind"].astype(str),
    )
    g = copies.groupby(["owner_key", "group_index", "group_kind"], sort=False, observed=True)
    out = pd.DataFrame({
        "workers": g.size(),
        "blocks": g["copy_blocks"].max(),
        "bytes": g["moved_bytes"].sum(),
        # the slowest worker's time; unknown when any worker's time is (it may have been the slowest)
        "copy_ms": g["timed_ms"].max().where(g["timed_ms"].count() == g.size()),
        "failed": g["failed"].any(),
    })
    slowest = copies.loc[g["duration_ms"].idxmax().to_numpy(), "worker_rank"].to_numpy()
    out["slowest_rank"] = pd.array(slowest, dtype="Int64")
    out["slowest_rank"] = out["slowest_rank"].where(out["copy_ms"].notna())
    seconds = out["copy_ms"] / 1e3
    out["gb_per_s"] = out["bytes"].astype(float) / seconds.where(seconds > 0) / 1e9
    out = out.reset_index().join(transfers, on="owner_key")
    scans = spans[(spans["name"] == SCAN) & spans["owner_key"].isin(own["span_key"])]
    scans = scans.drop_duplicates(["owner_key", "group_index"])[["owner_key", "group_index", *_SCAN_COLUMNS]]
    out = out.merge(scans.rename(columns=_SCAN_COLUMNS), on=["owner_key", "group_index"], how="left")
    for col in GROUP_SCAN_COLUMNS:  # NA for a store, which scans nothing
        out[col] = out[col].astype("Int64")
    out["group"] = [group_label(i, k) for i, k in zip(out["group_index"], out["group_kind"])]
    out = out.sort_values(["start_ns", "owner_key", "group_index"], kind="stable").reset_index(drop=True)
    out["workers"] = out["workers"].astype(np.int64)
    return out[list(GROUP_COPY_COLUMNS)]
