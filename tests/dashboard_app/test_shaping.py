"""Shaping: every table the pages show, checked against numbers computed from the raw JSON."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dashboard import traces

from .conftest import MALFORMED, TWO_ROUNDS, nearest_rank
from .test_ended_waiting import deferral
from .test_joins import copy, load
from .test_reader import engine_line, line, lookup, span, write


@pytest.fixture(scope="module")
def read() -> traces.Traces:
    return traces.read_trace_files([TWO_ROUNDS])


@pytest.fixture(scope="module")
def requests(read) -> pd.DataFrame:
    return traces.requests_table(read.spans)


def test_requests_table(read, requests, expected):
    assert list(requests["request_id"]) == [s["request.id"] for s in expected.lookups]  # arrival order
    assert requests["arrival_ns"].is_monotonic_increasing
    assert requests["t_s"].iloc[0] == 0
    for lk in expected.lookups:
        row = requests.set_index("request_id").loc[lk["request.id"]]
        assert (row["tokens_queried"], row["tokens_hit"], row["trace_id"]) == (
            lk["tokens.queried"], lk["tokens.hit"], lk["trace"])
        load = expected.loads.get(lk["request.id"])
        if load is None:  # a miss: no load span
            assert pd.isna(row["load_ms"]) and pd.isna(row["tokens_external"]) and pd.isna(row["bytes_loaded"])
            continue
        assert row["load_ms"] == pytest.approx(expected.load_ms[lk["request.id"]])
        assert (row["tokens_local"], row["tokens_external"], row["groups"]) == (
            load["tokens.local"], load["tokens.external"], load["groups"])
        assert row["bytes_loaded"] == sum(c["copy.bytes"] for c in expected.copies
                                          if c["trace"] == load["trace"] and c["copy.direction"] == "load")


def test_why_the_tier_missed_sums_what_each_reasons_lookups_were_not_served(read, requests, expected):
    assert list(requests["miss_reason"]) == [s["miss.reason"] for s in expected.lookups]
    table = traces.misses_by_reason(read.spans).set_index("miss_reason")
    assert list(table.index) == ["new", "tail"]  # most tokens first
    for reason in table.index:
        lookups = [s for s in expected.lookups if s["miss.reason"] == reason]
        assert table.loc[reason, "lookups"] == len(lookups)
        assert table.loc[reason, "tokens_not_served"] == sum(s["tokens.queried"] - s["tokens.hit"] for s in lookups)
    assert table["share"].sum() == pytest.approx(1.0)


def test_the_app_explains_every_reason_the_connector_gives():
    from connector.miss_reasons import MISS_REASON_MEANINGS, MISS_REASONS

    assert set(traces.MISS_REASON_TEXT) == set(MISS_REASONS)
    assert all(f"{reason} ({MISS_REASON_MEANINGS[reason]})" in traces.MISS_REASON_DEFINITION for reason in MISS_REASONS)


def test_a_file_from_before_miss_reasons_has_none_and_no_misses_table():
    spans = traces.read_trace_files([TWO_ROUNDS.parent / "engine_gemma3_two_rounds.jsonl"]).spans
    older = traces.requests_table(spans)
    assert len(older) and older["miss_reason"].isna().all()
    assert traces.misses_by_reason(spans).empty
    assert traces.misses_by_reason(spans).columns.tolist() == list(traces.MISSES_COLUMNS)


def test_bytes_stored_only_where_store_copies_join_the_request_trace(requests, expected):
    # Odd requests' store copies are in their own trace: they count as traffic, not per request.
    stored = requests.set_index("request_id")["bytes_stored"]
    assert pd.isna(stored["cmpl-r1-01"]) and stored["cmpl-r1-00"] > 0
    assert stored.sum() < expected.bytes["store"]


def test_a_requests_load_time_splits_into_copying_and_what_came_before(requests, expected):
    """Copying: from its first copy's start to its last copy's end (all workers and groups); the rest of the
    load time came before the copies started (planning, and waiting for the step that starts them)."""
    timed = requests[requests["load_ms"].notna()].set_index("request_id")
    assert len(timed) == len(expected.load_copy_ms) > 0
    for rid, copy_ms in expected.load_copy_ms.items():
        assert timed.loc[rid, "load_copy_ms"] == pytest.approx(copy_ms)
        assert 0 < timed.loc[rid, "load_copy_ms"] < timed.loc[rid, "load_ms"]
        assert timed.loc[rid, "load_wait_ms"] == pytest.approx(timed.loc[rid, "load_ms"] - copy_ms)
    assert requests.loc[requests["load_ms"].isna(), ["load_copy_ms", "load_wait_ms"]].isna().all().all()


def test_a_copy_starting_just_before_its_load_leaves_no_negative_wait(tmp_path):
    """A worker's clock a little behind the scheduler's (the copy starts 0.5 ms before its load: within the 1 ms
    kept): copying took the whole load time and longer, and the wait before it is 0 ms, not -0.5."""
    t = 1_700_000_000_000_000_000
    path = write(tmp_path, line(lookup("r", span_id="01" * 8, start=t),
                                load("r", span_id="02" * 8, parent="01" * 8, start=t + 1_000_000),
                                copy("load", 4096, "r", span_id="03" * 8, parent="02" * 8, start=t + 500_000,
                                     end=t + 3_000_000)))
    (row,) = traces.requests_table(traces.read_trace_files([path]).spans).to_dict("records")
    assert (row["load_ms"], row["load_copy_ms"], row["load_wait_ms"]) == pytest.approx((2.0, 2.5, 0.0))


def test_a_requests_device_hit_comes_from_its_lookup_even_without_a_load(tmp_path):
    """A short query after a long device prefix-cache hit is not a short prompt: the lookup says how many
    tokens the device had (newer files); older files, without it, fall back to the load's."""
    device_hit = span("kvscope.lookup", {"kvscope.request.id": "long", "kvscope.tokens.queried": 50,
                                         "kvscope.tokens.hit": 0, "kvscope.miss.reason": "tail",
                                         "kvscope.tokens.local": 1280}, span_id="01" * 8)
    short = span("kvscope.lookup", {"kvscope.request.id": "short", "kvscope.tokens.queried": 100,
                                    "kvscope.tokens.hit": 0, "kvscope.miss.reason": "tail",
                                    "kvscope.tokens.local": 0}, trace="cd" * 16, span_id="02" * 8)
    older = lookup("older", 100, 64, trace="ef" * 16, span_id="03" * 8)  # no kvscope.tokens.local
    older_load = span("kvscope.load", {"kvscope.request.id": "older", "kvscope.tokens.local": 32,
                                       "kvscope.tokens.external": 64, "kvscope.groups": 1},
                      trace="ef" * 16, span_id="04" * 8, parent="03" * 8)
    read = traces.read_trace_files([write(tmp_path, line(device_hit, short, older, older_load))])
    table = traces.requests_table(read.spans).set_index("request_id")
    assert table.loc["long", "tokens_local"] == 1280 and table.loc["long", "tokens_queried"] == 50
    assert table.loc["short", "tokens_local"] == 0
    assert table.loc["older", "tokens_local"] == 32


