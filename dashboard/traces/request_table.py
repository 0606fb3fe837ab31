"""One row per request: its lookup, its load and load time, and the bytes its copies moved."""

from __future__ import annotations

from collections.abc import Collection

import pandas as pd

from connector.miss_reasons import miss_reasons_explained
from dashboard.traces.schema import (
    COPY,
    DEFERRAL,
    DEFERRAL_OUTCOME,
    LOAD,
    LOOKUP,
    REQUEST_KEY,
    STATUS_ERROR,
    STORE,
    copies_of,
    moved_bytes,
)
from dashboard.traces.vllm_join import VLLM_REQUEST_COLUMNS, with_vllm_columns

LOAD_TIME_DEFINITION = (
    "Load time of a load: from the start of its `kvscope.load` span to the end of the last "
    "`kvscope.group.copy` span with direction `load` that belongs to it (a child of the load span, "
    "looked for in the copy's own file first, then in the other files of its trace when only one load "
    "there has the parent's id and it is of the copy's request; or else the only load of its request "
    "in the same trace and file). Copy spans carry the measured copy interval. A request's load "
    "time is the sum over its loads (a request resumed after preemption loads again) that did not fail. "
    "A load with no copy span (worker file missing or cut short?), with one timed on another clock "
    "(it ends before it starts, or starts more than 1 ms before the load: listed with the problems), or whose "
    "own span ends before it starts (listed too) has none, "
    "and its request's load time is then unknown (–): left out of the load time quantiles and slowest loads."
)
MISS_REASON_DEFINITION = (
    "Why the host tier served no more of the prompt (`kvscope.miss.reason` of the request's last lookup: a "
    "request whose load failed is looked up again): the reason of the offloaded block right after the hit, "
    f"as kvscope_missed_tokens_total counts it: {miss_reasons_explained()}. Empty for trace files written before "
    "kvscope recorded it."
)
# The Overview's table counts reasons by lookup, not by request
LOOKUP_MISS_REASON_DEFINITION = (
    "Why the host tier served no more of a lookup's prompt (`kvscope.miss.reason`; every lookup counts: a request "
    "whose load failed is looked up again, and counts again): the reason of the offloaded block right after the "
    f"hit, as kvscope_missed_tokens_total counts it: {miss_reasons_explained()}. Empty for trace files written "
    "before kvscope recorded it."
)
# One request's `miss_reason`, as the request view says it (what its hit stopped at)
MISS_REASON_TEXT = {
    "new": "the offloaded block after its hit was never stored, or left the tier longer ago than the tier "
           "remembers (as many blocks as it holds): a first sight of that prefix, or, where the tier evicts "
           "many times its size, an eviction too old to be told apart",
    "evicted": "the offloaded block after its hit had been evicted to make room: a larger tier would have "
               "served it (raise cpu_bytes)",
    "dropped": "the offloaded block after its hit was dropped after a load from it failed",
    "reset": "a cache reset had forgotten the offloaded block after its hit",
    "storing": "the offloaded block after its hit was still being stored (the same prefix came again "
               "within one copy)",
    "no_state": "no Mamba state was stored at the end of the block after its hit (vLLM keeps states at "
                "some block ends only; decode steps' states are stored only with mamba_decode_states true)",
    "other_blocks": "every group held the block after its hit, but the hit needed another one (a sliding "
                    "window's earlier block)",
    "load_failed": "the tier held the block after its hit, but an earlier load of this request failed: it "
                   "recomputes, and is not offered a hit again until vLLM preempts it or its streaming session takes "
                   "its next turn",
    "not_taken": "the tier had more, but vLLM took less of the hit (a request asking for prompt logprobs "
                 "skips prefix caches)",
    "tail": "it served every offloaded block a hit could cover; the rest (the prompt's partial last block, "
            "the last token) no offloaded block covers",
}
DEFERRAL_DEFINITION = (
    "Waited for device KV room: how many times kvscope answered vLLM's lookup of the request \"not yet\" (about "
    "once per scheduler step) and for how long, from its first deferred lookup to the start of the lookup vLLM "
    "admitted it on (`kvscope.deferred.lookups`, `kvscope.deferred.wait_us` of that lookup span, or of the load "
    "span of a request resumed after preemption, whose lookup has no span; summed over its spans, as a request "
    "can wait again after a preemption). kvscope defers a load while the loads admitted "
    "before it, together with it, need more device blocks than the device KV cache has; the wait delays the start "
    "of its load, not the load itself. Frequent deferrals ask for device KV headroom (a larger device KV cache, or "
    "fewer requests at once). Empty for a request kvscope did not defer, and in trace files written before kvscope "
    "recorded it. A request that ended (a client gave up, or vLLM aborted it) while kvscope still deferred its load "
    "has a `kvscope.deferral` span of its own instead, which is the wait itself: from its first deferred lookup to "
    "its end ('ended waiting', with the same two attributes). Unless vLLM had admitted it before a preemption, it "
    "has no other span: vLLM never counted its lookup (tokens queried and hit empty, out of the hit rate) and it "
    "loaded nothing; its external tokens are those its load would have brought. A request resumed after a "
    "preemption, deferred, and then admitted with nothing to load (its hit had left the tier, or vLLM's device "
    "cache covered it) has such a span too, to the lookup vLLM admitted it on (`kvscope.deferred.outcome` "
    "\"admitted\"): its wait counts, but it did not end waiting."
)
LOAD_FAILED_DEFINITION = (
    "A load failed when one of its copy spans has status ERROR (a worker could not load: vLLM "
    "recomputed the request's tokens instead). Its hit still counts, as vLLM counts it."
)


