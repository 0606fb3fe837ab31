"""The overview's per-group tables on small files: exact throughput, and rows in group order."""

from __future__ import annotations

import math

import pandas as pd

from dashboard import traces

from .conftest import TWO_ROUNDS
from .test_group_copies import group_copy
from .test_joins import load
from .test_reader import line, lookup, span, write

T = 1_700_000_000_000_000_000
S = 1_000_000_000  # one second in ns
TRACE = "ab" * 16


def scan(group: int, *, n: int, parent: str, total: int = 4, skipped: int = 0, start: int = T + 20) -> dict:
    kind = ("sliding_window", "full_attention")[group]
    return span("kvscope.group.scan", {
        "kvscope.group.index": group, "kvscope.group.kind": kind, "kvscope.group.blocks.total": total,
        "kvscope.group.blocks.null_skipped": skipped, "kvscope.group.blocks.pending": total - skipped,
        "kvscope.group.blocks.start": 0}, trace=TRACE, span_id=f"{0x500 + n:016x}", parent=parent, start=start)


def test_throughput_is_bytes_per_second_in_gb_exactly(tmp_path):
    """Two loads (a request resumed after preemption): 4e9 bytes in one second and 3e9 bytes in 1.5 s: 4 and
    2 GB/s, exact (1 GB = 1e9 bytes); the group's 7e9 bytes in 2.5 s are 2.8 GB/s."""
    owner, again = "02" * 8, "03" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T), load("r", span_id=owner, parent="01" * 8, trace=TRACE,
                                                                  start=T + 10),
        load("r", span_id=again, parent="01" * 8, trace=TRACE, start=T + 50),
        group_copy("load", 1, 0, 4 * S, T + 100, T + 100 + S, owner=owner, n=1),
        group_copy("load", 1, 0, 3 * S, T + 100, T + 100 + 3 * S // 2, owner=again, n=2)))
    tp = traces.copy_throughput(traces.read_trace_files([path]).spans)
    (row,) = tp.to_dict("records")
    assert (row["copies"], row["bytes"], row["copy_seconds"]) == (2, 7 * S, 2.5)
    assert row["gb_per_s"] == 7 / 2.5 and row["p50_gb_per_s"] == 3.0  # median of 4 and 2


def test_tensor_parallel_workers_copy_at_the_throughput_the_request_view_shows(tmp_path):
    """Two workers each copy 1e9 bytes of a load's group in the same second, then of a store's in 0.5 s and
    1 s: each transfer moved 2e9 bytes in its slowest worker's time (2 GB/s, then 2e9 bytes in 1 s), as the
    request view's copies per KV group say, not over the workers' summed time (half that)."""
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id="02" * 8, parent="01" * 8, trace=TRACE, start=T + 10),
        scan(0, n=1, parent="02" * 8),
        group_copy("load", 0, 0, S, T + 100, T + 100 + S, owner="02" * 8, n=1),
        group_copy("load", 0, 1, S, T + 100, T + 100 + S, owner="02" * 8, n=2),
        span("kvscope.store", {"kvscope.request.id": "r", "kvscope.groups": 1, "kvscope.blocks": 4}, trace=TRACE,
             span_id="03" * 8, start=T + 2 * S),
        group_copy("store", 0, 0, S, T + 2 * S, T + 2 * S + S // 2, owner="03" * 8, n=3),
        group_copy("store", 0, 1, S, T + 2 * S, T + 3 * S, owner="03" * 8, n=4)))
    spans = traces.read_trace_files([path]).spans
    (row,) = traces.group_summary(spans, traces.requests_table(spans)).to_dict("records")
    assert (row["load_gb_per_s"], row["store_gb_per_s"]) == (2.0, 2.0)
    by_transfer = traces.request_group_copies(spans, TRACE, "r").set_index("direction")["gb_per_s"]
    assert by_transfer.to_dict() == {"load": 2.0, "store": 2.0}
    tp = traces.copy_throughput(spans).set_index("direction")
    assert tp["copies"].tolist() == [2, 2] and tp["copy_seconds"].tolist() == [1.0, 1.0]