def test_a_request_looked_up_again_keeps_the_device_hit_of_its_first_lookup(tmp_path):
    """A request looked up again (its load failed, or it resumed after preemption) may find more on the device
    the second time: its row keeps the first lookup's device hit, the one beside its first load's external
    tokens (the load its hit planned), so local + external is the prompt prefix that hit first."""
    t = 1_700_000_000_000_000_000
    first = span("kvscope.lookup", {"kvscope.request.id": "again", "kvscope.tokens.queried": 100,
                                    "kvscope.tokens.hit": 64, "kvscope.tokens.local": 32}, span_id="01" * 8, start=t)
    first_load = span("kvscope.load", {"kvscope.request.id": "again", "kvscope.tokens.local": 32,
                                       "kvscope.tokens.external": 64, "kvscope.groups": 1},
                      span_id="02" * 8, parent="01" * 8, start=t + 1000)
    second = span("kvscope.lookup", {"kvscope.request.id": "again", "kvscope.tokens.queried": 36,
                                     "kvscope.tokens.hit": 0, "kvscope.tokens.local": 96}, span_id="03" * 8,
                  start=t + 10**9)
    read = traces.read_trace_files([write(tmp_path, line(second, first, first_load))])  # not in time order
    (row,) = traces.requests_table(read.spans).itertuples()
    assert (row.tokens_local, row.tokens_external, row.lookups) == (32, 64, 2)


def test_overall_hit_rate_and_numbers(read, requests, expected):
    assert traces.hit_rate(requests) == pytest.approx(expected.hit_rate)
    numbers = traces.overview_numbers(requests, read.spans)
    assert numbers["requests"] == 20 and numbers["requests_with_hit"] == 10
    assert [numbers["load_p50_ms"], numbers["load_p95_ms"], numbers["load_p99_ms"]] == pytest.approx(
        list(expected.load_quantiles))
    assert (numbers["bytes_loaded"], numbers["bytes_stored"]) == (expected.bytes["load"], expected.bytes["store"])


