"""The overview's headline numbers on small files, and load time quantiles of many loads."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dashboard import traces

from .conftest import TWO_ROUNDS
from .test_group_copies import group_copy
from .test_joins import load, store
from .test_reader import line, lookup, write

T = 1_700_000_000_000_000_000
TRACE = "ab" * 16


def test_overview_numbers_of_a_small_file(tmp_path):
    """Two requests: a load whose one copy ends 2 ms after the load started, and a load without copies; nothing
    stored. The spans run from T to the second load's end, 1.5 s + 1 us later."""
    owner = "02" * 8
    path = write(tmp_path, line(
        lookup("r", 100, 64, span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id=owner, parent="01" * 8, trace=TRACE, start=T + 1_000_000),
        group_copy("load", 0, 0, 4096, T + 1_000_000, T + 3_000_000, owner=owner, n=1),
        lookup("s", 50, 0, span_id="03" * 8, trace="cd" * 16, start=T + 500_000_000),
        load("s", span_id="04" * 8, parent="03" * 8, trace="cd" * 16, start=T + 1_500_000_000)))  # no copy
    spans = traces.read_trace_files([path]).spans
    numbers = traces.overview_numbers(traces.requests_table(spans), spans)
    assert numbers == {
        "requests": 2, "requests_with_hit": 1, "requests_load_failed": 0, "tokens_queried": 150, "tokens_hit": 64,
        "hit_rate": 64 / 150, "loads_timed": 1, "load_p50_ms": 2.0, "load_p95_ms": 2.0, "load_p99_ms": 2.0,
        "requests_deferred": 0, "deferral_wait_p50_ms": pytest.approx(math.nan, nan_ok=True),
        "deferral_wait_max_ms": pytest.approx(math.nan, nan_ok=True), "requests_ended_waiting": 0,
        "loads": 2, "loads_without_copies": 1, "copies_without_owner": 0, "bytes_loaded": 4096, "stores": 0,
        "stores_without_copies": 0, "workers": 1, "transfers_short_of_workers": 0, "bytes_stored": 0, "spans": 5,
        "duration_s": 1.500001}


def test_a_failed_copy_moves_nothing_on_every_page_and_a_copy_of_no_load_is_counted(tmp_path):
    """A failed copy whose span still says bytes counted in the request's row and group table but not in the
    overview's total; copies in another trace (a worker without the trace context) were said missing and
    summed in the totals all the same."""
    owner = "02" * 8
    path = write(tmp_path, line(
        lookup("r", 100, 64, span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id=owner, parent="01" * 8, trace=TRACE, start=T + 1_000_000),
        group_copy("load", 0, 0, 4096, T + 1_000_000, T + 3_000_000, owner=owner, n=1),
        group_copy("load", 1, 0, 65536, T + 1_000_000, T + 3_000_000, owner=owner, n=2, failed=True),
        {**group_copy("load", 0, 0, 1000, T + 4_000_000, T + 5_000_000, owner="09" * 8, n=3), "traceId": "ee" * 16}))
    spans = traces.read_trace_files([path]).spans
    requests = traces.requests_table(spans)
    numbers = traces.overview_numbers(requests, spans)
    assert numbers["copies_without_owner"] == 1
    assert numbers["bytes_loaded"] == 4096 + 1000  # the copy of no load moved its bytes: in the total
    (row,) = requests.itertuples()
    assert row.load_failed and row.bytes_loaded == 4096
    groups = traces.request_group_copies(spans, TRACE, "r")
    assert groups["bytes"].tolist() == [4096, 0] and groups["failed"].tolist() == [False, True]


def test_the_bytes_moved_are_unknown_where_transfers_ran_and_none_of_their_copies_is_in_the_files(tmp_path):
    """The scheduler's file without the workers': "Loaded from host" said 0 B beside loads of thousands of tokens,
    and "Stored to host" 0 B beside its store spans."""
    spans = traces.read_trace_files([TWO_ROUNDS]).spans
    scheduler_only = spans[spans["name"] != "kvscope.group.copy"]
    numbers = traces.overview_numbers(traces.requests_table(scheduler_only), scheduler_only)
    assert numbers["loads"] > 0 and numbers["loads_without_copies"] == numbers["loads"]
    assert numbers["stores"] > 0 and numbers["stores_without_copies"] == numbers["stores"]
    assert math.isnan(numbers["bytes_loaded"]) and math.isnan(numbers["bytes_stored"])
    whole = traces.overview_numbers(traces.requests_table(spans), spans)
    assert whole["bytes_loaded"] > 0 and whole["bytes_stored"] > 0 and whole["stores_without_copies"] == 0


