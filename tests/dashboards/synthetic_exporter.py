"""A stand-in for vLLM's /metrics: every kvscope contract metric with realistic, growing values.

Served by prometheus_client from a fresh CollectorRegistry on 127.0.0.1 (port chosen by the OS),
so the boards and rules can be checked against a real Prometheus without a vLLM engine. The
rates are fixed (see RATES / GROUPS) so tests can also check what the queries compute.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

from connector.telemetry.metrics import COPY_BUCKETS_S, REQUEST_LOAD_BUCKETS_S, SCAN_BUCKETS_S
from connector.telemetry.span_batcher import LOSS_REASONS

from . import contract

MODEL_NAME = "synthetic-model"
ENGINE = "0"

# The connector's own buckets: microseconds for scans, milliseconds for copies.
SCAN_BUCKETS, COPY_BUCKETS, REQUEST_LOAD_BUCKETS = SCAN_BUCKETS_S, COPY_BUCKETS_S, REQUEST_LOAD_BUCKETS_S

# Per-second rates of the engine-wide counters.
RATES = {
    "lookup_tokens": 2000.0,
    "hit_tokens": 1200.0,  # token hit rate 0.6
    "evicted_blocks": 5.0,
    "load_failures": 0.2,
    "dropped_trace_records": 0.0,  # healthy: KVScopeTracesIncomplete stays quiet
}
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


# A hybrid model: a sliding-window group that skips most of its blocks, a full-attention one.
GROUPS = (
    SyntheticGroup("0", "sliding_window", scan_blocks=40, null_skipped=28, loaded=12, stored=20, block_bytes=256 * 1024),
    SyntheticGroup("1", "full_attention", scan_blocks=40, null_skipped=0, loaded=40, stored=20, block_bytes=256 * 1024),
)


class SyntheticKVScopeExporter:
    """Serves the metrics and advances them every `tick_s` seconds from a background thread."""

    def __init__(self, tick_s: float = 0.1, seed: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._tick_s = tick_s
        self._rng = random.Random(seed)
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
        self.gauges = {
            name: Gauge(name, f"synthetic {name}", eng + list(labels), registry=reg)
            for name, labels in contract.GAUGES.items()
        }
        missing = contract.all_metrics() - set(self.counters) - set(self.gauges) - {
            "kvscope_scan_duration_seconds", "kvscope_copy_duration_seconds", "kvscope_request_load_duration_seconds",
        }
        assert not missing, f"synthetic exporter lacks contract metrics {missing}"
        self._used_bytes = 0.0
        self.gauges["kvscope_host_capacity_bytes"].labels(MODEL_NAME, ENGINE).set(HOST_CAPACITY_BYTES)
        self.step(0.0)  # create every labelled child, so every series exists from the first scrape

    def step(self, dt: float) -> None:
        """Advance all metrics by `dt` seconds of synthetic traffic."""
        rng = self._rng
        e = (MODEL_NAME, ENGINE)
        with self._lock:
            c = self.counters
            c["kvscope_lookup_tokens_total"].labels(*e).inc(RATES["lookup_tokens"] * dt)
            c["kvscope_hit_tokens_total"].labels(*e).inc(RATES["hit_tokens"] * dt)
            c["kvscope_evicted_blocks_total"].labels(*e).inc(RATES["evicted_blocks"] * dt)
            c["kvscope_load_failures_total"].labels(*e).inc(RATES["load_failures"] * dt)
            for reason in LOSS_REASONS:
                c["kvscope_dropped_trace_records_total"].labels(*e, reason).inc(RATES["dropped_trace_records"] * dt)
            for reason, rate in MISSED_RATES.items():
                c["kvscope_missed_tokens_total"].labels(*e, reason).inc(rate * dt)
            for g in GROUPS:
                gl = (*e, g.index, g.kind)
                c["kvscope_scan_blocks_total"].labels(*gl).inc(g.scan_blocks * dt)
                c["kvscope_null_blocks_skipped_total"].labels(*gl).inc(g.null_skipped * dt)
                c["kvscope_loaded_blocks_total"].labels(*gl).inc(g.loaded * dt)
                c["kvscope_load_bytes_total"].labels(*gl).inc(g.loaded * g.block_bytes * dt)
                c["kvscope_store_bytes_total"].labels(*gl).inc(g.stored * g.block_bytes * dt)
                if dt > 0:
                    self.scan_duration.labels(*gl).observe(rng.lognormvariate(-10.4, 0.5))  # ~30 us
                    for direction in contract.DIRECTIONS:
                        self.copy_duration.labels(*gl, direction).observe(rng.lognormvariate(-6.2, 0.6))  # ~2 ms
                else:
                    self.scan_duration.labels(*gl)
                    for direction in contract.DIRECTIONS:
                        self.copy_duration.labels(*gl, direction)
            if dt > 0:
                self.request_load_duration.labels(*e).observe(rng.lognormvariate(-3.9, 0.7))  # ~20 ms
            else:
                self.request_load_duration.labels(*e)
            stored = sum(g.stored * g.block_bytes for g in GROUPS) * dt
            self._used_bytes = min(0.9 * HOST_CAPACITY_BYTES, self._used_bytes + stored + 2**30 * dt)
            self.gauges["kvscope_host_used_bytes"].labels(*e).set(self._used_bytes)

    # --- serving ---------------------------------------------------------------------------

    def start(self) -> "SyntheticKVScopeExporter":
        self._httpd, self._http_thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self._ticker = threading.Thread(target=self._run, name="synthetic-kvscope-ticker", daemon=True)
        self._ticker.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            self.step(self._tick_s)

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