def test_per_engine_numbers_split_the_overall_ones(requests, expected):
    """Each engine's row is the overview's numbers over its requests alone; requests of no engine (older
    files) are in none, and a file naming no engine has no rows."""
    assert traces.engine_summary(requests).empty
    split = requests.assign(engine=pd.array([i % 2 if i < 18 else None for i in range(len(requests))],
                                            dtype="Int64"))
    table = traces.engine_summary(split).set_index("engine")
    assert list(table.index) == [0, 1]
    for engine in (0, 1):
        mine = split[split["engine"] == engine]
        assert table.loc[engine, "requests"] == len(mine) == 9
        assert table.loc[engine, "tokens_hit"] == mine["tokens_hit"].sum()
        assert table.loc[engine, "hit_rate"] == pytest.approx(mine["tokens_hit"].sum() / mine["tokens_queried"].sum())
        assert table.loc[engine, "load_p50_ms"] == pytest.approx(nearest_rank(mine["load_ms"].dropna(), 50))
    assert table["tokens_queried"].sum() == split["tokens_queried"].iloc[:18].sum()


def test_hit_rate_over_time(requests, expected):
    frame = traces.hit_rate_over_time(requests, bucket_s=1.0)
    # Round 1 (all misses) within the first second, round 2 (hits) about 2.4 s later.
    assert list(frame["t_s"]) == [0.0, 2.0]
    assert list(frame["requests"]) == [10, 10]
    assert frame["run"].iloc[0] != frame["run"].iloc[1]  # bucket 1 is empty: the chart's line breaks there
    assert frame["hit_rate"].iloc[0] == 0
    round2 = expected.lookups[10:]
    assert frame["hit_rate"].iloc[1] == pytest.approx(
        sum(s["tokens.hit"] for s in round2) / sum(s["tokens.queried"] for s in round2))
    assert frame["tokens_queried"].sum() == sum(s["tokens.queried"] for s in expected.lookups)
    auto = traces.hit_rate_over_time(requests)
    assert len(auto) <= 60 and auto["requests"].sum() == 20
    steps = auto["t_s"].diff().round(9)  # consecutive buckets share a run, a gap starts the next
    width = steps.min()
    assert ((auto["run"].diff() == 0) == (steps == width)).all()
    assert auto["run"].nunique() == 1 + (steps > width).sum()


@pytest.mark.parametrize(("duration", "width"), [(0, 0.001), (0.05, 0.001), (2.7, 0.05), (60, 1), (61, 2), (3600, 60),
                                                      (1e9, 86400)])
def test_bucket_width_is_round_and_bounded(duration, width):
    assert traces.pick_bucket_seconds(duration) == width


def test_null_skip_per_group(read, requests, expected):
    skip = traces.null_skip_by_group(read.spans).set_index("group_index")
    for g in (0, 1):
        scans = [s for s in expected.scans if s["group.index"] == g]
        assert skip.loc[g, "blocks_scanned"] == sum(s["group.blocks.total"] for s in scans)
        assert skip.loc[g, "blocks_loaded"] == sum(s["group.blocks.pending"] for s in scans)
        assert skip.loc[g, "null_skip_share"] == pytest.approx(
            sum(s["group.blocks.null_skipped"] for s in scans) / sum(s["group.blocks.total"] for s in scans))
    assert skip.loc[0, "group_kind"] == "sliding_window" and skip.loc[0, "null_skip_share"] > 0.5
    assert skip.loc[1, "null_skip_share"] == 0
    # no hit rate per group: a lookup is joint over the groups (it would read as each group's share)
    assert "hit_rate" not in traces.group_summary(read.spans, requests).columns


def test_latency_quantiles_and_distribution(read, requests, expected):
    q = traces.load_latency_quantiles(read.spans, requests)
    assert q["scope"].tolist() == ["request load (all groups)", "copy g0 sliding_window", "copy g1 full_attention"]
    assert q.iloc[0][["p50_ms", "p95_ms", "p99_ms"]].tolist() == pytest.approx(list(expected.load_quantiles))
    for g, row in zip((0, 1), q.iloc[1:].itertuples()):
        durations = [(c["end"] - c["start"]) / 1e6 for c in expected.copies
                     if c["group.index"] == g and c["copy.direction"] == "load"]
        assert [row.p50_ms, row.p95_ms, row.p99_ms] == pytest.approx([nearest_rank(durations, p) for p in (50, 95, 99)])
        assert row.count == len(durations)
    dist = traces.load_latency_distribution(read.spans, requests)
    assert dist["series"].value_counts().to_dict() == {
        "request load": 10, "copy g0 sliding_window": 10, "copy g1 full_attention": 10}


