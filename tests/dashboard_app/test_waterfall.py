"""One request's waterfall on small files: its rows, their order and labels, and the attribute text."""

from __future__ import annotations

import json

import pytest

from dashboard import charts, traces

from .conftest import TWO_ROUNDS
from .test_group_copies import group_copy
from .test_joins import load
from .test_group_stats import scan
from .test_reader import engine_line, line, lookup, span, write
from .vllm_traces import llm_request, vllm_line

T = 1_700_000_000_000_000_000
MS = 1_000_000
TRACE = "ab" * 16  # test_reader's span() default


@pytest.fixture(scope="module")
def read() -> traces.Traces:
    return traces.read_trace_files([TWO_ROUNDS])


def test_without_vllm_spans_given_the_waterfall_has_no_vllm_row(read):
    """The request's row names its vLLM span (`vllm_key`), but the caller gave no vLLM spans: kvscope's rows only."""
    requests = traces.requests_table(read.spans, read.vllm_requests)
    assert requests.set_index("request_id").loc["cmpl-r2-06", "vllm_key"] >= 0
    rows = traces.waterfall_rows(read.spans, requests, "cmpl-r2-06")
    assert rows["row"].tolist()[:2] == ["lookup", "load"]
    with_vllm = traces.waterfall_rows(read.spans, requests, "cmpl-r2-06", vllm=read.vllm_requests)
    assert with_vllm["row"].tolist() == ["vLLM request", *rows["row"]]


def test_times_are_exact_milliseconds_from_the_requests_first_span(tmp_path):
    owner = "02" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, start=T, end=T + 1 * MS),
        load("r", span_id=owner, parent="01" * 8, start=T + 2 * MS, end=T + 3 * MS),
        group_copy("load", 1, 0, 1000, T + 4 * MS, T + 7 * MS, owner=owner, n=1)))
    spans = traces.read_trace_files([path]).spans
    rows = traces.waterfall_rows(spans, traces.requests_table(spans), "r")
    assert rows[["start_ms", "end_ms", "duration_ms"]].values.tolist() == [[0.0, 1.0, 1.0], [2.0, 3.0, 1.0],
                                                                         [4.0, 7.0, 3.0]]


def test_the_vllm_row_carries_its_spans_times_ids_and_status(tmp_path):
    client = "99" * 8
    vllm_span = llm_request("cmpl-7-0", trace=TRACE, span_id="e1" * 8, parent=client, start=T - 2 * MS,
                            end=T + 900 * MS)
    vllm_span["status"] = {"code": 2}
    path = write(tmp_path, line(lookup("cmpl-7-0-1a2b3c4d", span_id="01" * 8, parent=client, start=T)),
                 vllm_line(vllm_span))
    read = traces.read_trace_files([path])
    requests = traces.requests_table(read.spans, read.vllm_requests)
    rows = traces.waterfall_rows(read.spans, requests, "cmpl-7-0-1a2b3c4d", TRACE, read.vllm_requests)
    first = rows.iloc[0]
    assert (first["row"], first["kind"], first["name"]) == ("vLLM request", "vLLM request", traces.VLLM_REQUEST_SPAN)
    assert (first["start_ms"], first["end_ms"], first["duration_ms"]) == (0.0, 902.0, 902.0)
    assert (first["status_code"], first["span_id"], first["parent_span_id"], first["trace_id"]) == (
        2, "e1" * 8, client, TRACE)
    shown = first["attributes"].split(", ")  # vLLM's own attributes, gen_ai.* keys shortened
    assert "request.id=cmpl-7-0" in shown and "usage.prompt_tokens=544" in shown
    assert "gen_ai." not in first["attributes"]


