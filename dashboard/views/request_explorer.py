"""Requests: a searchable table (vLLM's latencies beside kvscope's, where vLLM's spans were read); the selected
request's spans as a waterfall with attributes, and its copies per KV group."""

import streamlit as st

from dashboard import data, selection, traces, widgets

loaded = data.current()
st.title("Requests")
widgets.read_problems(loaded.traces)
loaded = data.require_requests()
requests, spans = loaded.requests, loaded.spans

opened = st.session_state.pop(widgets.OPEN_REQUEST, None)  # (trace id, request id) another page opened
if opened is not None:  # show it: its id searched, whatever its kind
    st.session_state["request_search"] = opened[1]
    st.session_state["request_show"] = "all"
    st.session_state["request_reasons"] = []
reason = st.session_state.pop(widgets.OPEN_REASON, None)  # the Overview's row of a miss reason
if reason is not None:  # its requests, whatever else was searched
    st.session_state["request_search"] = ""
    st.session_state["request_show"] = "all"
    st.session_state["request_reasons"] = [reason]

# Several engines (data parallelism): each has its own host tier, so which one served a request matters
engines = traces.engines_of(requests)
search, show, *pick_engine = st.columns([3, 2, 1] if len(engines) > 1 else [3, 2], vertical_alignment="bottom")
text = search.text_input("Search request or trace id", key="request_search", placeholder="e.g. cmpl-r2")
kind = show.radio("Show", traces.REQUEST_FILTERS, key="request_show", horizontal=True)
engine = None
if pick_engine:
    engine = pick_engine[0].selectbox("Engine", [None, *engines], key="request_engine",
                                      format_func=lambda e: "all" if e is None else str(e),
                                      help="vLLM's data-parallel engine; each has its own host tier")
reasons_seen = traces.miss_reasons_of(requests)
picked_reasons = []
if reasons_seen:  # trace files that record why each lookup's hit stopped
    picked_reasons = st.multiselect(
        "Served no more because", reasons_seen, key="request_reasons", placeholder="any reason (or none recorded)",
        help="Requests with a lookup whose hit stopped for one of these (an earlier lookup's too, as the Overview "
             "counts them). " + traces.MISS_REASON_DEFINITION)
shown = traces.search_requests(requests, text, show=kind, engine=engine, reasons=picked_reasons).reset_index(drop=True)
if picked_reasons:  # a row's column is its last lookup's reason: say why a row with another one is listed
    st.caption("Listed: requests with any lookup stopped for a chosen reason. The 'served no more because' column "
               "is a request's last lookup's (a request whose load failed is looked up again).")

# The selection follows its request, not its row position, when the search or the filter changes the rows.
keys = list(zip(shown["trace_id"], shown["request_id"]))
rows = st.session_state["request_table"]["selection"]["rows"] if "request_table" in st.session_state else []
row = (selection.row_of(keys, opened) if opened is not None
       else selection.follow_selection(rows, st.session_state.get("request_table_keys", []), keys))
if list(rows) != ([] if row is None else [row]):
    st.session_state["request_table"] = {"selection": {"rows": [] if row is None else [row]}}
st.session_state["request_table_keys"] = keys

# vLLM's latencies beside the load time, when vLLM's request span of any request has them
vllm_columns = [c for c in ("vllm_queue_ms", "vllm_ttft_ms", "vllm_e2e_ms") if requests[c].notna().any()]
# How long kvscope deferred loads for device KV room, when it deferred any (files that record it)
deferral_columns = ["deferred_lookups", "deferred_wait_ms"] if requests["deferred_lookups"].notna().any() else []
if requests["ended_waiting"].any():  # requests aborted while their loads waited (files that record them)
    deferral_columns.append("ended_waiting")
