"""A stand-in for vLLM's /metrics: every kvscope contract metric with realistic, growing values.

Served by prometheus_client from a fresh CollectorRegistry on 127.0.0.1 (port chosen by the OS),
so the boards and rules can be checked against a real Prometheus without a vLLM engine. The
rates and durations are fixed (see RATES / GROUPS) so tests can also check what the queries compute:
every observation of a histogram series falls in one bucket, where `histogram_quantile(q)` is
exact (`bucket_quantile`), so p50, p95 and p99 differ and each names its quantile.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

from connector.telemetry.metrics import (COPY_BUCKETS_S, DEFERRAL_WAIT_BUCKETS_S, REQUEST_LOAD_BUCKETS_S,
                                        SCAN_BUCKETS_S)
from connector.telemetry.span_batcher import LOSS_REASONS

from . import contract

MODEL_NAME = "synthetic-model"
ENGINE = "0"

# The connector's own buckets: microseconds for scans, milliseconds for copies.
SCAN_BUCKETS, COPY_BUCKETS, REQUEST_LOAD_BUCKETS = SCAN_BUCKETS_S, COPY_BUCKETS_S, REQUEST_LOAD_BUCKETS_S
DEFERRAL_WAIT_BUCKETS = DEFERRAL_WAIT_BUCKETS_S  # a wait lasts engine steps, from milliseconds to seconds

# Per-second rates of the engine-wide counters.
RATES = {
    "lookup_tokens": 2000.0,
    "hit_tokens": 1200.0,  # token hit rate 0.6
    "evicted_blocks": 5.0,
    "load_failures": 0.2,
    "deferred_loads": 0.1,  # loads waiting for device KV room now and then
}
# Span records lost per second by reason: one sink fails (KVScopeTracesIncomplete fires), the rest is healthy.
DROPPED_RATES = {"sink_failed": 0.5}
HOST_CAPACITY_BYTES = 8 * 2**30
# Per-second missed tokens by reason: they add up to lookup minus hit tokens, as the connector's do.
MISSED_RATES = {"new": 600.0, "evicted": 100.0, "storing": 20.0, "dropped": 2.0, "reset": 0.0, "no_state": 0.0,
                "other_blocks": 8.0, "load_failed": 0.0, "tail": 70.0}


@dataclass(frozen=True)
class SyntheticGroup:
    index: str
    kind: str
    scan_blocks: float  # per second
    null_skipped: float
    loaded: float
    stored: float
    block_bytes: int
    scan_s: float  # the duration of every scan, and of every copy by direction
    copy_s: dict[str, float]


# A hybrid model: a sliding-window group that skips most of its blocks, a full-attention one. Each
# group's scans and each direction's copies take their own time, in a bucket of their own.
GROUPS = (
    SyntheticGroup("0", "sliding_window", scan_blocks=40, null_skipped=28, loaded=12, stored=20, block_bytes=256 * 1024,
                   scan_s=30e-6, copy_s={"load": 3e-3, "store": 1.5e-3}),
    SyntheticGroup("1", "full_attention", scan_blocks=40, null_skipped=0, loaded=40, stored=20, block_bytes=512 * 1024,
                   scan_s=70e-6, copy_s={"load": 7e-3, "store": 0.4e-3}),
)
REQUEST_LOAD_S = 0.02
DEFERRAL_WAIT_S = 0.15  # each deferred load waits a few engine steps for device KV room, then is admitted
OBSERVATIONS_PER_S = 10.0  # of each histogram series: one scan per group, one copy per group and direction
HOST_USED_FRACTION = 0.9  # the host tier fills up to this share of its capacity and stays there


def bucket_quantile(q: float, observed: float, buckets: tuple[float, ...]) -> float:
    """What `histogram_quantile(q)` gives for a histogram whose every observation is `observed`: the
    linear interpolation inside its bucket (from 0 in the first bucket)."""
    i = bisect.bisect_left(buckets, observed)
    lower = buckets[i - 1] if i else 0.0
    return lower + (buckets[i] - lower) * q


class SyntheticKVScopeExporter:
    """Serves the metrics and advances them every `tick_s` seconds from a background thread, by the time
    that really passed: a busy machine delays ticks, not the rates."""

    def __init__(self, tick_s: float = 0.1) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._build_metrics()
        self._ticker: threading.Thread | None = None
        self._httpd = None
        self._http_thread: threading.Thread | None = None

    # --- metrics ---------------------------------------------------------------------------

    def _build_metrics(self) -> None:
        eng = list(contract.ENGINE_LABELS)
        reg = self.registry

        def counter(name: str) -> Counter:
            labels = eng + list(contract.COUNTERS[name])
            return Counter(name, f"synthetic {name}", labels, registry=reg)

        def histogram(name: str, buckets: tuple[float, ...]) -> Histogram:
            labels = eng + list(contract.HISTOGRAMS[name])
            return Histogram(name, f"synthetic {name}", labels, buckets=buckets, registry=reg)

        self.counters = {name: counter(name) for name in contract.COUNTERS}
        self.scan_duration = histogram("kvscope_scan_duration_seconds", SCAN_BUCKETS)
        self.copy_duration = histogram("kvscope_copy_duration_seconds", COPY_BUCKETS)
        self.request_load_duration = histogram("kvscope_request_load_duration_seconds", REQUEST_LOAD_BUCKETS)
        self.deferral_wait = histogram("kvscope_load_deferral_wait_seconds", DEFERRAL_WAIT_BUCKETS)
        self.gauges = {
            name: Gauge(name, f"synthetic {name}", eng + list(labels), registry=reg)
            for name, labels in contract.GAUGES.items()
        }
        missing = contract.all_metrics() - set(self.counters) - set(self.gauges) - {
            "kvscope_scan_duration_seconds", "kvscope_copy_duration_seconds", "kvscope_request_load_duration_seconds",
            "kvscope_load_deferral_wait_seconds",
        }
        assert not missing, f"synthetic exporter lacks contract metrics {missing}"
        self._used_bytes = 0.0
        self._observations_due = 0.0
        self._admissions_due = 0.0
        self.gauges["kvscope_host_capacity_bytes"].labels(MODEL_NAME, ENGINE).set(HOST_CAPACITY_BYTES)
        self.step(0.0)  # create every labelled child, so every series exists from the first scrape

    def step(self, dt: float) -> None:
        """Advance all metrics by `dt` seconds of synthetic traffic."""
        e = (MODEL_NAME, ENGINE)
        with self._lock:
            c = self.counters
            c["kvscope_lookup_tokens_total"].labels(*e).inc(RATES["lookup_tokens"] * dt)
            c["kvscope_hit_tokens_total"].labels(*e).inc(RATES["hit_tokens"] * dt)
            c["kvscope_evicted_blocks_total"].labels(*e).inc(RATES["evicted_blocks"] * dt)
            c["kvscope_load_failures_total"].labels(*e).inc(RATES["load_failures"] * dt)
            c["kvscope_deferred_loads_total"].labels(*e).inc(RATES["deferred_loads"] * dt)
            for reason in LOSS_REASONS:
                c["kvscope_dropped_trace_records_total"].labels(*e, reason).inc(DROPPED_RATES.get(reason, 0.0) * dt)
            for reason, rate in MISSED_RATES.items():
                c["kvscope_missed_tokens_total"].labels(*e, reason).inc(rate * dt)
            self._observations_due += OBSERVATIONS_PER_S * dt
            observations = int(self._observations_due)
            self._observations_due -= observations
            for g in GROUPS:
                gl = (*e, g.index, g.kind)
                c["kvscope_scan_blocks_total"].labels(*gl).inc(g.scan_blocks * dt)
                c["kvscope_null_blocks_skipped_total"].labels(*gl).inc(g.null_skipped * dt)
                c["kvscope_loaded_blocks_total"].labels(*gl).inc(g.loaded * dt)
                c["kvscope_load_bytes_total"].labels(*gl).inc(g.loaded * g.block_bytes * dt)
                c["kvscope_store_bytes_total"].labels(*gl).inc(g.stored * g.block_bytes * dt)
                for _ in range(observations):
                    self.scan_duration.labels(*gl).observe(g.scan_s)
                    for direction in contract.DIRECTIONS:
                        self.copy_duration.labels(*gl, direction).observe(g.copy_s[direction])
                self.scan_duration.labels(*gl)  # every child exists from the first scrape
                for direction in contract.DIRECTIONS:
                    self.copy_duration.labels(*gl, direction)
            for _ in range(observations):
                self.request_load_duration.labels(*e).observe(REQUEST_LOAD_S)
            self.request_load_duration.labels(*e)
            self._observe_deferral_waits(dt)
            stored = sum(g.stored * g.block_bytes for g in GROUPS) * dt
            self._used_bytes = min(HOST_USED_FRACTION * HOST_CAPACITY_BYTES, self._used_bytes + stored + 2**30 * dt)
            self.gauges["kvscope_host_used_bytes"].labels(*e).set(self._used_bytes)

    def _observe_deferral_waits(self, dt: float) -> None:
        """Every deferred load is admitted in the end (none aborted): one wait each, as the counter grows."""
        e = (MODEL_NAME, ENGINE)
        self._admissions_due += RATES["deferred_loads"] * dt
        admitted = int(self._admissions_due)
        self._admissions_due -= admitted
        for _ in range(admitted):
            self.deferral_wait.labels(*e).observe(DEFERRAL_WAIT_S)
        self.deferral_wait.labels(*e)

    # --- serving ---------------------------------------------------------------------------

    def start(self) -> "SyntheticKVScopeExporter":
        self._httpd, self._http_thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self._ticker = threading.Thread(target=self._run, name="synthetic-kvscope-ticker", daemon=True)
        self._ticker.start()
        return self

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self._tick_s):
            now = time.monotonic()
            self.step(now - last)
            last = now

    @property
    def port(self) -> int:
        assert self._httpd is not None, "start() first"
        return self._httpd.server_port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._http_thread is not None:
            self._http_thread.join(timeout=5)
