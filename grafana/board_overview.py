"""The kvscope overview board: is the host tier paying off, how fast is it, is it healthy.

One function per panel. Stat panels read the recording rules (the same 5-minute numbers the
alerts look at); time series compute from the raw counters over `$__rate_interval`, so they
follow the zoom level.
"""

from __future__ import annotations

import panels_common as pc
from panels_common import sel

from connector.miss_reasons import miss_reasons_explained

UID = "kvscope-overview"
TITLE = "kvscope / Overview"
DESCRIPTION = (
    "Host-tier KV offload by the kvscope vLLM connector: token hit rate, per-KV-group loads, "
    "load and copy latency, copy throughput, host-tier capacity, evictions, loads deferred for device KV "
    "room and their wait, and load failures."
)

RATE = "[$__rate_interval]"


# The stats of a 5-minute rate read it now: a range query's last value outlived a stopped engine for the
# dashboard's whole time range (a hit rate of 0.38 shown minutes after the traffic ended)
NOW = (" The value now (an instant query): \"no data\" where the selected engines looked nothing up in the last "
       "5 minutes or stopped, not the last value of the time range.")


# --- Host tier hit rate ---------------------------------------------------------------------

def token_hit_rate_stat():
    return pc.stat(
        "Token hit rate (5m)",
        "Share of prompt tokens looked up in the host tier that were found there, over the last 5 "
        "minutes (recording rules kvscope:hit_tokens:rate5m / kvscope:lookup_tokens:rate5m, the "
        "numbers the KVScopeHitRateCollapsed alert uses, per instance and engine: pick one of each to "
        "see an alert's number). Each hit token is prefill the engine does not recompute, unless its "
        "load fails (see load failures; the request is then looked up again and counts its tokens "
        "a second time, with no hit). Low with a workload that repeats prefixes (chat history, shared system "
        "prompts) means the tier is too small (see evictions) or blocks are evicted before reuse: "
        "raise cpu_bytes. A sudden drop at steady traffic points at a restart that emptied the tier "
        "or at a changed prompt prefix." + NOW,
        pc.instant(f"sum(kvscope:hit_tokens:rate5m{sel()}) / (sum(kvscope:lookup_tokens:rate5m{sel()}) > 0)",
                   "hit rate"),
        "percentunit",
        [(None, "red"), (0.2, "orange"), (0.5, "green")],
        sparkline=False,
    )


def token_hit_rate_over_time():
    return pc.timeseries(
        "Token hit rate over time",
        "Hit tokens / looked-up tokens per model, at the zoom level's rate interval, plus the 5-minute "
        "recorded ratio the alert evaluates (the alert per instance and engine). The rate a "
        "prefix-heavy workload reaches here is the ceiling of prefill saved; compare with evictions and "
        "host tier usage when it sags. No data means no lookups (no traffic, or the connector is not loaded: check vLLM's start-up log).",
        pc.queries(
            (
                f"sum by (model_name) (rate(kvscope_hit_tokens_total{sel()}{RATE})) / "
                f"(sum by (model_name) (rate(kvscope_lookup_tokens_total{sel()}{RATE})) > 0)",
                "{{model_name}}",
            ),
            (
                f"sum by (model_name) (kvscope:hit_tokens:rate5m{sel()}) / "
                f"(sum by (model_name) (kvscope:lookup_tokens:rate5m{sel()}) > 0)",
                "{{model_name}} (5m, recording rules)",
            ),
        ),
        "percentunit",
        width=pc.HALF,
        max_value=1,
    )


def lookup_and_hit_tokens():
    return pc.timeseries(
        "Tokens looked up and hit",
        "Prompt tokens per second the scheduler looked up in the host tier, and how many of them were "
        "found. The gap between the lines is prefill the GPU computes. Use it to judge whether a "
        "low hit rate matters: a low rate at a few tokens/s is noise.",
        pc.queries(
            (f"sum by (model_name) (rate(kvscope_lookup_tokens_total{sel()}{RATE}))", "looked up {{model_name}}"),
            (f"sum by (model_name) (rate(kvscope_hit_tokens_total{sel()}{RATE}))", "hit {{model_name}}"),
        ),
        pc.TOKENS_PER_SECOND,
        width=pc.QUARTER,
    )