st.caption(f"{len(shown)} of {len(requests)} requests. Select a row to see its spans.")
st.dataframe(
    shown,
    key="request_table",
    on_select="rerun",
    selection_mode="single-row",
    hide_index=True,
    width="stretch",
    height=min(320, 35 * (len(shown) + 1) + 3),  # no empty rows below a short result
    placeholder="–",
    column_order=["request", *(["engine"] if len(engines) > 1 else []), "t_s", "tokens_queried", "tokens_hit",
                  "hit_rate", "miss_reason", "tokens_local", "tokens_external", "groups", "load_ms",
                  *deferral_columns, *vllm_columns, "loads", "load_failed", "bytes_loaded", "bytes_stored", "trace_id"],
    column_config={
        "request": st.column_config.TextColumn("request", help="Request id; with its trace id's last digits where "
                                               "another request has the same id (runs read together)"),
        "engine": st.column_config.NumberColumn("engine", help="vLLM's data-parallel engine that looked the "
                                                "request up (each has its own host tier)"),
        "t_s": st.column_config.NumberColumn("arrival (s)", format="%.3f"),
        "tokens_queried": st.column_config.NumberColumn("queried", help="Σ over the request's lookups"),
        "tokens_hit": st.column_config.NumberColumn("hit", help="Σ over the request's lookups"),
        "hit_rate": st.column_config.NumberColumn("hit rate", format="percent"),
        "miss_reason": st.column_config.TextColumn("served no more because", help=traces.MISS_REASON_DEFINITION),
        "tokens_local": st.column_config.NumberColumn("device hit", help="Tokens vLLM's own device prefix cache "
                                                      "had: the host tier was asked for the rest only"),
        "tokens_external": st.column_config.NumberColumn(
            "external", help="What its first load (the one its hit planned) brought from the host tier (the "
            "load span's kvscope.tokens.external); the Overview's tokens loaded sums its loads that did not fail. "
            "For a request that ended waiting for device KV room with no load, what its load would have brought"),
        "groups": st.column_config.NumberColumn("groups"),
        "load_ms": st.column_config.NumberColumn("load time (ms)", format="%.3f",
                                                 help=traces.LOAD_TIME_DEFINITION),
        "deferred_lookups": st.column_config.NumberColumn("deferred", help=traces.DEFERRAL_DEFINITION),
        "deferred_wait_ms": st.column_config.NumberColumn("KV room wait (ms)", format="%.3f",
                                                          help=traces.DEFERRAL_DEFINITION),
        "ended_waiting": st.column_config.CheckboxColumn(
            "ended waiting", help="The request ended (aborted: did its client give up?) while kvscope still "
            "deferred its load for device KV room: its load never started. " + traces.DEFERRAL_DEFINITION),
        "vllm_queue_ms": st.column_config.NumberColumn("queue (ms)", format="%.3f",
                                                       help="vLLM's queue time. " + traces.VLLM_TIMES_DEFINITION),
        "vllm_ttft_ms": st.column_config.NumberColumn(
            "TTFT (ms)", format="%.3f", help="vLLM's time to first token. " + traces.VLLM_TIMES_DEFINITION),
        "vllm_e2e_ms": st.column_config.NumberColumn("e2e (ms)", format="%.3f",
                                                     help="vLLM's end-to-end latency. " + traces.VLLM_TIMES_DEFINITION),
        "loads": st.column_config.NumberColumn("loads", help="Loads of the request: more than one when "
                                               "vLLM resumed it after preemption"),
        "load_failed": st.column_config.CheckboxColumn("load failed", help=traces.LOAD_FAILED_DEFINITION),
        "bytes_loaded": st.column_config.NumberColumn("loaded", format="bytes"),
        "bytes_stored": st.column_config.NumberColumn("stored", format="bytes"),
        "trace_id": "trace",
    },
)
if shown.empty:
    st.stop()

request = shown.iloc[0 if row is None else row]
st.subheader(f"Request `{request['request']}`")
st.caption(f"trace `{request['trace_id']}` · arrived at {request['arrival']:%Y-%m-%d %H:%M:%S.%f} UTC"
           + ("" if row is not None or len(shown) == 1 else " · the first row is shown until you select one"))
widgets.request_numbers(request, spans)
widgets.request_waterfall(spans, requests, request, key="request_waterfall", vllm=loaded.vllm)
widgets.group_copy_tables(spans, request, key="request_group_copies")
