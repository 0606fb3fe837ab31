"""One row per request: its lookup, its load and load time, and the bytes its copies moved."""

from __future__ import annotations

import pandas as pd

from dashboard.traces.schema import COPY, LOAD, LOOKUP, STORE

LOAD_TIME_DEFINITION = (
    "Load time of a request: from the start of its `kvscope.load` span to the end of the last "
    "`kvscope.group.copy` span with direction `load` that belongs to that load (a child of the "
    "load span, or else in the same trace). Copy spans carry the measured copy interval."
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
    "bytes_loaded",
    "bytes_stored",
    "lookups",
    "load_span_id",
    "arrival_ns",
)


def requests_table(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per request id, in arrival order (first lookup, else its load).

    Tokens queried/hit come from the request's last lookup; local/external/groups and the load
    time (see `LOAD_TIME_DEFINITION`) from its last load; bytes from the copies of its loads and
    stores. Missing parts (no load for a miss, no copy spans recorded) are NA.
    """
    lookups = spans[spans["name"] == LOOKUP].sort_values("start_ns", kind="stable")
    loads = spans[spans["name"] == LOAD].sort_values("start_ns", kind="stable")
    if lookups.empty and loads.empty:
        return _empty_requests()

    last_lookup = lookups.drop_duplicates("request_id", keep="last").set_index("request_id")
    first_lookup = lookups.groupby("request_id", sort=False)["start_ns"].min()
    lookup_count = lookups.groupby("request_id", sort=False).size()
    last_load = loads.drop_duplicates("request_id", keep="last").set_index("request_id")

    ids = pd.Index(last_lookup.index).append(pd.Index(last_load.index).difference(last_lookup.index))
    out = pd.DataFrame(index=ids)
    out.index.name = "request_id"
    out["trace_id"] = last_load["trace_id"].reindex(ids).fillna(last_lookup["trace_id"].reindex(ids))
    # Nanosecond times stay integers: as float64 they would lose up to 256 ns.
    out["arrival_ns"] = (first_lookup.astype("Int64").reindex(ids)
                         .fillna(last_load["start_ns"].astype("Int64").reindex(ids)).astype("int64"))
    for col in ("tokens_queried", "tokens_hit"):
        out[col] = last_lookup[col].reindex(ids)
    for col in ("tokens_local", "tokens_external", "groups"):
        out[col] = last_load[col].reindex(ids)
    out["lookups"] = lookup_count.reindex(ids).fillna(0).astype("int64")
    out["load_span_id"] = last_load["span_id"].reindex(ids).fillna("")

    copies = spans[spans["name"] == COPY]
    load_copies = copies[copies["copy_direction"] == "load"].groupby("owner_span_id", sort=False)
    load_end = load_copies["end_ns"].max()
    load_bytes = load_copies["copy_bytes"].sum()
    load_start = last_load["start_ns"].astype("Int64").reindex(ids)
    end = load_end.astype("Int64").reindex(out["load_span_id"]).set_axis(ids)
    out["load_ms"] = ((end - load_start) / 1e6).astype(float)
    # Bytes of every load of the request, not only the last.
    req_of_load = loads.set_index("span_id")["request_id"]
    bytes_by_req = load_bytes.groupby(load_bytes.index.map(req_of_load)).sum()
    out["bytes_loaded"] = bytes_by_req.reindex(ids).astype("Int64")
    stores = spans[spans["name"] == STORE].set_index("span_id")["request_id"]
    store_bytes = copies[copies["copy_direction"] == "store"].groupby("owner_span_id")["copy_bytes"].sum()
    stored_by_req = store_bytes.groupby(store_bytes.index.map(stores)).sum()
    out["bytes_stored"] = stored_by_req.reindex(ids).astype("Int64")

    queried = out["tokens_queried"].astype(float)
    out["hit_rate"] = out["tokens_hit"].astype(float) / queried.where(queried > 0)
    out["arrival"] = pd.to_datetime(out["arrival_ns"], unit="ns", utc=True)
    out["t_s"] = (out["arrival_ns"] - out["arrival_ns"].min()) / 1e9
    out = out.reset_index().sort_values(["arrival_ns", "request_id"], kind="stable").reset_index(drop=True)
    return out[list(REQUEST_COLUMNS)]


def _empty_requests() -> pd.DataFrame:
    frame = pd.DataFrame({col: pd.Series(dtype=object) for col in REQUEST_COLUMNS})
    for col in ("tokens_queried", "tokens_hit", "tokens_local", "tokens_external", "groups",
                "bytes_loaded", "bytes_stored"):
        frame[col] = frame[col].astype("Int64")
    for col in ("hit_rate", "load_ms", "t_s"):
        frame[col] = frame[col].astype(float)
    frame["lookups"] = frame["lookups"].astype("int64")
    frame["arrival_ns"] = frame["arrival_ns"].astype("int64")
    frame["arrival"] = pd.to_datetime(frame["arrival_ns"], unit="ns", utc=True)
    return frame


def search_requests(requests: pd.DataFrame, text: str, only_hits: bool = False) -> pd.DataFrame:
    """Requests whose id or trace id contains `text` (case-insensitive)."""
    out = requests
    text = text.strip().lower()
    if text:
        match = out["request_id"].str.lower().str.contains(text, regex=False) | out[
            "trace_id"
        ].str.contains(text, regex=False)
        out = out[match]
    if only_hits:
        out = out[out["tokens_hit"].fillna(0) > 0]
    return out