def test_copy_throughput(read, expected):
    tp = traces.copy_throughput(read.spans).set_index(["group_index", "direction"])
    assert len(tp) == 4
    for (g, d), row in tp.iterrows():
        copies = [c for c in expected.copies if c["group.index"] == g and c["copy.direction"] == d]
        seconds = sum(c["end"] - c["start"] for c in copies) / 1e9
        assert row["gb_per_s"] == pytest.approx(sum(c["copy.bytes"] for c in copies) / seconds / 1e9)
        assert row["copies"] == len(copies)
    # The fixture copies at 6-12 GB/s, one slow load at 1.5 GB/s.
    assert tp["p50_gb_per_s"].between(6, 12).all()


def test_group_summary_joins_the_per_group_tables(read, requests):
    summary = traces.group_summary(read.spans, requests)
    assert summary["group"].tolist() == ["g0 sliding_window", "g1 full_attention"]
    assert {"null_skip_share", "p95_ms", "bytes_loaded", "load_gb_per_s", "bytes_stored",
            "store_gb_per_s"} <= set(summary.columns)


def test_top_slow_loads(requests, expected):
    top = traces.top_slow_loads(requests, 3)
    slowest = sorted(expected.load_ms.items(), key=lambda kv: -kv[1])[:3]
    assert top["request_id"].tolist() == [rid for rid, _ in slowest]
    assert top["request_id"].iloc[0] == "cmpl-r2-06"  # the fixture's slow copy
    # where each load's time went: copying, and the rest before the first copy
    assert (top["load_copy_ms"] + top["load_wait_ms"]).tolist() == pytest.approx(top["load_ms"].tolist())
    assert (top["load_copy_ms"] > 0).all() and (top["load_wait_ms"] >= 0).all()


def test_waterfall_of_a_hit(read, requests, expected):
    rows = traces.waterfall_rows(read.spans, requests, "cmpl-r2-06")
    assert rows["row"].tolist() == ["lookup", "load", "group.scan g0 sliding_window", "group.scan g1 full_attention",
                                    "copy load g0 sliding_window rank 0", "copy load g1 full_attention rank 0"]
    assert rows["start_ms"].iloc[0] == 0
    load = expected.loads["cmpl-r2-06"]
    lookup_start = next(s["start"] for s in expected.lookups if s["request.id"] == "cmpl-r2-06")
    assert rows["end_ms"].max() == pytest.approx(expected.load_ms["cmpl-r2-06"] + (load["start"] - lookup_start) / 1e6)
    assert rows["attributes"].iloc[2].startswith("blocks.total=34, blocks.null_skipped=26, blocks.pending=8, ")
    assert rows["attributes"].iloc[4] == "blocks=8, bytes=10485760, worker.rank=0"
    assert rows["attributes"].iloc[1] == "tokens.local=0, tokens.external=544, groups=2"


def test_waterfall_of_a_miss_with_its_store(read, requests):
    rows = traces.waterfall_rows(read.spans, requests, "cmpl-r1-00")
    assert rows["row"].tolist() == ["lookup", "store", "copy store g0 sliding_window rank 0",
                                    "copy store g1 full_attention rank 0"]
    assert traces.waterfall_rows(read.spans, requests, "no-such-request").empty


def test_waterfall_includes_extra_attributes():
    read = traces.read_trace_files([MALFORMED])
    requests = traces.requests_table(read.spans)
    rows = traces.waterfall_rows(read.spans, requests, "c4")
    assert rows["attributes"].iloc[0] == "tokens.queried=200, tokens.hit=0, kvscope.lookup.cached=False"


def test_replay(read, requests, expected):
    timeline = traces.replay_timeline(requests, read.spans)
    assert timeline["step"].tolist() == list(range(1, 21))
    for step in (1, 10, 11, 15, 20):
        state = traces.replay_state(timeline, step)
        assert state["request_id"] == expected.lookups[step - 1]["request.id"]
        assert state["cum_hit_rate"] == pytest.approx(expected.cumulative_hit_rate(step))
        cutoff = expected.lookups[step]["start"] if step < 20 else math.inf
        for d, col in (("load", "cum_bytes_loaded"), ("store", "cum_bytes_stored")):
            assert state[col] == sum(c["copy.bytes"] for c in expected.copies
                                     if c["copy.direction"] == d and c["end"] <= cutoff)
    assert traces.replay_state(timeline, 99)["step"] == 20 and traces.replay_state(timeline, -3)["step"] == 1
    with pytest.raises(ValueError):
        traces.replay_state(timeline.iloc[:0], 1)


