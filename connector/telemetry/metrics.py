"""Metrics: the stats payload that travels through vLLM, and its Prometheus metrics.

Path (vLLM's own): the scheduler-side and worker-side connectors each fill a ``KVScopeStats``
and hand it over in ``get_kv_connector_stats()``; vLLM aggregates the workers' and the
scheduler's payloads (``aggregate``), ships ``stats.data`` to the front-end process, logs
``reduce()`` and calls ``KVScopePromMetrics.observe(data, engine_idx)`` on the metrics that
``build_prom_metrics`` registered with vLLM's metric classes and engine labels.

``KVScopeStats.data`` is plain data with string keys only (it is pickled between workers and the
scheduler and msgpack-encoded by vLLM towards the front end)::

    {
      "lookup_tokens": int, "hit_tokens": int,                # counters
      "missed_tokens":       {"<reason>": int, ...},          # counters per miss reason
      "evicted_blocks": int, "load_failures": int, "deferred_loads": int,
      "dropped_trace_records": {"<reason>": int, ...},  # counters per loss reason
      "scan_blocks":         {"<group>|<kind>": int, ...},    # counters per group
      "null_blocks_skipped": {"<group>|<kind>": int, ...},
      "loaded_blocks":       {"<group>|<kind>": int, ...},
      "load_bytes":          {"<group>|<kind>": int, ...},
      "store_bytes":         {"<group>|<kind>": int, ...},
      "copy_blocks":         {"<group>|<kind>|<direction>": int, ...},   # not exported: summed over workers
      "copy_bytes":          {"<group>|<kind>|<direction>": int, ...},   # not exported: summed over workers
      "scan_duration_s":     {"<group>|<kind>": [float, ...]},           # observations
      "copy_duration_s":     {"<group>|<kind>|<direction>": [float, ...]},
      "request_load_duration_s": [float, ...],
      "load_deferral_wait_s": [float, ...],
      "host_used_bytes": int, "host_capacity_bytes": int,     # gauges
      "host_engine": int,                                     # the engine whose tier the gauges describe
      "host_usage_by_engine": {"<engine>": [used, capacity]}, # only where engines' payloads were aggregated
    }

Keys appear when first recorded, except the per-group series: the scheduler's first payload names
every group, kind and direction with zeros (`declare_groups`), so each series exists from the start
and ``rate()`` sees its first increase after a restart. Not quite on the CPU backend: its copies end
within the step, and vLLM merges the workers' first payload with the scheduler's, so the store bytes
and store copy of the engine's first step arrive with the zeros and are lost to ``rate()`` (on CUDA
the copies end after the step and arrive later). Aggregation sums counters, concatenates
observations and keeps the *latest* gauge value (the payload aggregated in, ``other``, is the newer one in vLLM's order;
only the host tier's owner reports the gauges, so there is nothing to combine), per engine: vLLM's aggregated
log of several data-parallel engines (``--aggregate-engine-logging``) aggregates every engine's payloads into
one, and each engine has a tier of its own, so ``reduce`` sums the latest values of the engines that reported
in the log's interval (an engine idle all interval sends nothing) and says how many they were.

Which call feeds which contract metric (each metric has exactly one source):

=================================  =============================================================
``record_lookup``                  ``kvscope_lookup_tokens_total``, ``kvscope_hit_tokens_total``
``record_missed``                  ``kvscope_missed_tokens_total`` (per reason: they add up to lookup - hit)
``record_scans``                   ``kvscope_scan_blocks_total``, ``kvscope_null_blocks_skipped_total``,
                                   ``kvscope_scan_duration_seconds``
``record_loaded_blocks``           ``kvscope_loaded_blocks_total`` (scheduler: blocks a load brought)
``record_copy``                    ``kvscope_copy_duration_seconds``, ``kvscope_load_bytes_total`` /
                                   ``kvscope_store_bytes_total`` by direction (workers: bytes moved)
``record_request_load``            ``kvscope_request_load_duration_seconds``
``record_evictions``               ``kvscope_evicted_blocks_total``
``record_load_failures``           ``kvscope_load_failures_total``
``record_deferred_loads``          ``kvscope_deferred_loads_total`` (scheduler: loads deferred for device KV room)
``record_deferral_wait``           ``kvscope_load_deferral_wait_seconds`` (scheduler: how long a deferred load waited)
``set_host_usage``                 ``kvscope_host_used_bytes``, ``kvscope_host_capacity_bytes``
``record_dropped_trace_records``    ``kvscope_dropped_trace_records_total`` (scheduler and workers: each its own)
=================================  =============================================================

Workers' payloads are summed: with tensor parallelism, count blocks where each block is counted
once (the scheduler), and bytes where they are moved (each worker moves its shard).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from connector.miss_reasons import MISS_REASONS, miss_reasons_explained
from connector.telemetry.span_batcher import LOSS_REASONS
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

logger = logging.getLogger(__name__)

GROUP_KINDS = ("full_attention", "sliding_window", "mamba")
DIRECTIONS = ("load", "store")

# Scans take microseconds: 1 µs .. 10 ms.
SCAN_BUCKETS_S = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
# Copies take milliseconds: 0.1 ms .. 2.5 s.
COPY_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
# A request's whole load: 0.1 ms .. 10 s.
REQUEST_LOAD_BUCKETS_S = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# A deferred load waits whole engine steps: a few ms to seconds
DEFERRAL_WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# data keys, by how they aggregate
_COUNTERS = ("lookup_tokens", "hit_tokens", "evicted_blocks", "load_failures", "deferred_loads")
_GROUP_COUNTERS = ("scan_blocks", "null_blocks_skipped", "loaded_blocks", "load_bytes", "store_bytes")
_COPY_COUNTERS = ("copy_blocks", "copy_bytes")
_GROUP_OBSERVATIONS = ("scan_duration_s",)
_COPY_OBSERVATIONS = ("copy_duration_s",)
_OBSERVATIONS = ("request_load_duration_s", "load_deferral_wait_s")
_GAUGES = ("host_used_bytes", "host_capacity_bytes", "host_engine")
_KEYED_COUNTERS = _GROUP_COUNTERS + _COPY_COUNTERS + ("missed_tokens", "dropped_trace_records")
_KEYED_OBSERVATIONS = _GROUP_OBSERVATIONS + _COPY_OBSERVATIONS


def group_key(group: int, kind: str) -> str:
    return f"{int(group)}|{kind}"


def copy_key(group: int, kind: str, direction: str) -> str:
    return f"{int(group)}|{kind}|{direction}"


@dataclass
class KVScopeStats(KVConnectorStats):
    """Counters and observations of one interval; see the module docstring for ``data``."""

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None) -> KVScopeStats:
        """For ``build_kv_connector_stats(data)``: wraps (does not copy) a payload."""
        return cls(data=data if isinstance(data, dict) else dict(data or {}))

    # ------------------------------------------------------------------ recording
    def declare_groups(self, groups: list[tuple[int, str]]) -> None:
        """Zero entries for every per-group series of these ``(group, kind)`` pairs, load and store
        alike: the metrics create a series when its key first arrives, and one created at its first
        value loses that value to ``rate()`` and ``increase()`` (and a board listing groups would miss
        a group not loaded yet)."""
        data = self.data
        for group, kind in groups:
            key = group_key(group, kind)
            for counter in _GROUP_COUNTERS:
                data.setdefault(counter, {}).setdefault(key, 0)
            for observations in _GROUP_OBSERVATIONS:
                data.setdefault(observations, {}).setdefault(key, [])
            for observations in _COPY_OBSERVATIONS:
                for direction in DIRECTIONS:
                    data.setdefault(observations, {}).setdefault(copy_key(group, kind, direction), [])

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """One lookup against the host tier; ``hit_tokens`` is clamped to ``0..queried_tokens``."""
        queried = max(0, int(queried_tokens))
        hit = min(max(0, int(hit_tokens)), queried)
        self._inc("lookup_tokens", queried)
        self._inc("hit_tokens", hit)

    def record_missed(self, reason: str, tokens: int) -> None:
        """Looked-up tokens the host tier did not serve, for one reason (`connector.miss_reasons`)."""
        self._inc_keyed("missed_tokens", reason, tokens)

    def record_scans(
        self, group: int, kind: str, blocks_total: int, null_skipped: int, durations_s: list[float]
    ) -> None:
        """One group's scans while planning loads: blocks scanned and null blocks skipped by them all,
        and each scan's duration."""
        key = group_key(group, kind)
        self._inc_keyed("scan_blocks", key, blocks_total)
        self._inc_keyed("null_blocks_skipped", key, null_skipped)
        for duration_s in durations_s:
            self._observe_keyed("scan_duration_s", key, duration_s)

    def record_loaded_blocks(self, group: int, kind: str, blocks: int) -> None:
        """Device blocks of one group a request received from the host tier (its load succeeded on
        every worker). Their bytes are counted by each worker's `record_copy`."""
        self._inc_keyed("loaded_blocks", group_key(group, kind), blocks)

    def record_copy(
        self, group: int, kind: str, direction: str, blocks: int, nbytes: int, duration_s: float | None
    ) -> None:
        """One copy of one group: ``direction`` is ``load`` (host->device) or ``store``; ``duration_s``
        None when its interval could not be measured (counted, not timed)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"copy direction {direction!r} is invalid: accepted are {DIRECTIONS}")
        key = copy_key(group, kind, direction)
        self._inc_keyed("copy_blocks", key, blocks)
        self._inc_keyed("copy_bytes", key, nbytes)
        if duration_s is not None:
            self._observe_keyed("copy_duration_s", key, duration_s)
        # Bytes where they move: a copy that ran counts, even when another worker's part of the
        # same load failed (so these totals equal the copy spans' bytes, but for copies whose interval
        # could not be measured: counted here, with no span and no duration; logged).
        self._inc_keyed(f"{direction}_bytes", group_key(group, kind), nbytes)

    def record_request_load(self, duration_s: float) -> None:
        """One request's whole load, from planning to the scheduler hearing every worker's copies done."""
        value = float(duration_s)
        if value >= 0:
            self.data.setdefault("request_load_duration_s", []).append(value)

    def record_evictions(self, n: int) -> None:
        self._inc("evicted_blocks", n)

    def record_load_failures(self, n: int) -> None:
        self._inc("load_failures", n)

    def record_deferred_loads(self, n: int) -> None:
        """Loads deferred for device KV room (`load_admission`), each load once however long it waits."""
        self._inc("deferred_loads", n)

    def record_deferral_wait(self, wait_s: float) -> None:
        """How long a deferred load's request waited for device KV room: from the first lookup answered
        "not yet" to the lookup vLLM admitted it on, or to its end (aborted while it waited)."""
        value = float(wait_s)
        if value >= 0:
            self.data.setdefault("load_deferral_wait_s", []).append(value)

    def record_dropped_trace_records(self, reason: str, n: int) -> None:
        """Span records this process made that a sink will not get, for one reason
        (`KVScopeTracing.take_lost_records`, `span_batcher.LOSS_REASONS`)."""
        self._inc_keyed("dropped_trace_records", reason, n)

    def set_host_usage(self, used_bytes: int, capacity_bytes: int, engine: int = 0) -> None:
        """Host tier occupancy (gauges) of data-parallel engine ``engine``'s tier. Set it when it changed: a
        set gauge makes the stats non-empty."""
        self.data["host_used_bytes"] = int(used_bytes)
        self.data["host_capacity_bytes"] = int(capacity_bytes)
        self.data["host_engine"] = int(engine)

    # ------------------------------------------------------------------ KVConnectorStats API
    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def take(self) -> KVScopeStats | None:
        """The interval's stats (a new object) and a reset of this one; None when empty.

        What ``get_kv_connector_stats()`` returns.
        """
        if self.is_empty():
            return None
        taken = KVScopeStats(data=self.data)
        self.data = {}
        return taken

    def aggregate(self, other: KVConnectorStats) -> KVScopeStats:
        """Add ``other`` into ``self`` (returned): sums, concatenations, latest gauges."""
        if other is None or other.is_empty():
            return self
        data = self.data
        self._keep_host_usage_by_engine(other.data)
        for key, value in other.data.items():
            if key in _COUNTERS:
                data[key] = data.get(key, 0) + value
            elif key in _KEYED_COUNTERS:
                mine = data.setdefault(key, {})
                for sub, count in value.items():
                    mine[sub] = mine.get(sub, 0) + count
            elif key in _KEYED_OBSERVATIONS:
                mine = data.setdefault(key, {})
                for sub, values in value.items():
                    mine.setdefault(sub, []).extend(values)
            elif key in _OBSERVATIONS:
                data.setdefault(key, []).extend(value)
            elif key in _GAUGES:
                data[key] = value
            elif key == "host_usage_by_engine":
                pass  # merged above
            # Unknown keys (a newer or older payload) are dropped rather than failing the engine.
        return self

    def _keep_host_usage_by_engine(self, newer: Mapping[str, Any]) -> None:
        """Before ``newer``'s gauges replace these: where the two payloads' tiers are another engine's (or
        engines' were aggregated before), each engine's latest usage, for ``reduce`` to sum."""
        data = self.data
        by_engine = data.get("host_usage_by_engine")
        newer_by_engine = newer.get("host_usage_by_engine")
        if "host_used_bytes" not in newer and newer_by_engine is None:
            return
        if by_engine is None:
            if newer_by_engine is None and (
                    "host_used_bytes" not in data or data.get("host_engine", 0) == newer.get("host_engine", 0)):
                return  # one engine: the latest gauge is the whole story
            by_engine = data["host_usage_by_engine"] = {}
            if "host_used_bytes" in data:
                by_engine[str(data.get("host_engine", 0))] = [data["host_used_bytes"],
                                                              data.get("host_capacity_bytes", 0)]
        if newer_by_engine is not None:
            by_engine.update(newer_by_engine)
        if "host_used_bytes" in newer:
            by_engine[str(newer.get("host_engine", 0))] = [newer["host_used_bytes"],
                                                           newer.get("host_capacity_bytes", 0)]

    def reduce(self) -> dict[str, int | float]:
        """Summary for vLLM's periodic "KV Transfer metrics" log line."""
        d = self.data
        out: dict[str, int | float] = {}
        lookup = d.get("lookup_tokens", 0)
        if "lookup_tokens" in d or "hit_tokens" in d:
            hit = d.get("hit_tokens", 0)
            out["lookup_tokens"] = lookup
            out["hit_tokens"] = hit
            out["hit_rate"] = round(hit / lookup, 4) if lookup else 0.0
        for reason, tokens in sorted(d.get("missed_tokens", {}).items()):
            out[f"missed_tokens_{reason}"] = tokens
        if "loaded_blocks" in d:
            out["loaded_blocks"] = sum(d["loaded_blocks"].values())
        if "load_bytes" in d:
            out["loaded_gb"] = _gb(sum(d["load_bytes"].values()))
        if "store_bytes" in d:
            out["stored_gb"] = _gb(sum(d["store_bytes"].values()))
        if "scan_duration_s" in d:
            scans = [v for values in d["scan_duration_s"].values() for v in values]
            if scans:
                out["scan_us_mean"] = round(1e6 * sum(scans) / len(scans), 3)
        for direction in DIRECTIONS:
            durations = [
                v
                for key, values in d.get("copy_duration_s", {}).items()
                if key.rsplit("|", 1)[-1] == direction
                for v in values
            ]
            if durations:
                out[f"{direction}_copies"] = len(durations)
                out[f"{direction}_copy_ms_mean"] = round(1e3 * sum(durations) / len(durations), 4)
        loads = d.get("request_load_duration_s")
        if loads:
            out["request_loads"] = len(loads)
            out["request_load_ms_mean"] = round(1e3 * sum(loads) / len(loads), 4)
        waits = d.get("load_deferral_wait_s")
        if waits:
            out["deferral_wait_ms_mean"] = round(1e3 * sum(waits) / len(waits), 4)
        for reason, records in sorted(d.get("dropped_trace_records", {}).items()):
            out[f"dropped_trace_records_{reason}"] = records
        for key in ("evicted_blocks", "load_failures", "deferred_loads"):
            if key in d:
                out[key] = d[key]
        by_engine = d.get("host_usage_by_engine")
        if by_engine:  # several engines' tiers: each engine's latest, summed
            out["host_used_gb"] = _gb(sum(used for used, _ in by_engine.values()))
            out["host_capacity_gb"] = _gb(sum(capacity for _, capacity in by_engine.values()))
            out["host_engines"] = len(by_engine)
        elif "host_used_bytes" in d:
            out["host_used_gb"] = _gb(d["host_used_bytes"])
            out["host_capacity_gb"] = _gb(d.get("host_capacity_bytes", 0))
            # how many engines' tiers the figures cover: an aggregated log of several engines where only one
            # stepped in the interval (an idle engine sends nothing) reads 1, not their number
            out["host_engines"] = 1
        return out

    # ------------------------------------------------------------------ internals
    def _inc(self, key: str, n: int) -> None:
        n = int(n)
        if n > 0:
            self.data[key] = self.data.get(key, 0) + n

    def _inc_keyed(self, key: str, sub: str, n: int) -> None:
        n = int(n)
        if n > 0:
            counts = self.data.setdefault(key, {})
            counts[sub] = counts.get(sub, 0) + n

    def _observe_keyed(self, key: str, sub: str, value: float) -> None:
        value = float(value)
        if value >= 0:
            self.data.setdefault(key, {}).setdefault(sub, []).append(value)


