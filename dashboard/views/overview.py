"""Overview: headline hit rate and load latency, then per KV group and the slowest loads."""

import streamlit as st

from dashboard import charts, data, formatting, traces, widgets

loaded = data.current()
st.title("Overview")
widgets.read_problems(loaded.traces)
loaded = data.require_requests()
requests, spans = loaded.requests, loaded.spans
numbers = traces.overview_numbers(requests, spans)

st.caption(
    f"{formatting.count(numbers['requests'])} traced requests over {formatting.duration(numbers['duration_s'])}, "
    f"from {len(loaded.traces.files)} file(s)."
)
if numbers["requests_load_failed"]:
    failed = requests.loc[requests["load_failed"], "request"]
    st.warning(f"{formatting.count(len(failed))} request(s) had a load that failed on a worker: vLLM recomputed "
               f"their tokens: {formatting.names(failed)}. The Requests page lists them ('failed loads').",
               icon=":material/error:")
if run_apart := traces.engines_run_apart_note(traces.engines_run_apart(spans)):
    st.warning(run_apart, icon=":material/warning:")
if numbers["loads_without_copies"]:
    st.warning(f"{formatting.count(numbers['loads_without_copies'])} of {formatting.count(numbers['loads'])} loads "
               "have no copy spans: worker trace file missing or cut short, or their copies in another trace (see "
               "below)? Their load times are unknown, and their bytes in no request's row.", icon=":material/warning:")
if numbers["transfers_short_of_workers"]:
    st.warning(f"{formatting.count(numbers['transfers_short_of_workers'])} loads or stores have copy spans from "
               f"fewer workers than the others ({numbers['workers']}): a worker's trace file cut short? Their bytes "
               "and copy times are those of the workers read.", icon=":material/warning:")
if numbers["stores_without_copies"]:
    st.warning(f"{formatting.count(numbers['stores_without_copies'])} of {formatting.count(numbers['stores'])} stores "
               "have no copy spans: worker trace file missing or cut short, or their copies in another trace? Their "
               "bytes are in no total.", icon=":material/warning:")
if numbers["copies_without_owner"]:
    st.warning(f"{formatting.count(numbers['copies_without_owner'])} copy span(s) belong to no load or store in "
               "these files: their parent is none of them (a worker that lost the request's trace id, or the "
               "scheduler's trace file missing). Their bytes count in the totals below, in no "
               "request.", icon=":material/warning:")
if numbers["requests_deferred"]:
    ended = numbers["requests_ended_waiting"]  # aborted while waiting: their waits are in the median and longest
    st.info(f"kvscope deferred the loads of {formatting.count(numbers['requests_deferred'])} request(s) for device "
            f"KV room: they waited {formatting.millis(numbers['deferral_wait_p50_ms'])} (median), at most "
            f"{formatting.millis(numbers['deferral_wait_max_ms'])}, before their loads could start"
            + (f" or, for {formatting.count(ended)} of them, until they ended (aborted: did a client give up?) while "
               "still waiting: their loads never started ('ended waiting')" if ended else "")
            + ". The device KV cache was nearly full; steady deferrals ask for device KV headroom. The Requests page "
            "lists them ('deferred').", icon=":material/hourglass_top:")
row = st.columns(5)
row[0].metric("Requests", formatting.count(numbers["requests"]))
row[1].metric("Token hit rate", formatting.percent(numbers["hit_rate"]), help=traces.HIT_RATE_DEFINITION)
row[2].metric("Requests with a hit", formatting.count(numbers["requests_with_hit"]))
row[3].metric("Tokens hit", formatting.count(numbers["tokens_hit"]))
row[4].metric("Tokens queried", formatting.count(numbers["tokens_queried"]))
row = st.columns(5)
row[0].metric("Load time p50", formatting.millis(numbers["load_p50_ms"]), help=traces.LOAD_TIME_DEFINITION)
row[1].metric("Load time p95", formatting.millis(numbers["load_p95_ms"]), help=traces.LOAD_TIME_DEFINITION)
row[2].metric("Load time p99", formatting.millis(numbers["load_p99_ms"]), help=traces.LOAD_TIME_DEFINITION)
row[3].metric("Loaded from host", formatting.data_size(numbers["bytes_loaded"]),
              help="Σ copy.bytes of load copies; unknown where loads ran but no load copy is in the files")
row[4].metric("Stored to host", formatting.data_size(numbers["bytes_stored"]), help="Σ copy.bytes of store copies")