def test_overview_numbers_without_copies_or_spans(tmp_path):
    spans = traces.read_trace_files([write(tmp_path, line(lookup("r", start=T, end=T + 2_000_000_000)))]).spans
    numbers = traces.overview_numbers(traces.requests_table(spans), spans)
    assert (numbers["bytes_loaded"], numbers["bytes_stored"], numbers["duration_s"]) == (0, 0, 2.0)
    assert (numbers["workers"], numbers["transfers_short_of_workers"]) == (0, 0)  # no copy: no worker seen
    empty = traces.read_trace_files([traces.TraceSource("empty", b"")]).spans
    numbers = traces.overview_numbers(traces.requests_table(empty), empty)
    assert (numbers["requests"], numbers["spans"], numbers["duration_s"]) == (0, 0, 0.0)
    assert math.isnan(numbers["load_p50_ms"]) and math.isnan(numbers["hit_rate"])


@pytest.fixture(scope="module")
def hundred_loads() -> pd.DataFrame:
    """The two-rounds requests five times over, with load times 1..100 ms (one in five of them on engine 1,
    the first of them too)."""
    requests = traces.requests_table(traces.read_trace_files([TWO_ROUNDS]).spans)
    many = pd.concat([requests] * 5, ignore_index=True)
    return many.assign(load_ms=[float(ms) for ms in range(100, 0, -1)],
                       engine=pd.array([int(i % 5 == 0) for i in range(100)], dtype="Int64"))


def test_load_time_quantiles_are_nearest_ranks(hundred_loads):
    """Of 100 load times (1..100 ms), p50, p95 and p99 are the 50th, 95th and 99th smallest."""
    numbers = traces.request_numbers(hundred_loads)
    assert [numbers["load_p50_ms"], numbers["load_p95_ms"], numbers["load_p99_ms"]] == [50.0, 95.0, 99.0]
    assert numbers["loads_timed"] == 100


def test_engines_are_listed_in_engine_order(hundred_loads):
    table = traces.engine_summary(hundred_loads)
    assert table["engine"].tolist() == [0, 1] and table["requests"].tolist() == [80, 20]
    assert table["load_p95_ms"].tolist() == [94.0, 95.0]  # the 76th of 80, the 19th of 5, 10, .., 100 ms


def test_a_one_token_hit_is_a_hit_and_a_request_without_lookup_none(tmp_path):
    path = write(tmp_path, line(lookup("one", 1, 1, span_id="01" * 8, trace="a1" * 16, start=T),
                                lookup("miss", 100, 0, span_id="02" * 8, trace="a2" * 16, start=T + 1),
                                load("resumed", span_id="03" * 8, trace="a3" * 16, start=T + 2)))  # no lookup
    requests = traces.requests_table(traces.read_trace_files([path]).spans)
    assert len(requests) == 3 and traces.request_numbers(requests)["requests_with_hit"] == 1


def test_a_failed_store_copy_stores_nothing_in_its_requests_row(tmp_path):
    """A store's copy that failed on a worker, its span still saying bytes: the request's bytes stored are its
    other copy's, as the overview's total counts them."""
    path = write(tmp_path, line(
        lookup("r", 100, 0, span_id="01" * 8, trace=TRACE, start=T),
        store("r", span_id="02" * 8, parent="01" * 8, trace=TRACE, start=T + 1_000_000),
        group_copy("store", 0, 0, 4096, T + 1_000_000, T + 3_000_000, owner="02" * 8, n=1),
        group_copy("store", 1, 0, 65536, T + 1_000_000, T + 3_000_000, owner="02" * 8, n=2, failed=True)))
    spans = traces.read_trace_files([path]).spans
    requests = traces.requests_table(spans)
    assert requests["bytes_stored"].tolist() == [4096]
    assert traces.overview_numbers(requests, spans)["bytes_stored"] == 4096


