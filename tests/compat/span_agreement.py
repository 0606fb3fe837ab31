"""kvscope's spans against its own stats, for one run: telemetry that disagrees with itself is a bug.

The stats are what vLLM hands its stat loggers (`model_free.LoopStats.connector`, summed as the front end
sums them), or what its Prometheus metrics hold after a real engine's run (`prometheus_stats`); the spans what
the trace file holds once every tracing is flushed. Every span is sampled
(`trace_sample_ratio` 1.0) and none dropped, or the totals cannot agree and the first problem says so.
The replay app reads the same file (`replay_app_mismatches`): what it shows must be the same run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from connector.telemetry.metrics import copy_key, group_key
from connector.telemetry.testing import proto_span_attributes, trace_file_spans


def trace_file_attributes(path) -> list[tuple[str, dict]]:
    """Each span of the trace file at `path`: (name, attributes)."""
    return [(span.name, proto_span_attributes(span)) for span in trace_file_spans(path)]


def span_stat_mismatches(spans: Iterable[tuple[str, dict]], data: dict) -> list[str]:
    """Where the spans' attribute totals and the stats `data` (`KVScopeStats.data`) disagree; empty when they
    agree. Lookups: tokens queried and hit. Scans, group by group: blocks scanned and null blocks skipped; their
    pending blocks, the blocks loaded or failed. Copies, group by group and direction: blocks and bytes (bytes
    only, from Prometheus). Waits for device KV room: one span tells each wait the histogram observed, never
    shorter (a load span's wait runs on to the load's start)."""
    dropped = sum(data.get("dropped_trace_records", {}).values())
    if dropped:
        return [f"telemetry: {dropped} trace records dropped, spans cannot agree with the stats"]
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    waits_us = []
    for name, attrs in spans:
        if name == "kvscope.lookup":
            totals["lookup_tokens"][""] += attrs["kvscope.tokens.queried"]
            totals["hit_tokens"][""] += attrs["kvscope.tokens.hit"]
        elif name == "kvscope.group.scan":
            key = group_key(attrs["kvscope.group.index"], attrs["kvscope.group.kind"])
            totals["scan_blocks"][key] += attrs["kvscope.group.blocks.total"]
            totals["null_blocks_skipped"][key] += attrs["kvscope.group.blocks.null_skipped"]
            totals["pending_blocks"][""] += attrs["kvscope.group.blocks.pending"]
        elif name == "kvscope.group.copy":
            key = copy_key(attrs["kvscope.group.index"], attrs["kvscope.group.kind"], attrs["kvscope.copy.direction"])
            totals["copy_blocks"][key] += attrs["kvscope.copy.blocks"]
            totals["copy_bytes"][key] += attrs["kvscope.copy.bytes"]
        if "kvscope.deferred.wait_us" in attrs:
            waits_us.append(attrs["kvscope.deferred.wait_us"])
    stats = {
        "lookup_tokens": {"": data.get("lookup_tokens", 0)},
        "hit_tokens": {"": data.get("hit_tokens", 0)},
        "scan_blocks": data.get("scan_blocks", {}),
        "null_blocks_skipped": data.get("null_blocks_skipped", {}),
        "pending_blocks": {"": sum(data.get("loaded_blocks", {}).values()) + data.get("load_failures", 0)},
        "copy_blocks": data.get("copy_blocks", {}),  # None: not counted where the stats come from
        "copy_bytes": data.get("copy_bytes", {}),
    }
    problems = []
    for what, counted in stats.items():
        if counted is None:
            continue
        told = {key: n for key, n in totals[what].items() if n}
        counted = {key: n for key, n in counted.items() if n}
        if told != counted:
            problems.append(f"telemetry: {what} in the spans {dict(sorted(told.items()))}, "
                            f"in the stats {dict(sorted(counted.items()))}")
    observed, observed_s = _waits_observed(data)
    if len(waits_us) != observed:
        problems.append(f"telemetry: {len(waits_us)} spans tell a wait for device KV room, "
                        f"the histogram observed {observed}")
    elif observed_s * 1e6 > sum(waits_us) + len(waits_us):  # each span's wait is truncated to the microsecond
        problems.append(f"telemetry: the spans' waits for device KV room sum to {sum(waits_us)} µs, "
                        f"the histogram's to {observed_s * 1e6:.0f} µs")
    return problems


def _waits_observed(data: dict) -> tuple[int, float]:
    """How many waits for device KV room the histogram observed, and their sum in seconds."""
    if "load_deferral_wait_s_count" in data:  # read back from Prometheus: its count and sum only
        return int(data["load_deferral_wait_s_count"]), data["load_deferral_wait_s_sum"]
    observed = data.get("load_deferral_wait_s", [])
    return len(observed), sum(observed)


# Prometheus counters (per label set) -> the `KVScopeStats.data` key they export, and which labels key it.
_PROMETHEUS_COUNTERS = {
    "kvscope_lookup_tokens_total": ("lookup_tokens", None),
    "kvscope_hit_tokens_total": ("hit_tokens", None),
    "kvscope_load_failures_total": ("load_failures", None),
    "kvscope_scan_blocks_total": ("scan_blocks", ("group", "kind")),
    "kvscope_null_blocks_skipped_total": ("null_blocks_skipped", ("group", "kind")),
    "kvscope_loaded_blocks_total": ("loaded_blocks", ("group", "kind")),
    "kvscope_dropped_trace_records_total": ("dropped_trace_records", ("reason",)),
}


def prometheus_stats(registry=None) -> dict:
    """kvscope's stats as `span_stat_mismatches` reads them, from the Prometheus metrics vLLM's stat loggers
    fed (a real engine in this process; every engine's label values summed). No metric counts copied blocks
    (`copy_blocks` None); bytes are counted by direction (`kvscope_load_bytes_total`, `kvscope_store_bytes_total`);
    the wait histogram keeps its count and sum only."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    data: dict = {"copy_blocks": None, "copy_bytes": defaultdict(int)}
    for metric in registry.collect():
        for sample in metric.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name in _PROMETHEUS_COUNTERS:
                key, keyed_by = _PROMETHEUS_COUNTERS[name]
                if keyed_by is None:
                    data[key] = data.get(key, 0) + int(value)
                else:
                    sub = data.setdefault(key, defaultdict(int))
                    sub["|".join(labels[label] for label in keyed_by)] += int(value)
            elif name in ("kvscope_load_bytes_total", "kvscope_store_bytes_total"):
                direction = name.split("_")[1]
                data["copy_bytes"][copy_key(labels["group"], labels["kind"], direction)] += int(value)
            elif name in ("kvscope_load_deferral_wait_seconds_count", "kvscope_load_deferral_wait_seconds_sum"):
                key = "load_deferral_wait_s_" + name.rsplit("_", 1)[1]
                data[key] = data.get(key, 0) + value
    return data


def replay_app_mismatches(path, data: dict) -> list[str]:
    """Where the replay app, reading the trace file at `path`, shows another run than the stats `data` count:
    problems reading it, requests' tokens queried and hit, loads without a copy span."""
    from dashboard import traces

    read = traces.read_trace_files([path])
    problems = [f"replay app: {problem}" for problem in read.problems[:5]]
    requests = traces.requests_table(read.spans)
    for column, key in (("tokens_queried", "lookup_tokens"), ("tokens_hit", "hit_tokens")):
        shown, counted = int(requests[column].sum()), data.get(key, 0)
        if shown != counted:
            problems.append(f"replay app: {column} sum to {shown}, the stats count {key} {counted}")
    uncopied = int(requests["loads_without_copies"].sum())
    if uncopied:
        problems.append(f"replay app: {uncopied} loads without a copy span")
    return problems