# --- Why lookups missed --------------------------------------------------------------------

def evicted_miss_share_stat():
    evicted = 'reason="evicted"'
    return pc.stat(
        "Missed because evicted (5m)",
        "Share of the prompt tokens looked up in the host tier that it did not serve because their "
        "block had been evicted to make room, over the last 5 minutes (kvscope:evicted_miss_ratio:rate5m, "
        "over the selected engines): what a larger tier would have served. kvscope remembers as many "
        "evicted blocks as the tier holds, so this counts what a tier up to about twice the size would "
        "have kept. Above a few percent with a workload that repeats prefixes: raise cpu_bytes." + NOW,
        pc.instant(f"sum(kvscope:missed_tokens:rate5m{sel(evicted)}) / "
                   f"(sum(kvscope:lookup_tokens:rate5m{sel()}) > 0)", "evicted"),
        "percentunit",
        [(None, "green"), (0.05, "orange"), (0.1, "red")],  # red from KVScopeHostTierTooSmall's threshold
        sparkline=False,
    )


def missed_tokens_by_reason():
    return pc.timeseries(
        "Looked-up tokens not served, by reason",
        "Tokens per second the host tier did not serve, stacked by why their offloaded block was missing "
        f"(kvscope_missed_tokens_total, block by block past each hit): {miss_reasons_explained()}. The stack is "
        "the gap between looked-up and hit tokens.",
        pc.queries((f"sum by (reason) (rate(kvscope_missed_tokens_total{sel()}{RATE}))", "{{reason}}")),
        pc.TOKENS_PER_SECOND,
        width=18,
        stacked=True,
    )


# --- KV groups ------------------------------------------------------------------------------

def group_loaded_share():
    return pc.timeseries(
        "Blocks loaded / blocks scanned, per KV group",
        "Per KV cache group: of the device blocks in a hit's range that the load plan scanned, the "
        "share copied in from the host tier (kvscope_loaded_blocks_total / kvscope_scan_blocks_total), "
        "per model. Full-attention groups should sit near 100%: every block of the hit range is "
        "needed. Sliding-window and Mamba groups sit lower by design, because blocks outside the "
        "window are null and skipped (next panel); loaded + skipped should add up to scanned. A "
        "group well below that means planned blocks were not loaded: failed loads count no loaded "
        "blocks (their blocks count under load failures); loads still running count when they finish. "
        "Look at load failures and at the connector log.",
        pc.queries((
            f"sum by (model_name, group, kind) (rate(kvscope_loaded_blocks_total{sel()}{RATE})) / "
            f"(sum by (model_name, group, kind) (rate(kvscope_scan_blocks_total{sel()}{RATE})) > 0)",
            "{{model_name}} group {{group}} ({{kind}})",
        )),
        "percentunit",
        max_value=1,
    )


def group_null_skipped_share():
    return pc.timeseries(
        "Null blocks skipped / blocks scanned, per KV group",
        "Per KV cache group: share of scanned blocks that were vLLM's null placeholder (positions "
        "outside a sliding window, or Mamba state vLLM does not keep) and so were not copied. This is transfer saved by the hybrid-aware plan. Expect ~0% for "
        "full attention and a large share for sliding window on long prompts. A full-attention group "
        "with skips, or a sliding-window group with none on prompts longer than its window, points "
        "at a group layout mismatch: check the groups reported at connector start-up.",
        pc.queries((
            f"sum by (model_name, group, kind) (rate(kvscope_null_blocks_skipped_total{sel()}{RATE})) / "
            f"(sum by (model_name, group, kind) (rate(kvscope_scan_blocks_total{sel()}{RATE})) > 0)",
            "{{model_name}} group {{group}} ({{kind}})",
        )),
        "percentunit",
        max_value=1,
    )


# --- Latency and throughput -----------------------------------------------------------------