if len(traces.engines_of(requests)) > 1:  # data parallelism: each engine has a host tier of its own
    st.subheader("By engine", help=traces.ENGINE_DEFINITION)
    st.dataframe(
        traces.engine_summary(requests),
        hide_index=True,
        width="stretch",
        placeholder="–",
        column_order=list(traces.ENGINE_COLUMNS),
        column_config={
            "engine": st.column_config.NumberColumn("engine"),
            "requests": st.column_config.NumberColumn("requests"),
            "tokens_queried": st.column_config.NumberColumn("tokens queried"),
            "tokens_hit": st.column_config.NumberColumn("tokens hit"),
            "hit_rate": st.column_config.NumberColumn("hit rate", format="percent"),
            "requests_load_failed": st.column_config.NumberColumn("requests with a failed load"),
            "load_p50_ms": st.column_config.NumberColumn("load p50 (ms)", format="%.3f"),
            "load_p95_ms": st.column_config.NumberColumn("load p95 (ms)", format="%.3f"),
        },
    )

st.subheader("Hit rate over time")
over_time = traces.hit_rate_over_time(requests)
bucket_s = traces.pick_bucket_seconds(float(requests["t_s"].max()))
st.altair_chart(charts.hit_rate_over_time(over_time, bucket_s), width="stretch")

misses = traces.misses_by_reason(spans)
if not misses.empty:  # trace files that record why each lookup missed
    st.subheader("Why the host tier served no more", help=traces.LOOKUP_MISS_REASON_DEFINITION)
    st.caption(traces.MISSES_DEFINITION + " 'evicted': a larger tier would have served at least the block where "
               "the hit stopped. 'new' counts blocks evicted longer ago than the tier remembers (as many blocks as "
               "it holds) too: where the tier evicts many times its size, some of those were evictions.")
    st.caption("Select a row to list its requests on the Requests page.")
    picked_reason = widgets.pickable_table(
        misses,
        key="miss_reasons",
        column_order=list(traces.MISSES_COLUMNS),
        column_config={
            "miss_reason": "reason",
            "lookups": st.column_config.NumberColumn("lookups"),
            "tokens_not_served": st.column_config.NumberColumn("tokens not served"),
            "share": st.column_config.NumberColumn("share", format="percent"),
        },
    )
    if picked_reason is not None:
        st.session_state[widgets.OPEN_REASON] = picked_reason["miss_reason"]
        st.switch_page("views/request_explorer.py")

by_outcome = traces.vllm_latency_by_outcome(requests)
if not by_outcome.empty:  # vLLM's own request spans were read: does loading from the host tier cut TTFT?
    st.subheader("vLLM latency by host-tier outcome", help=traces.OUTCOME_DEFINITION)
    st.dataframe(
        by_outcome,
        hide_index=True,
        width="stretch",
        placeholder="–",
        column_order=list(traces.OUTCOME_COLUMNS),
        column_config={
            "outcome": "outcome",
            "requests": st.column_config.NumberColumn("requests"),
            "prompt_tokens_p50": st.column_config.NumberColumn("prompt p50 (tokens)", format="%.0f"),
            "tokens_hit_p50": st.column_config.NumberColumn("hit p50 (tokens)", format="%.0f"),
            **{col: st.column_config.NumberColumn(col.replace("_ms", " (ms)").replace("_", " "), format="%.1f")
               for col in ("queue_p50_ms", "ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms")},
        },
    )

st.subheader("KV groups")
st.caption("A lookup is joint over all KV groups (a prefix hits only where every group can serve it): "
           "the token hit rate above is the groups' too.")
st.dataframe(
    traces.group_summary(spans, requests),
    hide_index=True,
    width="stretch",
    placeholder="–",
    column_order=["group", "scans", "blocks_scanned", "blocks_null_skipped", "null_skip_share",
                  "blocks_loaded", "bytes_loaded", "load_gb_per_s", "bytes_stored", "store_gb_per_s"],
    column_config={
        "group": "group",
        "scans": st.column_config.NumberColumn("loads"),
        "blocks_scanned": st.column_config.NumberColumn("blocks scanned"),
        "blocks_null_skipped": st.column_config.NumberColumn("null skipped"),
        "null_skip_share": st.column_config.NumberColumn("null-skip share", format="percent"),
        "blocks_loaded": st.column_config.NumberColumn("blocks loaded"),
        "bytes_loaded": st.column_config.NumberColumn("loaded", format="bytes"),
        "load_gb_per_s": st.column_config.NumberColumn("load GB/s", format="%.2f",
                                                       help=traces.COPY_THROUGHPUT_DEFINITION),
        "bytes_stored": st.column_config.NumberColumn("stored", format="bytes"),
        "store_gb_per_s": st.column_config.NumberColumn("store GB/s", format="%.2f",
                                                        help=traces.COPY_THROUGHPUT_DEFINITION),
    },
)