def test_the_vllm_row_leads_a_deferred_requests_wait_for_device_kv_room(tmp_path):
    """vLLM's span is the request from its arrival, the parent of kvscope's work: its row comes first, before
    the wait that delayed kvscope's lookup, which comes before that lookup."""
    client = "99" * 8
    deferred = span("kvscope.lookup", {"kvscope.request.id": "cmpl-7-0-1a2b3c4d", "kvscope.tokens.queried": 100,
                                       "kvscope.tokens.hit": 64, "kvscope.deferred.lookups": 2,
                                       "kvscope.deferred.wait_us": 5_000},
                    span_id="01" * 8, parent=client, start=T + 10 * MS)
    vllm_span = llm_request("cmpl-7-0", trace=TRACE, span_id="e1" * 8, parent=client, start=T, end=T + 900 * MS)
    read = traces.read_trace_files([write(tmp_path, line(deferred), vllm_line(vllm_span))])
    requests = traces.requests_table(read.spans, read.vllm_requests)
    rows = traces.waterfall_rows(read.spans, requests, "cmpl-7-0-1a2b3c4d", TRACE, read.vllm_requests)
    assert rows["row"].tolist() == ["vLLM request", traces.DEVICE_KV_WAIT, "lookup"]
    assert rows["start_ms"].tolist() == [0.0, 5.0, 10.0]


def test_rows_go_lookups_load_scans_copies_store_copies_whatever_the_file_order(tmp_path):
    """A request looked up again after its load (a recompute) and stored too: kinds in the order of the work,
    each kind's rows by group, the repeated lookup numbered."""
    load_id, store_id = "02" * 8, "05" * 8
    path = write(tmp_path, line(
        group_copy("store", 1, 0, 10, T + 9 * MS, T + 10 * MS, owner=store_id, n=1),
        span("kvscope.store", {"kvscope.request.id": "r", "kvscope.groups": 2, "kvscope.blocks": 2},
             span_id=store_id, parent="01" * 8, start=T + 8 * MS),
        group_copy("store", 0, 0, 10, T + 9 * MS, T + 10 * MS, owner=store_id, n=2),
        group_copy("load", 1, 0, 10, T + 3 * MS, T + 4 * MS, owner=load_id, n=3),
        group_copy("load", 0, 0, 10, T + 3 * MS, T + 4 * MS, owner=load_id, n=4),
        lookup("r", span_id="03" * 8, parent="01" * 8, start=T + 6 * MS),  # looked up again after the load
        scan(1, n=5, parent=load_id, start=T + 2 * MS), scan(0, n=6, parent=load_id, start=T + 2 * MS),
        load("r", span_id=load_id, parent="01" * 8, start=T + 1 * MS),
        lookup("r", span_id="01" * 8, start=T)))
    spans = traces.read_trace_files([path]).spans
    rows = traces.waterfall_rows(spans, traces.requests_table(spans), "r")
    assert rows["row"].tolist() == [
        "lookup", "lookup #2", "load", "group.scan g0 sliding_window", "group.scan g1 full_attention",
        "copy load g0 sliding_window rank 0", "copy load g1 full_attention rank 0", "store",
        "copy store g0 sliding_window rank 0", "copy store g1 full_attention rank 0"]
    assert rows["start_ms"].tolist() == [0.0, 6.0, 1.0, 2.0, 2.0, 3.0, 3.0, 8.0, 9.0, 9.0]


def test_a_failed_copy_is_a_kind_of_its_own_in_its_place(tmp_path):
    """A failed copy looked like any other in the chart: its status showed only in the table. Its row stays in
    its group's place (group 0's, before group 1's copy), not after every other kind."""
    load_id = "02" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, start=T),
        load("r", span_id=load_id, parent="01" * 8, start=T + 1 * MS),
        group_copy("load", 0, 0, 0, T + 3 * MS, T + 4 * MS, owner=load_id, n=3, failed=True),
        group_copy("load", 1, 0, 10, T + 3 * MS, T + 4 * MS, owner=load_id, n=4)))
    spans = traces.read_trace_files([path]).spans
    rows = traces.waterfall_rows(spans, traces.requests_table(spans), "r")
    assert rows["row"].tolist() == ["lookup", "load", "copy load failed g0 sliding_window rank 0",
                                    "copy load g1 full_attention rank 0"]
    assert "copy load failed" in charts.KIND_COLORS


