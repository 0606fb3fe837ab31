"""One request's copies per KV group and transfer: workers under tensor parallelism, the slowest one's
time, and copy times the reader cannot trust shown as unknown."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dashboard import traces

from .conftest import TWO_ROUNDS
from .test_joins import load, store
from .test_reader import line, lookup, span, write

T = 1_700_000_000_000_000_000
MS = 1_000_000
TRACE = "ab" * 16
SHOWN = ["transfer", "group", "workers", "blocks", "bytes", "copy_ms", "gb_per_s", "slowest_rank", "failed"]


def group_copy(direction: str, group: int, rank: int, nbytes: int, start: int, end: int, *, owner: str,
               rid: str = "r", blocks: int = 4, n: int = 0, failed: bool = False) -> dict:
    kind = ("sliding_window", "full_attention")[group]
    sp = span("kvscope.group.copy", {
        "kvscope.group.index": group, "kvscope.group.kind": kind, "kvscope.copy.direction": direction,
        "kvscope.copy.blocks": blocks, "kvscope.copy.bytes": nbytes, "kvscope.worker.rank": rank,
        "kvscope.request.id": rid}, trace=TRACE, span_id=f"{0xC00 + n:016x}", parent=owner, start=start, end=end)
    if failed:
        sp["status"] = {"code": 2}
    return sp


def copies_of(tmp_path, *spans: dict, rid: str = "r") -> pd.DataFrame:
    read = traces.read_trace_files([write(tmp_path, line(*spans))])
    return traces.request_group_copies(read.spans, TRACE, rid)


def test_tensor_parallel_workers_sum_bytes_and_wait_for_the_slowest(tmp_path):
    """Two workers per group: bytes add up, the group's copy time is the slower worker's."""
    copies = copies_of(
        tmp_path,
        lookup("r", trace=TRACE, span_id="01" * 8, start=T),
        load("r", trace=TRACE, span_id="02" * 8, start=T + MS),
        group_copy("load", 0, 0, 1_000_000, T + 2 * MS, T + 4 * MS, owner="02" * 8, n=1),
        group_copy("load", 0, 1, 1_000_000, T + 2 * MS, T + 5 * MS, owner="02" * 8, n=2),  # the slower
        group_copy("load", 1, 0, 500_000, T + 5 * MS, T + 6 * MS, owner="02" * 8, n=3, blocks=8),
        group_copy("load", 1, 1, 500_000, T + 5 * MS, T + 5 * MS + 500_000, owner="02" * 8, n=4, blocks=8),
        store("r", trace=TRACE, span_id="03" * 8, start=T + 20 * MS),
        group_copy("store", 1, 0, 250_000, T + 21 * MS, T + 23 * MS, owner="03" * 8, n=5, blocks=2),
    )
    assert copies[SHOWN].to_dict("records") == [
        {"transfer": "load 1", "group": "g0 sliding_window", "workers": 2, "blocks": 4, "bytes": 2_000_000,
         "copy_ms": pytest.approx(3.0), "gb_per_s": pytest.approx(2e6 / 3e-3 / 1e9), "slowest_rank": 1,
         "failed": False},
        {"transfer": "load 1", "group": "g1 full_attention", "workers": 2, "blocks": 8, "bytes": 1_000_000,
         "copy_ms": pytest.approx(1.0), "gb_per_s": pytest.approx(1.0), "slowest_rank": 0, "failed": False},
        {"transfer": "store 1", "group": "g1 full_attention", "workers": 1, "blocks": 2, "bytes": 250_000,
         "copy_ms": pytest.approx(2.0), "gb_per_s": pytest.approx(0.125), "slowest_rank": 0, "failed": False},
    ]


def test_untrusted_or_failed_copy_times_are_unknown_not_zero(tmp_path):
    """A worker's copy that ends before it starts (another clock) leaves its group's time unknown: it may
    have been the slowest; its bytes still count. A failed copy moved nothing and took no time."""
    copies = copies_of(
        tmp_path,
        load("r", trace=TRACE, span_id="02" * 8, start=T),
        group_copy("load", 0, 0, 1_000_000, T + 2 * MS, T + 4 * MS, owner="02" * 8, n=1),
        group_copy("load", 0, 1, 1_000_000, T + 4 * MS, T + 2 * MS, owner="02" * 8, n=2),  # ends before it starts
        group_copy("load", 1, 0, 0, T + 3 * MS, T + 3 * MS, owner="02" * 8, n=3, blocks=0, failed=True),
    ).set_index("group")
    mistimed, failed = copies.loc["g0 sliding_window"], copies.loc["g1 full_attention"]
    assert (mistimed["workers"], mistimed["bytes"], mistimed["failed"]) == (2, 2_000_000, False)
    assert math.isnan(mistimed["copy_ms"]) and math.isnan(mistimed["gb_per_s"]) and pd.isna(mistimed["slowest_rank"])
    assert failed["failed"] and math.isnan(failed["copy_ms"]) and math.isnan(failed["gb_per_s"])


def test_loads_are_numbered_in_start_order_and_other_requests_copies_stay_out(tmp_path):
    """A request resumed after preemption loads twice; another request of the same (upstream) trace is not its."""
    copies = copies_of(
        tmp_path,
        load("r", trace=TRACE, span_id="12" * 8, start=T + 50 * MS),  # written first, started second
        group_copy("load", 0, 0, 300, T + 51 * MS, T + 52 * MS, owner="12" * 8, n=1),
        load("r", trace=TRACE, span_id="02" * 8, start=T),
        group_copy("load", 0, 0, 100, T + MS, T + 2 * MS, owner="02" * 8, n=2),
        load("other", trace=TRACE, span_id="22" * 8, start=T),
        group_copy("load", 0, 0, 900, T + MS, T + 2 * MS, owner="22" * 8, rid="other", n=3),
    )
    assert copies[["transfer", "bytes"]].values.tolist() == [["load 1", 100], ["load 2", 300]]


def test_the_fixtures_slow_load_per_group(expected):
    """cmpl-r2-06 of two_rounds.jsonl: one worker; both groups copied at 1.5 GB/s (its slow copy)."""
    read = traces.read_trace_files([TWO_ROUNDS])
    load = expected.loads["cmpl-r2-06"]
    copies = traces.request_group_copies(read.spans, load["trace"], "cmpl-r2-06")
    raw = sorted((c for c in expected.copies if c["trace"] == load["trace"] and c["copy.direction"] == "load"),
                 key=lambda c: c["group.index"])
    assert copies["transfer"].tolist() == ["load 1", "load 1"] and copies["workers"].tolist() == [1, 1]
    assert copies["copy_ms"].tolist() == pytest.approx([(c["end"] - c["start"]) / 1e6 for c in raw])
    assert copies["bytes"].tolist() == [c["copy.bytes"] for c in raw]
    assert copies["gb_per_s"].tolist() == pytest.approx([1.5, 1.5], rel=1e-3)
    assert traces.request_group_copies(read.spans, "00" * 16, "cmpl-r2-06").empty


def test_a_loads_rows_show_each_groups_scan_beside_its_copies(tmp_path):
    """Checking a scan's pending blocks against what the copies copied took reading two tables."""
    from .test_group_stats import scan

    copies = copies_of(
        tmp_path,
        load("r", trace=TRACE, span_id="02" * 8, start=T),
        scan(0, n=1, parent="02" * 8, total=6, skipped=5, start=T + 10),
        scan(1, n=2, parent="02" * 8, total=6, skipped=0, start=T + 20),
        group_copy("load", 0, 0, 100, T + 2 * MS, T + 3 * MS, owner="02" * 8, n=3, blocks=1),
        group_copy("load", 1, 0, 600, T + 2 * MS, T + 3 * MS, owner="02" * 8, n=4, blocks=6),
        store("r", trace=TRACE, span_id="03" * 8, start=T + 20 * MS),
        group_copy("store", 1, 0, 100, T + 21 * MS, T + 23 * MS, owner="03" * 8, n=5, blocks=1),
    )
    rows = copies[["transfer", "group", "scanned", "null_skipped", "pending", "start_index", "blocks"]]
    assert rows.astype(object).to_dict("records") == [
        {"transfer": "load 1", "group": "g0 sliding_window", "scanned": 6, "null_skipped": 5, "pending": 1,
         "start_index": 0, "blocks": 1},
        {"transfer": "load 1", "group": "g1 full_attention", "scanned": 6, "null_skipped": 0, "pending": 6,
         "start_index": 0, "blocks": 6},
        {"transfer": "store 1", "group": "g1 full_attention", "scanned": None, "null_skipped": None,
         "pending": None, "start_index": None, "blocks": 1},  # a store scans nothing
    ]


def test_a_transfers_groups_are_in_group_order_whatever_order_the_copies_came_in(tmp_path):
    """Group 1's copy span came first: a transfer's rows still read g0, then g1, as the overview's group tables do."""
    copies = copies_of(
        tmp_path,
        load("r", trace=TRACE, span_id="02" * 8, start=T),
        group_copy("load", 1, 0, 100, T + MS, T + 2 * MS, owner="02" * 8, n=1),
        group_copy("load", 0, 0, 100, T + MS, T + 2 * MS, owner="02" * 8, n=2),
    )
    assert copies["group"].tolist() == ["g0 sliding_window", "g1 full_attention"]