def test_the_replays_host_traffic_counts_copies_that_ran_and_had_ended_by_the_next_arrival(tmp_path):
    """A store copy ending at the very nanosecond the next request arrives had finished by then: step 1 counts
    it. A failed copy whose span still says bytes moved none, at any step, as on every page."""
    t = 1_700_000_000_000_000_000
    failed = copy("load", 65536, "b", span_id="06" * 8, parent="05" * 8, trace="cd" * 16, start=t + 1010,
                  end=t + 1020)
    failed["status"] = {"code": 2}
    path = write(tmp_path, line(
        lookup("a", 100, 0, span_id="01" * 8, start=t),
        span("kvscope.store", {"kvscope.request.id": "a", "kvscope.groups": 1, "kvscope.blocks": 1},
             span_id="02" * 8, parent="01" * 8, start=t + 10),
        copy("store", 4096, "a", span_id="03" * 8, parent="02" * 8, start=t + 20, end=t + 1000),
        lookup("b", 100, 64, span_id="04" * 8, trace="cd" * 16, start=t + 1000),
        load("b", span_id="05" * 8, parent="04" * 8, trace="cd" * 16, start=t + 1005),
        copy("load", 512, "b", span_id="07" * 8, parent="05" * 8, trace="cd" * 16, start=t + 1010, end=t + 1030),
        failed))
    spans = traces.read_trace_files([path]).spans
    timeline = traces.replay_timeline(traces.requests_table(spans), spans)
    assert timeline[["cum_bytes_stored", "cum_bytes_loaded"]].values.tolist() == [[4096, 0], [4096, 512]]


@pytest.mark.parametrize("total, unit", [(0, "B"), (999, "B"), (1000, "kB"), (13_500_000, "MB"), (2e9, "GB")])
def test_byte_units_read_from_1_to_999(total, unit):
    from dashboard import charts

    assert charts.byte_unit(total)[0] == unit


def test_the_replay_traffic_axis_is_in_the_unit_of_the_whole_replays_total(read, requests):
    """A 13.5 MB replay read 0.000 to 0.010 GB on its axis."""
    from dashboard import charts

    timeline = traces.replay_timeline(requests, read.spans)
    total = max(timeline["cum_bytes_loaded"].max(), timeline["cum_bytes_stored"].max())
    chart = charts.replay_traffic(timeline, 1).to_dict()
    assert chart["encoding"]["y"]["title"] == f"host traffic ({charts.byte_unit(total)[0]})"


def test_search(requests):
    assert traces.search_requests(requests, "R2-0").shape[0] == 10
    shown = traces.search_requests(requests, "", show="hits or loads")
    loaded = requests[(requests["tokens_hit"] > 0) | (requests["loads"] > 0)]
    assert len(shown) == len(loaded) > 0 and set(shown["request_id"]) == set(loaded["request_id"])
    assert len(shown) < len(requests)  # the misses are left out
    trace = requests["trace_id"].iloc[3]
    assert traces.search_requests(requests, trace[:12])["request_id"].tolist() == [requests["request_id"].iloc[3]]


def test_search_by_the_reason_a_hit_stopped(requests):
    """The Overview's reasons open the Requests page listing the requests whose hit stopped for one of them."""
    new = traces.search_requests(requests, "", reasons=["new"])
    assert len(new) == (requests["miss_reason"] == "new").sum() > 0 and set(new["miss_reason"]) == {"new"}
    both = traces.search_requests(requests, "", reasons=("new", "tail"))
    assert len(both) == requests["miss_reason"].isin(["new", "tail"]).sum() > len(new)
    assert traces.search_requests(requests, "", reasons=["evicted"]).empty
    assert len(traces.search_requests(requests, "", reasons=[])) == len(requests)  # none picked: every request
    assert set(traces.search_requests(requests, "", show="hits or loads", reasons=["tail"])["miss_reason"]) == {"tail"}


def test_the_reasons_offered_to_search_by_are_every_lookups_once_and_sorted(requests):
    """The Requests page offers each reason a lookup's hit stopped for once, in order: an earlier lookup's too (a
    request's `miss_reasons` joins them with "|"); requests that recorded none (older files) offer none."""
    assert traces.miss_reasons_of(requests) == ["new", "tail"]
    several = pd.DataFrame({"miss_reasons": ["tail|new", pd.NA, "evicted", "new"]})
    assert traces.miss_reasons_of(several) == ["evicted", "new", "tail"]
    assert traces.miss_reasons_of(several.iloc[[1]]) == []