def request_load_p99_stat():
    return pc.stat(
        "Request load latency p99 (5m)",
        "99th percentile, over the last 5 minutes, of the time from starting a request's load from "
        "the host tier until the scheduler hears that every worker's copies are done (reported at "
        "the end of an engine step, so it includes that step's time; recording rule "
        "kvscope:request_load_duration_seconds_bucket:rate5m). The request's prefill waits this "
        "long; it should stay well below the prefill time it saves. Red is the "
        "KVScopeLoadLatencyHigh alert threshold (500 ms; the alert is per instance and engine, this "
        "stat over every selected one: pick one of each to see an alert's number). If high: check copy latency and "
        "throughput below (PCIe/host memory bandwidth), and whether the host is swapping." + NOW.replace(
            "looked nothing up", "loaded nothing"),
        pc.instant(pc.quantile(0.99, lambda *m: f"kvscope:request_load_duration_seconds_bucket:rate5m{sel(*m)}"),
                   "p99"),
        "s",
        [(None, "green"), (0.25, "orange"), (0.5, "red")],
        sparkline=False,
    )


def request_load_latency():
    return pc.timeseries(
        "Request load latency p50 / p95 / p99",
        "Quantiles of kvscope_request_load_duration_seconds: per request, the time its blocks take to "
        "arrive from the host tier. p50 is the usual cost of a hit; a p99 far above p50 means some "
        "loads queue behind others or behind stores (long prompts, bursts). Compare with the prefill "
        "time of the same prompts: a load slower than recomputing is a loss.",
        pc.quantile_queries(
            (0.5, 0.95, 0.99), lambda *m: f"rate(kvscope_request_load_duration_seconds_bucket{sel(*m)}{RATE})",
            ("model_name",), "{p} {{model_name}}"),
        "s",
        width=18,
    )


def copy_latency():
    return pc.timeseries(
        "Copy latency p50 / p99, per group and direction",
        "Quantiles of kvscope_copy_duration_seconds: one device<->host copy of one group's blocks, "
        "the measured copy interval (device events on a GPU; load = host to device, store = device "
        "to host). Copies of a group "
        "with bigger blocks take longer; what matters is the trend and the p99/p50 spread. Rising "
        "latency at flat throughput means contention on the PCIe link or host memory; compare with "
        "the throughput panel.",
        pc.quantile_queries(
            (0.5, 0.99), lambda *m: f"rate(kvscope_copy_duration_seconds_bucket{sel(*m)}{RATE})",
            ("model_name", "group", "kind", "direction"),
            "{p} {{direction}} {{model_name}} group {{group}} ({{kind}})"),
        "s",
    )


def copy_throughput():
    return pc.timeseries(
        "Copy throughput, per group and direction",
        "Bytes per second moved between device and host tier, per model and KV group: loads (host to "
        "device, kvscope_load_bytes_total) and stores (device to host, kvscope_store_bytes_total), "
        "summed over every selected engine and its tensor-parallel workers (each worker moves its "
        "own shard over its own link). Stores follow new prefill; loads follow hits, and include a "
        "worker's copied part of a load that failed on another worker. Compare with the link "
        "bandwidth times the workers (PCIe 4.0 x16 is ~25 GB/s per direction per GPU), or use the "
        "KV groups board's bandwidth while copying: near it, copies queue and latency rises. Stores "
        "with no loads for a long time: see the KVScopeStoresWithoutLoads alert.",
        pc.queries(
            (f"sum by (model_name, group, kind) (rate(kvscope_load_bytes_total{sel()}{RATE}))",
             "load {{model_name}} group {{group}} ({{kind}})"),
            (f"sum by (model_name, group, kind) (rate(kvscope_store_bytes_total{sel()}{RATE}))",
             "store {{model_name}} group {{group}} ({{kind}})"),
        ),
        "Bps",
    )


# --- Host tier capacity ---------------------------------------------------------------------

def host_usage_stat():
    return pc.stat(
        "Host tier usage (fullest)",
        "kvscope_host_used_bytes / kvscope_host_capacity_bytes of the fullest selected host tier "
        "(recording rule kvscope:host_usage:ratio). A full tier is normal once traffic has run a "
        "while: the tier is an LRU cache, and evicts one entry per new one from then on. It is a problem "
        "only when prompts asked for again were evicted (alert KVScopeHostTierTooSmall); then raise cpu_bytes. "
        "One colour whatever the value, for that reason. The value now: \"no data\" where no selected engine "
        "has been scraped in the last 5 minutes, or none has served a request since it started (its scheduler "
        "reports the tier with a step's stats).",
        pc.instant(f"max(kvscope:host_usage:ratio{sel()})", "usage"),
        "percentunit",
        [(None, "blue")],
        sparkline=False,
    )