def test_a_load_whose_only_copy_failed_is_not_a_load_without_copies(tmp_path):
    """Its copy span was read (the copy failed and moved nothing): the overview must not say a worker's file
    is missing for it, as it does for a load with no copy span."""
    owner = "02" * 8
    path = write(tmp_path, line(
        lookup("r", 100, 64, span_id="01" * 8, trace=TRACE, start=T),
        load("r", span_id=owner, parent="01" * 8, trace=TRACE, start=T + 1_000_000),
        group_copy("load", 0, 0, 0, T + 1_000_000, T + 2_000_000, owner=owner, n=1, blocks=0, failed=True)))
    spans = traces.read_trace_files([path]).spans
    requests = traces.requests_table(spans)
    assert traces.overview_numbers(requests, spans)["loads_without_copies"] == 0
    assert requests["loads_without_copies"].tolist() == [0] and requests["load_failed"].tolist() == [True]


def test_loads_with_copies_from_fewer_workers_than_the_others_are_counted_and_warned_of(tmp_path, monkeypatch):
    """Tensor parallelism 2, rank 1's file cut short: the last load has rank 0's copies only, and its bytes and
    copy time were shown as the whole with no word (the review's request 22 showed "workers 1")."""
    spans = []
    for i in range(3):
        owner = f"{0x100 + i:016x}"
        spans.append(load(f"r{i}", span_id=owner, trace=TRACE, start=T + i * 10_000_000))
        for rank in (0, 1) if i < 2 else (0,):
            spans.append(group_copy("load", 1, rank, 4096, T + i * 10_000_000, T + i * 10_000_000 + 1_000_000,
                                    owner=owner, rid=f"r{i}", n=2 * i + rank))
    path = write(tmp_path, line(*spans))
    read = traces.read_trace_files([path]).spans
    numbers = traces.overview_numbers(traces.requests_table(read), read)
    assert (numbers["workers"], numbers["transfers_short_of_workers"]) == (2, 1)
    whole = read[~((read["name"] == "kvscope.group.copy") & (read["worker_rank"] == 1))]  # TP=1: one rank everywhere
    assert traces.overview_numbers(traces.requests_table(whole), whole)["transfers_short_of_workers"] == 0
    from .test_pages import app

    at = app(monkeypatch, path)
    assert any(w.value.startswith("1 loads or stores have copy spans from fewer workers than the others (2)")
               for w in at.warning)


def test_the_slowest_loads_are_ten_by_default_with_the_tables_columns_only(hundred_loads):
    top = traces.top_slow_loads(hundred_loads)
    assert top["load_ms"].tolist() == [float(ms) for ms in range(100, 90, -1)]
    assert top.columns.tolist() == ["request", "t_s", "load_ms", "load_copy_ms", "load_wait_ms", "tokens_loaded",
                                    "bytes_loaded", "request_id", "trace_id"]
    assert top.index.tolist() == list(range(10))


def test_the_deferral_wait_median_is_a_nearest_rank(hundred_loads):
    """100 deferred requests waiting 1..100 ms: the median is the 50th smallest wait, the longest 100 ms."""
    deferred = hundred_loads.assign(deferred_lookups=1, deferred_wait_ms=[float(ms) for ms in range(100, 0, -1)])
    numbers = traces.request_numbers(deferred)
    assert (numbers["requests_deferred"], numbers["deferral_wait_p50_ms"], numbers["deferral_wait_max_ms"]) == (
        100, 50.0, 100.0)


def test_files_naming_no_engine_have_an_empty_engine_table_with_its_columns(hundred_loads):
    table = traces.engine_summary(hundred_loads.assign(engine=pd.array([pd.NA] * 100, dtype="Int64")))
    assert table.empty and table.columns.tolist() == list(traces.ENGINE_COLUMNS)


def test_the_note_on_engines_run_apart_lists_engines_in_index_order_and_the_unnamed_last():
    note = traces.engines_run_apart_note({2: 2, None: 4, 1: 3, 0: 5})
    assert ("(engine 0: 5 processes; engine 1: 3 processes; engine 2: 2 processes; no engine named: 4 processes;"
            in note)