def test_every_lookup_counts_and_copies_join_their_load(tmp_path):
    """A request looked up twice (its first load failed: a recompute) counts both lookups, as
    kvscope_lookup_tokens_total and kvscope_hit_tokens_total do."""
    trace = "ef" * 16
    t = 1_700_000_000_000_000_000
    path = write(
        tmp_path,
        line(lookup("r", 100, 0, trace=trace, span_id="01" * 8, start=t),
             lookup("r", 100, 64, trace=trace, span_id="02" * 8, start=t + 5_000_000),
             span("kvscope.load", {"kvscope.request.id": "r", "kvscope.tokens.local": 0, "kvscope.tokens.external": 64,
                                   "kvscope.groups": 1}, trace=trace, span_id="03" * 8, start=t + 6_000_000)),
        # No parent span id: joins the load as the only load in its trace.
        line(span("kvscope.group.copy", {"kvscope.group.index": 0, "kvscope.group.kind": "mamba",
                                         "kvscope.copy.direction": "load", "kvscope.copy.blocks": 1,
                                         "kvscope.copy.bytes": 512}, trace=trace, span_id="04" * 8,
                  start=t + 7_000_000, end=t + 9_000_000)),
    )
    read = traces.read_trace_files([path])
    requests = traces.requests_table(read.spans)
    row = requests.iloc[0]
    assert len(requests) == 1 and row["lookups"] == 2
    assert (row["tokens_queried"], row["tokens_hit"]) == (200, 64)  # both lookups
    assert row["arrival_ns"] == t  # the first lookup
    assert row["load_ms"] == 3.0 and row["bytes_loaded"] == 512  # exact: 3,000,000 ns
    assert row["load_copy_ms"] == 2.0  # its one load's copy, 2,000,000 ns
    assert traces.hit_rate(requests) == pytest.approx(64 / 200) and row["hit_rate"] == pytest.approx(64 / 200)


def test_spans_of_a_request_starting_at_the_same_time_are_taken_in_the_order_they_were_written(tmp_path):
    """A clock coarser than a nanosecond can give two spans of a request one start; the one written later was
    recorded later. So a request's miss reason is its later-written lookup's, its external tokens its
    earlier-written load's (the one its hit planned), and a request that ended waiting twice takes its
    later-written wait's. Ten of each span: enough that a sort that does not keep ties in order reorders some."""
    t = 1_700_000_000_000_000_000
    written = []
    for k in range(5):
        start = t + (3 * k % 5) * 1000  # the requests out of time order in the file
        for j, (reason, external) in enumerate((("evicted", 16), ("tail", 32))):
            first_or_again = lookup(f"r{k}", 100, 10 * j, span_id=f"{k:02d}{j:02d}" * 4, start=start)
            first_or_again["attributes"].append({"key": "kvscope.miss.reason", "value": {"stringValue": reason}})
            loaded = load(f"r{k}", span_id=f"{k:02d}{j + 2:02d}" * 4, start=start)
            (tokens,) = (a for a in loaded["attributes"] if a["key"] == "kvscope.tokens.external")
            tokens["value"] = {"intValue": str(external)}
            written += [first_or_again, loaded,
                        deferral(f"w{k}", 1, 10, external=external, span_id=f"{k:02d}{j + 4:02d}" * 4, start=start)]
    requests = traces.requests_table(traces.read_trace_files([write(tmp_path, line(*written))]).spans)
    by_id = requests.set_index("request_id")
    assert by_id.loc[[f"r{k}" for k in range(5)], ["miss_reason", "tokens_external"]].values.tolist() == [
        ["tail", 16]] * 5
    assert by_id.loc[[f"w{k}" for k in range(5)], "tokens_external"].tolist() == [32] * 5


def test_requests_arrive_at_seconds_since_the_first(tmp_path):
    t = 1_700_000_000_000_000_000
    path = write(tmp_path, line(lookup("r1", span_id="01" * 8, start=t),
                                lookup("r2", span_id="02" * 8, start=t + 1_500_000_000)))
    requests = traces.requests_table(traces.read_trace_files([path]).spans)
    assert requests["t_s"].tolist() == [0, 1.5]
    assert traces.find_request(requests, "ab" * 16, "r2")["t_s"] == 1.5
    with pytest.raises(KeyError):  # the replay page's request gone from the rows
        traces.find_request(requests, "ab" * 16, "r3")


def test_an_empty_requests_table_has_the_column_types_of_a_full_one(tmp_path):
    def types(requests):  # text columns may be str or object alike
        return {col: str(t) for col, t in requests.dtypes.items() if str(t) not in ("str", "object")}

    full = traces.requests_table(traces.read_trace_files([write(tmp_path, line(lookup("r1")))]).spans)
    empty = traces.requests_table(traces.read_trace_files([traces.TraceSource("empty", b"")]).spans)
    assert len(full) == 1 and empty.empty
    assert types(empty) == types(full) and {"arrival", "hit_rate", "loads", "load_failed", "engine"} <= set(types(full))


