"""One row per request: its lookup, its load and load time, and the bytes its copies moved."""

from __future__ import annotations

import pandas as pd

from dashboard.traces.schema import COPY, LOAD, LOOKUP, STATUS_ERROR, STORE

LOAD_TIME_DEFINITION = (
    "Load time of a load: from the start of its `kvscope.load` span to the end of the last "
    "`kvscope.group.copy` span with direction `load` that belongs to it (a child of the load span, "
    "looked for in the copy's own file first, then in the other files of its trace when only one load "
    "there has the parent's id and it is of the copy's request; or else the only load of its request "
    "in the same trace and file). Copy spans carry the measured copy interval. A request's load "
    "time is the sum over its loads (a request resumed after preemption loads again) that did not fail."
)
LOAD_FAILED_DEFINITION = (
    "A load failed when one of its copy spans has status ERROR (a worker could not load: vLLM "
    "recomputed the request's tokens instead). Its hit still counts, as vLLM counts it."
)


REQUEST_COLUMNS = (
    "request_id",
    "trace_id",
    "arrival",
    "t_s",
    "tokens_queried",
    "tokens_hit",
    "hit_rate",
    "tokens_local",
    "tokens_external",
    "groups",
    "load_ms",
    "loads",
    "load_failed",
    "bytes_loaded",
    "bytes_stored",
    "lookups",
    "load_span_id",
    "arrival_ns",
)


def requests_table(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per request id, in arrival order (first lookup, else its load).

    Tokens queried/hit come from the request's last lookup; local/external/groups from its first
    load (the one its hit planned); the load time (see `LOAD_TIME_DEFINITION`), the number of loads
    and whether one failed (`LOAD_FAILED_DEFINITION`) over all its loads; bytes from the copies of
    its loads and stores. Missing parts (no load for a miss, no copy spans recorded) are NA.
    """
    lookups = spans[spans["name"] == LOOKUP].sort_values("start_ns", kind="stable")
    loads = spans[spans["name"] == LOAD].sort_values("start_ns", kind="stable")
    if lookups.empty and loads.empty:
        return _empty_requests()

    last_lookup = lookups.drop_duplicates("request_id", keep="last").set_index("request_id")
    first_lookup = lookups.groupby("request_id", sort=False)["start_ns"].min()
    lookup_count = lookups.groupby("request_id", sort=False).size()
    last_load = loads.drop_duplicates("request_id", keep="last").set_index("request_id")
    first_load = loads.drop_duplicates("request_id", keep="first").set_index("request_id")

    ids = pd.Index(last_lookup.index).append(pd.Index(last_load.index).difference(last_lookup.index))
    out = pd.DataFrame(index=ids)
    out.index.name = "request_id"
    out["trace_id"] = last_load["trace_id"].reindex(ids).fillna(last_lookup["trace_id"].reindex(ids))
    # Nanosecond times stay integers: as float64 they would lose up to 256 ns.
    out["arrival_ns"] = (first_lookup.astype("Int64").reindex(ids)
                         .fillna(first_load["start_ns"].astype("Int64").reindex(ids)).astype("int64"))
    for col in ("tokens_queried", "tokens_hit"):
        out[col] = last_lookup[col].reindex(ids)
    for col in ("tokens_local", "tokens_external", "groups"):
        out[col] = first_load[col].reindex(ids)
    out["lookups"] = lookup_count.reindex(ids).fillna(0).astype("int64")
    out["load_span_id"] = last_load["span_id"].reindex(ids).fillna("")

    per_load = load_rows(spans)
    by_request = per_load.groupby("request_id", sort=False)
    out["loads"] = by_request.size().reindex(ids).fillna(0).astype("int64")
    out["load_failed"] = by_request["failed"].any().reindex(ids).fillna(False).astype(bool)
    out["load_ms"] = by_request["load_ms"].sum(min_count=1).reindex(ids).astype(float)
    out["bytes_loaded"] = by_request["bytes"].sum(min_count=1).reindex(ids).astype("Int64")
    copies = spans[spans["name"] == COPY]
    stores = spans[spans["name"] == STORE].set_index("span_key")["request_id"]
    store_bytes = copies[copies["copy_direction"] == "store"].groupby("owner_key")["copy_bytes"].sum()
    stored_by_req = store_bytes.groupby(store_bytes.index.map(stores)).sum()
    out["bytes_stored"] = stored_by_req.reindex(ids).astype("Int64")

    queried = out["tokens_queried"].astype(float)
    out["hit_rate"] = out["tokens_hit"].astype(float) / queried.where(queried > 0)
    out["arrival"] = pd.to_datetime(out["arrival_ns"], unit="ns", utc=True)
    out["t_s"] = (out["arrival_ns"] - out["arrival_ns"].min()) / 1e9
    out = out.reset_index().sort_values(["arrival_ns", "request_id"], kind="stable").reset_index(drop=True)
    return out[list(REQUEST_COLUMNS)]


def load_rows(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per `kvscope.load` span: span_key, request_id, span_id, start_ns, load_ms (NA when no copy
    of it was recorded, or it failed), bytes its copies moved, and whether it failed (`LOAD_FAILED_DEFINITION`)."""
    loads = spans.loc[spans["name"] == LOAD, ["span_key", "request_id", "span_id", "start_ns"]].set_index("span_key")
    copies = spans[(spans["name"] == COPY) & (spans["copy_direction"] == "load")].groupby("owner_key", sort=False)
    failed = copies["status_code"].max().reindex(loads.index).fillna(0) == STATUS_ERROR
    end = copies["end_ns"].max().astype("Int64").reindex(loads.index)
    load_ms = ((end - loads["start_ns"].astype("Int64")) / 1e6).astype(float).where(~failed)
    return pd.DataFrame({
        "request_id": loads["request_id"],
        "span_id": loads["span_id"],
        "start_ns": loads["start_ns"],
        "load_ms": load_ms,
        "bytes": copies["copy_bytes"].sum().reindex(loads.index).astype("Int64"),
        "failed": failed.astype(bool),
    }).rename_axis("span_key").reset_index()


def _empty_requests() -> pd.DataFrame:
    frame = pd.DataFrame({col: pd.Series(dtype=object) for col in REQUEST_COLUMNS})
    for col in ("tokens_queried", "tokens_hit", "tokens_local", "tokens_external", "groups",
                "bytes_loaded", "bytes_stored"):
        frame[col] = frame[col].astype("Int64")
    for col in ("hit_rate", "load_ms", "t_s"):
        frame[col] = frame[col].astype(float)
    frame["lookups"] = frame["lookups"].astype("int64")
    frame["loads"] = frame["loads"].astype("int64")
    frame["load_failed"] = frame["load_failed"].astype(bool)
    frame["arrival_ns"] = frame["arrival_ns"].astype("int64")
    frame["arrival"] = pd.to_datetime(frame["arrival_ns"], unit="ns", utc=True)
    return frame


def search_requests(requests: pd.DataFrame, text: str, only_hits: bool = False) -> pd.DataFrame:
    """Requests whose id or trace id contains `text` (case-insensitive); `only_hits`: those with a
    hit or a load (a request resumed after preemption can load what it stored itself, with no hit)."""
    out = requests
    text = text.strip().lower()
    if text:
        match = out["request_id"].str.lower().str.contains(text, regex=False) | out[
            "trace_id"
        ].str.contains(text, regex=False)
        out = out[match]
    if only_hits:
        out = out[(out["tokens_hit"].fillna(0) > 0) | (out["loads"] > 0)]
    return out
