"""Loads kvscope deferred for device KV room (`kvscope.deferred.*` on the lookup span vLLM admitted the request on,
or on the load span of a request resumed after preemption): per request in the requests table, in words in the
request view, and as a wait bar before the span in the waterfall; a file without them shows none."""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard import charts, traces, widgets

from .conftest import TWO_ROUNDS
from .test_group_copies import group_copy
from .test_joins import load
from .test_pages import app, assert_ok
from .test_reader import line, lookup, write

T, MS = 1_700_000_000_000_000_000, 1_000_000
WAIT = traces.DEVICE_KV_WAIT
DEFERRAL_COLUMNS = ["deferred_lookups", "deferred_wait_ms"]


def deferred(sp: dict, lookups: int, wait_us: int) -> dict:
    sp["attributes"] += [{"key": "kvscope.deferred.lookups", "value": {"intValue": str(lookups)}},
                         {"key": "kvscope.deferred.wait_us", "value": {"intValue": str(wait_us)}}]
    return sp


def deferred_lookup(rid: str, lookups: int, wait_us: int, **kw) -> dict:
    return deferred(lookup(rid, **kw), lookups, wait_us)


@pytest.fixture
def deferrals(tmp_path) -> traces.Traces:
    """q: not deferred; r: deferred 3 times (12.4 ms) before its lookup at 20 ms, then loaded; s: deferred before
    each of its two lookups; t: loaded at once, then preempted, its load deferred twice (4 ms) when resumed (its
    load span tells it: that lookup has no span)."""
    path = write(tmp_path, line(
        lookup("q", trace="cd" * 16, span_id="09" * 8, start=T),
        deferred_lookup("r", 3, 12_400, span_id="01" * 8, start=T + 20 * MS),
        load("r", span_id="02" * 8, parent="01" * 8, start=T + 21 * MS),
        group_copy("load", 0, 0, 1000, T + 22 * MS, T + 24 * MS, owner="02" * 8, n=1),
        deferred_lookup("s", 1, 500, trace="ef" * 16, span_id="05" * 8, start=T + 30 * MS),
        deferred_lookup("s", 2, 1_250, trace="ef" * 16, span_id="06" * 8, start=T + 40 * MS),
        lookup("t", trace="ab" * 16, span_id="07" * 8, start=T + 50 * MS),
        load("t", trace="ab" * 16, span_id="08" * 8, parent="07" * 8, start=T + 51 * MS),
        deferred(load("t", trace="ab" * 16, span_id="0a" * 8, parent="07" * 8, start=T + 70 * MS), 2, 4_000)))
    read = traces.read_trace_files([path])
    assert read.problems == []
    return read


def test_a_requests_deferrals_and_wait_are_summed_over_its_lookups_and_empty_when_not_deferred(deferrals):
    requests = traces.requests_table(deferrals.spans).set_index("request_id")[DEFERRAL_COLUMNS]
    assert requests.dtypes.astype(str).tolist() == ["Int64", "float64"]
    assert requests.loc["r"].tolist() == [3, 12.4]
    assert requests.loc["s"].tolist() == [3, 1.75]  # 1 + 2 lookups, 0.5 + 1.25 ms
    assert requests.loc["t"].tolist() == [2, 4.0]  # told by its resumed load
    assert requests.loc["q"].isna().all()


def test_a_deferred_request_arrived_when_its_wait_began(deferrals):
    """Its first deferred lookup has no span: the wait tells when it came (replays order requests by it)."""
    arrivals = traces.requests_table(deferrals.spans).set_index("request_id")["arrival_ns"]
    assert arrivals.to_dict() == {"q": T, "r": T + 20 * MS - 12_400_000, "s": T + 30 * MS - 500_000,
                                  "t": T + 50 * MS}  # t waited after its first lookup: not before it


def test_a_file_without_deferral_attributes_has_no_deferral_and_no_wait_bar():
    read = traces.read_trace_files([TWO_ROUNDS])
    requests = traces.requests_table(read.spans, read.vllm_requests)
    assert len(requests) and requests[DEFERRAL_COLUMNS].isna().all().all()
    assert all(widgets.deferral_text(request) is None for _, request in requests.iterrows())
    for request_id in requests["request_id"]:
        rows = traces.waterfall_rows(read.spans, requests, request_id, vllm=read.vllm_requests)
        assert WAIT not in set(rows["kind"]), request_id