def test_a_hit_without_a_load_and_a_load_without_a_hit_are_both_hits_or_loads(tmp_path):
    """vLLM may take none of a hit (no load), and a request resumed after preemption loads with no hit."""
    path = write(tmp_path, line(lookup("hit", 100, 64, span_id="01" * 8, trace="a1" * 16),
                                lookup("resumed", 100, 0, span_id="02" * 8, trace="a2" * 16),
                                load("resumed", span_id="03" * 8, parent="02" * 8, trace="a2" * 16),
                                lookup("miss", 100, 0, span_id="04" * 8, trace="a3" * 16),
                                lookup("one", 1, 1, span_id="05" * 8, trace="a4" * 16)))  # a one-token prompt, hit
    spans = traces.read_trace_files([path]).spans
    requests = traces.requests_table(spans)
    loads = traces.load_rows(spans)  # the load has no copy (its worker's file not read)
    assert loads[["request_id", "span_id", "start_ns", "copies"]].values.tolist() == [
        ["resumed", "03" * 8, 1_700_000_000_000_000_000, 0]]
    assert traces.overview_numbers(requests, spans)["loads_without_copies"] == 1
    assert sorted(traces.search_requests(requests, "", show="hits or loads")["request_id"]) == ["hit", "one", "resumed"]
    assert list(traces.search_requests(requests, "", show="misses")["request_id"]) == ["miss"]
    assert traces.search_requests(requests, ".").empty  # text, not a pattern: no id holds a dot
    assert traces.search_requests(requests, "", show="failed loads").empty  # no load is no failed load
    assert not requests["load_failed"].any() and not requests["load_mistimed"].any()
    assert requests.set_index("request_id")["hit_rate"].to_dict() == pytest.approx(
        {"hit": 0.64, "resumed": 0, "miss": 0, "one": 1})


def test_a_request_with_no_load_has_no_load_without_copies(tmp_path):
    """The request view warns of a request's loads that have no copy span: a miss (no load) has none to warn of,
    a load whose worker's file was not read is one."""
    path = write(tmp_path, line(lookup("miss", 100, 0, span_id="01" * 8, trace="a1" * 16),
                                lookup("hit", 100, 64, span_id="02" * 8, trace="a2" * 16),
                                load("hit", span_id="03" * 8, parent="02" * 8, trace="a2" * 16)))
    requests = traces.requests_table(traces.read_trace_files([path]).spans).set_index("request_id")
    assert requests[["loads", "loads_without_copies"]].to_dict("index") == {
        "miss": {"loads": 0, "loads_without_copies": 0}, "hit": {"loads": 1, "loads_without_copies": 1}}


def test_a_request_without_lookup_arrives_at_its_first_load(tmp_path):
    t = 1_700_000_000_000_000_000
    load = {"kvscope.request.id": "r", "kvscope.tokens.local": 0, "kvscope.tokens.external": 64, "kvscope.groups": 1}
    path = write(tmp_path, line(span("kvscope.load", load, span_id="01" * 8, start=t),
                                span("kvscope.load", load, span_id="02" * 8, start=t + 9_000_000)))  # resumed
    requests = traces.requests_table(traces.read_trace_files([path]).spans)
    assert requests["arrival_ns"].tolist() == [t] and requests["loads"].tolist() == [2]
    assert requests["lookups"].tolist() == [0]


def test_a_failed_load_and_its_second_lookup_both_count(tmp_path):
    """A request whose load failed may be looked up again (when it restarts from nothing); Prometheus counts
    every recorded lookup (kvscope_lookup_tokens_total / kvscope_hit_tokens_total), and so does the table."""
    t = 1_700_000_000_000_000_000
    failed = copy("load", 0, "r", span_id="03" * 8, parent="02" * 8, start=t + 20)
    failed["status"] = {"code": 2}
    path = write(tmp_path, line(
        lookup("r", 4711, 1024, span_id="01" * 8, start=t),
        load("r", span_id="02" * 8, parent="01" * 8, start=t + 10), failed,
        lookup("r", 1566, 0, span_id="04" * 8, parent="01" * 8, start=t + 30)))
    requests = traces.requests_table(traces.read_trace_files([path]).spans)
    (row,) = requests.itertuples(index=False)
    assert (row.tokens_queried, row.tokens_hit, row.lookups, row.load_failed) == (6277, 1024, 2, True)
    assert traces.hit_rate(requests) == pytest.approx(1024 / 6277)
    assert "may be looked up again; every recorded lookup counts" in traces.HIT_RATE_DEFINITION  # not always


