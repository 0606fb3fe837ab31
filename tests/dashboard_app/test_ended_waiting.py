"""Requests that ended (aborted: a client gave up?) while kvscope deferred their loads for device KV room: a
`kvscope.deferral` span of their own, which is the wait itself. Each gets a row (arriving at the span's start,
no hit invented, `ended_waiting`), is said in words and drawn as the wait bar in the request view, and counted on
the Overview; the hit rates leave them out, and a file without such spans shows none of it."""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard import charts, formatting, traces, widgets

from .test_deferrals import DEFERRAL_COLUMNS, MS, T, WAIT, deferred_lookup
from .test_group_copies import group_copy
from .test_joins import load
from .test_pages import app, assert_ok, metrics
from .test_reader import line, lookup, span, write

ENDED = "ended_waiting"


def deferral(rid: str, lookups: int, wait_us: int, *, external: int = 128, start: int = T,
             engine: int | None = None, outcome: str | None = None, **kw) -> dict:
    """The span of a request that ended waiting: from its first deferred lookup (`start`) to its end. With
    `outcome` "admitted": resumed after a preemption, then admitted with nothing to load."""
    attrs = {"kvscope.request.id": rid, "kvscope.tokens.external": external, "kvscope.deferred.lookups": lookups,
             "kvscope.deferred.wait_us": wait_us}
    if outcome is not None:
        attrs["kvscope.deferred.outcome"] = outcome
    if engine is not None:
        attrs["kvscope.engine"] = engine
    return span(traces.DEFERRAL, attrs, start=start, end=start + 1000 * wait_us, **kw)


@pytest.fixture
def ended(tmp_path) -> traces.Traces:
    """q: not deferred, a miss; v: ended after waiting 3.5 ms (2 lookups), its span the root of its own trace; r: deferred
    3 times (12.4 ms), then admitted and loaded; u: ended after waiting 1.2 s (40 lookups) on engine 1, its span a
    child of the upstream span it came with; w: admitted and loaded, then (resumed after a preemption) ended
    waiting 4 ms (2 lookups) to load again."""
    path = write(tmp_path, line(
        lookup("q", hit=0, trace="cd" * 16, span_id="09" * 8, start=T),
        deferral("v", 2, 3_500, external=64, trace="aa" * 16, span_id="0b" * 8, start=T + 5 * MS),
        deferred_lookup("r", 3, 12_400, span_id="01" * 8, start=T + 20 * MS),
        load("r", span_id="02" * 8, parent="01" * 8, start=T + 21 * MS),
        group_copy("load", 0, 0, 1000, T + 22 * MS, T + 24 * MS, owner="02" * 8, n=1),
        deferral("u", 40, 1_200_000, engine=1, trace="ef" * 16, span_id="0c" * 8, parent="ee" * 8,
                 start=T + 25 * MS),
        lookup("w", trace="12" * 16, span_id="07" * 8, parent="ff" * 8, start=T + 40 * MS),
        load("w", trace="12" * 16, span_id="08" * 8, parent="07" * 8, start=T + 41 * MS),
        deferral("w", 2, 4_000, external=16, trace="12" * 16, span_id="0d" * 8, parent="ff" * 8,
                 start=T + 60 * MS)))
    read = traces.read_trace_files([path])
    assert read.problems == []
    return read


def requests_by_id(read: traces.Traces) -> pd.DataFrame:
    return traces.requests_table(read.spans).set_index("request_id")


def test_a_request_that_ended_waiting_has_a_row_with_its_wait_and_no_hit_invented(ended):
    requests = requests_by_id(ended)
    assert requests[ENDED].dtype == bool
    assert requests[ENDED].to_dict() == {"q": False, "v": True, "r": False, "u": True, "w": True}
    u = requests.loc["u"]
    assert u[DEFERRAL_COLUMNS].tolist() == [40, 1200.0]
    assert (u["tokens_external"], u["engine"], u["lookups"], u["loads"], u["load_failed"]) == (128, 1, 0, 0, False)
    never_counted = ["tokens_queried", "tokens_hit", "hit_rate", "miss_reason", "tokens_local", "groups",
                     "tokens_loaded", "load_ms", "bytes_loaded"]
    assert u[never_counted].isna().all(), u[never_counted]
    assert requests.loc["v", [*DEFERRAL_COLUMNS, "tokens_external"]].tolist() == [2, 3.5, 64]


def test_one_admitted_before_a_preemption_sums_its_waits_and_keeps_its_hit_and_first_load(ended):
    w = requests_by_id(ended).loc["w"]
    assert w[[*DEFERRAL_COLUMNS, ENDED]].tolist() == [2, 4.0, True]
    assert w[["tokens_queried", "tokens_hit", "tokens_external", "lookups", "loads"]].tolist() == [100, 64, 16, 1, 1]