REQUEST_COLUMNS = (
    "request",
    "request_id",
    "trace_id",
    "engine",
    "arrival",
    "t_s",
    "tokens_queried",
    "tokens_hit",
    "hit_rate",
    "miss_reason",
    "miss_reasons",
    "deferred_lookups",
    "deferred_wait_ms",
    "ended_waiting",
    "tokens_local",
    "tokens_external",
    "tokens_loaded",
    "groups",
    "load_ms",
    "load_copy_ms",
    "load_wait_ms",
    "loads",
    "loads_without_copies",
    "load_failed",
    "load_mistimed",
    "bytes_loaded",
    "bytes_stored",
    "lookups",
    "arrival_ns",
    *VLLM_REQUEST_COLUMNS,  # from vLLM's own request span (`vllm_join`), NA without one
    "vllm_key",
)


def requests_table(spans: pd.DataFrame, vllm: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per request (trace id, request id: see `REQUEST_KEY`), in arrival order (first lookup, else its
    load; a deferred request's when its wait for device KV room began: the start of its `kvscope.deferral` span
    when it ended waiting).

    Tokens queried/hit are summed over the request's lookups (a request whose load failed may be
    looked up again: every recorded lookup counts, as in kvscope's counters); local (vLLM's device
    prefix-cache hit) from its first lookup, else its first load; external/groups from its first load
    (the one its hit planned); tokens_loaded summed over its loads that did not fail; the load time (see
    `LOAD_TIME_DEFINITION`: NA when a load that did not fail has none), the number of loads, how many have no
    copy span, and whether one failed (`LOAD_FAILED_DEFINITION`) over all its loads; bytes from the copies of
    its loads and stores; how often and how long kvscope deferred its load for device KV room, summed over its
    lookups, loads and deferral spans (`DEFERRAL_DEFINITION`: NA when no span says it was deferred), and whether it
    ended waiting (a `kvscope.deferral` span not marked "admitted": a request vLLM never admitted has no other, so
    its tokens queried and hit stay NA and its external tokens are that span's). Missing parts (no load for a miss,
    no copy spans recorded) are NA. `request` labels the row: the request id, with the end of its trace id
    (`request_labels`) where the id is another request's too (two runs read together). With `vllm` (the reader's
    `vllm_requests`), each request's vLLM latencies where vLLM's request span joins it (`vllm_join`).
    """
    lookups = spans[spans["name"] == LOOKUP].sort_values("start_ns", kind="stable")  # `.last()` is the latest
    loads = spans[spans["name"] == LOAD].sort_values("start_ns", kind="stable")
    waits = spans[spans["name"] == DEFERRAL].sort_values("start_ns", kind="stable")  # maybe no other span
    ended = waits[~waits["attributes"].map(_admitted).astype(bool)]  # ended waiting (the rest: admitted, no load)
    if lookups.empty and loads.empty and waits.empty:
        return with_vllm_columns(_empty_requests(), None)[list(REQUEST_COLUMNS)]

    by_lookup = lookups.groupby(REQUEST_KEY, sort=False)
    first_load = loads.drop_duplicates(REQUEST_KEY, keep="first").set_index(REQUEST_KEY)
    by_end = ended.groupby(REQUEST_KEY, sort=False)
    looked_up_or_loaded = by_lookup.size().index.append(first_load.index.difference(by_lookup.size().index))
    waited_ids = waits.drop_duplicates(REQUEST_KEY).set_index(REQUEST_KEY).index  # a MultiIndex, even empty
    ids = looked_up_or_loaded.append(waited_ids.difference(looked_up_or_loaded))
    out = pd.DataFrame(index=ids)
    out["arrival_ns"] = _arrivals(spans, by_lookup, first_load, ids)
    for col in ("tokens_queried", "tokens_hit"):
        out[col] = by_lookup[col].sum(min_count=1).reindex(ids)
    out["groups"] = first_load["groups"].reindex(ids)
    # what its first load brought, else what the load it ended waiting for would have brought
    out["tokens_external"] = (first_load["tokens_external"].reindex(ids).astype("Int64")
                              .fillna(by_end["tokens_external"].last().reindex(ids)))
    # vLLM's device prefix-cache hit: the first lookup says it (newer files), a load does too
    out["tokens_local"] = (by_lookup["tokens_local"].first().reindex(ids).astype("Int64")
                           .fillna(first_load["tokens_local"].reindex(ids)))
    # the engine (vLLM's data-parallel index) that looked it up, else loaded it, else deferred it; NA in older files
    out["engine"] = (by_lookup["engine"].first().reindex(ids).astype("Int64")
                     .fillna(first_load["engine"].reindex(ids))
                     .fillna(waits.groupby(REQUEST_KEY, sort=False)["engine"].first().reindex(ids)))
    out["lookups"] = by_lookup.size().reindex(ids).fillna(0).astype("int64")
    out["miss_reason"] = by_lookup["miss_reason"].last().reindex(ids)  # its last lookup's (`MISS_REASON_DEFINITION`)
    # every lookup's, distinct, "|"-joined: the Overview counts reasons by lookup, and its row of one opens the
    # requests with a lookup that stopped for it (`search_requests`), an earlier lookup's too
    reasons = lookups.loc[lookups["miss_reason"].notna(), [*REQUEST_KEY, "miss_reason"]].drop_duplicates()
    out["miss_reasons"] = (reasons.groupby(REQUEST_KEY, sort=False)["miss_reason"].agg("|".join).reindex(ids)
                           if not reasons.empty else pd.Series(pd.NA, index=ids, dtype=object))
    # NA unless a span says it was deferred (`DEFERRAL_DEFINITION`): older files cannot tell "not deferred"
    by_deferral = spans[spans["name"].isin(_TELL_WAITS)].groupby(REQUEST_KEY, sort=False)
    out["deferred_lookups"] = by_deferral["deferred_lookups"].sum(min_count=1).reindex(ids).astype("Int64")
    wait_us = by_deferral["deferred_wait_us"].sum(min_count=1).reindex(ids)
    out["deferred_wait_ms"] = (wait_us.astype("Int64") / 1e3).astype(float)
    out["ended_waiting"] = by_end.size().reindex(ids).notna()

    loads = load_rows(spans)
    by_request = loads.groupby(REQUEST_KEY, sort=False)
    out["loads"] = by_request.size().reindex(ids).fillna(0).astype("int64")
    out["load_failed"] = by_request["failed"].any().reindex(ids).fillna(False).astype(bool)
    out["load_mistimed"] = by_request["mistimed"].any().reindex(ids).fillna(False).astype(bool)
    uncopied = loads.assign(uncopied=loads["copies"] == 0).groupby(REQUEST_KEY, sort=False)["uncopied"].sum()
    out["loads_without_copies"] = uncopied.reindex(ids).fillna(0).astype("int64")  # each one warned of
    out["load_ms"] = _sum_unless_unknown(loads, "load_ms").reindex(ids).astype(float)
    out["load_copy_ms"] = _sum_unless_unknown(loads, "copy_ms").reindex(ids).astype(float)  # NA where load_ms is
    # before the first copy: planning, then the engine step that starts the copies (clipped: clocks of workers)
    out["load_wait_ms"] = (out["load_ms"] - out["load_copy_ms"]).clip(lower=0.0)
    # the tokens of the loads its load time sums (a resumed request loads again), beside that time
    tokens_loaded = loads[~loads["failed"]].groupby(REQUEST_KEY, sort=False)["tokens_external"].sum()
    out["tokens_loaded"] = tokens_loaded.reindex(ids).astype("Int64")
    out["bytes_loaded"] = by_request["bytes"].sum(min_count=1).reindex(ids).astype("Int64")
    out["bytes_stored"] = _bytes_stored(spans).reindex(ids).astype("Int64")

    queried = out["tokens_queried"].astype(float)
    out["hit_rate"] = out["tokens_hit"].astype(float) / queried.where(queried > 0)
    out["arrival"] = pd.to_datetime(out["arrival_ns"], unit="ns", utc=True)
    out["t_s"] = (out["arrival_ns"] - out["arrival_ns"].min()) / 1e9
    out = out.reset_index().sort_values(["arrival_ns", *REQUEST_KEY], kind="stable").reset_index(drop=True)
    out["request"] = request_labels(out)
    return with_vllm_columns(out, vllm)[list(REQUEST_COLUMNS)]


# The spans that tell a wait for device KV room: before a lookup's or load's start, or the deferral span itself
_TELL_WAITS = [LOOKUP, LOAD, DEFERRAL]


def _admitted(attributes) -> bool:
    """A `kvscope.deferral` span's wait ended in an admission with nothing to load, not the request's end."""
    return isinstance(attributes, dict) and attributes.get(DEFERRAL_OUTCOME) == "admitted"  # `WAIT_ADMITTED`


def _arrivals(spans: pd.DataFrame, by_lookup, first_load: pd.DataFrame, ids: pd.MultiIndex) -> pd.Series:
    """When each request (`ids`) arrived: its first lookup's start, else its first load's, or when its first
    wait for device KV room began where that was earlier (or it has neither: it ended waiting). In ns, int64."""
    # Nanosecond times stay integers: as float64 they would lose up to 256 ns.
    first_span = (by_lookup["start_ns"].min().astype("Int64").reindex(ids)
                  .fillna(first_load["start_ns"].astype("Int64").reindex(ids)))
    first_wait = _first_wait_starts(spans).reindex(ids)
    waited_first = ((first_wait < first_span).fillna(False) | first_span.isna()).astype(bool)
    return first_span.mask(waited_first, first_wait).astype("int64")


def _first_wait_starts(spans: pd.DataFrame) -> pd.Series:
    """Per request (`REQUEST_KEY`), when its first wait for device KV room began (Int64): a lookup's or load's
    wait lies just before it (its first deferred lookup has no span), a `kvscope.deferral` span is the wait."""
    told = spans[spans["name"].isin(_TELL_WAITS) & spans["deferred_wait_us"].notna()]
    wait_before_ns = (1000 * told["deferred_wait_us"].astype("int64")).where(told["name"] != DEFERRAL, 0)
    starts = told["start_ns"].astype("int64") - wait_before_ns
    return starts.groupby([told[key] for key in REQUEST_KEY]).min().astype("Int64")


def _sum_unless_unknown(loads: pd.DataFrame, column: str) -> pd.Series:
    """Per request (`REQUEST_KEY`), `column` of `load_rows` summed over its loads that did not fail; NA when none
    did, or when one of them has no time (no copy span, a copy on another clock): a sum leaving it out would
    read as the whole load time."""
    counted = loads[~loads["failed"]]
    by_request = counted.assign(unknown=counted[column].isna()).groupby(REQUEST_KEY, sort=False)
    return by_request[column].sum().where(~by_request["unknown"].any())


def request_labels(requests: pd.DataFrame) -> pd.Series:
    """The request id, with " · trace " and the trace id's last 8 digits where another request has the same id
    (the first 8 are all zeros in 64-bit ids padded to 128 bits), or its whole trace id where another request
    with that id has the same last 8."""
    ids = requests["request_id"].astype(str)
    trace_ids = requests["trace_id"].astype(str)
    short = ids + " · trace " + trace_ids.str[-8:]
    # one request per (trace id, request id): a short label on two rows names two traces
    ambiguous = short.duplicated(keep=False)
    labels = short.where(~ambiguous, ids + " · trace " + trace_ids)
    return ids.where(~ids.duplicated(keep=False), labels)


def _bytes_stored(spans: pd.DataFrame) -> pd.Series:
    """Bytes of the store copies of each request's stores, by `REQUEST_KEY`."""
    stores = spans.loc[spans["name"] == STORE, ["span_key", *REQUEST_KEY]]
    copies = copies_of(spans, "store")[["owner_key", "copy_bytes"]]
    joined = copies.dropna(subset=["owner_key"]).merge(stores, left_on="owner_key", right_on="span_key")
    return joined.groupby(REQUEST_KEY)["copy_bytes"].sum()