def test_a_request_missed_for_its_last_lookups_reason_and_each_lookup_counts_under_its_own(tmp_path):
    t = 1_700_000_000_000_000_000
    first = lookup("r", 4711, 1024, span_id="01" * 8, start=t)
    again = lookup("r", 1566, 0, span_id="04" * 8, parent="01" * 8, start=t + 30)
    other = lookup("s", 300, 0, span_id="05" * 8, trace="ef" * 16, start=t + 40)
    for span_, reason in ((first, "evicted"), (again, "load_failed"), (other, "evicted")):
        span_["attributes"].append({"key": "kvscope.miss.reason", "value": {"stringValue": reason}})
    spans = traces.read_trace_files([write(tmp_path, line(first, again, other))]).spans
    assert traces.requests_table(spans).set_index("request_id")["miss_reason"].to_dict() == {
        "r": "load_failed", "s": "evicted"}
    table = traces.misses_by_reason(spans).set_index("miss_reason")
    assert table.loc["evicted", ["lookups", "tokens_not_served"]].tolist() == [2, 4711 - 1024 + 300]
    assert table.loc["load_failed", ["lookups", "tokens_not_served"]].tolist() == [1, 1566]


def test_search_filters(requests):
    hits = traces.search_requests(requests, "", show="hits or loads")
    misses = traces.search_requests(requests, "", show="misses")
    assert len(hits) + len(misses) == len(requests) and not set(hits["request"]) & set(misses["request"])
    assert (misses["tokens_hit"] == 0).all() and (misses["loads"] == 0).all()
    failed = requests.assign(load_failed=requests["request_id"] == "cmpl-r2-03")
    assert traces.search_requests(failed, "", show="failed loads")["request_id"].tolist() == ["cmpl-r2-03"]
    with pytest.raises(ValueError, match="expected one of all, hits or loads, misses, failed loads"):
        traces.search_requests(requests, "", show="hits")


def test_a_selection_follows_its_request():
    from dashboard.selection import follow_selection

    before = [("t1", "a"), ("t1", "b"), ("t2", "b")]
    assert follow_selection([2], before, [("t2", "b"), ("t1", "a")]) == 0
    assert follow_selection([1], before, [("t2", "b")]) is None  # not shown now
    assert follow_selection([], before, before) is None and follow_selection([5], before, before) is None


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0004, "0.4 ms"), (0.85, "850 ms"), (42.46, "42.5 s"), (185, "3 min 5 s"), (10_920, "3 h 2 min"),
    (95_981_990.9, "1110.9 d"), (math.nan, "–"),
    # where rounding reaches the next unit
    (0.9994, "999 ms"), (0.9996, "1.0 s"), (59.94, "59.9 s"), (59.97, "1 min 0 s"), (3599.4, "59 min 59 s"),
    (3599.6, "1 h 0 min"), (-0.9996, "-1.0 s"), (86_399.4, "23 h 59 min"), (86_400, "1.0 d")])
def test_durations_read_in_their_units(seconds, text):
    from dashboard import formatting

    assert formatting.duration(seconds) == text


def test_names_are_listed_briefly():
    from dashboard import formatting

    assert formatting.names(["a", "b"]) == "a, b"
    assert formatting.names("abcde") == "a, b, c, d, e"  # five, the default limit: all named, no "and 0 more"
    assert formatting.names([f"r{i}" for i in range(8)], limit=3) == "r0, r1, r2 and 5 more"


def test_a_request_without_a_lookup_takes_its_loads_engine(tmp_path):
    """Its lookup not read (a file cut before it): the engine its load names is the request's."""
    path = write(tmp_path, engine_line({"intValue": "1"}, load("r", span_id="11" * 8)))
    requests = traces.requests_table(traces.read_trace_files([path]).spans)
    assert requests["engine"].tolist() == [1] and traces.engines_of(requests) == [1]


def test_engines_are_listed_in_engine_order_not_in_order_of_arrival(tmp_path):
    """Engine 1's request arrived first: the engine filter still offers engine 0 first."""
    t = 1_700_000_000_000_000_000
    path = write(tmp_path, engine_line({"intValue": "1"}, lookup("a", span_id="11" * 8, start=t)),
                 engine_line({"intValue": "0"}, lookup("b", span_id="22" * 8, trace="cd" * 16, start=t + 1)))
    assert traces.engines_of(traces.requests_table(traces.read_trace_files([path]).spans)) == [0, 1]