def test_tensor_parallel_workers_copies_of_a_group_go_in_rank_order(tmp_path):
    """Rank 1's copy started first: each group's rows still read rank 0, rank 1, so the same worker has the same
    place in every group."""
    load_id = "02" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, start=T),
        load("r", span_id=load_id, parent="01" * 8, start=T + 1 * MS),
        group_copy("load", 0, 1, 10, T + 2 * MS, T + 4 * MS, owner=load_id, n=1),
        group_copy("load", 0, 0, 10, T + 3 * MS, T + 4 * MS, owner=load_id, n=2),
        group_copy("load", 1, 0, 10, T + 2 * MS, T + 4 * MS, owner=load_id, n=3),
        group_copy("load", 1, 1, 10, T + 3 * MS, T + 4 * MS, owner=load_id, n=4)))
    spans = traces.read_trace_files([path]).spans
    rows = traces.waterfall_rows(spans, traces.requests_table(spans), "r")
    assert rows["row"].tolist()[2:] == ["copy load g0 sliding_window rank 0", "copy load g0 sliding_window rank 1",
                                        "copy load g1 full_attention rank 0", "copy load g1 full_attention rank 1"]
    assert rows["start_ms"].tolist()[2:] == [3.0, 2.0, 2.0, 3.0]


def test_the_chart_draws_the_rows_in_their_order_and_its_legend_in_the_order_of_the_work(tmp_path):
    """Not alphabetically: "copy load" would come before "lookup" on the axis and in the legend."""
    load_id = "02" * 8
    path = write(tmp_path, line(
        lookup("r", span_id="01" * 8, start=T),
        load("r", span_id=load_id, parent="01" * 8, start=T + 1 * MS),
        scan(0, n=1, parent=load_id, start=T + 2 * MS),
        group_copy("load", 0, 0, 10, T + 3 * MS, T + 4 * MS, owner=load_id, n=2)))
    spans = traces.read_trace_files([path]).spans
    rows = traces.waterfall_rows(spans, traces.requests_table(spans), "r")
    spec = charts.waterfall(rows).to_dict()
    encoding = spec["encoding"]
    # the time axis zooms and pans (a short copy is a sliver of a long request); the span rows stay put
    (zoom,) = spec["params"]
    assert zoom["bind"] == "scales" and zoom["select"]["encodings"] == ["x"]
    assert encoding["y"]["sort"] == rows["row"].tolist() == [
        "lookup", "load", "group.scan g0 sliding_window", "copy load g0 sliding_window rank 0"]
    assert encoding["color"]["scale"]["domain"] == ["lookup", "load", "group.scan", "copy load"]
    assert encoding["color"]["scale"]["range"] == [charts.KIND_COLORS[k] for k in encoding["color"]["scale"]["domain"]]


def test_an_attribute_key_without_a_kvscope_prefix_is_shown_whole(tmp_path):
    """The process's id (the SDK's `service.instance.id`, a resource attribute read onto each span) has no
    "kvscope." prefix to shorten: the lookup's text names it by its whole key, after the engine's short one."""
    doc = json.loads(engine_line({"intValue": "1"}, lookup("r", span_id="01" * 8)))
    doc["resourceSpans"][0]["resource"]["attributes"].append(
        {"key": "service.instance.id", "value": {"stringValue": "aaaa"}})
    spans = traces.read_trace_files([write(tmp_path, json.dumps(doc))]).spans
    rows = traces.waterfall_rows(spans, traces.requests_table(spans), "r")
    assert rows["attributes"].tolist() == ["tokens.queried=100, tokens.hit=64, engine=1, service.instance.id=aaaa"]


def test_the_rows_are_numbered_from_0_and_have_the_waterfalls_columns_only(tmp_path):
    """The request view shows the rows as a table: no column of the spans frame, nor its row positions, left in;
    an unknown request's empty waterfall has the same columns."""
    load_id = "02" * 8
    path = write(tmp_path, line(
        group_copy("load", 0, 0, 10, T + 3 * MS, T + 4 * MS, owner=load_id, n=1),  # before its load in the file
        load("r", span_id=load_id, parent="01" * 8, start=T + 1 * MS),
        lookup("r", span_id="01" * 8, start=T)))
    spans = traces.read_trace_files([path]).spans
    requests = traces.requests_table(spans)
    rows = traces.waterfall_rows(spans, requests, "r")
    columns = ["row", "kind", "name", "start_ms", "end_ms", "duration_ms", "group_index", "group_kind", "direction",
               "attributes", "status_code", "span_id", "parent_span_id", "trace_id"]
    assert list(rows.columns) == columns
    assert rows.index.tolist() == [0, 1, 2] and rows["row"].tolist() == ["lookup", "load",
                                                                         "copy load g0 sliding_window rank 0"]
    unknown = traces.waterfall_rows(spans, requests, "no-such-request")
    assert unknown.empty and list(unknown.columns) == columns