def host_used_vs_capacity():
    return pc.timeseries(
        "Host tier used vs capacity",
        "Bytes of host memory holding offloaded KV blocks, against the configured capacity "
        "(cpu_bytes), per engine. Used climbs with new prefixes and stays at capacity once the LRU "
        "starts evicting. Both are one worker's (cpu_bytes is per worker): a tensor-parallel engine pins "
        "the capacity once per GPU, so make sure the machine has that to spare. Both start with the engine's "
        "first request after a start: its scheduler reports the tier with a step's stats, and steps run for "
        "requests only.",
        pc.queries(
            (f"sum by (instance, engine) (kvscope_host_used_bytes{sel()})", "used {{instance}} engine {{engine}}"),
            (f"sum by (instance, engine) (kvscope_host_capacity_bytes{sel()})", "capacity {{instance}} engine {{engine}}"),
        ),
        "bytes",
        width=9,
    )


def evictions():
    return pc.timeseries(
        "Evictions",
        "Host-tier entries evicted per second (least recently used first) to make room for stores, "
        "per engine. An entry is one offloaded block of one KV group (block_size tokens; the loaded "
        "and failed counters elsewhere count device blocks). Some eviction at full capacity is "
        "expected. Heavy eviction while the hit rate falls means prefixes are pushed out before "
        "they are reused: raise cpu_bytes, or accept the lower hit rate.",
        pc.queries((
            f"sum by (instance, model_name, engine) (rate(kvscope_evicted_blocks_total{sel()}{RATE}))",
            "{{model_name}} {{instance}} engine {{engine}}",
        )),
        pc.ENTRIES_PER_SECOND,
        width=9,
    )


# --- Device KV headroom --------------------------------------------------------------------

def deferred_loads():
    return pc.timeseries(
        "Loads deferred for device KV room",
        "Host-tier loads kvscope deferred per minute, per engine (kvscope_deferred_loads_total), because "
        "the device KV cache was nearly full: the loads vLLM had not yet run could, with this one, have "
        "needed more device blocks than the cache has, where vLLM (0.32 to 0.34) would stall for good. A "
        "deferred load is not lost: its request waits (vLLM asks again next step) until the loads before it "
        "have run, then loads; each load counts once however many steps it waits. A few under a burst are "
        "harmless; steady deferrals mean the prompts loaded at once often outgrow the device cache, so loads "
        "run one after another instead of together and requests wait longer for their prefix: leave device KV "
        "headroom (give vLLM more KV cache memory, e.g. a higher gpu_memory_utilization).",
        pc.queries((
            f"60 * sum by (instance, model_name, engine) (rate(kvscope_deferred_loads_total{sel()}{RATE}))",
            "{{model_name}} {{instance}} engine {{engine}}",
        )),
        pc.LOADS_PER_MINUTE,
        width=pc.HALF,
    )


def deferral_wait():
    return pc.timeseries(
        "Wait for device KV room p50 / p99",
        "Quantiles of kvscope_load_deferral_wait_seconds, per engine: how long a deferred load's request "
        "waited for device KV room, from the first lookup kvscope answered \"not yet\" to the lookup vLLM "
        "admitted it on. The request's load had not even started: it waits this long, then its load (request load "
        "latency) on top. A request aborted while it waited is observed at its end (clients give up on the "
        "longest waits). No line means no wait ended in the window. "
        "Steady waits well above an engine step or two ask for device KV headroom: a larger device KV cache "
        "(a higher gpu_memory_utilization), or fewer concurrent requests (max_num_seqs).",
        pc.quantile_queries(
            (0.5, 0.99), lambda *m: f"rate(kvscope_load_deferral_wait_seconds_bucket{sel(*m)}{RATE})",
            ("instance", "model_name", "engine"), "{p} {{model_name}} {{instance}} engine {{engine}}"),
        "s",
        width=pc.HALF,
    )