def load_rows(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per `kvscope.load` span: span_key, trace_id, request_id, span_id, start_ns, tokens_external,
    load_ms (NA when no copy of it was recorded, it failed, or it is `mistimed`: one of its copies is timed on
    another clock, or the load span ends before it starts),
    copy_ms (from its first copy's start to its last copy's end, on every worker and group: the part of
    load_ms spent copying; NA where load_ms is), its load copies and the bytes they moved, and whether
    it failed (`LOAD_FAILED_DEFINITION`)."""
    loads = spans.loc[spans["name"] == LOAD,
                      ["span_key", *REQUEST_KEY, "span_id", "start_ns", "tokens_external", "clock_ok"]]
    loads = loads.set_index("span_key")
    copies = spans[(spans["name"] == COPY) & (spans["copy_direction"] == "load")]
    copies = copies.assign(moved_bytes=moved_bytes(copies))
    copies = copies.groupby("owner_key", sort=False)
    failed = copies["status_code"].max().reindex(loads.index).fillna(0) == STATUS_ERROR
    # a copy on another clock, or the load span itself ending before it starts (its start is then no start)
    mistimed = ~copies["clock_ok"].all().reindex(loads.index).fillna(True).astype(bool) | ~loads["clock_ok"]
    end = copies["end_ns"].max().astype("Int64").reindex(loads.index)
    load_ms = ((end - loads["start_ns"].astype("Int64")) / 1e6).astype(float).where(~failed & ~mistimed)
    first_start = copies["start_ns"].min().astype("Int64").reindex(loads.index)
    copy_ms = ((end - first_start) / 1e6).astype(float).where(load_ms.notna())
    return pd.DataFrame({
        "trace_id": loads["trace_id"],
        "request_id": loads["request_id"],
        "span_id": loads["span_id"],
        "start_ns": loads["start_ns"],
        "tokens_external": loads["tokens_external"],
        "load_ms": load_ms,
        "copy_ms": copy_ms,
        "copies": copies.size().reindex(loads.index).fillna(0).astype("int64"),
        "bytes": copies["moved_bytes"].sum().reindex(loads.index).astype("Int64"),
        "failed": failed.astype(bool),
        "mistimed": mistimed,
    }).rename_axis("span_key").reset_index()


def _empty_requests() -> pd.DataFrame:
    added_later = {*VLLM_REQUEST_COLUMNS, "vllm_key"}  # by `with_vllm_columns`
    frame = pd.DataFrame({col: pd.Series(dtype=object) for col in REQUEST_COLUMNS if col not in added_later})
    for col in ("engine", "tokens_queried", "tokens_hit", "tokens_local", "tokens_external", "tokens_loaded",
                "groups", "bytes_loaded", "bytes_stored", "deferred_lookups"):
        frame[col] = frame[col].astype("Int64")
    for col in ("hit_rate", "load_ms", "load_copy_ms", "load_wait_ms", "t_s", "deferred_wait_ms"):
        frame[col] = frame[col].astype(float)
    frame["lookups"] = frame["lookups"].astype("int64")
    frame["loads_without_copies"] = frame["loads_without_copies"].astype("int64")
    frame["loads"] = frame["loads"].astype("int64")
    frame["load_failed"] = frame["load_failed"].astype(bool)
    frame["load_mistimed"] = frame["load_mistimed"].astype(bool)
    frame["ended_waiting"] = frame["ended_waiting"].astype(bool)
    frame["arrival_ns"] = frame["arrival_ns"].astype("int64")
    frame["arrival"] = pd.to_datetime(frame["arrival_ns"], unit="ns", utc=True)
    return frame


REQUEST_FILTERS = ("all", "hits or loads", "misses", "failed loads")


def engines_of(requests: pd.DataFrame) -> list[int]:
    """The engines (vLLM's data-parallel indexes) the requests ran on, in order; none for older files."""
    return sorted(int(e) for e in requests["engine"].dropna().unique())


def of_engine(requests: pd.DataFrame, spans: pd.DataFrame, engine: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The requests and spans of one engine (its host tier's story apart from the others')."""
    return (requests[(requests["engine"] == engine).fillna(False).astype(bool)],
            spans[(spans["engine"] == engine).fillna(False).astype(bool)])


def miss_reasons_of(requests: pd.DataFrame) -> list[str]:
    """Every reason a lookup of ``requests`` stopped for (`search_requests`' ``reasons``), sorted."""
    said = requests["miss_reasons"].dropna().astype(str)
    return sorted({reason for joined in said for reason in joined.split("|")})


def search_requests(requests: pd.DataFrame, text: str, show: str = "all", engine: int | None = None,
                    reasons: Collection[str] = ()) -> pd.DataFrame:
    """Requests whose label, id or trace id contains `text` (case-insensitive), and of the kind `show` names
    (`REQUEST_FILTERS`): "hits or loads" (a request resumed after preemption can load what it stored
    itself, with no hit; one that ended waiting for device KV room had a hit to load, never counted), "misses"
    (the others) or "failed loads"; with `engine`, those of that engine only
    (each engine has a host tier of its own: a prefix another engine stored is a miss on this one); with
    `reasons`, those with a lookup whose hit stopped for one of them (`miss_reasons`: a partial hit's too)."""
    out = requests
    if reasons:
        said = out["miss_reasons"].fillna("").astype(str).str.split("|")
        out = out[said.map(lambda of_request: not set(reasons).isdisjoint(of_request)).astype(bool)]
    if engine is not None:
        out = out[(out["engine"] == engine).fillna(False).astype(bool)]
    text = text.strip().lower()
    if text:
        match = (out["request"].str.lower().str.contains(text, regex=False)
                 | out["trace_id"].str.contains(text, regex=False))
        out = out[match]
    if show not in REQUEST_FILTERS:
        raise ValueError(f"show={show!r}: expected one of {', '.join(REQUEST_FILTERS)}")
    hit_or_load = (out["tokens_hit"].fillna(0) > 0) | (out["loads"] > 0) | out["ended_waiting"]
    if show == "hits or loads":
        out = out[hit_or_load]
    elif show == "misses":
        out = out[~hit_or_load]
    elif show == "failed loads":
        out = out[out["load_failed"]]
    return out


def find_request(requests: pd.DataFrame, trace_id: str, request_id: str) -> pd.Series:
    """The row of the request (`trace_id`, `request_id`); KeyError when there is none."""
    match = requests[(requests["trace_id"] == trace_id) & (requests["request_id"] == request_id)]
    if match.empty:
        raise KeyError((trace_id, request_id))
    return match.iloc[0]