def test_a_transfer_that_failed_on_one_worker_has_no_throughput_as_in_the_request_view(tmp_path):
    """Worker 0's copy of a load's group failed, worker 1 copied 1e9 bytes in a second: the transfer did not
    complete, so its time is unknown (timing the survivor's share as the whole would halve it), as the
    request view shows; its bytes still count. A second load, whole, is timed."""
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id="02" * 8, parent="01" * 8, trace=TRACE, start=T + 10),
        group_copy("load", 0, 0, 0, T + 100, T + 100, owner="02" * 8, n=1, blocks=0, failed=True),
        group_copy("load", 0, 1, S, T + 100, T + 100 + S, owner="02" * 8, n=2),
        load("r", span_id="03" * 8, parent="01" * 8, trace=TRACE, start=T + 3 * S),
        group_copy("load", 0, 0, S, T + 3 * S, T + 4 * S, owner="03" * 8, n=3),
        group_copy("load", 0, 1, S, T + 3 * S, T + 4 * S, owner="03" * 8, n=4)))
    spans = traces.read_trace_files([path]).spans
    by_transfer = traces.request_group_copies(spans, TRACE, "r")
    assert by_transfer["failed"].tolist() == [True, False] and pd.isna(by_transfer["gb_per_s"].iloc[0])
    assert by_transfer["gb_per_s"].iloc[1] == 2.0
    (row,) = traces.copy_throughput(spans).to_dict("records")
    assert (row["copies"], row["bytes"], row["copy_seconds"]) == (3, 3 * S, 1.0)
    assert row["gb_per_s"] == 2.0 and row["p50_gb_per_s"] == 2.0


def test_a_transfer_that_failed_on_every_worker_has_no_row(tmp_path):
    """Both workers' copies of a load's group failed: no copy ran, so that group and direction has no copy
    throughput row (not one of 0 copies), beside the store that ran."""
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id="02" * 8, parent="01" * 8, trace=TRACE, start=T + 10),
        group_copy("load", 0, 0, 0, T + 100, T + 100, owner="02" * 8, n=1, blocks=0, failed=True),
        group_copy("load", 0, 1, 0, T + 100, T + 100, owner="02" * 8, n=2, blocks=0, failed=True),
        span("kvscope.store", {"kvscope.request.id": "r", "kvscope.groups": 1, "kvscope.blocks": 4}, trace=TRACE,
             span_id="03" * 8, start=T + 2 * S),
        group_copy("store", 0, 0, S, T + 2 * S, T + 3 * S, owner="03" * 8, n=3)))
    (row,) = traces.copy_throughput(traces.read_trace_files([path]).spans).to_dict("records")
    assert (row["direction"], row["copies"], row["bytes"], row["gb_per_s"]) == ("store", 1, S, 1.0)


def test_a_file_whose_only_transfer_failed_on_every_worker_has_no_throughput_rows_but_keeps_its_group(tmp_path):
    """The one load's copies failed on both workers: no copy ran, so no group and direction has a throughput row
    (the table keeps its columns); the overview's group table still lists the group the load scanned, its 4
    blocks scanned, none loaded (a failed load's blocks reach no request) and no bytes or throughput."""
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id="02" * 8, parent="01" * 8, trace=TRACE, start=T + 10),
        scan(0, n=1, parent="02" * 8),
        group_copy("load", 0, 0, 0, T + 100, T + 100, owner="02" * 8, n=1, blocks=0, failed=True),
        group_copy("load", 0, 1, 0, T + 100, T + 100, owner="02" * 8, n=2, blocks=0, failed=True)))
    spans = traces.read_trace_files([path]).spans
    tp = traces.copy_throughput(spans)
    assert tp.empty and {"group_index", "group_kind", "direction", "copies", "bytes", "gb_per_s"} <= set(tp.columns)
    (row,) = traces.group_summary(spans, traces.requests_table(spans)).to_dict("records")
    assert row["group"] == traces.group_label(0, "sliding_window")
    assert (row["blocks_scanned"], row["blocks_loaded"]) == (4, 0)
    assert pd.isna(row["bytes_loaded"]) and pd.isna(row["load_gb_per_s"]) and pd.isna(row["store_gb_per_s"])


