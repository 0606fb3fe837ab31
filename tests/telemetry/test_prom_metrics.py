"""KVScopePromMetrics: the contract metrics (DESIGN §3) in a fresh registry, as vLLM builds them."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from connector.telemetry.metrics import (
    COPY_BUCKETS_S,
    METRIC_NAMES,
    REQUEST_LOAD_BUCKETS_S,
    SCAN_BUCKETS_S,
    KVScopePromMetrics,
    KVScopeStats,
    serve_metrics_port,
    unregister_kvscope_metrics,
)
from connector.telemetry.testing import engine_labels

VLLM = ["model_name", "engine"]
# DESIGN §3: exposed name -> (type, own labels)
CONTRACT = {
    "kvscope_lookup_tokens_total": ("counter", []),
    "kvscope_hit_tokens_total": ("counter", []),
    "kvscope_missed_tokens_total": ("counter", ["reason"]),
    "kvscope_scan_blocks_total": ("counter", ["group", "kind"]),
    "kvscope_null_blocks_skipped_total": ("counter", ["group", "kind"]),
    "kvscope_loaded_blocks_total": ("counter", ["group", "kind"]),
    "kvscope_load_bytes_total": ("counter", ["group", "kind"]),
    "kvscope_store_bytes_total": ("counter", ["group", "kind"]),
    "kvscope_scan_duration_seconds": ("histogram", ["group", "kind"]),
    "kvscope_copy_duration_seconds": ("histogram", ["group", "kind", "direction"]),
    "kvscope_request_load_duration_seconds": ("histogram", []),
    "kvscope_evicted_blocks_total": ("counter", []),
    "kvscope_load_failures_total": ("counter", []),
    "kvscope_deferred_loads_total": ("counter", []),  # beyond §3 (asked of DESIGN)
    "kvscope_load_deferral_wait_seconds": ("histogram", []),  # beyond §3 (asked of DESIGN)
    "kvscope_dropped_trace_records_total": ("counter", ["reason"]),  # beyond §3 (asked of DESIGN)
    "kvscope_host_used_bytes": ("gauge", []),
    "kvscope_host_capacity_bytes": ("gauge", []),
}


def _payload() -> dict:
    s = KVScopeStats()
    s.record_lookup(100, 64)
    s.record_missed("evicted", 32)
    s.record_missed("tail", 4)
    s.record_scans(0, "full_attention", 8, 0, [3e-6])
    s.record_scans(1, "sliding_window", 8, 6, [2e-6])
    s.record_loaded_blocks(1, "sliding_window", 2)
    s.record_copy(1, "sliding_window", "load", 2, 2048, 0.0015)
    s.record_copy(2, "mamba", "store", 1, 512, 0.0004)
    s.record_request_load(0.003)
    s.record_evictions(3)
    s.record_load_failures(1)
    s.record_deferred_loads(2)
    s.record_deferral_wait(0.03)
    s.set_host_usage(10_000, 1 << 30)
    return s.data


def _families(registry: CollectorRegistry) -> dict:
    return {f.name: f for f in registry.collect()}


def _exposed_name(family) -> str:
    return family.name + "_total" if family.type == "counter" else family.name


def test_registers_exactly_the_contract_metrics(registry, prom_metrics):
    families = _families(registry)
    assert {_exposed_name(f): f.type for f in families.values()} == {k: t for k, (t, _) in CONTRACT.items()}
    assert set(METRIC_NAMES) == set(CONTRACT)
    assert not any(":" in name for name in CONTRACT)


def test_label_names_are_vllm_labels_then_ours(registry, prom_metrics):
    prom_metrics.observe(_payload(), engine_idx=0)
    for family in registry.collect():
        _, own = CONTRACT[_exposed_name(family)]
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            names = [n for n in sample.labels if n != "le"]
            assert sorted(names) == sorted(VLLM + own), (sample.name, names)


def test_unlabelled_series_exist_at_zero_before_any_observation(registry, prom_metrics):
    for engine in (0, 1):
        labels = engine_labels(engine)
        assert registry.get_sample_value("kvscope_lookup_tokens_total", labels) == 0
        assert registry.get_sample_value("kvscope_deferred_loads_total", labels) == 0  # rate() sees the first
        assert registry.get_sample_value("kvscope_request_load_duration_seconds_count", labels) == 0
        assert registry.get_sample_value("kvscope_load_deferral_wait_seconds_count", labels) == 0
        for reason in ("evicted", "new", "tail"):  # every reason: an evicted share is 0, not absent
            assert registry.get_sample_value("kvscope_missed_tokens_total", {**labels, "reason": reason}) == 0


def test_every_groups_series_exists_at_zero_from_the_schedulers_first_payload(registry, prom_metrics):
    """A series created at its first value loses that value to rate() and increase(), and a board
    listing groups misses one never loaded: the scheduler's first payload names them all at zero."""
    from connector.telemetry.tracing import KVScopeTracing
    from tests.telemetry.test_scheduler_spans import LAYOUTS, make_scheduler

    payload = make_scheduler(KVScopeTracing.disabled()).take_stats().data
    prom_metrics.observe(payload, engine_idx=1)
    get = registry.get_sample_value
    for layout in LAYOUTS:
        group = engine_labels(1, group=str(layout.index), kind=layout.kind.value)
        for name in ("kvscope_scan_blocks_total", "kvscope_null_blocks_skipped_total", "kvscope_loaded_blocks_total",
                     "kvscope_load_bytes_total", "kvscope_store_bytes_total", "kvscope_scan_duration_seconds_count"):
            assert get(name, group) == 0, name
        for direction in ("load", "store"):
            assert get("kvscope_copy_duration_seconds_count", {**group, "direction": direction}) == 0
    assert get("kvscope_scan_blocks_total", engine_labels(0, group="0", kind="sliding_window")) is None
    # the zeros add nothing where real payloads follow, nor to vLLM's log line
    stats = KVScopeStats(data=payload).aggregate(KVScopeStats(data=_payload()))
    prom_metrics.observe(stats.data, engine_idx=1)
    assert get("kvscope_scan_blocks_total", engine_labels(1, group="1", kind="sliding_window")) == 8
    assert get("kvscope_scan_blocks_total", engine_labels(1, group="1", kind="full_attention")) == 0
    assert stats.reduce()["loaded_blocks"] == 2