def test_a_resumed_request_admitted_with_nothing_to_load_sums_its_wait_but_did_not_end_waiting(tmp_path):
    """a: looked up and loaded, preempted, deferred on resuming, then admitted with nothing to load (its hit had
    left the tier): its `kvscope.deferral` span says "admitted". Its wait counts; it did not end waiting, and its
    external tokens stay its load's. z: the same span saying "ended" (as every older file's says nothing)."""
    path = write(tmp_path, line(
        lookup("a", trace="12" * 16, span_id="07" * 8, start=T),
        load("a", trace="12" * 16, span_id="08" * 8, parent="07" * 8, start=T + MS),
        deferral("a", 3, 6_000, external=128, trace="12" * 16, span_id="0d" * 8, parent="07" * 8,
                 start=T + 30 * MS, outcome="admitted"),
        deferral("z", 2, 2_000, external=64, trace="34" * 16, span_id="0e" * 8, start=T + 40 * MS,
                 outcome="ended")))
    read = traces.read_trace_files([path])
    assert read.problems == []
    requests = requests_by_id(read)
    assert requests[ENDED].to_dict() == {"a": False, "z": True}
    a = requests.loc["a"]
    assert a[[*DEFERRAL_COLUMNS, "tokens_external", "lookups", "loads"]].tolist() == [3, 6.0, 16, 1, 1]
    text = widgets.deferral_text(a)
    assert text.startswith("kvscope deferred its load 3 times (6.00 ms) for device KV room: the loads admitted")
    assert "ended" not in text
    assert requests.loc["z", [*DEFERRAL_COLUMNS, "tokens_external"]].tolist() == [2, 2.0, 64]
    numbers = traces.overview_numbers(traces.requests_table(read.spans), read.spans)
    assert (numbers["requests_deferred"], numbers["requests_ended_waiting"]) == (2, 1)
    rows = traces.waterfall_rows(read.spans, traces.requests_table(read.spans), "a")
    assert rows["row"].tolist() == [WAIT, "lookup", "load"]
    assert rows[["start_ms", "end_ms"]].values.tolist()[0] == [30.0, 36.0]


def test_a_request_that_ended_waiting_arrived_at_its_span_start(ended):
    """The span is the wait (it does not lie before the span, as a lookup's does): the arrival is its start."""
    requests = traces.requests_table(ended.spans)
    assert requests["request_id"].tolist() == ["q", "v", "r", "u", "w"]
    assert requests.set_index("request_id")["arrival_ns"].to_dict() == {
        "q": T, "v": T + 5 * MS, "r": T + 20 * MS - 12_400_000, "u": T + 25 * MS, "w": T + 40 * MS}
    assert requests["t_s"].iloc[0] == 0.0


def test_the_hit_rates_and_the_replay_leave_their_uncounted_lookups_out(ended):
    requests = traces.requests_table(ended.spans)
    assert traces.hit_rate(requests) == pytest.approx(128 / 300)  # q 0, r and w 64, of 100 each
    timeline = traces.replay_timeline(requests, ended.spans)
    assert timeline["request_id"].tolist() == ["q", "v", "r", "u", "w"]
    assert timeline["cum_tokens_queried"].tolist() == [100, 100, 200, 200, 300]
    over_time = traces.hit_rate_over_time(requests, bucket_s=0.01).set_index("t_s")
    assert over_time["requests"].to_dict() == {0.0: 3, 0.02: 1, 0.04: 1}
    assert over_time.loc[0.0, "hit_rate"] == pytest.approx(64 / 200) and pd.isna(over_time.loc[0.02, "hit_rate"])
    shown = traces.search_requests(requests, "", show="hits or loads")["request_id"].tolist()
    assert shown == ["v", "r", "u", "w"]  # a hit to load, never counted: not a miss
    assert traces.search_requests(requests, "", show="misses")["request_id"].tolist() == ["q"]


def test_a_request_whose_only_span_says_it_was_admitted_with_nothing_to_load_is_listed_with_the_misses(tmp_path):
    """Its lookup before a preemption not read (a file cut before it): no hit is known (tokens hit NA), it loaded
    nothing and did not end waiting, so it is none of "hits or loads" (a hit, a load, or a hit it ended waiting
    to load) and the requests page lists it with the misses."""
    path = write(tmp_path, line(
        lookup("q", hit=0, trace="cd" * 16, span_id="09" * 8, start=T),
        deferral("a", 3, 6_000, trace="12" * 16, span_id="0d" * 8, start=T + 30 * MS, outcome="admitted")))
    requests = traces.requests_table(traces.read_trace_files([path]).spans)
    assert requests.set_index("request_id").loc["a", ["loads", ENDED]].tolist() == [0, False]
    assert pd.isna(requests.set_index("request_id").loc["a", "tokens_hit"])
    assert traces.search_requests(requests, "", show="misses")["request_id"].tolist() == ["q", "a"]
    assert traces.search_requests(requests, "", show="hits or loads").empty