def test_group_rows_are_in_group_order_whatever_order_the_spans_came_in(tmp_path):
    """Group 1's spans written before group 0's: the tables still list g0 first."""
    owner = "02" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T), load("r", span_id=owner, parent="01" * 8, trace=TRACE,
                                                                  start=T + 10),
        scan(1, n=1, parent=owner), scan(0, n=2, parent=owner, total=8, skipped=6),
        group_copy("load", 1, 0, 1000, T + 100, T + 1100, owner=owner, n=3),
        group_copy("load", 0, 0, 1000, T + 100, T + 2100, owner=owner, n=4)))
    spans = traces.read_trace_files([path]).spans
    requests = traces.requests_table(spans)
    skip = traces.null_skip_by_group(spans)
    assert skip["group_index"].tolist() == [0, 1] and skip["blocks_null_skipped"].tolist() == [6, 0]
    assert traces.load_latency_quantiles(spans, requests)["scope"].tolist() == [
        "request load (all groups)", "copy g0 sliding_window", "copy g1 full_attention"]
    assert traces.copy_throughput(spans)["group_index"].tolist() == [0, 1]
    summary = traces.group_summary(spans, requests)
    assert summary["group"].tolist() == ["g0 sliding_window", "g1 full_attention"]
    assert summary["p50_ms"].tolist() == [0.002, 0.001]
    assert summary["bytes_loaded"].tolist() == [1000, 1000] and summary["bytes_stored"].isna().all()
    dist = traces.load_latency_distribution(spans, requests)
    assert dist.values.tolist() == [["request load", 0.00209], ["copy g1 full_attention", 0.001],
                                    ["copy g0 sliding_window", 0.002]]
    assert dist.index.tolist() == [0, 1, 2]  # one row each, numbered afresh


def test_copy_latency_quantiles_are_nearest_ranks_of_many_copies(tmp_path):
    """100 load copies of 1..100 ms: p50, p95, p99 and max are the 50th, 95th, 99th and 100th (with
    fewer than 21 values p95 and p99 are the same rank)."""
    owner = "02" * 8
    copies = [group_copy("load", 0, 0, 1000, T + 100, T + 100 + ms * 1_000_000, owner=owner, n=ms)
              for ms in range(100, 0, -1)]
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T), load("r", span_id=owner, parent="01" * 8, trace=TRACE,
                                                                  start=T + 10), *copies))
    spans = traces.read_trace_files([path]).spans
    q = traces.load_latency_quantiles(spans, traces.requests_table(spans)).set_index("scope")
    row = q.loc["copy g0 sliding_window"]
    assert row[["count", "p50_ms", "p95_ms", "p99_ms", "max_ms"]].tolist() == [100, 50.0, 95.0, 99.0, 100.0]


def test_a_copy_that_ends_before_it_starts_has_no_latency(tmp_path):
    """Its duration is not to be trusted (another clock): it is in no latency quantile nor in the
    distribution, but its bytes count; its load's copy time (the slowest worker's: it may have been) and
    throughput are unknown, as in the request view."""
    owner = "02" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T), load("r", span_id=owner, parent="01" * 8, trace=TRACE,
                                                                  start=T + 10),
        group_copy("load", 0, 0, 1000, T + 100, T + 100 + 2_000_000, owner=owner, n=1),
        group_copy("load", 0, 1, 3000, T + 5_000_000, T + 4_000_000, owner=owner, n=2)))  # ends before it starts
    spans = traces.read_trace_files([path]).spans
    requests = traces.requests_table(spans)
    dist = traces.load_latency_distribution(spans, requests)
    assert dist.loc[dist["series"] != "request load", "ms"].tolist() == [2.0]
    assert dist.loc[dist["series"] == "request load", "ms"].empty  # nor has its load a time
    q = traces.load_latency_quantiles(spans, requests).set_index("scope").loc["copy g0 sliding_window"]
    assert q[["count", "max_ms"]].tolist() == [1, 2.0]
    (tp,) = traces.copy_throughput(spans).to_dict("records")
    assert (tp["copies"], tp["bytes"]) == (2, 4000)
    assert pd.isna(tp["copy_seconds"]) and pd.isna(tp["gb_per_s"])


def test_a_failed_loads_scanned_blocks_reached_no_request(tmp_path):
    """As kvscope_loaded_blocks_total counts: a load whose copy failed loaded none of its pending blocks."""
    path = write(tmp_path, line(
        lookup("ok", span_id="01" * 8, trace=TRACE, start=T),
        load("ok", span_id="02" * 8, parent="01" * 8, trace=TRACE, start=T + 10),
        scan(0, n=1, parent="02" * 8, total=8, skipped=3),
        group_copy("load", 0, 0, 1000, T + 100, T + 1100, owner="02" * 8, rid="ok", n=1),
        lookup("bad", span_id="03" * 8, trace=TRACE, start=T),
        load("bad", span_id="04" * 8, parent="03" * 8, trace=TRACE, start=T + 10),
        scan(0, n=2, parent="04" * 8, total=6, skipped=2),
        group_copy("load", 0, 0, 1000, T + 100, T + 1100, owner="04" * 8, rid="bad", n=2, failed=True)))
    (row,) = traces.null_skip_by_group(traces.read_trace_files([path]).spans).to_dict("records")
    assert (row["scans"], row["blocks_scanned"], row["blocks_null_skipped"], row["blocks_loaded"]) == (2, 14, 5, 5)