def test_observe_applies_a_payload_per_engine(registry, prom_metrics):
    prom_metrics.observe(_payload(), engine_idx=1)
    prom_metrics.observe(_payload(), engine_idx=1)
    get = registry.get_sample_value
    e1, e0 = engine_labels(1), engine_labels(0)
    assert get("kvscope_lookup_tokens_total", e1) == 200
    assert get("kvscope_hit_tokens_total", e1) == 128
    assert get("kvscope_lookup_tokens_total", e0) == 0
    assert get("kvscope_missed_tokens_total", engine_labels(1, reason="evicted")) == 64
    assert get("kvscope_missed_tokens_total", engine_labels(1, reason="tail")) == 8
    sw = engine_labels(1, group="1", kind="sliding_window")
    assert get("kvscope_scan_blocks_total", sw) == 16
    assert get("kvscope_null_blocks_skipped_total", sw) == 12
    assert get("kvscope_loaded_blocks_total", sw) == 4
    assert get("kvscope_load_bytes_total", sw) == 4096
    assert get("kvscope_store_bytes_total", engine_labels(1, group="2", kind="mamba")) == 1024
    assert get("kvscope_scan_duration_seconds_count", sw) == 2
    load_copy = engine_labels(1, group="1", kind="sliding_window", direction="load")
    assert get("kvscope_copy_duration_seconds_count", load_copy) == 2
    assert get("kvscope_copy_duration_seconds_sum", load_copy) == 0.003
    assert get("kvscope_copy_duration_seconds_bucket", {**load_copy, "le": "0.001"}) == 0
    assert get("kvscope_copy_duration_seconds_bucket", {**load_copy, "le": "0.0025"}) == 2
    assert get("kvscope_request_load_duration_seconds_count", e1) == 2
    assert get("kvscope_evicted_blocks_total", e1) == 6
    assert get("kvscope_load_failures_total", e1) == 2
    assert get("kvscope_deferred_loads_total", e1) == 4
    assert get("kvscope_deferred_loads_total", e0) == 0
    assert get("kvscope_load_deferral_wait_seconds_count", e1) == 2
    assert get("kvscope_load_deferral_wait_seconds_bucket", {**e1, "le": "0.025"}) == 0
    assert get("kvscope_load_deferral_wait_seconds_bucket", {**e1, "le": "0.05"}) == 2
    assert get("kvscope_host_used_bytes", e1) == 10_000
    assert get("kvscope_host_capacity_bytes", e1) == 1 << 30