@pytest.mark.parametrize(("rid", "starts", "unadmitted"), [
    ("u", "kvscope deferred its load 40 times (1200.00 ms) for device KV room, and the request ended (aborted", True),
    ("w", "kvscope deferred its load 2 times (4.00 ms) for device KV room, and the request ended (aborted", False),
    ("r", "kvscope deferred its load 3 times (12.40 ms) for device KV room: the loads admitted", False),
])
def test_the_request_view_says_it_ended_before_its_load_could_start(ended, rid, starts, unadmitted):
    text = widgets.deferral_text(requests_by_id(ended).loc[rid])
    assert text.startswith(starts) and "device KV headroom" in text
    assert ("before its load could start" in text) == (rid != "r")
    assert ("vLLM never admitted it" in text) == unadmitted
    assert ("its load would have brought 128 tokens" in text) == unadmitted


def test_the_waterfall_draws_the_deferral_span_as_the_wait(ended):
    requests = traces.requests_table(ended.spans)
    rows = traces.waterfall_rows(ended.spans, requests, "u")
    assert rows["row"].tolist() == [WAIT]
    wait = rows.iloc[0]
    assert (wait["kind"], wait["name"], wait["start_ms"], wait["end_ms"], wait["duration_ms"]) == (
        WAIT, traces.DEFERRAL, 0.0, 1200.0, 1200.0)
    assert (wait["span_id"], wait["parent_span_id"], wait["status_code"]) == ("0c" * 8, "ee" * 8, 0)  # a span
    assert wait["attributes"] == "deferred.lookups=40, deferred.wait_us=1200000, tokens.external=128, engine=1"
    encoding = charts.waterfall(rows).to_dict()["encoding"]
    assert encoding["color"]["scale"]["domain"] == [WAIT]
    assert encoding["color"]["scale"]["range"] == [charts.KIND_COLORS[WAIT]]

    rows = traces.waterfall_rows(ended.spans, requests, "w")  # after its lookup and load, to its end
    assert rows["row"].tolist() == [WAIT, "lookup", "load"]
    assert rows[["start_ms", "end_ms"]].values.tolist()[0] == [20.0, 24.0]


def test_the_overview_counts_the_requests_that_ended_waiting(monkeypatch, ended):
    numbers = traces.overview_numbers(traces.requests_table(ended.spans), ended.spans)
    assert (numbers["requests_deferred"], numbers["requests_ended_waiting"]) == (4, 3)  # r; v, u, w
    assert (numbers["deferral_wait_p50_ms"], numbers["deferral_wait_max_ms"]) == (4.0, 1200.0)  # u's wait counts
    assert numbers["requests"] == 5 and numbers["requests_with_hit"] == 2
    at = app(monkeypatch, *ended.files)
    assert_ok(at)
    (said,) = [i.value for i in at.info if "for device KV room" in i.value]
    assert said.startswith("kvscope deferred the loads of 4 request(s) for device KV room: they waited 4.00 ms "
                           "(median), at most 1200.00 ms, before their loads could start or, for 3 of them, until "
                           "they ended (aborted: did a client give up?) while still waiting: their loads never "
                           "started ('ended waiting'). ")
    assert metrics(at)["Requests"] == "5"


def test_the_requests_page_shows_ended_waiting_and_says_it(monkeypatch, ended):
    at = app(monkeypatch, *ended.files)
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    table = at.dataframe[0]
    assert {*DEFERRAL_COLUMNS, ENDED} <= set(table.proto.column_order)
    assert table.value.set_index("request_id").loc["u", [ENDED, *DEFERRAL_COLUMNS]].tolist() == [True, 40, 1200.0]
    at.text_input(key="request_search").input("u").run()
    assert_ok(at)
    said = [i.value for i in at.info if "deferred" in i.value]
    assert said == [widgets.deferral_text(requests_by_id(ended).loc["u"])]
    assert metrics(at)["Tokens hit / queried"] == f"{formatting.MISSING} / {formatting.MISSING}"
    assert at.dataframe[1].value["row"].tolist() == [WAIT]


def test_a_file_of_requests_that_all_ended_waiting_shows_on_every_page(monkeypatch, tmp_path):
    """No lookup or load span at all: the requests still count, and no page fails on their empty hits."""
    path = write(tmp_path, line(deferral("v", 2, 3_500, trace="aa" * 16, span_id="0b" * 8)))
    at = app(monkeypatch, path)
    assert_ok(at)
    assert metrics(at)["Requests"] == "1"
    assert [i.value for i in at.info if "for 1 of them, until they ended" in i.value]
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    assert at.dataframe[1].value["row"].tolist() == [WAIT]
    at.switch_page("views/replay.py").run()
    assert_ok(at)
    assert metrics(at)["Request"] == "1 of 1"
