"""The kvscope per-group board: one repeated row per KV cache group.

Hybrid models (sliding window + full attention, Mamba + attention) keep one KV cache group per
layer kind; the connector plans, copies and counts each group separately. This board shows one
group per row so their different behaviour is visible side by side. One function per panel.
"""

from __future__ import annotations

from grafana_foundation_sdk.models.dashboard import DynamicConfigValue, VariableSort

import panels_common as pc
from panels_common import sel

UID = "kvscope-groups"
TITLE = "kvscope / KV groups"
DESCRIPTION = (
    "Per KV cache group: blocks scanned, skipped and loaded, scan time, copy latency, throughput "
    "and the bandwidth copies reach while they run. One row per group (variable `group`); a group "
    "index means another cache in another model, so every series is per model."
)

RATE = "[$__rate_interval]"
GROUP = 'group=~"$group"'
LOAD = 'direction="load"'
STORE = 'direction="store"'


def group_variable():
    return pc.label_variable(
        "group", "KV group", f"kvscope_scan_blocks_total{sel()}",
        "KV cache group index as the connector numbers them (vLLM's kv_cache_groups order).",
        sort=VariableSort.NUMERICAL_ASC,
    )


def group_row():
    return pc.row("Group $group").repeat("group")


def blocks_per_second():
    return pc.timeseries(
        "Blocks scanned, skipped and loaded",
        "Device blocks per second in this group's load plans: scanned (the hit range), null-skipped "
        "(vLLM's placeholder for positions the group does not keep, e.g. outside a sliding window) "
        "and loaded from the host tier. Loaded + skipped should equal scanned; a gap means planned "
        "blocks were not loaded: failed loads count theirs under load failures (see the overview), "
        "not here.",
        pc.queries(
            (f"sum by (model_name, group, kind) (rate(kvscope_scan_blocks_total{sel(GROUP)}{RATE}))",
             "scanned ({{kind}}, {{model_name}})"),
            (f"sum by (model_name, group, kind) (rate(kvscope_null_blocks_skipped_total{sel(GROUP)}{RATE}))",
             "null skipped ({{kind}}, {{model_name}})"),
            (f"sum by (model_name, group, kind) (rate(kvscope_loaded_blocks_total{sel(GROUP)}{RATE}))",
             "loaded ({{kind}}, {{model_name}})"),
        ),
        pc.BLOCKS_PER_SECOND,
        width=pc.THIRD,
    )


def scan_duration():
    return pc.timeseries(
        "Scan duration p50 / p99",
        "Time the scheduler spends scanning this group's blocks for one load plan "
        "(kvscope_scan_duration_seconds, microsecond buckets). The scan runs on vLLM's scheduler "
        "loop, so it delays every request in the step: it should stay in the tens of microseconds. "
        "Growth with prompt length is linear by design; a jump at equal prompt lengths is a "
        "regression worth a profile.",
        pc.quantile_queries(
            (0.5, 0.99), lambda *m: f"rate(kvscope_scan_duration_seconds_bucket{sel(GROUP, *m)}{RATE})",
            ("model_name", "group", "kind"), "{p} ({{kind}}, {{model_name}})"),
        "s",
        width=pc.THIRD,
    )


def copy_latency_by_direction():
    return pc.timeseries(
        "Copy latency p50 / p99 by direction",
        "Quantiles of one copy of this group's blocks (kvscope_copy_duration_seconds), loads (host "
        "to device) and stores (device to host) apart. A load p99 far above p50 means loads wait "
        "behind stores or each other; compare the copy rate panel.",
        pc.quantile_queries(
            (0.5, 0.99), lambda *m: f"rate(kvscope_copy_duration_seconds_bucket{sel(GROUP, *m)}{RATE})",
            ("model_name", "direction"), "{p} {{direction}} ({{model_name}})"),
        "s",
        width=pc.THIRD,
    )