def test_hit_tokens_never_exceed_lookup_tokens(registry, prom_metrics):
    s = KVScopeStats()
    s.record_lookup(10, 50)  # a caller bug is clamped, not exported
    prom_metrics.observe(s.data)
    get = registry.get_sample_value
    assert get("kvscope_hit_tokens_total", engine_labels(0)) == get("kvscope_lookup_tokens_total", engine_labels(0)) == 10


def test_bucket_edges(registry, prom_metrics):
    prom_metrics.observe(_payload())
    families = _families(registry)

    def edges(name):
        return sorted(
            {float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")}
        )

    inf = [float("inf")]
    assert edges("kvscope_scan_duration_seconds") == list(SCAN_BUCKETS_S) + inf
    assert edges("kvscope_copy_duration_seconds") == list(COPY_BUCKETS_S) + inf
    assert edges("kvscope_request_load_duration_seconds") == list(REQUEST_LOAD_BUCKETS_S) + inf
    assert SCAN_BUCKETS_S[0] == 1e-6 and SCAN_BUCKETS_S[-1] == 1e-2
    assert COPY_BUCKETS_S[0] == 1e-4 and COPY_BUCKETS_S[-1] >= 1.0
    assert REQUEST_LOAD_BUCKETS_S[0] == 1e-4 and REQUEST_LOAD_BUCKETS_S[-1] == 10.0


def test_host_gauges_are_absent_until_the_tier_reports_them(registry, prom_metrics):
    """Only the host tier's owner sets the gauges: a capacity of 0 before it reports would be a wrong
    value (a board dividing used by capacity), so the gauges have no series until then."""
    get = registry.get_sample_value
    assert get("kvscope_host_used_bytes", engine_labels(0)) is None
    assert get("kvscope_host_capacity_bytes", engine_labels(0)) is None
    prom_metrics.observe(_payload(), engine_idx=0)
    assert get("kvscope_host_capacity_bytes", engine_labels(0)) == 1 << 30
    assert get("kvscope_host_capacity_bytes", engine_labels(1)) is None


def test_host_gauges_are_one_series_in_multiprocess_mode(tmp_path, monkeypatch):
    """With several API servers vLLM runs Prometheus in multiprocess mode, where a gauge defaults to a
    series per process (a `pid` label): the host tier's gauges are one value, the latest reported."""
    from prometheus_client import multiprocess, values

    from connector.telemetry.testing import build_prom_metrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    prom = build_prom_metrics(CollectorRegistry())
    prom.observe(_payload())
    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged, path=str(tmp_path))
    samples = [(s.labels, s.value) for f in merged.collect() if f.name == "kvscope_host_used_bytes" for s in f.samples]
    assert samples == [(engine_labels(0), 10_000)]


def test_unknown_and_internal_keys_are_ignored(registry, prom_metrics):
    prom_metrics.observe({"copy_blocks": {"0|mamba|load": 3}, "from_the_future": 1, "scan_blocks": {"bad": 1}})
    assert registry.get_sample_value("kvscope_scan_blocks_total", engine_labels(0, group="bad", kind="")) is None


def test_global_registry_can_be_rebuilt_like_vllm_does():
    """Plain prometheus_client classes (vLLM's default) register globally; a second engine must not fail."""
    from types import SimpleNamespace

    metric_types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    try:
        for _ in range(2):
            KVScopePromMetrics(SimpleNamespace(kv_transfer_config=None), metric_types, VLLM, {0: ["m", "0"]})
        assert REGISTRY.get_sample_value("kvscope_lookup_tokens_total", {"model_name": "m", "engine": "0"}) == 0
    finally:
        unregister_kvscope_metrics(REGISTRY)
    assert REGISTRY.get_sample_value("kvscope_lookup_tokens_total", {"model_name": "m", "engine": "0"}) is None


def test_dropping_kvscope_collectors_leaves_vllms_own_in_the_registry(registry, prom_metrics):
    """A second engine drops kvscope's collectors from the global registry before it registers them again:
    vLLM's own metrics there must stay exported."""
    vllm_counter = Counter("vllm:prompt_tokens", "vLLM's own", registry=registry)
    vllm_counter.inc(3)
    unregister_kvscope_metrics(registry)
    assert registry.get_sample_value("vllm:prompt_tokens_total") == 3
    assert registry.get_sample_value("kvscope_lookup_tokens_total", engine_labels(0)) is None