# --- Failures -------------------------------------------------------------------------------

def load_failures_stat():
    return pc.stat(
        "Load failures in range",
        "Blocks whose load from the host tier failed during the selected time range "
        "(kvscope_load_failures_total counts blocks, not requests). kvscope sets vLLM's KV load "
        "failure policy to recompute, so their tokens are recomputed (slower requests); no request "
        "fails. Should be 0: any failure fires KVScopeLoadFailures; check the vLLM log for the "
        "connector's error message.",
        pc.instant(f"round(sum(increase(kvscope_load_failures_total{sel()}[$__range])))", "failures"),
        "short",
        [(None, "green"), (1, "red")],
        sparkline=False,
    )


def load_failures_over_time():
    return pc.timeseries(
        "Load failures over time",
        "Device blocks whose host-tier load failed, per minute and engine. Correlate spikes with "
        "evictions (a block evicted between lookup and load), with restarts and with the vLLM log.",
        pc.queries((
            f"60 * sum by (instance, model_name, engine) (rate(kvscope_load_failures_total{sel()}{RATE}))",
            "{{model_name}} {{instance}} engine {{engine}}",
        )),
        pc.BLOCKS_PER_MINUTE,
        width=18,
    )


# --- Telemetry ------------------------------------------------------------------------------

def dropped_trace_records_stat():
    return pc.stat(
        "Trace records dropped in range",
        "Span records the connector made that a trace sink did not get during the selected time range "
        "(kvscope_dropped_trace_records_total; a record is one span, or one request's load with its scans "
        "and lookup): a sink failed them (an OTLP endpoint down, an unwritable trace file), the span queue "
        "was full (a sink too slow), the span export helper fell behind or died holding them, or they ended "
        "after tracing shut down. Metrics are unaffected; the traces of those requests lack spans. Fires "
        "KVScopeTracesIncomplete; the vLLM log says which cause, once.",
        pc.instant(f"round(sum(increase(kvscope_dropped_trace_records_total{sel()}[$__range])))", "records"),
        "short",
        [(None, "green"), (1, "orange")],
        sparkline=False,
    )


def dropped_trace_records_over_time():
    return pc.timeseries(
        "Trace records dropped over time",
        "Span records dropped per minute, by why (scheduler and workers together). sink_failed: a sink "
        "is down (the OTLP endpoint, the trace file's disk), fix it; queue_full: the sinks do not keep up "
        "(lower trace_sample_ratio); helper_lost: the span export helper fell behind or died (the vLLM log "
        "has its warning); after_shutdown: spans at engine shutdown, harmless; record_failed: a kvscope "
        "bug while recording (the vLLM log has its traceback): report it.",
        pc.queries((
            f"60 * sum by (reason) (rate(kvscope_dropped_trace_records_total{sel()}{RATE}))",
            "{{reason}}",
        )),
        pc.RECORDS_PER_MINUTE,
        width=18,
    )


def build():
    board = pc.dashboard(UID, TITLE, DESCRIPTION)
    board = board.with_variable(pc.datasource_variable())
    for variable in pc.engine_variables():
        board = board.with_variable(variable)
    return pc.with_panels(board, [
        pc.row("Host tier hit rate"),
        token_hit_rate_stat(), token_hit_rate_over_time(), lookup_and_hit_tokens(),
        pc.row("Why lookups missed"),
        evicted_miss_share_stat(), missed_tokens_by_reason(),
        pc.row("KV groups"),
        group_loaded_share(), group_null_skipped_share(),
        pc.row("Latency and throughput"),
        request_load_p99_stat(), request_load_latency(),
        copy_latency(), copy_throughput(),
        pc.row("Host tier capacity"),
        host_usage_stat(), host_used_vs_capacity(), evictions(),
        pc.row("Device KV headroom"),
        deferred_loads(), deferral_wait(),
        pc.row("Failures"),
        load_failures_stat(), load_failures_over_time(),
        pc.row("Telemetry"),
        dropped_trace_records_stat(), dropped_trace_records_over_time(),
    ])