def copy_throughput_by_direction():
    return pc.timeseries(
        "Copy throughput by direction",
        "Bytes per second this group moves: loads (kvscope_load_bytes_total) and stores "
        "(kvscope_store_bytes_total), summed over the selected engines and their tensor-parallel "
        "workers (a worker's copied part of a load that failed on another worker included). Loads of a "
        "group with null-skipped blocks (a sliding window's out-of-window blocks, Mamba's padding) move fewer "
        "bytes per token: that is the saving of the hybrid-aware plan. Stores do not save so for a sliding "
        "window: each of its blocks is stored, since it is in the window of some later, longer prompt; a Mamba "
        "group stores only the states it keeps.",
        pc.queries(
            (f"sum by (model_name) (rate(kvscope_load_bytes_total{sel(GROUP)}{RATE}))", "load ({{model_name}})"),
            (f"sum by (model_name) (rate(kvscope_store_bytes_total{sel(GROUP)}{RATE}))", "store ({{model_name}})"),
        ),
        "Bps",
        width=pc.THIRD,
    )


def copy_bandwidth_while_copying():
    return pc.timeseries(
        "Bandwidth while copying",
        "Bytes moved divided by the time spent in copies (bytes rate / kvscope_copy_duration_seconds_sum "
        "rate), per direction: the speed a copy reaches while it runs, independent of how busy the "
        "connector is. Compare with the link's bandwidth (PCIe 4.0 x16 ~25 GB/s, 5.0 ~50 GB/s). Far "
        "below it: small copies dominated by launch overhead (larger block_size helps), or host "
        "memory that is not pinned. A copy whose device-event interval could not be measured (logged "
        "once) counts its bytes and no time: then this reads high.",
        pc.queries(
            (
                f"sum by (model_name) (rate(kvscope_load_bytes_total{sel(GROUP)}{RATE})) / "
                f"(sum by (model_name) (rate(kvscope_copy_duration_seconds_sum{sel(GROUP, LOAD)}{RATE})) > 0)",
                "load ({{model_name}})",
            ),
            (
                f"sum by (model_name) (rate(kvscope_store_bytes_total{sel(GROUP)}{RATE})) / "
                f"(sum by (model_name) (rate(kvscope_copy_duration_seconds_sum{sel(GROUP, STORE)}{RATE})) > 0)",
                "store ({{model_name}})",
            ),
        ),
        "Bps",
        width=pc.THIRD,
    )


def copies_per_second():
    return pc.timeseries(
        "Copies per second and mean copy size",
        "Copies per second by direction (kvscope_copy_duration_seconds_count: one per worker, group "
        "and transfer job) and the mean bytes per copy (right axis: one worker's shard). Many small "
        "copies cost launch overhead each; if copies are small, a larger offload block_size batches "
        "more tokens per copy. A copy whose device-event interval could not be measured (logged once) "
        "is not counted here, its bytes are.",
        pc.queries(
            (f"sum by (model_name, direction) (rate(kvscope_copy_duration_seconds_count{sel(GROUP)}{RATE}))",
             "{{direction}} copies/s ({{model_name}})"),
            (
                f"sum by (model_name) (rate(kvscope_load_bytes_total{sel(GROUP)}{RATE})) / "
                f"(sum by (model_name) (rate(kvscope_copy_duration_seconds_count{sel(GROUP, LOAD)}{RATE})) > 0)",
                "bytes per load ({{model_name}})",
            ),
        ),
        "short",
        width=pc.THIRD,
    ).override_by_query("B", [  # the bytes per load, one series per model
        DynamicConfigValue(id_val="unit", value="bytes"),
        DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
    ])


def build():
    board = pc.dashboard(UID, TITLE, DESCRIPTION)
    board = board.with_variable(pc.datasource_variable())
    for variable in pc.engine_variables():
        board = board.with_variable(variable)
    board = board.with_variable(group_variable())
    return pc.with_panels(board, [
        group_row(),
        blocks_per_second(), scan_duration(), copy_latency_by_direction(),
        copy_throughput_by_direction(), copy_bandwidth_while_copying(), copies_per_second(),
    ])