def test_serve_metrics_port_is_idempotent_and_serves_the_registry(registry, prom_metrics):
    prom_metrics.observe(_payload())
    port = serve_metrics_port(0, registry=registry)
    assert serve_metrics_port(0, registry=registry) == port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvscope_hit_tokens_total{engine="0",model_name="test-model"} 64.0' in body


def test_serve_metrics_port_serves_vllms_registry_by_default():
    """What the connector starts for `metrics_port` (no registry given): vLLM's registry, which holds
    vLLM's metrics and kvscope's."""
    import socket
    from types import SimpleNamespace

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metric_types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    try:
        KVScopePromMetrics(SimpleNamespace(kv_transfer_config=None), metric_types, VLLM, {0: ["m", "0"]})
        assert serve_metrics_port(port) == port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        unregister_kvscope_metrics(REGISTRY)
    assert 'kvscope_lookup_tokens_total{engine="0",model_name="m"} 0.0' in body


def test_a_metrics_port_in_use_stops_start_up_naming_the_key():
    """vLLM builds the connector's Prometheus metrics when it starts an offline `LLM`: a port it
    cannot bind is said as the config key, not as a bare OSError."""
    import socket
    from types import SimpleNamespace

    from connector import KVScopeConnector
    from connector.config import ConfigError
    from connector.telemetry.testing import VLLM_LABELNAMES, metric_types_for, per_engine_labelvalues

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"cpu_bytes": 1 << 20, "metrics_port": port}))
        with pytest.raises(ConfigError, match=f"metrics_port={port} is not accepted: cannot serve on "
                                              f"127.0.0.1:{port} .*Address already in use"):
            KVScopeConnector.build_prom_metrics(config, metric_types_for(CollectorRegistry()),
                                                list(VLLM_LABELNAMES), per_engine_labelvalues(1))


def test_only_the_first_api_server_serves_the_metrics_port(monkeypatch):
    """With `--api-server-count` > 1 vLLM builds the metrics in every front end: only the first binds
    the port (the others would fail to start on it; vLLM's own /metrics covers them)."""
    import socket
    from types import SimpleNamespace

    import connector.connector as connector_module
    from connector import KVScopeConnector
    from connector.telemetry.testing import VLLM_LABELNAMES, metric_types_for, per_engine_labelvalues

    def config(port: int, rank: int):
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"cpu_bytes": 1 << 20, "metrics_port": port}),
            parallel_config=SimpleNamespace(_api_process_rank=rank, _api_process_count=2))

    def build(port: int, rank: int):
        return KVScopeConnector.build_prom_metrics(config(port, rank), metric_types_for(CollectorRegistry()),
                                                   list(VLLM_LABELNAMES), per_engine_labelvalues(1))

    # The second front end on a port the first one holds: it starts, with its metrics, and binds nothing.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert isinstance(build(port, rank=1), KVScopePromMetrics)

    # Both front ends, in order: the port is asked for once, by the first.
    served: list[tuple[int, int]] = []
    for rank in (0, 1):
        monkeypatch.setattr(connector_module, "serve_metrics_port", lambda p, rank=rank: served.append((rank, p)))
        build(port, rank)
    assert served == [(0, port)]

    # -1 (`vllm serve` sets it before it starts its API servers) is not a later front end: it serves the port too
    served.clear()
    monkeypatch.setattr(connector_module, "serve_metrics_port", lambda p: served.append(p))
    build(port, rank=-1)
    assert served == [port]


def test_every_observation_of_a_payload_is_observed(registry, prom_metrics):
    """A payload aggregated over an interval's workers and steps holds many durations per series: each is
    one observation (a histogram's count is the number of copies, scans and loads, its sum their time)."""
    s = KVScopeStats()
    for duration_s in (0.0002, 0.002, 0.2):
        s.record_copy(0, "full_attention", "load", 1, 1024, duration_s)
        s.record_request_load(duration_s)
    s.record_scans(0, "full_attention", 3, 0, [1e-6, 2e-6, 3e-6])
    prom_metrics.observe(s.data)
    get = registry.get_sample_value
    fa = engine_labels(0, group="0", kind="full_attention")
    assert get("kvscope_copy_duration_seconds_count", {**fa, "direction": "load"}) == 3
    assert get("kvscope_copy_duration_seconds_sum", {**fa, "direction": "load"}) == pytest.approx(0.2022)
    assert get("kvscope_scan_duration_seconds_count", fa) == 3
    assert get("kvscope_request_load_duration_seconds_count", engine_labels(0)) == 3
