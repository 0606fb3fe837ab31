"""The kvscope metric contract (shared DESIGN.md, section 3), as data for the dashboard tests."""

from __future__ import annotations

# vLLM adds its engine labels to every metric it exports through the connector stats path.
ENGINE_LABELS = ("model_name", "engine")

# Names as exposed by prometheus_client: counters carry `_total`.
COUNTERS: dict[str, tuple[str, ...]] = {
    "kvscope_lookup_tokens_total": (),
    "kvscope_hit_tokens_total": (),
    "kvscope_missed_tokens_total": ("reason",),
    "kvscope_evicted_blocks_total": (),
    "kvscope_load_failures_total": (),
    "kvscope_deferred_loads_total": (),  # beyond DESIGN §3 (asked of it): loads deferred for device KV room
    "kvscope_dropped_trace_records_total": ("reason",),  # beyond DESIGN §3 (asked of it): records a sink did not get
    "kvscope_scan_blocks_total": ("group", "kind"),
    "kvscope_null_blocks_skipped_total": ("group", "kind"),
    "kvscope_loaded_blocks_total": ("group", "kind"),
    "kvscope_load_bytes_total": ("group", "kind"),
    "kvscope_store_bytes_total": ("group", "kind"),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "kvscope_scan_duration_seconds": ("group", "kind"),
    "kvscope_copy_duration_seconds": ("group", "kind", "direction"),
    "kvscope_request_load_duration_seconds": (),
    # beyond DESIGN §3 (asked of it): how long an admitted deferred load waited for device KV room
    "kvscope_load_deferral_wait_seconds": (),
}
GAUGES: dict[str, tuple[str, ...]] = {
    "kvscope_host_used_bytes": (),
    "kvscope_host_capacity_bytes": (),
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# vLLM's own series a rule may read: that an engine runs (alert KVScopeMetricsMissing)
VLLM_SERIES = ("vllm:num_requests_running",)

GROUP_KINDS = ("full_attention", "sliding_window", "mamba")
DIRECTIONS = ("load", "store")


def series_names() -> set[str]:
    """Every series name a query may reference directly."""
    names = set(COUNTERS) | set(GAUGES)
    names |= {h + s for h in HISTOGRAMS for s in HISTOGRAM_SUFFIXES}
    return names


def base_name(series_name: str) -> str:
    """The contract metric a series name belongs to (histogram suffixes stripped)."""
    for h in HISTOGRAMS:
        if series_name in {h + s for s in HISTOGRAM_SUFFIXES}:
            return h
    return series_name


def all_metrics() -> set[str]:
    return set(COUNTERS) | set(HISTOGRAMS) | set(GAUGES)