def test_a_copy_of_no_time_has_no_throughput(tmp_path):
    """A zero-duration copy (start = end) is on time but its throughput is unknown, not infinite: it is
    left out of the median, and a group with no other copy has no GB/s."""
    owner, again = "02" * 8, "03" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T), load("r", span_id=owner, parent="01" * 8, trace=TRACE,
                                                                  start=T + 10),
        load("r", span_id=again, parent="01" * 8, trace=TRACE, start=T + 50),  # resumed: a second transfer
        scan(0, n=1, parent=owner, total=1, skipped=1), scan(1, n=2, parent=owner, total=1, skipped=0),
        group_copy("load", 0, 0, 4 * S, T + 100, T + 100 + S, owner=owner, n=1),
        group_copy("load", 0, 0, S, T + 100, T + 100, owner=again, n=2),
        group_copy("load", 1, 0, 1000, T + 100, T + 100, owner=owner, n=3)))
    spans = traces.read_trace_files([path]).spans
    tp = traces.copy_throughput(spans).set_index("group_index")
    assert tp.loc[0, "p50_gb_per_s"] == 4.0 and tp.loc[0, "gb_per_s"] == 5.0
    assert tp.loc[1, "copy_seconds"] == 0 and pd.isna(tp.loc[1, "gb_per_s"]) and pd.isna(tp.loc[1, "p50_gb_per_s"])
    # one block scanned: its share is 0 or 1, not unknown
    assert traces.null_skip_by_group(spans)["null_skip_share"].tolist() == [1.0, 0.0]


def test_a_file_without_scans_has_an_empty_group_table(tmp_path):
    spans = traces.read_trace_files([write(tmp_path, line(lookup("r")))]).spans
    summary = traces.group_summary(spans, traces.requests_table(spans))
    assert summary.empty and "group" in summary.columns


def test_the_median_throughput_is_the_middle_transfers_not_their_mean(tmp_path):
    """Three loads of a group (a request resumed twice) copy at 1, 2 and 6 GB/s: the median per transfer is
    2 GB/s, where their mean would say 3 (as Σ bytes / Σ time does here: 9e9 bytes in 3 s)."""
    owners = [f"{0x10 + i:016x}" for i in range(3)]
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T),
        *(load("r", span_id=owner, parent="01" * 8, trace=TRACE, start=T + 10 + i) for i, owner in enumerate(owners)),
        *(group_copy("load", 0, 0, gb * S, T + 100, T + 100 + S, owner=owner, n=i)
          for i, (gb, owner) in enumerate(zip((1, 2, 6), owners)))))
    (row,) = traces.copy_throughput(traces.read_trace_files([path]).spans).to_dict("records")
    assert (row["copies"], row["gb_per_s"], row["p50_gb_per_s"]) == (3, 3.0, 2.0)


def test_a_failed_copys_blocks_are_not_counted_as_copied(tmp_path):
    """Its span may still say the blocks it was to copy: the throughput table's blocks, like its bytes, are what
    the copies that ran moved."""
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id="02" * 8, parent="01" * 8, trace=TRACE, start=T + 10),
        group_copy("load", 0, 0, S, T + 100, T + 100 + S, owner="02" * 8, n=1, blocks=4),
        group_copy("load", 0, 1, 0, T + 100, T + 100 + S, owner="02" * 8, n=2, blocks=4, failed=True)))
    (row,) = traces.copy_throughput(traces.read_trace_files([path]).spans).to_dict("records")
    assert (row["copies"], row["blocks"], row["bytes"]) == (1, 4, S)


