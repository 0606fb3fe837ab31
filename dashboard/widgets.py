"""UI pieces more than one page shows."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, formatting, traces

OPEN_REQUEST = "open_request"  # session state: (trace id, request id) for the Requests page to show
OPEN_REASON = "open_reason"  # session state: a miss reason whose requests the Requests page lists

WATERFALL_TABLE_COLUMNS = {
    "row": st.column_config.TextColumn("span"),
    "start_ms": st.column_config.NumberColumn("start (ms)", format="%.3f"),
    "duration_ms": st.column_config.NumberColumn("duration (ms)", format="%.3f"),
    "status_code": st.column_config.NumberColumn("status", help="OTLP status code: 0 unset, 1 ok, 2 error"),
    "span_id": st.column_config.TextColumn("span id"),
    "attributes": st.column_config.TextColumn("attributes", width="large"),
}


def pickable_table(frame: pd.DataFrame, key: str, **table) -> pd.Series | None:
    """A table whose rows are picked one at a time (a pick reruns the page); the picked row, or None."""
    event = st.dataframe(frame, key=key, on_select="rerun", selection_mode="single-row", hide_index=True,
                         width="stretch", placeholder="–", **table)
    rows = event.selection.rows
    return frame.iloc[rows[0]] if rows else None


def read_problems(read: traces.Traces) -> None:
    """A warning with the lines the reader skipped, by file and line number; spans read twice (the same span in
    two files) only a note, as they count once."""
    duplicates = [p for p in read.problems if p.reason == traces.DUPLICATE_SPAN]
    if duplicates:
        st.caption(f"{sum(p.spans or 0 for p in duplicates)} span(s) were read twice, in one file or in two of "
                   "the files read (a Collector's copy beside the connector's trace file, a file given twice, or "
                   "a file holding a copy of itself): each counts once.")
    problems = [p for p in read.problems if p.reason != traces.DUPLICATE_SPAN]
    if not problems:
        return
    spans = sum(p.spans or 0 for p in problems)
    # places, not problems: one line can break the contract in several ways
    unknown = len({(p.file, p.line) for p in problems if p.spans is None})
    lines = len({(p.file, p.line) for p in problems if p.line})
    skipped = f"{spans} kvscope span(s) skipped"
    if unknown:  # a line that does not parse (or a file not read) held how many? nobody can tell
        skipped += f", and an unknown number in {unknown} line(s) or file(s) that could not be read"
    st.warning(
        f"{len(problems)} problem(s) while reading the trace files ({lines} line(s), {skipped}): "
        f"{traces.problem_lines(problems)}." + (" Everything else is shown." if not read.empty else ""),
        icon=":material/warning:",
    )
    with st.expander("Skipped lines and spans"):
        st.dataframe(traces.problems_frame(problems), hide_index=True, width="stretch", placeholder="–",
                     column_config={
                         "line": st.column_config.NumberColumn("line", help="–: the whole file"),
                         "reason": st.column_config.TextColumn("reason", width="large"),
                         "spans skipped": st.column_config.NumberColumn(
                             "spans skipped", help="–: unknown (a line or file that could not be read)"),
                     })


def request_waterfall(spans: pd.DataFrame, requests: pd.DataFrame, request: pd.Series, *, key: str,
                      vllm: pd.DataFrame | None = None) -> None:
    """One request's spans on a shared time axis (vLLM's request span first, when `vllm` has it), then the
    same spans as a table with attributes."""
    rows = traces.waterfall_rows(spans, requests, request["request_id"], request["trace_id"], vllm)
    if rows.empty:
        st.info(f"No kvscope spans for request {request['request']}.")
        return
    st.altair_chart(charts.waterfall(rows), width="stretch", key=f"{key}_chart")
    st.dataframe(rows[list(WATERFALL_TABLE_COLUMNS)], column_config=WATERFALL_TABLE_COLUMNS, hide_index=True,
                 width="stretch", placeholder="–", key=f"{key}_table")


def request_numbers(request: pd.Series, spans: pd.DataFrame | None = None) -> None:
    """The headline numbers of one request; with the ``spans`` read, what its first load waited for."""
    cols = st.columns(4)
    cols[0].metric("Tokens hit / queried", f"{formatting.count(request['tokens_hit'])} / "
                   f"{formatting.count(request['tokens_queried'])}")
    cols[1].metric("Request hit rate", formatting.percent(request["hit_rate"]))
    cols[2].metric("Load time", formatting.millis(request["load_ms"]), help=traces.LOAD_TIME_DEFINITION)
    cols[3].metric("Loaded from host", formatting.data_size(request["bytes_loaded"]))
    loads = int(request["loads"])
    if pd.notna(request["load_ms"]) and pd.notna(request["load_copy_ms"]):  # where its load time went
        each = f", summed over its {loads} loads" if loads > 1 else ""
        st.caption(f"Load time{each}: {formatting.millis(request['load_copy_ms'])} copying (a load's first copy's "
                   f"start to its last copy's end, every worker and group) and "
                   f"{formatting.millis(request['load_wait_ms'])} before the first copy started: planning, then "
                   "waiting for a worker to run the engine step that starts it (a long step before it, or copies "
                   "queued ahead, delay it).")
        wait = traces.load_wait(spans, request["trace_id"], request["request_id"]) if spans is not None else None
        if wait is not None:
            text = traces.load_wait_text(wait)
            st.caption(f"Its first load: {text[0].lower()}{text[1:]}" if loads > 1 else text)
    hit, loaded = request["tokens_hit"], request["tokens_loaded"]
    if pd.notna(loaded) and loaded > (hit if pd.notna(hit) else 0):
        st.caption(f"It loaded {formatting.count(loaded)} tokens from the host tier, more than its lookup hit: "
                   "resumed after preemption, it was looked up again (vLLM counts that lookup apart: it has no "
                   "span) and loaded its own stored blocks back.")
    local = request["tokens_local"]
    if pd.notna(local) and local > 0:
        st.caption(f"vLLM's device prefix cache had its first {formatting.count(local)} tokens: the host tier was "
                   "asked for the rest only (they are not in the tokens queried).")
    deferral = deferral_text(request)
    if deferral:
        st.info(deferral, icon=":material/hourglass_top:")
    reason = request["miss_reason"]
    if isinstance(reason, str):  # trace files that record it
        text = traces.MISS_REASON_TEXT.get(reason, "a reason this version of the app does not know")
        st.info(f"Why the host tier served no more (`{reason}`): {text}.", icon=":material/help:")
    vllm_times = ["vllm_queue_ms", "vllm_ttft_ms", "vllm_prefill_ms", "vllm_e2e_ms"]
    if request[vllm_times].notna().any():  # the request as vLLM timed it; nothing (not zeros) without its span
        cols = st.columns(4)
        cols[0].metric("Queue time (vLLM)", formatting.millis(request["vllm_queue_ms"]),
                       help=traces.VLLM_TIMES_DEFINITION)
        cols[1].metric("Time to first token (vLLM)", formatting.millis(request["vllm_ttft_ms"]),
                       help=traces.VLLM_TIMES_DEFINITION)
        cols[2].metric("Prefill (vLLM)", formatting.millis(request["vllm_prefill_ms"]),
                       help="Time in the model from scheduling to the first token, as vLLM measured it")
        cols[3].metric("End-to-end (vLLM)", formatting.millis(request["vllm_e2e_ms"]),
                       help=traces.VLLM_TIMES_DEFINITION)
    uncopied, loads = int(request["loads_without_copies"]), int(request["loads"])
    if uncopied and uncopied == loads:
        st.warning("No copy span of its load was recorded (worker trace file missing or cut short?): its load "
                   "time and bytes are unknown.", icon=":material/warning:")
    elif uncopied:  # a resumed request: the other loads' bytes show, but not the whole load time
        st.warning(f"{uncopied} of its {loads} loads {'has' if uncopied == 1 else 'have'} no copy span (worker trace "
                   "file missing or cut short?): "
                   "its load time is unknown, and the bytes shown are its other loads' only.",
                   icon=":material/warning:")
    if request["load_mistimed"]:  # as well as a missing copy: each leaves the load time unknown
        st.warning("A copy span of one of its loads ends before it starts or starts more than 1 ms before the "
                   "load, or a load span ends before it starts (placed on another clock?): its load time is unknown.",
                   icon=":material/warning:")
    if request["load_failed"]:
        st.error("A load of this request failed on a worker (copy span with status ERROR): vLLM recomputed "
                 "its tokens instead. " + traces.LOAD_FAILED_DEFINITION, icon=":material/error:")


_DEFERRAL_CAUSE = ("the loads admitted before it, together with it, needed more device blocks than the device KV "
                   "cache has")


def deferral_text(request: pd.Series) -> str | None:
    """How long kvscope deferred the request's load for device KV room, in words, and whether the request ended
    while still waiting (`ended_waiting`); None when it was not deferred (or the trace file predates deferral
    attributes)."""
    lookups = request["deferred_lookups"]
    if pd.isna(lookups) or lookups < 1:
        return None
    times = "once" if lookups == 1 else f"{formatting.count(lookups)} times"
    waited = request["deferred_wait_ms"]
    wait = "wait unknown" if pd.isna(waited) else formatting.millis(waited)
    deferred = f"kvscope deferred its load {times} ({wait}) for device KV room"
    if not bool(request.get("ended_waiting", False)):
        return f"{deferred}: {_DEFERRAL_CAUSE}. Frequent deferrals ask for device KV headroom."
    return (f"{deferred}, and the request ended (aborted: did its client give up?) before its load could start: "
            f"{_DEFERRAL_CAUSE}.{_never_admitted_text(request)} Waits that outlast clients ask for device KV "
            "headroom.")


def _never_admitted_text(request: pd.Series) -> str:
    """What a request that ended waiting and has no lookup or load span lacks, and why ("" for one vLLM admitted
    before a preemption)."""
    if request.get("lookups", 0) or request.get("loads", 0):
        return ""
    external = request.get("tokens_external")
    would_load = "" if pd.isna(external) else f"; its load would have brought {formatting.count(external)} tokens"
    return (" vLLM never admitted it: it has no lookup or load span, and no hit counted (tokens queried and hit "
            f"are empty, out of the hit rate){would_load}.")


GROUP_COPY_TABLE_COLUMNS = {
    "group": st.column_config.TextColumn("group"),
    "scanned": st.column_config.NumberColumn("scanned", help="Blocks the load's null-skip scan of the group looked at"),
    "null_skipped": st.column_config.NumberColumn(
        "null skipped", help="Null placeholder blocks the scan skipped: out-of-window sliding-window blocks, Mamba "
        "padding"),
    "pending": st.column_config.NumberColumn("pending", help="Blocks the scan planned to load: what the copies copy"),
    "start_index": st.column_config.NumberColumn("start", help="Index of the first pending block in the group's "
                                                 "block list"),
    "workers": st.column_config.NumberColumn("workers", help="Copy spans of the group: one per worker"),
    "blocks": st.column_config.NumberColumn("blocks", help="The most blocks a worker copied"),
    "bytes": st.column_config.NumberColumn("bytes", format="bytes", help="Summed over the workers"),
    "copy_ms": st.column_config.NumberColumn("copy time (ms)", format="%.3f", help="The slowest worker's"),
    "gb_per_s": st.column_config.NumberColumn("GB/s", format="%.2f", help="Bytes over the slowest worker's time"),
    "slowest_rank": st.column_config.NumberColumn("slowest rank", help="The worker whose copy took longest"),
    "failed": st.column_config.CheckboxColumn("failed"),
}


def group_copy_tables(spans: pd.DataFrame, request: pd.Series, *, key: str) -> None:
    """Per load and store of the request, a small table of its copies per KV group."""
    copies = traces.request_group_copies(spans, request["trace_id"], request["request_id"])
    st.markdown("**Copies per KV group**", help=traces.GROUP_COPY_DEFINITION)
    if copies.empty:
        st.caption("No copy spans joined this request's loads or stores.")
        return
    for transfer, rows in copies.groupby("transfer", sort=False):
        st.caption(transfer)
        is_load = rows["direction"].iloc[0] == "load"
        columns = [c for c in GROUP_COPY_TABLE_COLUMNS if is_load or c not in traces.GROUP_SCAN_COLUMNS]
        st.dataframe(rows[columns], column_config=GROUP_COPY_TABLE_COLUMNS, hide_index=True,
                     width="stretch", placeholder="unknown", key=f"{key}_{transfer}")