def test_the_waterfall_draws_the_wait_before_the_lookup_it_delayed(deferrals):
    """Times count from the wait's start (12.4 ms before the lookup span), the lookup and the load after it."""
    requests = traces.requests_table(deferrals.spans)
    rows = traces.waterfall_rows(deferrals.spans, requests, "r")
    assert rows["row"].tolist() == [WAIT, "lookup", "load", "copy load g0 sliding_window rank 0"]
    assert rows[["start_ms", "end_ms"]].values.tolist() == [[0.0, 12.4], [12.4, 12.401], [13.4, 13.401],
                                                            [14.4, 16.4]]
    wait = rows.iloc[0]
    assert (wait["kind"], wait["duration_ms"]) == (WAIT, 12.4)
    assert wait["attributes"] == "deferred.lookups=3, deferred.wait_us=12400"
    assert pd.isna(wait["span_id"]) and pd.isna(wait["status_code"])  # no span of its own
    assert str(rows["status_code"].dtype) == "Int64" and rows["status_code"].tolist()[1:] == [0, 0, 0]

    rows = traces.waterfall_rows(deferrals.spans, requests, "s")  # a wait before each lookup, each ending at it
    assert rows["row"].tolist() == [WAIT, f"{WAIT} #2", "lookup", "lookup #2"]
    assert rows["end_ms"].tolist()[:2] == rows["start_ms"].tolist()[2:] == [0.5, 10.5]
    assert rows["start_ms"].tolist()[:2] == [0.0, 10.5 - 1.25]

    assert traces.waterfall_rows(deferrals.spans, requests, "q")["row"].tolist() == ["lookup"]

    rows = traces.waterfall_rows(deferrals.spans, requests, "t")  # the resumed load's wait ends where it starts
    assert rows["row"].tolist() == [WAIT, "lookup", "load", "load #2"]
    assert rows[["start_ms", "end_ms"]].values.tolist()[0] == [16.0, 20.0]
    assert rows["start_ms"].tolist()[3] == 20.0


def test_the_chart_colours_the_wait_and_draws_it_first(deferrals):
    requests = traces.requests_table(deferrals.spans)
    rows = traces.waterfall_rows(deferrals.spans, requests, "r")
    encoding = charts.waterfall(rows).to_dict()["encoding"]
    assert encoding["y"]["sort"][0] == WAIT
    assert encoding["color"]["scale"]["domain"][:2] == [WAIT, "lookup"]
    assert encoding["color"]["scale"]["range"][0] == charts.KIND_COLORS[WAIT] != charts.KIND_COLORS["lookup"]


@pytest.mark.parametrize(("lookups", "wait_ms", "said"), [
    (3, 12.4, "kvscope deferred its load 3 times (12.40 ms) for device KV room: "),
    (1, float("nan"), "kvscope deferred its load once (wait unknown) for device KV room: "),
])
def test_the_request_view_says_how_often_and_how_long_kvscope_deferred_its_load(lookups, wait_ms, said):
    text = widgets.deferral_text(pd.Series({"deferred_lookups": lookups, "deferred_wait_ms": wait_ms}))
    assert text.startswith(said) and "device KV headroom" in text
    assert widgets.deferral_text(pd.Series({"deferred_lookups": pd.NA, "deferred_wait_ms": float("nan")})) is None


def test_the_requests_page_shows_the_deferral_columns_and_says_it_in_words(monkeypatch, deferrals):
    at = app(monkeypatch, *deferrals.files)
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    table = at.dataframe[0]
    assert set(DEFERRAL_COLUMNS) <= set(table.proto.column_order)
    assert "ended_waiting" not in table.proto.column_order  # none ended waiting (`test_ended_waiting`)
    assert table.value.set_index("request_id").loc["r", DEFERRAL_COLUMNS].tolist() == [3, 12.4]
    assert not [i.value for i in at.info if "deferred" in i.value]  # q, the first row, was not deferred
    at.text_input(key="request_search").input("r").run()
    assert_ok(at)
    assert [i.value for i in at.info if "deferred" in i.value] == [widgets.deferral_text(
        traces.requests_table(deferrals.spans).set_index("request_id").loc["r"])]
    assert at.dataframe[1].value["row"].tolist()[0] == WAIT


def test_the_overview_counts_the_deferred_requests_and_their_waits(monkeypatch, deferrals):
    numbers = traces.overview_numbers(traces.requests_table(deferrals.spans), deferrals.spans)
    assert (numbers["requests_deferred"], numbers["deferral_wait_p50_ms"], numbers["deferral_wait_max_ms"]) == (
        3, 4.0, 12.4)  # r 12.4 ms, s 1.75, t 4.0: the nearest-rank median
    at = app(monkeypatch, *deferrals.files)
    at.run()
    assert_ok(at)
    (said,) = [i.value for i in at.info if "for device KV room" in i.value]
    assert said.startswith("kvscope deferred the loads of 3 request(s) for device KV room: they waited 4.00 ms "
                           "(median), at most 12.40 ms, before their loads could start. ")  # none ended waiting


def test_an_overview_without_deferrals_says_nothing_of_them(monkeypatch):
    at = app(monkeypatch, TWO_ROUNDS)
    at.run()
    assert_ok(at)
    assert not [i.value for i in at.info if "device KV room" in i.value]