def test_a_copy_starting_before_its_load_keeps_its_duration(tmp_path):
    """A copy placed more than 1 ms before its load (an offset to another clock) leaves the load without a load
    time, but its duration, measured on one clock, counts in the copy latencies."""
    owner = "02" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id=owner, parent="01" * 8, trace=TRACE, start=T + 10_000_000),
        group_copy("load", 0, 0, 1000, T + 5_000_000, T + 7_000_000, owner=owner, n=1)))
    spans = traces.read_trace_files([path]).spans
    requests = traces.requests_table(spans)
    assert requests["load_ms"].isna().all() and requests["load_mistimed"].all()
    q = traces.load_latency_quantiles(spans, requests).set_index("scope").loc["copy g0 sliding_window"]
    assert q[["count", "max_ms"]].tolist() == [1, 2.0]


def test_a_group_that_only_stored_has_its_row_with_no_loads(tmp_path):
    """A cold start: every group stored, none loaded yet. The KV groups table said "empty" beside a copy
    throughput chart of both groups' stores."""
    owner = "03" * 8
    path = write(tmp_path, line(
        span("kvscope.store", {"kvscope.request.id": "r", "kvscope.groups": 2, "kvscope.blocks": 8},
             trace=TRACE, span_id=owner, start=T),
        group_copy("store", 1, 0, 4096, T + 100, T + 1100, owner=owner, n=1),
        group_copy("store", 0, 0, 2048, T + 100, T + 2100, owner=owner, n=2)))
    spans = traces.read_trace_files([path]).spans
    summary = traces.group_summary(spans, traces.requests_table(spans))
    assert summary["group"].tolist() == ["g0 sliding_window", "g1 full_attention"]
    assert summary["scans"].tolist() == [0, 0] and summary["blocks_loaded"].tolist() == [0, 0]
    assert summary["bytes_stored"].tolist() == [2048, 4096] and summary["bytes_loaded"].isna().all()
    assert summary["null_skip_share"].isna().all() and summary["p50_ms"].isna().all()


def test_a_group_that_only_stored_takes_its_place_in_group_order(tmp_path):
    """g1 was loaded (scanned), g0 only stored: g0's row, known from the throughput table alone, still comes
    first, its loads 0 beside g1's one."""
    owner = "03" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id="02" * 8, parent="01" * 8, trace=TRACE, start=T + 10),
        scan(1, n=1, parent="02" * 8),
        group_copy("load", 1, 0, 1000, T + 100, T + 1100, owner="02" * 8, n=1),
        span("kvscope.store", {"kvscope.request.id": "r", "kvscope.groups": 1, "kvscope.blocks": 4},
             trace=TRACE, span_id=owner, start=T + S),
        group_copy("store", 0, 0, 2048, T + S, T + S + 1000, owner=owner, n=2)))
    spans = traces.read_trace_files([path]).spans
    summary = traces.group_summary(spans, traces.requests_table(spans))
    assert summary["group"].tolist() == ["g0 sliding_window", "g1 full_attention"]
    assert summary["scans"].tolist() == [0, 1] and summary["bytes_stored"].tolist()[0] == 2048


def test_with_the_workers_file_alone_a_groups_load_counts_are_unknown_not_zero():
    """Copies only (the scheduler's file not given): the groups' rows showed 0 loads beside megabytes loaded."""
    spans = traces.read_trace_files([TWO_ROUNDS]).spans
    copies = spans[spans["name"] == "kvscope.group.copy"]
    summary = traces.group_summary(copies, traces.requests_table(copies))
    assert len(summary) == 2 and (summary["bytes_loaded"] > 0).all()
    for col in ("scans", "blocks_scanned", "blocks_null_skipped", "blocks_loaded"):
        assert summary[col].isna().all(), col


def test_request_load_quantiles_are_nearest_ranks_and_no_load_counts_zero(tmp_path):
    """No load: a count of 0 and unknown quantiles. 1000 load times (1..1000 ms): p50, p95 and p99 are the
    500th, 950th and 990th smallest."""
    spans = traces.read_trace_files([write(tmp_path, line(lookup("r")))]).spans
    (row,) = traces.load_latency_quantiles(spans, traces.requests_table(spans)).to_dict("records")
    assert (row["scope"], row["count"]) == ("request load (all groups)", 0) and math.isnan(row["p50_ms"])
    many = pd.DataFrame({"load_ms": [float(ms) for ms in range(1000, 0, -1)]})
    row = traces.load_latency_quantiles(spans, many).iloc[0]
    assert [row["count"], row["p50_ms"], row["p95_ms"], row["p99_ms"], row["max_ms"]] == [
        1000, 500.0, 950.0, 990.0, 1000.0]