def _gb(nbytes: int | float) -> float:
    return float(f"{nbytes / 1e9:.4g}")  # 4 significant digits: readable for KB and TB alike


# ====================================================================== Prometheus
@dataclass(frozen=True)
class MetricSpec:
    """One contract metric: its exposed name, the payload key feeding it and its own labels."""

    name: str
    kind: type  # prometheus_client Counter / Gauge / Histogram
    data_key: str
    labels: tuple[str, ...]
    documentation: str
    buckets: tuple[float, ...] | None = None
    reasons: tuple[str, ...] = ()  # the values of its `reason` label: every series exists from the start


_GK = ("group", "kind")
_GKD = ("group", "kind", "direction")
# What a span record is, in the words of the metric that counts them (`span_records`).
RECORD_DEF = ("A record is one span (a lookup, a store, a copy), or one request's load with its per-group "
              "scans and its lookup.")

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("kvscope_lookup_tokens_total", Counter, "lookup_tokens", (),
               "Prompt tokens looked up in the kvscope host tier: past vLLM's device prefix-cache hit, as vLLM "
               "counts its external prefix-cache queries."),
    MetricSpec("kvscope_hit_tokens_total", Counter, "hit_tokens", (),
               "Looked-up tokens found in the kvscope host tier (never more than the looked-up tokens)."),
    MetricSpec("kvscope_missed_tokens_total", Counter, "missed_tokens", ("reason",),
               "Looked-up tokens the kvscope host tier did not serve, by why their offloaded block was missing: "
               f"{miss_reasons_explained()}. Each offloaded block past the hit counts under its own reason. Adds "
               "up to lookup minus hit tokens.", reasons=MISS_REASONS),
    MetricSpec("kvscope_scan_blocks_total", Counter, "scan_blocks", _GK,
               "Blocks scanned while planning loads, per KV cache group."),
    MetricSpec("kvscope_null_blocks_skipped_total", Counter, "null_blocks_skipped", _GK,
               "Null blocks (outside a sliding window, or mamba state) skipped by the load plan, per group."),
    MetricSpec("kvscope_loaded_blocks_total", Counter, "loaded_blocks", _GK,
               "Device blocks loaded from the host tier into device KV cache, per group; a load that failed on "
               "any worker counts its blocks in kvscope_load_failures_total instead."),
    MetricSpec("kvscope_load_bytes_total", Counter, "load_bytes", _GK,
               "Bytes copied from the host tier into device KV cache, per group, summed over the engine's "
               "workers (each copies its own share); also a worker's copies of a load that failed on another "
               "worker (its blocks count in kvscope_load_failures_total, not kvscope_loaded_blocks_total)."),
    MetricSpec("kvscope_store_bytes_total", Counter, "store_bytes", _GK,
               "Bytes copied from device KV cache into the host tier, per group, summed over the engine's "
               "workers (each copies its own share); also stores dropped afterwards (a failed copy, a reset)."),
    MetricSpec("kvscope_scan_duration_seconds", Histogram, "scan_duration_s", _GK,
               "Time to scan one group while planning a load.", SCAN_BUCKETS_S),
    MetricSpec("kvscope_copy_duration_seconds", Histogram, "copy_duration_s", _GKD,
               "Measured duration of one group's copy between device and host tier, one observation per "
               "worker.", COPY_BUCKETS_S),
    MetricSpec("kvscope_request_load_duration_seconds", Histogram, "request_load_duration_s", (),
               "Time from planning a request's load to the scheduler hearing that every worker's copies are done "
               "(reported at the end of an engine step, so it includes that step's time); failed loads and loads of "
               "aborted requests are not timed.", REQUEST_LOAD_BUCKETS_S),
    MetricSpec("kvscope_evicted_blocks_total", Counter, "evicted_blocks", (),
               "Host-tier entries evicted (LRU) to make room; an entry is one offloaded block (block_size tokens) "
               "of one group."),
    MetricSpec("kvscope_load_failures_total", Counter, "load_failures", (),
               "Device blocks whose load from the host tier failed (recomputed instead)."),
    MetricSpec("kvscope_deferred_loads_total", Counter, "deferred_loads", (),
               "Loads from the host tier deferred for device KV room: the device KV cache was nearly full, and "
               "the loads vLLM had not yet run could, with this one, need more device blocks than the cache has, "
               "where vLLM would stall. The load waits (vLLM asks again next step) until the loads before it have "
               "run; it is not lost. Each load is counted once, however many steps it waits."),
    MetricSpec("kvscope_load_deferral_wait_seconds", Histogram, "load_deferral_wait_s", (),
               "How long a deferred load's request waited for device KV room (see kvscope_deferred_loads_total): "
               "from the first lookup kvscope answered 'not yet' to the lookup vLLM admitted the request on, "
               "or to the request's end where it was aborted while it waited.", DEFERRAL_WAIT_BUCKETS_S),
    MetricSpec("kvscope_dropped_trace_records_total", Counter, "dropped_trace_records", ("reason",),
               "Span records the connector made that a trace sink did not get, so traces lack their spans, by "
               "why: sink_failed (a sink failed to take them: an OTLP endpoint down, an unwritable trace file; "
               "once however many sinks failed), queue_full (its span queue was full), helper_lost (its span "
               "export helper fell behind or died holding them), after_shutdown (they ended after tracing shut "
               "down), record_failed (a fault while recording them: a bug). The engine log says more, once. "
               f"{RECORD_DEF} Summed over the scheduler and the workers.",
               reasons=LOSS_REASONS),
    MetricSpec("kvscope_host_used_bytes", Gauge, "host_used_bytes", (),
               "Bytes of one worker's host tier holding KV blocks (every worker holds the same blocks, "
               "its own share of each)."),
    MetricSpec("kvscope_host_capacity_bytes", Gauge, "host_capacity_bytes", (),
               "Capacity of one worker's host tier in bytes: its slots times the slot size "
               "(cpu_bytes, which is per worker, rounded down to whole slots)."),
)
METRIC_NAMES = tuple(spec.name for spec in METRICS)


