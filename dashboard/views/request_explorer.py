"""Requests: a searchable table; the selected request's spans as a waterfall with attributes."""

import streamlit as st

from dashboard import data, traces, widgets

loaded = data.current()
st.title("Requests")
widgets.read_problems(loaded.traces)
loaded = data.require_requests()
requests, spans = loaded.requests, loaded.spans

search, only_hits = st.columns([4, 1], vertical_alignment="bottom")
text = search.text_input("Search request or trace id", key="request_search", placeholder="e.g. cmpl-r2")
hits = only_hits.toggle("Only hits or loads", key="request_only_hits")
shown = traces.search_requests(requests, text, hits).reset_index(drop=True)
st.caption(f"{len(shown)} of {len(requests)} requests. Select a row to see its spans.")

table = st.dataframe(
    shown,
    key="request_table",
    on_select="rerun",
    selection_mode="single-row",
    hide_index=True,
    width="stretch",
    height=min(320, 35 * (len(shown) + 1) + 3),  # no empty rows below a short result
    placeholder="–",
    column_order=["request_id", "t_s", "tokens_queried", "tokens_hit", "hit_rate", "tokens_local",
                  "tokens_external", "groups", "load_ms", "loads", "load_failed", "bytes_loaded", "bytes_stored",
                  "trace_id"],
    column_config={
        "request_id": "request",
        "t_s": st.column_config.NumberColumn("arrival (s)", format="%.3f"),
        "tokens_queried": st.column_config.NumberColumn("queried"),
        "tokens_hit": st.column_config.NumberColumn("hit"),
        "hit_rate": st.column_config.NumberColumn("hit rate", format="percent"),
        "tokens_local": st.column_config.NumberColumn("local"),
        "tokens_external": st.column_config.NumberColumn("external"),
        "groups": st.column_config.NumberColumn("groups"),
        "load_ms": st.column_config.NumberColumn("load time (ms)", format="%.3f",
                                                 help=traces.LOAD_TIME_DEFINITION),
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

selected = [i for i in table.selection.rows if i < len(shown)]
request = shown.iloc[selected[0] if selected else 0]
st.subheader(f"Request `{request['request_id']}`")
st.caption(f"trace `{request['trace_id']}` · arrived at {request['arrival']:%Y-%m-%d %H:%M:%S.%f} UTC"
           + ("" if selected else " · the first row is shown until you select one"))
widgets.request_numbers(request)
widgets.request_waterfall(spans, requests, request["request_id"], key="request_waterfall")
