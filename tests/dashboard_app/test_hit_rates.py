"""Why lookups missed, on small files: the reasons most tokens not served first."""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard import traces

from .test_reader import line, lookup, write

T = 1_700_000_000_000_000_000


def missed(rid: str, queried: int, hit: int, reason: str, n: int) -> dict:
    span_ = lookup(rid, queried, hit, span_id=f"{n:016x}", trace=f"{n:032x}", start=T + n)
    span_["attributes"].append({"key": "kvscope.miss.reason", "value": {"stringValue": reason}})
    return span_


def test_reasons_are_listed_by_tokens_not_served_then_by_lookups(tmp_path):
    """Not by name: 'tail' left 50 tokens unserved, 'evicted' and 'new' 10 each ('new' in two lookups)."""
    path = write(tmp_path, line(missed("a", 20, 10, "evicted", 1), missed("b", 60, 10, "tail", 2),
                                missed("c", 5, 0, "new", 3), missed("d", 5, 0, "new", 4)))
    table = traces.misses_by_reason(traces.read_trace_files([path]).spans)
    assert table.values.tolist() == [["tail", 1, 50, pytest.approx(50 / 70)], ["new", 2, 10, pytest.approx(10 / 70)],
                                     ["evicted", 1, 10, pytest.approx(10 / 70)]]


def test_buckets_are_as_wide_as_the_run_asks_and_start_on_the_utc_clock(tmp_path):
    """Requests over 3 s + 1 ns: 0.05 s would cut it into 61 buckets, so they are 0.1 s wide; the request at
    0.06 s shares the first bucket. A one-token query that hit is a hit rate of 1."""
    path = write(tmp_path, line(lookup("a", 100, 25, span_id="01" * 8, start=T),
                                lookup("b", 1, 1, span_id="02" * 8, start=T + 60_000_000),
                                lookup("c", 1, 1, span_id="03" * 8, start=T + 3_000_000_001)))
    frame = traces.hit_rate_over_time(traces.requests_table(traces.read_trace_files([path]).spans))
    assert frame["t_s"].tolist() == [0.0, 3.0] and frame["requests"].tolist() == [2, 1]
    assert frame["hit_rate"].tolist() == [26 / 101, 1.0]
    assert frame["bucket_start"].tolist() == [pd.Timestamp(T, unit="ns", tz="UTC"),
                                              pd.Timestamp(T + 3_000_000_000, unit="ns", tz="UTC")]


ROUND_WIDTHS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900,
                  1800, 3600, 7200, 21600, 43200, 86400)


@pytest.mark.parametrize("width", ROUND_WIDTHS_S)
def test_each_round_width_is_the_one_for_59_of_its_buckets(width):
    """Every width of the list is picked for a run of 59 such buckets (the next smaller would cut it into more
    than 60)."""
    assert traces.pick_bucket_seconds(59 * width) == width


def test_buckets_are_in_time_order_whatever_the_order_of_the_requests(tmp_path):
    path = write(tmp_path, line(lookup("a", 100, 25, span_id="01" * 8, start=T),
                                lookup("b", 1, 1, span_id="02" * 8, start=T + 60_000_000),
                                lookup("c", 1, 1, span_id="03" * 8, start=T + 3_000_000_001)))
    requests = traces.requests_table(traces.read_trace_files([path]).spans)
    frame = traces.hit_rate_over_time(requests.iloc[::-1])
    assert frame["t_s"].tolist() == [0.0, 3.0] and frame["requests"].tolist() == [2, 1]
    assert frame["run"].tolist() == [1, 2]


def test_no_requests_have_an_empty_hit_rate_series_with_its_columns():
    empty = traces.requests_table(traces.read_trace_files([traces.TraceSource("empty", b"")]).spans)
    frame = traces.hit_rate_over_time(empty)
    assert frame.empty
    assert frame.columns.tolist() == ["bucket_start", "t_s", "requests", "tokens_queried", "tokens_hit", "hit_rate",
                                      "run"]