# Where no load has a time, the latency chart and the slowest loads say why instead of drawing nothing
no_timed_loads = (f"None of the {formatting.count(numbers['loads'])} loads in these traces has a time: they failed "
                  "(vLLM recomputed them), or their copy spans are not in these traces (see Load time in the "
                  "Definitions)." if numbers["loads"] else "No loads in these traces: the host tier served no "
                  "request.")
left, right = st.columns([3, 2])  # the latency table has six columns; the throughput chart fits in less
with left:
    st.subheader("Load latency")
    latencies = traces.load_latency_distribution(spans, requests)
    if latencies.empty:  # an empty chart reads as "the chart broke", not "nothing loaded"
        st.info(no_timed_loads)
    else:
        st.altair_chart(charts.latency_distribution(latencies), width="stretch")
    st.dataframe(
        traces.load_latency_quantiles(spans, requests),
        hide_index=True,
        width="stretch",
        placeholder="–",
        column_order=["scope", "count", "p50_ms", "p95_ms", "p99_ms", "max_ms"],
        column_config={col: st.column_config.NumberColumn(col.replace("_ms", " (ms)"), format="%.3f")
                       for col in ("p50_ms", "p95_ms", "p99_ms", "max_ms")},
    )
    st.caption("Copy rows count each worker's copy span, as kvscope_copy_duration_seconds does: under tensor "
               "parallelism a group's load counts once per worker. The KV groups table and a request's view time "
               "a transfer by its slowest worker instead.")
with right:
    st.subheader("Copy throughput", help=traces.COPY_THROUGHPUT_DEFINITION)
    throughput = traces.copy_throughput(spans)
    if throughput.empty:
        st.info("No kvscope.group.copy spans in these traces.")
    else:
        st.altair_chart(charts.copy_throughput(throughput), width="stretch")

st.subheader("Slowest loads")
slowest = traces.top_slow_loads(requests, 10)
if slowest.empty:
    st.info(no_timed_loads)
else:
    st.caption("Select a row to open the request on the Requests page.")
    picked = widgets.pickable_table(
        slowest,
        key="slowest_loads",
        column_order=["request", "t_s", "load_ms", "load_copy_ms", "load_wait_ms", "tokens_loaded", "bytes_loaded",
                      "trace_id"],
        column_config={
            "t_s": st.column_config.NumberColumn("arrival (s)", format="%.3f"),
            "load_ms": st.column_config.NumberColumn("load time (ms)", format="%.3f",
                                                     help=traces.LOAD_TIME_DEFINITION),
            "load_copy_ms": st.column_config.NumberColumn(
                "copying (ms)", format="%.3f", help="From its first copy's start to its last copy's end (every worker "
                "and group, summed over its loads)"),
            "load_wait_ms": st.column_config.NumberColumn(
                "before the copies (ms)", format="%.3f", help="Load time less copying: planning, then waiting for a "
                "worker to run the engine step that starts the copies (a long step before it, or copies queued "
                "ahead). Long waits with short copies: the engine was busy, not the host tier"),
            "tokens_loaded": st.column_config.NumberColumn(
                "tokens loaded", help="Σ kvscope.tokens.external over the request's loads that did not fail: the "
                "loads its load time sums (a request resumed after preemption loads again)"),
            "bytes_loaded": st.column_config.NumberColumn(
                "bytes loaded", format="bytes", help="Σ kvscope.copy.bytes of the copies into the device of all the "
                "request's loads: a load that failed on one worker counts what the others copied"),
            "trace_id": "trace",
        },
    )
    if picked is not None:
        st.session_state[widgets.OPEN_REQUEST] = (picked["trace_id"], picked["request_id"])
        st.switch_page("views/request_explorer.py")

with st.expander("Definitions"):
    for text in (traces.HIT_RATE_DEFINITION, traces.LOAD_TIME_DEFINITION, traces.LOAD_FAILED_DEFINITION,
                 "All numbers cover the traced requests only: with `trace_sample_ratio` below 1 the totals "
                 "are that fraction of the engine's (Prometheus has every request).",
                 traces.COPY_THROUGHPUT_DEFINITION,
                 "Null-skip share: Σ group.blocks.null_skipped / Σ group.blocks.total over a group's scans."):
        st.markdown(f"- {text}")