class KVScopePromMetrics(KVConnectorPromMetrics):
    """Registers the contract metrics with vLLM's metric classes and applies stats payloads.

    Label names are vLLM's (``model_name``, ``engine``) followed by the metric's own.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        if metric_types.get(Counter) is Counter:
            # Plain prometheus_client classes register in the global REGISTRY; vLLM drops its own
            # collectors before re-registering (unregister_vllm_metrics), we drop ours likewise so
            # a second engine in one process does not fail with "Duplicated timeseries".
            unregister_kvscope_metrics(REGISTRY)
        classes = {Counter: self._counter_cls, Gauge: self._gauge_cls, Histogram: self._histogram_cls}
        self._specs: dict[str, MetricSpec] = {spec.data_key: spec for spec in METRICS}
        self._metrics: dict[str, Any] = {}
        for spec in METRICS:
            kwargs: dict[str, Any] = {
                "name": spec.name,
                "documentation": spec.documentation,
                "labelnames": list(self._labelnames) + list(spec.labels),
            }
            if spec.kind is Histogram:
                kwargs["buckets"] = list(spec.buckets or ())
            if spec.kind is Gauge:
                kwargs["multiprocess_mode"] = "mostrecent"
            self._metrics[spec.data_key] = classes[spec.kind](**kwargs)
        # (engine_idx, data_key, own label values) -> child
        self._children: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        # Unlabelled series, and the missed tokens of every reason, exist from the start (at zero) so
        # rate() and dashboards see them (the evicted share is 0 before any eviction, not absent).
        for engine_idx in self.per_engine_labelvalues:
            for spec in METRICS:
                if not spec.labels and spec.kind is not Gauge:
                    self._child(engine_idx, spec.data_key, ())
                for reason in spec.reasons:
                    self._child(engine_idx, spec.data_key, (reason,))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Apply one ``KVScopeStats.data`` payload to the metrics of engine ``engine_idx``."""
        for key, value in transfer_stats_data.items():
            spec = self._specs.get(key)
            if spec is None:
                continue  # internal (copy_blocks/bytes) or unknown keys
            if spec.labels:
                for sub, sub_value in value.items():
                    own = tuple(sub.split("|"))
                    if len(own) != len(spec.labels):
                        continue
                    self._apply(spec, self._child(engine_idx, key, own), sub_value)
            else:
                self._apply(spec, self._child(engine_idx, key, ()), value)

    def _child(self, engine_idx: int, key: str, own: tuple[str, ...]) -> Any:
        cache_key = (engine_idx, key, own)
        child = self._children.get(cache_key)
        if child is None:
            values = [*self.per_engine_labelvalues[engine_idx], *own]
            metric = self._metrics[key]
            child = metric.labels(*values) if values else metric
            self._children[cache_key] = child
        return child

    @staticmethod
    def _apply(spec: MetricSpec, child: Any, value: Any) -> None:
        if spec.kind is Counter:
            if value > 0:
                child.inc(value)
        elif spec.kind is Histogram:
            for observation in value:
                child.observe(observation)
        else:
            child.set(value)


def unregister_kvscope_metrics(registry: CollectorRegistry = REGISTRY) -> None:
    """Drop kvscope collectors from ``registry`` (as vLLM's ``unregister_vllm_metrics`` does for its own)."""
    for collector in list(registry._collector_to_names):
        if getattr(collector, "_name", "").startswith("kvscope_"):
            registry.unregister(collector)


# ====================================================================== offline scraping
_servers: dict[tuple[str, int], Any] = {}
_servers_lock = threading.Lock()


def serve_metrics_port(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> int:
    """Serve Prometheus metrics of this process on ``http://addr:port/metrics``; returns the bound port.

    For offline ``vllm.LLM`` runs, which have no API server: call it in the process that created
    the ``LLM`` (the front end, where vLLM's ``PrometheusStatLogger`` and ``KVScopePromMetrics``
    live); the registry served holds vLLM's metrics and kvscope's. Idempotent per process: a
    repeated call with the same ``addr``/``port`` returns the running server's port (``port=0``
    binds a free port once). The default registry is vLLM's (multiprocess-aware when
    ``PROMETHEUS_MULTIPROC_DIR`` is set). Binds to loopback by default; pass ``addr="0.0.0.0"`` to
    expose it.
    """
    from prometheus_client import start_http_server

    with _servers_lock:
        server = _servers.get((addr, port))
        if server is None:
            if registry is None:
                from vllm.v1.metrics.prometheus import get_prometheus_registry

                registry = get_prometheus_registry()
            server, _thread = start_http_server(port, addr=addr, registry=registry)
            _servers[(addr, port)] = server
            logger.info("kvscope: serving Prometheus metrics on http://%s:%d/metrics", addr, server.server_port)
        return server.server_port
