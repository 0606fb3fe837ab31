"""Reading trace files into the span frame: both decoders, bad input, the Collector's format."""

from __future__ import annotations

import base64
import gzip
import json
import re
import zlib
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from dashboard import traces
from dashboard.traces import file_formats, gzip_files, line_decoder, otlp_arrow, reader

from .conftest import MALFORMED, TWO_ROUNDS, raw_spans


@pytest.fixture(params=["arrow", "lines"])
def decoder(request, monkeypatch):
    """Run a test with the Arrow decoder allowed (default) and with the line-by-line one only.

    With Arrow allowed it must take at least one file of the test, else both runs would test the line
    decoder alone; a test marked ``arrow_declines`` is one whose every file Arrow must decline (with
    ``when=``, a function of the test's parameters: where it returns True)."""
    if request.param == "lines":
        monkeypatch.setattr(otlp_arrow, "decode", lambda *args: None)
        yield request.param
        return
    decode, took = otlp_arrow.decode, []

    def recorded(*args):
        result = decode(*args)
        took.append(result is not None)
        return result

    monkeypatch.setattr(otlp_arrow, "decode", recorded)
    yield request.param
    params = request.node.callspec.params
    declines = any(m.kwargs.get("when", lambda **_: True)(**params)
                   for m in request.node.iter_markers("arrow_declines"))
    if declines:
        assert not any(took), f"the Arrow decoder took a file it should decline: {took}"
    else:
        assert any(took), f"the Arrow decoder took none of the test's files ({len(took)}): mark it arrow_declines"


def span(name: str, attrs: dict, *, trace: str = "ab" * 16, span_id: str = "cd" * 8, parent: str = "",
         start: int = 1_700_000_000_000_000_000, end: int | None = None) -> dict:
    def value(v):
        if isinstance(v, bool):
            return {"boolValue": v}
        if isinstance(v, int):
            return {"intValue": str(v)}
        if isinstance(v, float):
            return {"doubleValue": v}
        return {"stringValue": v}

    return {"traceId": trace, "spanId": span_id, "parentSpanId": parent, "name": name, "kind": 1,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(end or start + 1000),
            "attributes": [{"key": k, "value": value(v)} for k, v in attrs.items()], "status": {}}


def line(*spans: dict, scope: str = "kvscope", version: str = "0.1.0") -> str:
    return json.dumps({"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [
        {"scope": {"name": scope, "version": version}, "spans": list(spans)}]}]})


def lookup(rid: str = "r1", queried: int = 100, hit: int = 64, **kw) -> dict:
    return span("kvscope.lookup", {"kvscope.request.id": rid, "kvscope.tokens.queried": queried,
                                   "kvscope.tokens.hit": hit}, **kw)


def write(tmp_path: Path, *lines: str, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_rounds_fixture_loads_every_kvscope_span(decoder):
    read = traces.read_trace_files([TWO_ROUNDS])
    raw = raw_spans(TWO_ROUNDS)
    assert read.problems == []
    assert len(read.spans) == len(raw)
    assert read.other_spans == 10  # the vLLM request spans of half the requests
    assert sorted(read.spans["span_id"]) == sorted(s["span"] for s in raw)
    by_id = read.spans.set_index("span_id")
    for s in raw:
        row = by_id.loc[s["span"]]
        assert row["name"] == s["name"]
        assert (row["start_ns"], row["end_ns"]) == (s["start"], s["end"])
        if "copy.bytes" in s:
            assert row["copy_bytes"] == s["copy.bytes"] and row["copy_direction"] == s["copy.direction"]
        if "tokens.hit" in s:
            assert row["tokens_hit"] == s["tokens.hit"] and row["request_id"] == s["request.id"]


def test_arrow_and_line_decoders_agree_on_clean_files(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from dashboard_bench import write_trace

    synthetic = tmp_path / "synthetic.jsonl"
    write_trace(synthetic, 3000, seed=3)
    for path in (TWO_ROUNDS, synthetic):
        data = path.read_bytes()
        lines = data.split(b"\n")
        fast = otlp_arrow.decode(data, str(path), lines)
        assert fast is not None, "the Arrow decoder declined a clean file"
        slow = traces.decode_lines(str(path), lines)
        fast_frame, fast_problems = reader._validated_frame(fast, str(path))
        slow_frame, slow_problems = reader._validated_frame(slow, str(path))
        pd.testing.assert_frame_equal(fast_frame.reset_index(drop=True), slow_frame.reset_index(drop=True))
        assert fast_problems == slow_problems == []
        assert (fast.other_spans, fast.lines) == (slow.other_spans, slow.lines)


@pytest.mark.arrow_declines
def test_collector_file_with_malformed_lines_reports_each_with_its_line_number(decoder):
    read = traces.read_trace_files([MALFORMED])
    got = {(p.line, p.spans): p.reason for p in read.problems}
    # how many spans a line held that does not parse is unknown (None), not 0
    assert set(got) == {(3, None), (4, 0), (5, 0), (6, 1), (7, 1), (10, None)}
    assert got[(3, None)].startswith("not JSON")
    assert "JSON object" in got[(4, 0)]
    assert "resourceMetrics" in got[(5, 0)]
    assert got[(6, 1)] == "kvscope.load span lacks kvscope.tokens.external"
    assert "'9.0.0' is not supported" in got[(7, 1)]
    assert got[(10, None)] == line_decoder.INCOMPLETE_LAST_LINE  # a line cut short by a crash, no newline after it
    assert all(p.file == str(MALFORMED) for p in read.problems)
    # The rest loads: c1 (lookup, load, 2 scans, 2 copies), c2's lookup, c4's lookup; the vLLM span is left out.
    assert len(read.spans) == 8 and read.other_spans == 1 and read.lines == 9
    assert sorted(read.spans["request_id"].dropna()) == ["c1", "c1", "c2", "c4"]
    c4 = read.spans[read.spans["request_id"] == "c4"].iloc[0]
    assert c4["attributes"] == {"kvscope.lookup.cached": False} and c4["status_code"] == 1
    # intValue as a JSON number (line 1) reads like the decimal string form.
    c1 = read.spans[(read.spans["request_id"] == "c1") & (read.spans["name"] == traces.LOOKUP)].iloc[0]
    assert (c1["tokens_queried"], c1["tokens_hit"]) == (300, 288)


@pytest.mark.arrow_declines
def test_empty_file_gives_empty_frames(tmp_path, decoder):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    read = traces.read_trace_files([path])
    assert read.empty and read.files == [str(path)]
    assert [(p.line, p.reason) for p in read.problems] == [(0, "empty file: it holds no lines")]
    assert list(read.spans.columns) == list(traces.SPAN_COLUMNS)
    requests = traces.requests_table(read.spans)
    assert requests.empty and list(requests.columns) == list(traces.REQUEST_COLUMNS)
    assert traces.replay_timeline(requests, read.spans).empty
    assert traces.hit_rate_over_time(requests).empty
    assert traces.group_summary(read.spans, requests).empty
    assert traces.copy_throughput(read.spans).empty


def test_an_empty_read_has_the_column_types_of_a_loaded_one(tmp_path):
    """Pages filter and sum an empty frame as they do a full one (`.cat`, Int64 sums, bool masks)."""
    def types(read):  # text columns may be str or object alike
        return {col: str(t) for col, t in read.spans.dtypes.items() if str(t) not in ("str", "object")}

    loaded = traces.read_trace_files([write(tmp_path, line(lookup("r1")), name="one.jsonl")])
    empty = traces.read_trace_files([traces.TraceSource("empty", b"")])
    assert len(loaded.spans) == 1 and empty.empty
    assert types(empty) == types(loaded) and "start_ns" in types(loaded) and "name" in types(loaded)


def test_blank_lines_only_and_no_files():
    blank = traces.read_trace_files([traces.TraceSource("blank", b"\n  \n\n")])
    assert blank.empty and [p.reason for p in blank.problems] == ["empty file: it holds no lines"]
    assert traces.read_trace_files([]).empty


def test_missing_file_is_a_problem_not_an_error(tmp_path):
    read = traces.read_trace_files([tmp_path / "nope.jsonl", TWO_ROUNDS])
    assert read.problems[0].file == str(tmp_path / "nope.jsonl") and read.problems[0].line == 0
    assert "cannot read file" in read.problems[0].reason
    assert len(read.spans) == len(raw_spans(TWO_ROUNDS))
    assert read.files == [str(tmp_path / "nope.jsonl"), str(TWO_ROUNDS)]  # the headline counts it as given


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (span("kvscope.lookup", {"kvscope.request.id": "r9", "kvscope.tokens.hit": 3}), "lacks kvscope.tokens.queried"),
        (span("kvscope.group.scan", {"kvscope.group.index": 0, "kvscope.group.kind": "sliding_window"}),
         "lacks kvscope.group.blocks.total"),
        (span("kvscope.group.copy", {"kvscope.group.index": 0, "kvscope.group.kind": "full_attention",
                                     "kvscope.copy.direction": "sideways", "kvscope.copy.blocks": 1,
                                     "kvscope.copy.bytes": 10}), "copy.direction is not one of load, store"),
        (span("kvscope.store", {"kvscope.request.id": "r9", "kvscope.groups": 2, "kvscope.blocks": 1.5}),
         "kvscope.blocks is not an integer"),
        pytest.param(span("kvscope.store", {"kvscope.request.id": "r9", "kvscope.groups": 2, "kvscope.blocks": True}),
                     "kvscope.blocks is not an integer", marks=pytest.mark.arrow_declines),  # pandas reads true as 1
        (lookup(trace="xyz"), "invalid trace id"),
        (span("kvscope.lookup", {"kvscope.request.id": "r9", "kvscope.tokens.queried": 9, "kvscope.tokens.hit": 0,
                                 "kvscope.deferred.lookups": 2, "kvscope.deferred.wait_us": -5}),
         "kvscope.deferred.wait_us is -5, expected a count >= 0"),
    ],
)
def test_span_breaking_the_contract_is_skipped_and_reported(tmp_path, decoder, bad, reason):
    good = lookup("r1", span_id="11" * 8)
    bad["spanId"] = "22" * 8
    path = write(tmp_path, line(good), line(bad))
    read = traces.read_trace_files([path])
    assert list(read.spans["span_id"]) == ["11" * 8]
    assert len(read.problems) == 1
    assert read.problems[0].line == 2 and read.problems[0].spans == 1 and reason in read.problems[0].reason


@pytest.mark.parametrize("value", [None, 1234567890123456, True, [], {}, ""], ids=repr)
@pytest.mark.parametrize(("field", "reason"), [("traceId", "invalid trace id"), ("spanId", "invalid span id"),
                                               ("parentSpanId", "invalid parent span id")])
# (an empty id, and an unset parent, are well-formed: the shared checks judge them)
@pytest.mark.arrow_declines(when=lambda field, value, **_: value != ""
                            and (value is not None or field != "parentSpanId"))
def test_an_id_that_is_not_a_string_skips_only_its_span(tmp_path, decoder, field, reason, value):
    bad = lookup("r9", span_id="22" * 8)
    bad[field] = value
    if field == "parentSpanId" and value in (None, ""):  # unset: a root span
        reason = None
    path = write(tmp_path, line(lookup("r1", span_id="11" * 8)), line(bad), line(lookup("r2", span_id="33" * 8)))
    read = traces.read_trace_files([path])
    if reason is None:
        assert read.problems == [] and len(read.spans) == 3
        return
    assert list(read.spans["request_id"]) == ["r1", "r2"]
    assert [(p.line, p.spans) for p in read.problems] == [(2, 1)] and reason in read.problems[0].reason
    assert "hex digits" in read.problems[0].reason


COPY = {"kvscope.group.index": 0, "kvscope.group.kind": "full_attention", "kvscope.copy.direction": "load",
        "kvscope.copy.blocks": 4, "kvscope.copy.bytes": 4096}
SCAN = {"kvscope.group.index": 1, "kvscope.group.kind": "mamba", "kvscope.group.blocks.total": 4,
        "kvscope.group.blocks.null_skipped": 4, "kvscope.group.blocks.pending": 0, "kvscope.group.blocks.start": -1}


def test_deferral_attributes_are_integer_columns_na_where_a_span_lacks_them(tmp_path, decoder):
    """Only the lookup kvscope admitted a deferred load on carries them: NA on another request's lookup, and on
    every other span."""
    deferred = span("kvscope.lookup", {"kvscope.request.id": "r1", "kvscope.tokens.queried": 100,
                                       "kvscope.tokens.hit": 64, "kvscope.deferred.lookups": 3,
                                       "kvscope.deferred.wait_us": 12_400}, span_id="11" * 8)
    store = span("kvscope.store", {"kvscope.request.id": "r1", "kvscope.groups": 1, "kvscope.blocks": 1},
                 span_id="33" * 8)
    read = traces.read_trace_files([write(tmp_path, line(deferred, lookup("r2", span_id="22" * 8), store))])
    assert read.problems == []
    by_id = read.spans.set_index("span_id")[["deferred_lookups", "deferred_wait_us", "attributes"]]
    assert by_id.dtypes[["deferred_lookups", "deferred_wait_us"]].tolist() == ["Int64", "Int64"]
    assert by_id.loc["11" * 8].tolist() == [3, 12_400, None]  # columns of their own, not extra attributes
    assert by_id.loc[["22" * 8, "33" * 8], ["deferred_lookups", "deferred_wait_us"]].isna().all().all()


def test_the_reader_takes_the_deferral_span_and_names_an_attribute_it_lacks(tmp_path, decoder):
    """The span of a request that ended waiting for device KV room (newer files): its attributes in their columns,
    and one it lacks named, as any other span's."""
    ended = {"kvscope.request.id": "u", "kvscope.tokens.external": 128, "kvscope.deferred.lookups": 40,
             "kvscope.deferred.wait_us": 1_200_000, "kvscope.engine": 1}
    lacking = span(traces.DEFERRAL, {**ended, "kvscope.request.id": "x"}, span_id="0e" * 8)
    lacking["attributes"] = [a for a in lacking["attributes"] if a["key"] != "kvscope.deferred.wait_us"]
    whole = span(traces.DEFERRAL, ended, end=1_700_000_000_000_000_000 + 1_200_000_000)
    read = traces.read_trace_files([write(tmp_path, line(whole, lacking))])
    assert [(p.line, p.reason, p.spans) for p in read.problems] == [
        (1, "kvscope.deferral span lacks kvscope.deferred.wait_us", 1)]
    (row,) = read.spans.to_dict("records")
    assert (row["name"], row["request_id"], row["tokens_external"], row["deferred_lookups"], row["deferred_wait_us"],
            row["engine"], row["duration_ms"]) == (traces.DEFERRAL, "u", 128, 40, 1_200_000, 1, 1200.0)


def test_a_scan_with_no_pending_block_starts_at_minus_one_and_is_kept(tmp_path, decoder):
    path = write(tmp_path, line(span("kvscope.group.scan", SCAN)))
    read = traces.read_trace_files([path])
    assert read.problems == [] and list(read.spans["blocks_start"]) == [-1]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (lookup("r9", queried=-100, hit=0), "kvscope.tokens.queried is -100, expected a count >= 0"),
        (lookup("r9", queried=100, hit=-50), "kvscope.tokens.hit is -50, expected a count >= 0"),
        (lookup("r9", queried=10, hit=500), "kvscope.tokens.hit 500 is more than kvscope.tokens.queried 10, "
                                            "expected hit <= queried"),
        (span("kvscope.group.copy", {**COPY, "kvscope.copy.bytes": -4096}), "kvscope.copy.bytes is -4096, expected"),
        (span("kvscope.group.copy", {**COPY, "kvscope.copy.blocks": -4}), "kvscope.copy.blocks is -4, expected"),
        (span("kvscope.store", {"kvscope.request.id": "r9", "kvscope.groups": 1, "kvscope.blocks": -1}),
         "kvscope.blocks is -1, expected a count >= 0"),
        (span("kvscope.group.scan", {**SCAN, "kvscope.group.blocks.start": -2}),
         "kvscope.group.blocks.start is -2, expected a block index >= 0, or -1 when no block is pending"),
    ],
    ids=["queried", "hit", "hit-over-queried", "bytes", "blocks", "store-blocks", "scan-start"],
)
def test_a_count_that_cannot_be_right_skips_its_span(tmp_path, decoder, bad, reason):
    bad["spanId"] = "22" * 8
    path = write(tmp_path, line(lookup("r1", span_id="11" * 8, queried=100, hit=100)), line(bad))
    read = traces.read_trace_files([path])
    assert list(read.spans["span_id"]) == ["11" * 8]
    assert [(p.line, p.spans) for p in read.problems] == [(2, 1)] and reason in read.problems[0].reason
    assert traces.overview_numbers(traces.requests_table(read.spans, read.vllm_requests), read.spans)["hit_rate"] == 1


def test_counts_whose_sums_would_wrap_around_are_left_out(tmp_path):
    huge = 1 << 53  # the most one span may hold; 1,100 of them add up past int64
    lines = [line(lookup(f"h{i}", queried=huge, hit=huge, span_id=f"{i + 1:016x}")) for i in range(1100)]
    path = write(tmp_path, line(lookup("r1", span_id="ff" * 8, queried=100, hit=50)), *lines)
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["r1"]
    assert [p.line for p in read.problems] == list(range(2, 1102)) and {p.spans for p in read.problems} == {1}
    assert read.problems[0].reason.startswith(f"kvscope.tokens.queried is {huge}: summed over the 1,101 spans that "
                                              "have it, counts this large would pass 2^62, expected at most")
    numbers = traces.overview_numbers(traces.requests_table(read.spans, read.vllm_requests), read.spans)
    assert (numbers["tokens_queried"], numbers["tokens_hit"], numbers["hit_rate"]) == (100, 50, 0.5)


def test_one_large_count_among_many_spans_loads_when_the_total_is_far_from_2_62(tmp_path, decoder):
    """Spans are left out for their counts only when a column's total would pass 2^62."""
    huge = 1 << 53  # above 2^62 / 1,100 but alone it sums to far less than 2^62
    spans = [lookup(f"r{i}", span_id=f"{i + 1:016x}") for i in range(1100)]
    spans[0] = lookup("big", queried=huge, hit=1, span_id="ff" * 8)
    read = traces.read_trace_files([write(tmp_path, line(*spans))])
    assert read.problems == [] and len(read.spans) == 1100
    assert read.spans.set_index("request_id").loc["big", "tokens_queried"] == huge


def test_a_count_equal_to_its_share_of_2_62_stays(tmp_path):
    """Past 2^62 in all, only the largest counts go: those above the largest count whose spans (with the smaller
    ones) total less than 2^62. The reason says "at most" that count, and a value equal to it stays."""
    spans = [lookup(f"r{i}", queried=1 << 52, hit=0, span_id=f"{i + 1:016x}") for i in range(1023)]
    spans.append(lookup("big", queried=1 << 53, hit=0, span_id="ff" * 8))
    read = traces.read_trace_files([write(tmp_path, line(*spans))])
    assert [(p.spans, p.reason.split(":")[0]) for p in read.problems] == [(1, f"kvscope.tokens.queried is {1 << 53}")]
    assert len(read.spans) == 1023 and "expected at most 4503599627370496" in read.problems[0].reason


def test_a_column_totalling_exactly_2_62_is_cut_below_it(tmp_path):
    """Two sums of 2^62 wrap around int64: a total of exactly 2^62 is too much (the bound is exact, not a
    float64 sum), and only the largest count goes."""
    spans = [lookup(f"r{i}", queried=1 << 52, hit=0, span_id=f"{i + 1:016x}") for i in range(1022)]
    spans.append(lookup("big", queried=1 << 53, hit=0, span_id="ff" * 8))
    assert 1022 * (1 << 52) + (1 << 53) == 1 << 62
    read = traces.read_trace_files([write(tmp_path, line(*spans))])
    assert [(p.spans, p.reason.split(":")[0]) for p in read.problems] == [(1, f"kvscope.tokens.queried is {1 << 53}")]
    assert "expected at most 4503599627370496" in read.problems[0].reason
    assert len(read.spans) == 1022 and read.spans["tokens_queried"].sum() == 1022 << 52


def test_equal_counts_that_alone_reach_2_62_all_go(tmp_path):
    """Which of equal counts would go is arbitrary, so all of them go, and the reason names the bound they pass."""
    spans = [lookup(f"h{i}", queried=1 << 53, hit=0, span_id=f"{i + 1:016x}") for i in range(512)]
    read = traces.read_trace_files([write(tmp_path, line(*spans))])
    assert len(read.spans) == 0 and [p.spans for p in read.problems] == [512]
    assert read.problems[0].reason.endswith(f"spans that have it, counts this large would pass 2^62, expected at "
                                            f"most {(1 << 53) - 1}")


def test_a_span_of_zero_duration_is_on_time(tmp_path, decoder):
    t = 1_700_000_000_000_000_000
    read = traces.read_trace_files([write(tmp_path, line(lookup("r1", start=t, end=t)))])
    assert read.problems == [] and list(read.spans["clock_ok"]) == [True] and list(read.spans["duration_ms"]) == [0]


def test_a_negative_count_says_what_was_expected(tmp_path, decoder):
    read = traces.read_trace_files([write(tmp_path, line(lookup("r1", queried=-3, hit=0)))])
    assert [(p.spans, p.reason) for p in read.problems] == [(1, "kvscope.tokens.queried is -3, expected a count >= 0")]


def test_a_clock_problem_in_one_file_is_listed_for_that_file_only(tmp_path):
    t = 1_700_000_000_000_000_000
    backwards = write(tmp_path, line(lookup("r1", start=t, end=t - 5)), name="a.jsonl")
    fine = write(tmp_path, line(lookup("r2", span_id="22" * 8, start=t)), name="b.jsonl")
    read = traces.read_trace_files([fine, backwards])
    assert [(Path(p.file).name, p.line, p.reason) for p in read.problems] == [
        ("a.jsonl", 1, f"{reader.ENDS_BEFORE_START} (1 span(s), kept)")]


def _bad_lookup_line(**edits: str) -> str:
    """A lookup line with fields replaced by raw JSON text (values `json.dumps` cannot write)."""
    text = line(lookup("r9", span_id="22" * 8))
    for field, raw in edits.items():
        text = re.sub(rf'"{field}": ("[^"]*"|\{{\}})', f'"{field}": {raw}', text, count=1)
    return text


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (_bad_lookup_line(startTimeUnixNano="1e400"), "malformed kvscope.lookup"),
        (_bad_lookup_line(startTimeUnixNano='"99999999999999999999"'), "outside 0..2^63"),
        (_bad_lookup_line(startTimeUnixNano='"9223372036854775808"'), "outside 0..2^63"),  # 2^63: past int64
        (_bad_lookup_line(startTimeUnixNano='"-5"'), "outside 0..2^63"),
        (_bad_lookup_line(startTimeUnixNano='"0x10"'), "is '0x10', expected an integer"),  # Arrow's cast takes hex
        (_bad_lookup_line(status='{"code": 1e400}'), "malformed kvscope.lookup"),
        (_bad_lookup_line(status='{"code": 7}'), "unknown status code 7"),
        (line(lookup("r9", span_id="22" * 8, queried=99999999999999999999)), "tokens.queried is not an integer"),
        # what Python's int() takes and protobuf's JSON parser does not: the time would be one never written
        (_bad_lookup_line(startTimeUnixNano="1.5"), "startTimeUnixNano is 1.5, expected an integer"),
        (_bad_lookup_line(startTimeUnixNano="true"), "startTimeUnixNano is true, expected an integer"),
        (_bad_lookup_line(endTimeUnixNano='" 1700000000000000000"'), "endTimeUnixNano is ' 1700000000000000000', "
                                                                    "expected an integer"),
        (_bad_lookup_line(startTimeUnixNano='"1_000"'), "startTimeUnixNano is '1_000', expected an integer"),
        (_bad_lookup_line(status='{"code": 1.5}'), "unknown status code 1.5: accepted are 0, 1, 2 and their names "
                                                   "STATUS_CODE_UNSET, STATUS_CODE_OK, STATUS_CODE_ERROR"),
        (_bad_lookup_line(status='{"code": true}'), "unknown status code true: accepted are 0, 1, 2"),
    ],
    ids=["deep", "infinite-time", "time-past-int64", "time-2^63", "negative-time", "hex-time", "infinite-status",
         "unknown-status", "huge-int", "fraction-time", "boolean-time", "spaced-time", "underscored-time",
         "fraction-status", "boolean-status"],
)
@pytest.mark.arrow_declines(when=lambda reason, **_: reason != "tokens.queried is not an integer")
def test_values_no_frame_can_hold_are_problems_not_crashes(tmp_path, decoder, bad, reason):
    path = write(tmp_path, line(lookup("r1", span_id="11" * 8)), bad)
    read = traces.read_trace_files([path])
    assert list(read.spans["span_id"]) == ["11" * 8]
    assert [p.line for p in read.problems] == [2] and reason in read.problems[0].reason, read.problems


@pytest.mark.arrow_declines
def test_times_and_status_codes_as_json_numbers_load_as_protobuf_reads_them(tmp_path, decoder):
    # OTLP/JSON writes 64-bit integers as strings; a JSON number, even in exponent form, is the same integer
    # when whole (protobuf's JSON parser takes it), and 1.0 is the status code 1
    text = _bad_lookup_line(startTimeUnixNano="1.7e18", endTimeUnixNano="1700000000000000123",
                            status='{"code": 1.0}')
    read = traces.read_trace_files([write(tmp_path, text)])
    assert read.problems == []
    assert (read.spans["start_ns"][0], read.spans["end_ns"][0]) == (1_700_000_000_000_000_000,
                                                                   1_700_000_000_000_000_123)
    assert read.spans["status_code"][0] == 1


def test_span_times_at_the_ends_of_int64_load(tmp_path, decoder):
    path = write(tmp_path, line(lookup("r1", span_id="11" * 8, start=1, end=(1 << 63) - 1)))
    read = traces.read_trace_files([path])
    assert (read.spans["start_ns"][0], read.spans["end_ns"][0]) == (1, (1 << 63) - 1)
    assert [(p.line, p.spans, p.reason.split(":")[0]) for p in read.problems] == [
        (0, 0, "1 span(s) start before 2000-01-01")]  # read, and said


@pytest.mark.parametrize("field", ["startTimeUnixNano", "endTimeUnixNano"])
@pytest.mark.parametrize("as_number", [False, True], ids=["string", "number"])
@pytest.mark.arrow_declines
def test_a_time_of_0_is_unset_and_skips_its_span_in_both_decoders(tmp_path, decoder, field, as_number):
    """OTLP reads 0 as unset: taken as 1970, one such span stretched the overview over 53 years."""
    spans = [lookup("r1", span_id="11" * 8), lookup("r9", span_id="22" * 8)]
    spans[1][field] = "0"
    if as_number:  # every time of the file a JSON number: Arrow reads the column as numbers, not text
        for s in spans:
            s["startTimeUnixNano"], s["endTimeUnixNano"] = int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])
    path = write(tmp_path, line(*spans))
    data = path.read_bytes()
    assert otlp_arrow.decode(data, str(path), data.split(b"\n")) is None  # declined: the line decoder names it
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["r1"]
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [
        (1, 1, f"malformed kvscope.lookup span: {field} is 0 (unset); expected ns since the epoch")]


def test_a_corrupted_gzip_file_is_a_problem_not_an_error(tmp_path):
    data = bytearray(gzip.compress((line(lookup()) + "\n").encode() * 50))
    data[20:40] = b"\xff" * 20
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(data))
    read = traces.read_trace_files([tmp_path / "bad.jsonl.gz", TWO_ROUNDS])
    assert [(p.line, p.reason.split(" (")[0]) for p in read.problems] == [(0, "gzip data is corrupt: cannot "
                                                                                "decompress past byte 25 of the file")]
    assert len(read.spans) == len(raw_spans(TWO_ROUNDS))


@pytest.mark.arrow_declines
def test_span_without_ids_or_times_is_reported(tmp_path, decoder):
    no_trace = lookup()
    del no_trace["traceId"]
    bad_time = lookup(span_id="33" * 8)
    bad_time["startTimeUnixNano"] = "soon"
    read = traces.read_trace_files([write(tmp_path, line(no_trace), line(bad_time), line(lookup(span_id="44" * 8)))])
    assert [p.line for p in read.problems] == [1, 2]
    assert "without traceId" in read.problems[0].reason
    assert "malformed kvscope.lookup" in read.problems[1].reason
    assert list(read.spans["span_id"]) == ["44" * 8]


def test_unknown_scope_version_skips_only_that_scope(tmp_path, decoder):
    path = write(tmp_path, line(lookup("old"), version="0.0.9"), line(lookup("new", span_id="55" * 8), version="0.1.7"))
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["new"]
    assert [(p.line, p.spans) for p in read.problems] == [(1, 1)]
    assert "'0.0.9'" in read.problems[0].reason


def test_spans_of_other_scopes_are_left_out_silently(tmp_path, decoder):
    foreign = span("llm_request", {"gen_ai.request.id": "r1"}, span_id="66" * 8)
    path = write(tmp_path, line(foreign, scope="vllm.llm_engine", version="1.0"), line(lookup()))
    read = traces.read_trace_files([path])
    assert read.problems == [] and read.other_spans == 1 and list(read.spans["request_id"]) == ["r1"]


@pytest.mark.arrow_declines
def test_base64_ids_and_numeric_int_values_are_accepted(tmp_path, decoder):
    s = lookup()
    s["traceId"] = base64.b64encode(bytes.fromhex("0a" * 16)).decode()
    s["spanId"] = base64.b64encode(bytes.fromhex("0b" * 8)).decode()
    s["attributes"][1]["value"] = {"intValue": 100}  # a JSON number, not a string
    read = traces.read_trace_files([write(tmp_path, line(s))])
    assert read.problems == []
    row = read.spans.iloc[0]
    assert (row["trace_id"], row["span_id"], row["tokens_queried"]) == ("0a" * 16, "0b" * 8, 100)


def test_duplicate_spans_are_dropped_once_reported(tmp_path):
    path = write(tmp_path, line(lookup()))
    copy = write(tmp_path, line(lookup()), name="collector-copy.jsonl")
    read = traces.read_trace_files([path, copy])
    assert len(read.spans) == 1
    assert [(p.line, p.spans) for p in read.problems] == [(1, 1)]
    assert "duplicate" in read.problems[0].reason


def test_reused_ids_keep_both_spans_and_are_reported(tmp_path):
    # Python's random seeded alike in two runs gives both runs the same trace and span ids.
    first = write(tmp_path, line(lookup("run1", start=1_700_000_000_000_000_000)), name="run1.jsonl")
    second = write(tmp_path, line(lookup("run2", start=1_700_000_999_000_000_000)), name="run2.jsonl")
    read = traces.read_trace_files([first, second])
    assert sorted(read.spans["request_id"]) == ["run1", "run2"]
    assert [(Path(p.file).name, p.line, p.spans) for p in read.problems] == [("run1.jsonl", 1, 0), ("run2.jsonl", 1, 0)]
    assert "also used by a different span" in read.problems[0].reason
    assert read.problems[0].reason.endswith("(1 span(s), kept)")


def test_gzip_files_and_uploaded_bytes(tmp_path):
    data = TWO_ROUNDS.read_bytes()
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(data))
    from_gz = traces.read_trace_files([gz])
    from_bytes = traces.read_trace_files([traces.TraceSource("upload: t.jsonl", data)])
    assert len(from_gz.spans) == len(from_bytes.spans) == len(raw_spans(TWO_ROUNDS))
    assert set(from_bytes.spans["source_file"]) == {"upload: t.jsonl"}


def test_problem_lines_summary():
    problems = [traces.Problem("/x/a.jsonl", n, "bad") for n in range(1, 12)] + [traces.Problem("b.jsonl", 0, "gone")]
    assert traces.problem_lines(problems) == "a.jsonl lines 1, 2, 3, 4, 5, 6, 7, 8 and 3 more; b.jsonl (gone)"
    assert traces.problem_lines([traces.Problem("upload: c.jsonl", 4, "x")]) == "upload: c.jsonl line 4 (x)"


def test_problem_lines_of_a_file_with_many_bad_lines():
    """100k problems (a file of another kind): the lines in order, the rest counted. (Their cost is
    linear now; it was quadratic, half a minute here: not a timed test, the dashboard benchmark's to show.)"""
    problems = [traces.Problem("a.jsonl", n, "bad") for n in range(100_000, 0, -1)]
    assert traces.problem_lines(problems).endswith("lines 1, 2, 3, 4, 5, 6, 7, 8 and 99992 more")


def test_problems_frame_is_sorted_by_file_and_line():
    problems = [traces.Problem("b", 2, "x"), traces.Problem("a", 9, "y"), traces.Problem("a", 1, "z")]
    frame = traces.problems_frame(problems + [traces.Problem("b", 0, "w")])
    assert list(zip(frame["file"], frame["line"].astype(object))) == [("a", 1), ("a", 9), ("b", pd.NA), ("b", 2)]


@pytest.mark.parametrize("cut", [b'{"resourceSpans":[xxxx', b'{"resourceSpans":[{"resource":{"attributes":['])
def test_a_file_of_one_line_cut_short_is_told_as_such_not_as_an_unparsable_document(tmp_path, cut):
    """A short run's file can be one line: cut mid-line, it was reported at line 0 as a JSON document
    that does not parse."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(cut)
    read = traces.read_trace_files([path])
    assert [(p.line, p.reason) for p in read.problems] == [(1, line_decoder.INCOMPLETE_LAST_LINE)]
    path.write_bytes(cut + b"\n")  # ended, so not being written: not JSON, at its column
    (problem,) = traces.read_trace_files([path]).problems
    assert problem.line == 1 and problem.reason.startswith("not JSON: ")


def test_connector_trace_file_sink_is_readable(tmp_path):
    """The connector's own exporter and this reader agree on the format (contract §4)."""
    from connector.telemetry import trace_file
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import set_span_in_context

    path = tmp_path / "sink.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(trace_file.OtlpJsonLinesExporter(path)))
    tracer = provider.get_tracer("kvscope", "0.1.0")
    with tracer.start_as_current_span("kvscope.lookup") as s:  # the request's trace, as the connector roots it
        s.set_attributes({"kvscope.request.id": "x", "kvscope.tokens.queried": 32, "kvscope.tokens.hit": 16})
    load = tracer.start_span("kvscope.load", context=set_span_in_context(s), attributes={
        "kvscope.request.id": "x", "kvscope.tokens.local": 0, "kvscope.tokens.external": 16, "kvscope.groups": 1})
    tracer.start_span("kvscope.group.copy", context=set_span_in_context(load), attributes={
        "kvscope.group.index": 0, "kvscope.group.kind": "mamba", "kvscope.copy.direction": "load",
        "kvscope.copy.blocks": 1, "kvscope.copy.bytes": 4096}).end()
    load.end()
    provider.shutdown()
    read = traces.read_trace_files([path])
    assert read.problems == [] and len(read.spans) == 3
    requests = traces.requests_table(read.spans)
    assert len(requests) == 1 and requests.loc[0, "lookups"] == 1
    assert requests.loc[0, "bytes_loaded"] == 4096 and requests.loc[0, "load_ms"] > 0


def _mutate(doc: dict, rng) -> None:
    """One random contract-relevant change to a parsed trace line."""
    spans = [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    target = rng.choice(spans)
    choice = rng.randrange(17)
    if choice == 0 and target["attributes"]:
        target["attributes"].pop(rng.randrange(len(target["attributes"])))
    elif choice == 1:
        target["attributes"].append({"key": "extra.flag", "value": {"boolValue": True}})
    elif choice == 2:
        target.pop("parentSpanId", None)
    elif choice == 3:
        doc["resourceSpans"][0]["scopeSpans"][0]["scope"]["version"] = "2.0.0"
    elif choice == 4:
        target["attributes"].append({"key": "kvscope.group.kind", "value": {"stringValue": "cross_attention"}})
    elif choice == 5:
        target["status"] = {"code": 2, "message": "copy failed"}
    elif choice == 6:
        target["name"] = "vllm.other"
    elif choice == 7:
        target["attributes"].append({"key": "kvscope.tokens.hit", "value": {"doubleValue": 1.5}})
    elif choice == 8:
        target["spanId"] = "zz" + target["spanId"][2:]
    elif choice == 9:
        target["attributes"].append({"key": "extra.unset", "value": rng.choice([None, {}])})
    elif choice == 10:
        target["attributes"].append({"key": "extra.list", "value": {"arrayValue": {"values": [
            {"stringValue": "a"}, {"intValue": "2"}]}}})
    elif choice == 11:
        target["attributes"].append({"key": "extra.map", "value": {"kvlistValue": {"values": [
            {"key": "k", "value": {"boolValue": False}}]}}})
    elif choice == 12:
        target["attributes"].append({"key": "kvscope.worker.rank", "value": None})
    elif choice == 13:
        doc["resourceSpans"][0]["scopeSpans"][0]["spans"].append(rng.choice(["junk", None, 7]))
    elif choice == 14:
        target["attributes"].append({"key": "kvscope.tokens.hit", "value": {"doubleValue": 3.0, "intValue": "5"}})
    elif choice == 15:  # the engine a resource names (data parallelism), well or badly
        resource = rng.choice(doc["resourceSpans"]).setdefault("resource", {})
        resource.setdefault("attributes", []).append({"key": "kvscope.engine", "value": rng.choice([
            {"intValue": "1"}, {"intValue": 2}, {"stringValue": "x"}, {"doubleValue": 0.5}, {}])})
    else:
        target["attributes"].append({"key": "extra.text", "value": {"stringValue": "half a pair: \ud800"}})


def test_decoders_agree_on_mutated_files(tmp_path, monkeypatch):
    """Where the Arrow decoder accepts a file, it reads it exactly like the line-by-line decoder."""
    import random

    rng = random.Random(11)
    lines = TWO_ROUNDS.read_text().splitlines()
    accepted = 0
    for case in range(25):
        docs = [json.loads(text) for text in lines]
        for _ in range(rng.randrange(1, 4)):
            _mutate(rng.choice(docs), rng)
        path = write(tmp_path, *(json.dumps(d) for d in docs), name=f"case{case}.jsonl")
        fast = traces.read_trace_files([path])
        accepted += otlp_arrow.decode(path.read_bytes(), str(path), path.read_bytes().split(b"\n")) is not None
        with monkeypatch.context() as m:
            m.setattr(otlp_arrow, "decode", lambda *args: None)
            slow = traces.read_trace_files([path])
        pd.testing.assert_frame_equal(fast.spans, slow.spans)
        assert fast.problems == slow.problems and fast.other_spans == slow.other_spans
    assert accepted >= 15  # the mutations keep most files in the Arrow decoder's shape


@pytest.mark.arrow_declines
def test_an_unfinished_last_line_is_reported_as_incomplete(tmp_path, decoder):
    cut = line(lookup("r2", span_id="22" * 8))[:50]
    live = tmp_path / "live.jsonl"
    live.write_text(line(lookup("r1", span_id="11" * 8)) + "\n" + cut)  # no newline: still being written
    read = traces.read_trace_files([live])
    assert list(read.spans["request_id"]) == ["r1"]
    assert [(p.line, p.reason) for p in read.problems] == [(2, line_decoder.INCOMPLETE_LAST_LINE)]
    # The same line with a newline after it is finished, and broken.
    read = traces.read_trace_files([write(tmp_path, cut, line(lookup("r1", span_id="11" * 8)))])
    assert [p.line for p in read.problems] == [1] and read.problems[0].reason.startswith("not JSON")


@pytest.mark.arrow_declines
def test_a_lone_surrogate_skips_only_its_span(tmp_path, decoder):
    """JSON may escape half a UTF-16 pair ("\\ud800"); no pandas string column or Arrow table takes it."""
    bad_id = lookup("r\ud800x", span_id="22" * 8)
    bad_extra = lookup("r3", span_id="33" * 8)
    bad_extra["attributes"].append({"key": "note", "value": {"stringValue": "\udfff"}})
    emoji = lookup("r-\U0001f600", span_id="44" * 8)  # a whole pair ("\ud83d\ude00"): fine
    path = write(tmp_path, line(lookup("r1", span_id="11" * 8), bad_id, bad_extra), line(emoji))
    assert b"\\ud800" in path.read_bytes() and b"\\ud83d\\ude00" in path.read_bytes()
    read = traces.read_trace_files([path])
    assert sorted(read.spans["request_id"]) == ["r-\U0001f600", "r1"]
    assert [(p.line, p.spans) for p in read.problems] == [(1, 2)]
    assert read.problems[0].reason.startswith("kvscope.lookup span holds a string that is not valid Unicode (a lone")
    pa.Table.from_pandas(traces.requests_table(read.spans))  # what st.dataframe does


@pytest.mark.arrow_declines
def test_a_lone_surrogate_in_a_span_name_is_named_printably(tmp_path, decoder):
    """The problem names the span: its name escaped, since the page cannot show (encode) a lone surrogate."""
    read = traces.read_trace_files([write(tmp_path, line(span("kvscope.x\ud800", {})))])
    assert read.empty and [p.reason.split(" span holds")[0] for p in read.problems] == ["kvscope.x\\ud800"]
    read.problems[0].reason.encode("utf-8")


@pytest.mark.parametrize("where", ["request id", "extra attribute"])
@pytest.mark.arrow_declines
def test_raw_surrogate_bytes_skip_only_their_span(tmp_path, decoder, where):
    """A surrogate UTF-8-encoded (ED A0 80, from a CESU-8/WTF-8 writer): not UTF-8, so Arrow declines the file,
    and the line decoder reads it as the escaped one ("\\ud800"): its span goes, not the whole read."""
    bad = lookup("r2" + "SURROGATE" * (where == "request id"), span_id="22" * 8)
    if where == "extra attribute":
        bad["attributes"].append({"key": "note", "value": {"stringValue": "SURROGATE"}})
    path = tmp_path / "t.jsonl"
    path.write_bytes((line(lookup("r1", span_id="11" * 8), bad) + "\n" + line(lookup("r3", span_id="33" * 8))
                      + "\n").encode().replace(b"SURROGATE", b"\xed\xa0\x80"))
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["r1", "r3"]
    assert [(p.line, p.spans) for p in read.problems] == [(1, 1)]
    assert read.problems[0].reason.startswith("kvscope.lookup span holds a string that is not valid Unicode (a lone")
    pa.Table.from_pandas(traces.requests_table(read.spans))  # what st.dataframe does


@pytest.mark.arrow_declines
def test_a_non_object_entry_of_spans_skips_only_that_entry(tmp_path, decoder):
    doc = json.loads(line(lookup("r1", span_id="11" * 8), lookup("r2", span_id="22" * 8)))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][1:1] = ["junk", None, 7, True, 1.5, False, [1]]
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc))])
    assert sorted(read.spans["request_id"]) == ["r1", "r2"]
    assert {p.line for p in read.problems} == {1} and len(read.problems) == 6
    assert {p.reason.removeprefix("an entry of spans is ").removesuffix(", not a span object"): p.spans
            for p in read.problems} == {"a string": 1, "null": 1, "a number": 2, "true": 1, "false": 1, "a list": 1}


@pytest.mark.arrow_declines
def test_a_null_entry_of_spans_is_a_problem_in_both_decoders(tmp_path, decoder):
    """Only nulls among the spans: a list Arrow parses, where a null struct would pass as a span of no name."""
    doc = json.loads(line(lookup("r1", span_id="11" * 8)))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"].append(None)
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc), line(lookup("r2", span_id="22" * 8)))])
    assert list(read.spans["request_id"]) == ["r1", "r2"] and read.other_spans == 0
    assert [(p.line, p.reason, p.spans) for p in read.problems] == [
        (1, "an entry of spans is null, not a span object", 1)]


@pytest.mark.arrow_declines
def test_a_string_attribute_written_as_a_number_reads_as_its_json_text(tmp_path, decoder):
    s = lookup("r1")
    s["attributes"][0]["value"] = {"stringValue": 5}  # kvscope.request.id
    read = traces.read_trace_files([write(tmp_path, line(s))])
    assert read.problems == [] and list(read.spans["request_id"]) == ["5"]


def test_spans_without_attributes_lack_what_their_name_requires_in_both_decoders(tmp_path, decoder):
    bare = lookup("r1")
    bare["attributes"] = []
    read = traces.read_trace_files([write(tmp_path, line(bare))])
    assert read.empty and [(p.reason, p.spans) for p in read.problems] == [
        ("kvscope.lookup span lacks kvscope.request.id", 1)]


@pytest.mark.arrow_declines
def test_a_span_attribute_holding_two_values_is_a_problem_in_both_decoders(tmp_path, decoder):
    two = lookup("r9", span_id="22" * 8)
    two["attributes"].append({"key": "note", "value": {"intValue": "5", "doubleValue": 3.0}})
    read = traces.read_trace_files([write(tmp_path, line(lookup("r1", span_id="11" * 8), two))])
    assert list(read.spans["request_id"]) == ["r1"]
    assert [(p.spans, "attribute 'note' holds 2 values" in p.reason) for p in read.problems] == [(1, True)]


def test_a_resource_or_scope_without_spans_holds_none(tmp_path, decoder):
    """OTLP/JSON leaves an empty repeated field out (or writes null): no spans, not a malformed line."""
    doc = json.loads(line(lookup("r1", span_id="11" * 8)))
    doc["resourceSpans"] += [{"resource": {}}, {"scopeSpans": None},
                             {"scopeSpans": [{"scope": {"name": "kvscope", "version": "0.1.0"}}]}]
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc))])
    assert list(read.spans["request_id"]) == ["r1"] and read.problems == []


@pytest.mark.arrow_declines
def test_a_status_code_written_as_its_enum_name_reads_as_its_number(tmp_path, decoder):
    """Protobuf's JSON printer writes an enum by name ("STATUS_CODE_ERROR"), OTLP/JSON by number."""
    spans = [lookup(f"r{i}", span_id=f"{i}{i}" * 8) for i in range(1, 4)]
    for s, code in zip(spans, ["STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR"]):
        s["status"] = {"code": code}
    read = traces.read_trace_files([write(tmp_path, line(*spans))])
    assert read.problems == []
    assert dict(zip(read.spans["request_id"], read.spans["status_code"])) == {"r1": 0, "r2": 1, "r3": 2}


@pytest.mark.arrow_declines
def test_bytes_that_are_not_utf8_skip_their_line_in_both_decoders(tmp_path, decoder):
    # In a span the dashboard leaves out: Arrow would not look at them, the line decoder skips the line.
    foreign = span("llm_request", {"gen_ai.prompt": "PROMPT"}, span_id="66" * 8)
    text = line(foreign, lookup("r1", span_id="11" * 8)) + "\n" + line(lookup("r2", span_id="22" * 8)) + "\n"
    path = tmp_path / "t.jsonl"
    path.write_bytes(text.encode().replace(b"PROMPT", b"\xff"))
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["r2"]
    assert [p.line for p in read.problems] == [1] and read.problems[0].reason.startswith("not UTF-8 text")


@pytest.mark.arrow_declines
def test_a_line_starting_with_nul_bytes_is_not_json_in_both_decoders(tmp_path, decoder):
    """NULs (a hole a copytruncate rotation leaves) made `json.loads` guess UTF-32 and say the line was not UTF-8."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\0" * 100 + (line(lookup("r1", span_id="11" * 8)) + "\n"
                                    + line(lookup("r2", span_id="22" * 8)) + "\n").encode())
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["r2"]
    assert [(p.line, p.reason) for p in read.problems] == [(1, "not JSON: Expecting value (column 1)")]


def test_decoders_agree_on_unset_and_nested_attribute_values(tmp_path):
    s = lookup("r1", span_id="11" * 8)
    s["attributes"] += [
        {"key": "null", "value": None},
        {"key": "empty", "value": {}},
        {"key": "absent"},
        {"key": "array", "value": {"arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "2"}]}}},
        {"key": "kvlist", "value": {"kvlistValue": {"values": [{"key": "k", "value": {"boolValue": True}}]}}},
    ]
    path = write(tmp_path, line(s), line(lookup("r2", span_id="22" * 8)))
    data = path.read_bytes()
    fast = otlp_arrow.decode(data, str(path), data.split(b"\n"))
    assert fast is not None, "the Arrow decoder declined"
    slow = traces.decode_lines(str(path), data.split(b"\n"))
    assert fast.problems == slow.problems == []
    assert fast.extra_attributes == slow.extra_attributes == [{
        "null": None, "empty": None, "absent": None,
        "array": {"values": [{"stringValue": "a"}, {"intValue": "2"}]},
        "kvlist": {"values": [{"key": "k", "value": {"boolValue": True}}]},
    }, None]


@pytest.mark.parametrize("value", [{"doubleValue": 3.0, "intValue": "5"}, {"intValue": "5", "stringValue": "5"}])
def test_an_attribute_holding_two_values_skips_its_span_in_both_decoders(tmp_path, decoder, value):
    """OTLP's AnyValue is a oneof: with two fields set, which one to read is a guess (the decoders
    guessed apart), so the span is a problem naming the attribute, as other malformed spans are."""
    bad = lookup("r2", span_id="22" * 8)
    bad["attributes"] = [a for a in bad["attributes"] if a["key"] != "kvscope.tokens.hit"]
    bad["attributes"].append({"key": "kvscope.tokens.hit", "value": value})
    path = write(tmp_path, line(lookup("r1", span_id="11" * 8), bad))
    data = path.read_bytes()
    assert otlp_arrow.decode(data, str(path), data.split(b"\n")) is None  # declined: the line decoder names it
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["r1"]
    assert [(p.line, p.spans) for p in read.problems] == [(1, 1)]
    assert "'kvscope.tokens.hit' holds 2 values" in read.problems[0].reason
    assert "an OTLP AnyValue holds one" in read.problems[0].reason
    # null entries beside the one value set are not a second value
    ok = lookup("r3", span_id="33" * 8)
    ok["attributes"] = [{"key": a["key"], "value": {**a["value"], "boolValue": None}} for a in ok["attributes"]]
    assert list(traces.read_trace_files([write(tmp_path, line(ok), name="ok.jsonl")]).spans["request_id"]) == ["r3"]


def engine_line(engine_value, *spans: dict) -> str:
    """A line whose resource names its engine (`kvscope.engine`, as the connector's SDK resource writes it)."""
    doc = json.loads(line(*spans))
    doc["resourceSpans"][0]["resource"]["attributes"] = [
        {"key": "service.name", "value": {"stringValue": "vllm"}},
        {"key": "kvscope.engine", "value": engine_value}]
    return json.dumps(doc)


@pytest.mark.arrow_declines
def test_each_span_takes_the_engine_its_resource_names(tmp_path, decoder):
    """Data parallelism: each engine's resource names it; its spans and requests carry it, a span's own
    value wins, and files written before kvscope recorded it give NA."""
    own = lookup("r4", span_id="44" * 8)
    own["attributes"].append({"key": "kvscope.engine", "value": {"intValue": "5"}})
    path = write(tmp_path, engine_line({"intValue": "0"}, lookup("r1", span_id="11" * 8)),
                 engine_line({"intValue": 1}, lookup("r2", span_id="22" * 8, trace="12" * 16), own),
                 line(lookup("r3", span_id="33" * 8, trace="34" * 16)))
    read = traces.read_trace_files([path])
    assert read.problems == []
    engine_of = dict(zip(read.spans["request_id"], read.spans["engine"]))
    assert engine_of == {"r1": 0, "r2": 1, "r4": 5, "r3": pd.NA}
    assert str(read.spans["engine"].dtype) == "Int64"
    requests = traces.requests_table(read.spans)
    assert traces.engines_of(requests) == [0, 1, 5]
    assert list(traces.search_requests(requests, "", engine=1)["request_id"]) == ["r2"]
    assert len(traces.search_requests(requests, "")) == 4
    engine_requests, engine_spans = traces.of_engine(requests, read.spans, 1)  # one host tier's story
    assert list(engine_requests["request_id"]) == ["r2"] and list(engine_spans["request_id"]) == ["r2"]


def _process_line(engine: int, instance: str | None, *spans: dict) -> str:
    """`engine_line` whose resource also names its process (`service.instance.id`, as the OTel SDK writes it)."""
    doc = json.loads(engine_line({"intValue": str(engine)}, *spans))
    if instance is not None:
        doc["resourceSpans"][0]["resource"]["attributes"].append(
            {"key": "service.instance.id", "value": {"stringValue": instance}})
    return json.dumps(doc)


def test_lookups_of_one_engine_index_from_several_processes_are_told(tmp_path, decoder):
    """Two servers' trace files read together (each engine 0), or one server restarted: each process had a host
    tier of its own, and the app said nothing of it. The SDK's service.instance.id tells the processes apart."""
    path = write(tmp_path,
                 _process_line(0, "aaaa", lookup("r1", span_id="11" * 8), lookup("r2", span_id="12" * 8)),
                 _process_line(0, "bbbb", lookup("r3", span_id="21" * 8, trace="12" * 16)),
                 _process_line(1, "cccc", lookup("r4", span_id="31" * 8, trace="13" * 16)),
                 _process_line(1, None, lookup("r5", span_id="41" * 8, trace="14" * 16)))
    read = traces.read_trace_files([path])
    assert read.problems == []
    instance_of = {r: None if pd.isna(i) else i
                   for r, i in zip(read.spans["request_id"], read.spans["service_instance"])}
    assert instance_of == {"r1": "aaaa", "r2": "aaaa", "r3": "bbbb", "r4": "cccc", "r5": None}
    assert traces.engines_run_apart(read.spans) == {0: 2}  # engine 1's second resource names no process
    note = traces.engines_run_apart_note({0: 2, None: 3})
    assert "(engine 0: 2 processes; no engine named: 3 processes;" in note and "host tier of its own" in note
    assert traces.engines_run_apart_note({}) == ""
    one = write(tmp_path, _process_line(0, "aaaa", lookup("r1", span_id="11" * 8)), name="one.jsonl")
    assert traces.engines_run_apart(traces.read_trace_files([one]).spans) == {}


def test_a_spans_own_engine_wins_over_its_resources_in_the_arrow_decoder_too(tmp_path):
    """The test above writes one engine as text and one as a JSON number, which the Arrow decoder declines: here
    both are text, so the Arrow decoder reads the file, and a span's own engine wins there too."""
    own = lookup("r2", span_id="22" * 8)
    own["attributes"].append({"key": "kvscope.engine", "value": {"intValue": "5"}})
    path = write(tmp_path, engine_line({"intValue": "1"}, lookup("r1", span_id="11" * 8), own))
    data = path.read_bytes()
    fast = otlp_arrow.decode(data, str(path), data.split(b"\n"))
    assert fast is not None, "the Arrow decoder declined a clean file"
    assert list(fast.values["kvscope.engine"]) == [1, 5]


@pytest.mark.arrow_declines
def test_resource_attributes_that_are_no_attribute_objects_are_not_kvscopes_to_judge(tmp_path, decoder):
    doc = json.loads(engine_line({"intValue": "1"}, lookup("r1", span_id="11" * 8)))
    doc["resourceSpans"][0]["resource"]["attributes"][:0] = ["x", None, 7]
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc))])
    assert read.problems == [] and list(read.spans["engine"]) == [1]
    unset = json.loads(engine_line(None, lookup("r2", span_id="22" * 8)))  # OTLP/JSON's null: unset
    read = traces.read_trace_files([write(tmp_path, json.dumps(unset))])
    assert read.problems == [] and read.spans["engine"].isna().all()


@pytest.mark.arrow_declines
def test_a_resource_naming_its_engine_twice_takes_the_first(tmp_path, decoder):
    doc = json.loads(engine_line({"intValue": "1"}, lookup("r1", span_id="11" * 8)))
    doc["resourceSpans"][0]["resource"]["attributes"].append({"key": "kvscope.engine", "value": {"intValue": "2"}})
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc))])
    assert read.problems == [] and list(read.spans["engine"]) == [1]


@pytest.mark.arrow_declines
def test_attributes_without_a_key_in_a_file_where_none_has_one(tmp_path, decoder):
    """No attribute of the file has a key (Arrow has no key column): a span's is a problem, a resource's is
    no kvscope attribute, as where other attributes have keys."""
    doc = json.loads(engine_line({"intValue": "1"}, lookup("r1", span_id="11" * 8)))
    for attribute in doc["resourceSpans"][0]["resource"]["attributes"]:
        del attribute["key"]
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc))])
    assert read.problems == [] and list(read.spans["request_id"]) == ["r1"] and read.spans["engine"].isna().all()
    bad = lookup("r2", span_id="22" * 8)
    bad["attributes"] = [{"value": a["value"]} for a in bad["attributes"]]
    read = traces.read_trace_files([write(tmp_path, line(bad), name="span.jsonl")])
    assert read.spans.empty
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [
        (1, 1, "malformed kvscope.lookup span: an attribute has no key")]


@pytest.mark.arrow_declines
def test_a_boolean_engine_where_no_resource_gives_a_number_is_no_integer(tmp_path, decoder):
    """Arrow types the resources' intValue column boolean then, not as numbers: still not an integer."""
    read = traces.read_trace_files([write(tmp_path, engine_line({"intValue": True}, lookup("r1")))])
    assert read.spans.empty and [(p.line, p.spans) for p in read.problems] == [(1, 1)]
    assert "kvscope.engine is not an integer" in read.problems[0].reason


def test_the_arrow_decoder_reads_engines_as_the_line_decoder_does(tmp_path):
    path = write(tmp_path, engine_line({"intValue": "0"}, lookup("r1", span_id="11" * 8)),
                 engine_line({"intValue": "1"}, lookup("r2", span_id="22" * 8)), line(lookup("r3", span_id="33" * 8)))
    data = path.read_bytes()
    fast = otlp_arrow.decode(data, str(path), data.split(b"\n"))
    assert fast is not None, "the Arrow decoder declined a clean file"
    slow = traces.decode_lines(str(path), data.split(b"\n"))
    pd.testing.assert_frame_equal(reader._validated_frame(fast, "t")[0], reader._validated_frame(slow, "t")[0])


@pytest.mark.parametrize("value, reason", [
    ({"stringValue": "west"}, "kvscope.engine is not an integer"),
    ({"doubleValue": 1.5}, "kvscope.engine is not an integer"),
    ({"boolValue": True}, "kvscope.engine is not an integer"),
    ({"intValue": True}, "kvscope.engine is not an integer"),
    ({"intValue": "-1"}, "kvscope.engine is -1, expected a count >= 0"),
    ({"intValue": "1", "stringValue": "1"}, "'kvscope.engine' holds 2 values"),
])
@pytest.mark.arrow_declines(when=lambda value, **_: value not in ({"doubleValue": 1.5}, {"intValue": "-1"}))
def test_a_bad_engine_in_a_resource_skips_that_resources_spans_only(tmp_path, decoder, value, reason):
    path = write(tmp_path, engine_line(value, lookup("r1", span_id="11" * 8), lookup("r2", span_id="22" * 8)),
                 engine_line({"intValue": "1"}, lookup("r3", span_id="33" * 8)))
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["r3"]
    assert [(p.line, p.spans) for p in read.problems] == [(1, 2)]
    assert reason in read.problems[0].reason


def test_a_pretty_printed_export_is_read_as_one_document(tmp_path, decoder):
    one = json.loads(line(lookup("r1", span_id="11" * 8)))
    two = json.loads(line(lookup("r2", span_id="22" * 8)))
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(one, indent=2))
    listed = tmp_path / "listed.json"
    listed.write_text(json.dumps([two, three := json.loads(line(lookup("r3", span_id="33" * 8)))], indent=2))
    read = traces.read_trace_files([pretty, listed])
    assert read.problems == [] and sorted(read.spans["request_id"]) == ["r1", "r2", "r3"]
    one_line = write(tmp_path, json.dumps([one, three]), name="one_line.json")  # a list of exports on one line
    assert sorted(traces.read_trace_files([one_line]).spans["request_id"]) == ["r1", "r3"]


@pytest.mark.arrow_declines
def test_a_file_whose_every_line_is_a_list_of_exports_is_read(tmp_path, decoder):
    """`jq -c '[.]'` writes each export in a list: JSON lines all the same, as a list is on one line."""
    lists = [f"[{line(lookup(f'r{i}', span_id=f'{i}{i}' * 8))}]" for i in range(1, 4)]
    read = traces.read_trace_files([write(tmp_path, *lists, "[]")])
    assert list(read.spans["request_id"]) == ["r1", "r2", "r3"]
    assert [(p.line, p.reason) for p in read.problems] == [
        (4, "expected a JSON object (an ExportTraceServiceRequest), got an empty list")]
    # after a stray first line the file is parsed whole, then told JSON lines by its lines that are lists
    read = traces.read_trace_files([write(tmp_path, "[", *lists, name="stray.jsonl")])
    assert list(read.spans["request_id"]) == ["r1", "r2", "r3"] and [p.line for p in read.problems] == [1]


def test_a_broken_pretty_printed_export_is_one_problem(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(json.loads(line(lookup())), indent=2)[:-3])
    read = traces.read_trace_files([broken])
    assert [(p.line, p.spans) for p in read.problems] == [(0, None)]
    assert read.problems[0].reason.startswith("expected JSON Lines: one ExportTraceServiceRequest per line")
    # nor are its lines JSON lines, though one is an empty list: that is no list of exports
    listed = tmp_path / "broken_list.json"
    listed.write_text(json.dumps([json.loads(line(lookup())), []], indent=2)[:-2])
    assert [(p.line, p.spans) for p in traces.read_trace_files([listed]).problems] == [(0, None)]


def test_a_json_lines_file_is_not_parsed_whole_to_tell_its_kind(monkeypatch):
    """Whether a file is one pretty-printed document shows in its first line's end: parsing a long first
    line (or the whole file) to find out cost seconds."""
    data = (line(lookup("r1", span_id="11" * 8)) + "\n" + line(lookup("r2", span_id="22" * 8)) + "\n").encode()
    loads, parsed = json.loads, []
    monkeypatch.setattr(json, "loads", lambda text, *a, **kw: parsed.append(text) or loads(text, *a, **kw))
    assert file_formats.as_json_lines("t.jsonl", data) == (data, []) and parsed == []


@pytest.mark.parametrize("stray", ["{", "[", '{"resourceSpans": ['])
@pytest.mark.arrow_declines
def test_a_bad_first_line_loses_only_itself(tmp_path, decoder, stray):
    path = write(tmp_path, stray, line(lookup("r1", span_id="11" * 8)), line(lookup("r2", span_id="22" * 8)))
    read = traces.read_trace_files([path])
    assert list(read.spans["request_id"]) == ["r1", "r2"]
    assert [(p.line, p.spans) for p in read.problems] == [(1, None)] and read.problems[0].reason.startswith("not JSON")


def test_files_of_another_kind_say_what_they_are(tmp_path):
    prom = tmp_path / "metrics.txt"
    prom.write_text("# HELP kvscope_lookup_tokens_total Tokens looked up\n# TYPE kvscope_lookup_tokens_total counter\n"
                    'kvscope_lookup_tokens_total{engine="0"} 8328\n')
    bare = tmp_path / "metrics_no_help.txt"
    bare.write_text('kvscope_hit_tokens_total{engine="0"} 5504\n')
    zst = tmp_path / "t.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(40))
    spans_only = write(tmp_path, json.dumps([lookup("r1"), lookup("r2")]), name="spans.json")
    read = traces.read_trace_files([prom, bare, zst, spans_only])
    reasons = {Path(p.file).name: p for p in read.problems}
    assert reasons["metrics.txt"].reason.startswith("looks like Prometheus metrics") and "Live page" in \
        reasons["metrics.txt"].reason
    assert reasons["metrics_no_help.txt"].reason.startswith("looks like Prometheus metrics")
    assert reasons["metrics.txt"].spans is None  # a file not read, like the zstd one: unknown
    assert reasons["t.jsonl.zst"].reason.startswith("zstd stream ends early")  # a frame header, no blocks
    assert reasons["spans.json"].reason.startswith("no resourceSpans: a bare span, not a trace export")
    assert reasons["spans.json"].reason.endswith("(2 entries of the list)") and reasons["spans.json"].spans == 2
    assert len(read.problems) == 4 and read.empty


@pytest.mark.parametrize(("doc", "reason"), [
    ({"traceId": "ab" * 16, "spanId": "cd" * 8}, "no resourceSpans: a bare span, not a trace export (spans belong"),
    ({"traceId": "ab" * 16}, "no resourceSpans: not a trace export"),
    ({"spanId": "cd" * 8}, "no resourceSpans: not a trace export"),
    ({"resourceLogs": [], "traceId": "ab" * 16, "spanId": "cd" * 8},
     "no resourceSpans: not a trace export (a resourceLogs export)"),
], ids=["span", "trace-id-only", "span-id-only", "log-export"])
@pytest.mark.arrow_declines
def test_a_bare_span_is_told_by_both_of_its_ids_in_a_document_of_no_other_export(doc, reason, decoder):
    read = traces.read_trace_files([traces.TraceSource("t.json", json.dumps(doc).encode())])
    assert [p.reason[:len(reason)] for p in read.problems] == [reason]


@pytest.mark.arrow_declines
def test_a_kvscope_span_without_its_ids_or_export_is_counted_by_both_decoders(decoder):
    """No ids, so not told a bare span; its kvscope name still counts it as a skipped kvscope span."""
    doc = lookup("r1")
    del doc["traceId"], doc["spanId"]
    read = traces.read_trace_files([traces.TraceSource("t.jsonl", (json.dumps(doc) + "\n").encode())])
    assert [(p.line, p.reason, p.spans) for p in read.problems] == [(1, "no resourceSpans: not a trace export", 1)]


@pytest.mark.arrow_declines
def test_bare_kvscope_spans_one_a_line_are_named_and_counted_by_both_decoders(decoder):
    """Spans written one a line with no export around them: the Arrow decoder once called each line "not a trace
    export" with no span skipped, where the line decoder says what the line is and counts its span."""
    data = (json.dumps(lookup("r1")) + "\n" + json.dumps(lookup("r2", span_id="22" * 8)) + "\n").encode()
    read = traces.read_trace_files([traces.TraceSource("spans.jsonl", data)])
    assert read.empty and [(p.line, p.spans) for p in read.problems] == [(1, 1), (2, 1)]
    assert all(p.reason.startswith("no resourceSpans: a bare span, not a trace export") for p in read.problems)


def test_a_gzip_file_still_being_written_keeps_its_complete_lines(tmp_path):
    data = gzip.compress(TWO_ROUNDS.read_bytes())
    cut = tmp_path / "live.jsonl.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    read = traces.read_trace_files([cut])
    assert 0 < len(read.spans) < len(raw_spans(TWO_ROUNDS))
    assert [(p.line, p.reason) for p in read.problems] == [(0, gzip_files.CUT_SHORT)]  # its last line is left out
    members = tmp_path / "members.jsonl.gz"  # gzip members appended one after the other
    members.write_bytes(gzip.compress(line(lookup("r1", span_id="11" * 8)).encode() + b"\n")
                        + gzip.compress(line(lookup("r2", span_id="22" * 8)).encode() + b"\n"))
    both = traces.read_trace_files([members])
    assert both.problems == [] and list(both.spans["request_id"]) == ["r1", "r2"]


def test_gzip_data_after_corruption_or_trailing_bytes_loses_only_what_follows(monkeypatch):
    text = "".join(line(lookup(f"r{i}", span_id=f"{i:016x}")) + "\n" for i in range(200)).encode()
    packed = gzip.compress(text)
    trailing = traces.read_trace_files([traces.TraceSource("t.jsonl.gz", packed + b"not gzip")])
    assert len(trailing.spans) == 200 and [p.line for p in trailing.problems] == [0]
    # zlib reads a header's two magic bytes before it rejects them
    assert trailing.problems[0].reason.startswith(f"gzip data is corrupt: cannot decompress past byte "
                                                  f"{len(packed) + 1:,} of the file (Error -3")

    monkeypatch.setattr(gzip_files, "_CHUNK", 256)  # decompressed step by step
    corrupt = bytearray(packed)
    middle = len(corrupt) // 2
    corrupt[middle:middle + 16] = b"\xff" * 16
    before = zlib.decompressobj(wbits=31).decompress(packed[:middle]).count(b"\n")
    read = traces.read_trace_files([traces.TraceSource("t.jsonl.gz", bytes(corrupt))])
    assert read.spans["request_id"].tolist()[:before] == [f"r{i}" for i in range(before)] and before > 20
    # deflate decodes these bytes (as garbage): only the member's checksum tells
    assert read.problems[0].line == 0 and read.problems[0].reason.startswith("gzip checksum does not match")
    assert all(p.line > before for p in read.problems[1:])  # lines the corruption garbled, if any


def test_the_same_file_given_twice_is_read_once(tmp_path):
    path = write(tmp_path, line(lookup()))
    read = traces.read_trace_files([path, tmp_path / "." / "t.jsonl"])
    assert len(read.spans) == 1 and read.files == [str(path)]
    assert [(p.line, p.spans) for p in read.problems] == [(0, 0)]
    assert read.problems[0].reason == f"the same file as {path}: read once"


def test_a_file_given_twice_that_cannot_be_read_is_not_said_to_be_read(tmp_path):
    missing = tmp_path / "gone.jsonl"
    read = traces.read_trace_files([missing, tmp_path / "." / "gone.jsonl"])
    assert [(p.line, p.spans) for p in read.problems] == [(0, None), (0, 0)]
    assert read.problems[1].reason == f"the same file as {missing}: it could not be read"


@pytest.mark.arrow_declines
def test_the_pre_1_0_otlp_field_names_read_like_the_current_ones(tmp_path, decoder):
    """Old Collectors write instrumentationLibrarySpans/instrumentationLibrary; a resource holding both
    fields is read by the current one."""
    old = {"resourceSpans": [{"instrumentationLibrarySpans": [
        {"instrumentationLibrary": {"name": "kvscope", "version": "0.1.0"}, "spans": [lookup("old")]}]}]}
    both = json.loads(line(lookup("new", span_id="22" * 8)))
    both["resourceSpans"][0]["instrumentationLibrarySpans"] = [{"spans": [lookup("stale", span_id="33" * 8)]}]
    exact = line(lookup("exact", span_id="44" * 8), version="0.1")  # the version itself, not only 0.1.x
    read = traces.read_trace_files([write(tmp_path, json.dumps(old), json.dumps(both), exact)])
    assert read.problems == [] and list(read.spans["request_id"]) == ["old", "new", "exact"]
    old["resourceSpans"][0]["instrumentationLibrarySpans"][0]["instrumentationLibrary"]["version"] = "9.0.0"
    read = traces.read_trace_files([write(tmp_path, json.dumps(old))])
    assert read.empty and [(p.spans, "'9.0.0' is not supported" in p.reason) for p in read.problems] == [(1, True)]


def test_only_the_kvscope_scopes_version_is_checked_under_either_field_name(tmp_path, decoder):
    """The scope's pre-1.0 field name inside a current scopeSpans entry still names kvscope's scope; another
    scope's version is not kvscope's to judge, even over a span named kvscope.*."""
    doc = json.loads(line(lookup("r1"), version="9.0.0"))
    scope_spans = doc["resourceSpans"][0]["scopeSpans"][0]
    scope_spans["instrumentationLibrary"] = scope_spans.pop("scope")
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc))])
    assert read.spans.empty
    assert [(p.spans, "'9.0.0' is not supported" in p.reason) for p in read.problems] == [(1, True)]
    read = traces.read_trace_files([write(tmp_path, line(lookup("r2"), scope="vllm", version="9.0.0"), name="o.jsonl")])
    assert read.problems == [] and list(read.spans["request_id"]) == ["r2"]


def test_a_file_of_clean_exports_without_spans_lists_each_line_that_is_no_trace_export(tmp_path, decoder):
    """Parses cleanly (the Arrow decoder takes it) yet holds no span: a metrics export, a trace export of none."""
    path = write(tmp_path, json.dumps({"resourceMetrics": [{"resource": {}}]}), json.dumps({"resourceSpans": []}),
                 json.dumps({"resourceMetrics": []}), json.dumps({"resourceLogs": []}))
    if decoder == "arrow":
        assert otlp_arrow.decode(path.read_bytes(), str(path), path.read_bytes().split(b"\n")) is not None
    read = traces.read_trace_files([path])
    assert read.empty and read.lines == 4 and read.other_spans == 0
    assert [(p.line, p.reason, p.spans) for p in read.problems] == [
        (1, "no resourceSpans: not a trace export (a resourceMetrics export)", 0),
        (3, "no resourceSpans: not a trace export (a resourceMetrics export)", 0),
        (4, "no resourceSpans: not a trace export (a resourceLogs export)", 0)]


@pytest.mark.arrow_declines
def test_a_line_that_is_no_export_says_what_json_it_holds(tmp_path, decoder):
    path = write(tmp_path, "[]", '["x", {}]', "7", line(lookup("r1")))
    read = traces.read_trace_files([path])
    assert [(p.line, p.reason) for p in read.problems] == [
        (1, "expected a JSON object (an ExportTraceServiceRequest), got an empty list"),
        (2, "expected a JSON object (an ExportTraceServiceRequest), got a list holding a string"),
        (3, "expected a JSON object (an ExportTraceServiceRequest), got a number")]
    assert list(read.spans["request_id"]) == ["r1"]


@pytest.mark.arrow_declines
def test_a_line_holding_two_json_documents_is_not_json(tmp_path, decoder):
    """Arrow's parser reads them as two rows: one line fewer than rows, so the line decoder names the line."""
    empty = json.dumps({"resourceSpans": []})
    read = traces.read_trace_files([write(tmp_path, line(lookup("r1")), empty + " " + empty)])
    assert list(read.spans["request_id"]) == ["r1"]
    assert [(p.line, p.reason.startswith("not JSON: Extra data")) for p in read.problems] == [(2, True)]


@pytest.mark.arrow_declines
def test_a_long_reason_is_cut_to_160_characters(tmp_path, decoder):
    bad = lookup("r9", span_id="22" * 8)
    bad["startTimeUnixNano"] = "9" * 400  # beyond int64: its value is quoted in the reason
    read = traces.read_trace_files([write(tmp_path, line(lookup("r1", span_id="11" * 8), bad))])
    prefix = "malformed kvscope.lookup span: "
    (problem,) = read.problems
    assert problem.reason.startswith(prefix + "startTimeUnixNano '999") and problem.reason.endswith("9…")
    assert len(problem.reason) == len(prefix) + 160
    bad["startTimeUnixNano"] = "9" * 118  # a reason of 160 characters exactly: whole
    read = traces.read_trace_files([write(tmp_path, line(lookup("r1", span_id="11" * 8), bad))])
    assert read.problems[0].reason == prefix + f"startTimeUnixNano '{'9' * 118}' is outside 0..2^63 ns"
    assert len(read.problems[0].reason) == len(prefix) + 160


def test_a_kvscope_scope_without_a_version_is_not_supported(tmp_path, decoder):
    doc = json.loads(line(lookup("r1")))
    del doc["resourceSpans"][0]["scopeSpans"][0]["scope"]["version"]
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc), line(lookup("r2", span_id="22" * 8)))])
    assert list(read.spans["request_id"]) == ["r2"]
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [
        (1, 1, "kvscope scope version '' is not supported (this dashboard reads 0.1.x)")]


@pytest.mark.arrow_declines
def test_a_scope_of_an_unsupported_version_counts_only_its_kvscope_spans(tmp_path, decoder):
    doc = json.loads(line(lookup("r9"), span("llm_request", {}, span_id="66" * 8), version="9.0.0"))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"].append("junk")  # not a span: not kvscope's either
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc), line(lookup("r1", span_id="11" * 8)))])
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [
        (1, 1, "kvscope scope version '9.0.0' is not supported (this dashboard reads 0.1.x)")]
    assert list(read.spans["request_id"]) == ["r1"] and read.other_spans == 2  # llm_request and the junk entry


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        ({"resourceSpans": {}}, "not an OTLP trace export: resourceSpans is an object, expected a list"),
        ({"resourceSpans": ["x"]}, "not an OTLP trace export: resourceSpans[0] is a string, expected an object"),
        ({"resourceSpans": [{"scopeSpans": {"spans": []}}]},
         "not an OTLP trace export: resourceSpans[0].scopeSpans is an object, expected a list"),
        ({"resourceSpans": [{"scopeSpans": [{"scope": "kvscope", "spans": []}]}]},
         "not an OTLP trace export: resourceSpans[0].scopeSpans[0].scope is a string, expected an object"),
        ({"resourceSpans": [{"scopeSpans": 0}]},  # falsy, yet not a list: not the old format's "no scopeSpans"
         "not an OTLP trace export: resourceSpans[0].scopeSpans is a number, expected a list"),
        ({"resourceSpans": [None]}, "not an OTLP trace export: resourceSpans[0] is null, expected an object"),
        ({"resourceSpans": [{"scopeSpans": [None]}]},
         "not an OTLP trace export: resourceSpans[0].scopeSpans[0] is null, expected an object"),
    ],
    ids=["resourceSpans-object", "resource-string", "scopeSpans-object", "scope-string", "scopeSpans-zero",
         "resource-null",
         "scopeSpans-entry-null"],
)
@pytest.mark.arrow_declines
def test_a_misshapen_export_names_the_field(tmp_path, decoder, doc, reason):
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc), line(lookup()))])
    assert [(p.line, p.reason) for p in read.problems] == [(1, reason)]
    assert len(read.spans) == 1


def _scope_spans(doc: dict) -> dict:
    return doc["resourceSpans"][0]["scopeSpans"][0]


def _values(doc: dict, value) -> None:
    for attribute in _scope_spans(doc)["spans"][0]["attributes"]:
        attribute["value"] = value


@pytest.mark.parametrize(
    ("edit", "reason", "spans"),
    [
        (lambda doc: _scope_spans(doc)["spans"][0].update(status=None), None, None),
        (lambda doc: _scope_spans(doc).update(scope=None), None, None),
        pytest.param(lambda doc: doc["resourceSpans"][0]["resource"].update(
            attributes=[{"key": "kvscope.engine", "value": None}]), None, None, marks=pytest.mark.arrow_declines),
        pytest.param(lambda doc: doc["resourceSpans"][0]["resource"].update(attributes=[{"key": "kvscope.engine"}]),
                     None, None, marks=pytest.mark.arrow_declines),
        (lambda doc: _values(doc, None), "kvscope.lookup span lacks kvscope.request.id", 1),
        (lambda doc: [a.pop("value") for a in _scope_spans(doc)["spans"][0]["attributes"]],
         "kvscope.lookup span lacks kvscope.request.id", 1),
        (lambda doc: _scope_spans(doc)["spans"][0].update(status="ok"),
         "malformed kvscope.lookup span: status is a string, expected an object", 1),
        (lambda doc: _scope_spans(doc).update(scope="kvscope"),
         "not an OTLP trace export: resourceSpans[0].scopeSpans[0].scope is a string, expected an object", None),
        (lambda doc: _values(doc, 5),
         "malformed kvscope.lookup span: the value of attribute 'kvscope.request.id' is a number, "
         "expected an object", 1),
    ],
    ids=["status-null", "scope-null", "engine-null", "engine-unset", "values-null", "values-unset", "status-string",
         "scope-string", "values-number"],
)
@pytest.mark.arrow_declines(when=lambda reason, **_: reason is not None)  # and the two engine cases below
def test_a_field_that_is_no_object_on_any_line_reads_as_in_the_line_decoder(tmp_path, decoder, edit, reason, spans):
    """Where no line gives a field as an object, Arrow types it null (or text, a number), not as an object:
    null is unset, anything else is a problem, as where other lines hold objects (the Arrow decoder crashed)."""
    doc = json.loads(line(lookup("r1")))
    edit(doc)
    read = traces.read_trace_files([write(tmp_path, json.dumps(doc))])
    if reason is None:
        assert read.problems == [] and list(read.spans["request_id"]) == ["r1"]
        assert read.spans["engine"].isna().all() and list(read.spans["status_code"]) == [0]
    else:
        assert read.spans.empty and [(p.line, p.reason, p.spans) for p in read.problems] == [(1, reason, spans)]


def _attributes_null(doc: dict) -> dict:
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [None]
    return doc


@pytest.mark.parametrize(
    ("edit", "reason", "spans"),
    [
        (lambda doc: {"resourceSpans": [None]},
         "not an OTLP trace export: resourceSpans[0] is null, expected an object", None),
        (lambda doc: {"resourceSpans": [{"scopeSpans": [None]}]},
         "not an OTLP trace export: resourceSpans[0].scopeSpans[0] is null, expected an object", None),
        (lambda doc: {"resourceSpans": [{"scopeSpans": [{"spans": [None]}]}]},
         "an entry of spans is null, not a span object", 1),
        (_attributes_null, "malformed kvscope.lookup span: an entry of attributes is null, expected an object", 1),
    ],
    ids=["resource", "scopeSpans", "spans", "attributes"],
)
@pytest.mark.arrow_declines
def test_a_list_whose_only_entries_in_the_file_are_null_is_reported(tmp_path, decoder, edit, reason, spans):
    """With no object anywhere in the list, Arrow types its entries null, not as objects: the null entry is
    still a problem, as where another line's entries are objects (the Arrow decoder took it for an empty list)."""
    read = traces.read_trace_files([write(tmp_path, json.dumps(edit(json.loads(line(lookup())))))])
    assert read.spans.empty
    assert [(p.line, p.reason, p.spans) for p in read.problems] == [(1, reason, spans)]


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda s: s.update(attributes={"k": 1}),
         "malformed kvscope.lookup span: attributes is an object, expected a list"),
        (lambda s: s["attributes"].append("x"), "malformed kvscope.lookup span: an entry of attributes is a string, "
                                               "expected an object"),
        (lambda s: s["attributes"].append({"key": "k", "value": 5}),
         "malformed kvscope.lookup span: the value of attribute 'k' is a number, expected an object"),
        (lambda s: s.update(status="ok"), "malformed kvscope.lookup span: status is a string, expected an object"),
        (lambda s: s.update(startTimeUnixNano="soon"), "malformed kvscope.lookup span: startTimeUnixNano is 'soon', "
                                                        "expected an integer: nanoseconds since the epoch"),
        (lambda s: s["attributes"].append(None), "malformed kvscope.lookup span: an entry of attributes is null, "
                                                 "expected an object"),
        (lambda s: s["attributes"].append({"value": {"intValue": "1"}}),
         "malformed kvscope.lookup span: an attribute has no key"),
        (lambda s: s.update(endTimeUnixNano="later"), "malformed kvscope.lookup span: endTimeUnixNano is 'later', "
                                                      "expected an integer: nanoseconds since the epoch"),
        (lambda s: s.pop("traceId"), "kvscope.lookup span without traceId"),
    ],
    ids=["attributes-object", "attribute-string", "value-number", "status-string", "time-text", "attribute-null",
         "attribute-no-key", "end-time-text", "no-trace-id"],
)
@pytest.mark.arrow_declines
def test_a_misshapen_span_names_the_field(tmp_path, decoder, edit, reason):
    bad = lookup("r9", span_id="22" * 8)
    edit(bad)
    read = traces.read_trace_files([write(tmp_path, line(lookup("r1", span_id="11" * 8), bad))])
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [(1, 1, reason)]
    assert list(read.spans["request_id"]) == ["r1"]


def test_spans_timed_on_another_clock_lose_only_the_times_they_spoil(tmp_path, decoder):
    """A copy starting before its load was placed on another clock: its load time is unknown, its own
    duration (measured on one clock) still counts. A copy ending before it starts has no duration."""
    from .test_joins import copy, load

    t = 1_700_000_000_000_000_000
    path = write(tmp_path,
                 line(lookup("early", trace="aa" * 16, span_id="a1" * 8, start=t),
                      load("early", trace="aa" * 16, span_id="a2" * 8, parent="a1" * 8, start=t + 5_000_000),
                      lookup("backwards", trace="bb" * 16, span_id="b1" * 8, start=t),
                      load("backwards", trace="bb" * 16, span_id="b2" * 8, parent="b1" * 8, start=t + 10)),
                 # the worker's clock 4 ms behind: its copy "starts" before the load was planned
                 line(copy("load", 100, "early", trace="aa" * 16, span_id="a3" * 8, parent="a2" * 8,
                           start=t + 1_000_000, end=t + 2_000_000)),
                 line(copy("load", 7, "backwards", trace="bb" * 16, span_id="b3" * 8, parent="b2" * 8,
                           start=t + 3_000_000, end=t + 1_000_000)))
    read = traces.read_trace_files([path])
    assert [(p.line, p.spans) for p in read.problems] == [(2, 0), (3, 0)]
    assert read.problems[0].reason.startswith(reader.STARTS_BEFORE_OWNER)
    assert read.problems[1].reason.startswith(reader.ENDS_BEFORE_START)
    assert "copy durations and throughput" in reader.ENDS_BEFORE_START  # says what is left out, and no more
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert requests["load_ms"].isna().all() and requests["load_mistimed"].all()
    assert requests["bytes_loaded"].to_dict() == {"early": 100, "backwards": 7}  # the bytes were copied
    quantiles = traces.load_latency_quantiles(read.spans, traces.requests_table(read.spans))
    assert quantiles["count"].tolist() == [0, 1] and quantiles["max_ms"].iloc[1] == pytest.approx(1.0)
    throughput = traces.copy_throughput(read.spans)
    assert throughput["copies"].tolist() == [2] and throughput["copy_seconds"].tolist() == pytest.approx([0.001])
    assert throughput["gb_per_s"].tolist() == pytest.approx([100 / 0.001 / 1e9])


def test_a_scan_with_more_null_and_pending_blocks_than_it_scanned_is_skipped_and_named(tmp_path, decoder):
    """A scan's blocks are null (skipped) or pending: more than its total made a null-skip share of 18,586%."""
    def scan(group: int, total: int, skipped: int, pending: int, span_id: str) -> dict:
        return span("kvscope.group.scan", {"kvscope.group.index": group, "kvscope.group.kind": "full_attention",
                                           "kvscope.group.blocks.total": total,
                                           "kvscope.group.blocks.null_skipped": skipped,
                                           "kvscope.group.blocks.pending": pending, "kvscope.group.blocks.start": 0},
                    trace="aa" * 16, span_id=span_id, parent="a2" * 8)

    bad, fine = scan(0, 5, 999, 1, "a3" * 8), scan(1, 5, 0, 5, "a4" * 8)
    read = traces.read_trace_files([write(tmp_path, line(bad, fine))])
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [
        (1, 1, "kvscope.group.blocks.null_skipped 999 + kvscope.group.blocks.pending 1 is more than "
               "kvscope.group.blocks.total 5, expected null skipped + pending <= total")]
    assert read.spans["group_index"].tolist() == [1]


def test_a_load_span_ending_before_it_starts_leaves_its_load_without_load_time(tmp_path, decoder):
    """The load's own start is a load time's start: a load span ending before it starts (a clock stepped back)
    gave a load time from its end, and a negative one where its copies ended before it "started"."""
    from .test_joins import copy, load

    t = 1_700_000_000_000_000_000
    path = write(tmp_path,
                 line(lookup("r1", trace="aa" * 16, span_id="a1" * 8, start=t),
                      load("r1", trace="aa" * 16, span_id="a2" * 8, parent="a1" * 8, start=t + 1_000_000, end=t)),
                 line(copy("load", 100, "r1", trace="aa" * 16, span_id="a3" * 8, parent="a2" * 8,
                           start=t + 500_000, end=t + 800_000)))
    read = traces.read_trace_files([path])
    assert [(p.line, p.reason) for p in read.problems] == [(1, f"{reader.ENDS_BEFORE_START} (1 span(s), kept)")]
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert pd.isna(requests.loc["r1", "load_ms"]) and requests.loc["r1", "load_mistimed"]
    assert requests.loc["r1", "bytes_loaded"] == 100  # the bytes were copied
    assert traces.top_slow_loads(traces.requests_table(read.spans), 5).empty


def test_a_copy_starting_within_a_millisecond_before_its_load_is_on_its_clock(tmp_path):
    """A GPU copy's interval is placed on the wall clock within about 1 ms: no problem, its load is timed."""
    from .test_joins import copy, load

    t = 1_700_000_000_000_000_000
    path = write(tmp_path, line(load("r", span_id="a2" * 8, start=t + 5_000_000),
                                copy("load", 100, "r", span_id="a3" * 8, parent="a2" * 8,
                                     start=t + 4_500_000, end=t + 6_500_000)))
    read = traces.read_trace_files([path])
    assert read.problems == []
    requests = traces.requests_table(read.spans)
    assert requests["load_ms"].tolist() == pytest.approx([1.5]) and not requests["load_mistimed"].any()


def test_a_group_without_a_trusted_copy_time_has_unknown_throughput(tmp_path):
    from .test_joins import copy, load

    t = 1_700_000_000_000_000_000
    path = write(tmp_path, line(load("r", span_id="a2" * 8, start=t),
                                copy("load", 100, "r", span_id="a3" * 8, parent="a2" * 8,
                                     start=t + 3_000_000, end=t + 1_000_000)))
    throughput = traces.copy_throughput(traces.read_trace_files([path]).spans)
    assert throughput["copies"].tolist() == [1] and throughput["bytes"].tolist() == [100]
    assert throughput[["copy_seconds", "gb_per_s", "p50_gb_per_s"]].isna().all(axis=None)  # unknown, not 0 s


@pytest.mark.parametrize("name", [None, 7], ids=["no name", "a number"])
@pytest.mark.arrow_declines(when=lambda name, **_: name == 7)
def test_spans_without_a_string_name_are_no_kvscope_spans_and_no_crash(tmp_path, decoder, name):
    """A file whose only span has no name (or a number for one): no kvscope span; the Arrow decoder leaves
    it to the line decoder rather than failing on the missing column."""
    sp = lookup("r1", span_id="01" * 8)
    if name is None:
        del sp["name"]
    else:
        sp["name"] = name
    read = traces.read_trace_files([write(tmp_path, line(sp))])
    assert read.spans.empty and read.problems == []
    # beside a kvscope span (Arrow's name column is there, null or not text for this span): another span
    read = traces.read_trace_files([write(tmp_path, line(lookup("r2", span_id="02" * 8), sp), name="two.jsonl")])
    assert list(read.spans["request_id"]) == ["r2"] and read.problems == [] and read.other_spans == 1


@pytest.mark.parametrize("field", ["traceId", "spanId", "startTimeUnixNano", "endTimeUnixNano"])
@pytest.mark.arrow_declines
def test_a_field_no_span_of_the_file_has_is_reported_not_a_crash(tmp_path, decoder, field):
    """Arrow has no column at all for a key no line holds; the span is still reported and skipped, as where
    another line's span holds the key."""
    sp = lookup("r1", span_id="01" * 8)
    del sp[field]
    read = traces.read_trace_files([write(tmp_path, line(sp))])
    assert read.spans.empty and [(p.line, p.spans) for p in read.problems] == [(1, 1)]
    # held by another line's span: Arrow's column is there, with a null for this span
    read = traces.read_trace_files([write(tmp_path, line(lookup("r2", span_id="02" * 8)), line(sp))])
    assert list(read.spans["request_id"]) == ["r2"] and [(p.line, p.spans) for p in read.problems] == [(2, 1)]


def test_numbers_written_as_json_numbers_read_alike_in_both_decoders(tmp_path):
    """OTLP/JSON writes int64 as decimal strings; JSON numbers (times, intValue) and a doubleValue are read too,
    by the Arrow decoder as well."""
    sp = span("kvscope.lookup", {"kvscope.request.id": "r1", "gen_ai.request.temperature": 0.5},
              start=1_700_000_000_000_000_000)
    sp["attributes"] += [{"key": "kvscope.tokens.queried", "value": {"intValue": 100}},
                         {"key": "kvscope.tokens.hit", "value": {"intValue": 64}}]
    sp["startTimeUnixNano"], sp["endTimeUnixNano"] = 1_700_000_000_000_000_000, 1_700_000_000_000_001_000
    path = write(tmp_path, line(sp))
    data = path.read_bytes()
    fast = otlp_arrow.decode(data, str(path), data.split(b"\n"))
    assert fast is not None, "the Arrow decoder declined a clean file"
    slow = traces.decode_lines(str(path), data.split(b"\n"))
    pd.testing.assert_frame_equal(reader._validated_frame(fast, "t")[0], reader._validated_frame(slow, "t")[0])
    assert list(fast.start_ns) == [1_700_000_000_000_000_000] and fast.problems == []
    assert list(fast.values["kvscope.tokens.hit"]) == [64]
    assert fast.extra_attributes == [{"gen_ai.request.temperature": 0.5}]


@pytest.mark.parametrize("edit", [
    lambda doc: _scope_spans(doc).pop("scope"),
    lambda doc: _scope_spans(doc)["scope"].pop("name"),
    lambda doc: _scope_spans(doc)["spans"][0].update(status={"code": None}),
    lambda doc: _scope_spans(doc)["spans"][0].update(status=None),
    lambda doc: _scope_spans(doc)["spans"][0].update(parentSpanId=None),
    lambda doc: _scope_spans(doc)["spans"].append(span("llm_request", {}, span_id="66" * 8)),
    lambda doc: _scope_spans(doc)["spans"][0].update(name="llm_request"),
], ids=["no scope", "a scope without name", "status code null", "status null", "parent id null",
        "a vLLM span beside", "no kvscope span"])
def test_the_arrow_decoder_reads_clean_files_of_uncommon_shape(tmp_path, edit):
    """A field absent (or null) on every line has no Arrow column (or a null one); a file without kvscope spans
    keeps none: read, not left to the line decoder."""
    doc = json.loads(line(lookup("r1")))
    edit(doc)
    path = write(tmp_path, json.dumps(doc))
    data = path.read_bytes()
    fast = otlp_arrow.decode(data, str(path), data.split(b"\n"))
    assert fast is not None, "the Arrow decoder declined a clean file"
    slow = traces.decode_lines(str(path), data.split(b"\n"))
    pd.testing.assert_frame_equal(reader._validated_frame(fast, "t")[0], reader._validated_frame(slow, "t")[0])
    assert fast.problems == slow.problems == [] and list(fast.status_code) == [0] * len(fast.name)
    assert (fast.other_spans, fast.lines) == (slow.other_spans, slow.lines)


@pytest.mark.parametrize(("start", "reason"), [
    (-5, "startTimeUnixNano -5 is outside 0..2^63 ns"),
    (True, "startTimeUnixNano is true, expected an integer: nanoseconds since the epoch"),
], ids=["negative", "boolean"])
@pytest.mark.arrow_declines
def test_a_time_that_is_a_negative_or_boolean_json_value_skips_its_span(tmp_path, decoder, start, reason):
    """Where every span's time is a JSON number (or a boolean), Arrow's column is numbers (booleans), not text."""
    bad = lookup("r9", span_id="22" * 8)
    bad["startTimeUnixNano"], bad["endTimeUnixNano"] = start, 1000
    spans = [bad]
    if not isinstance(start, bool):  # a good span beside it, with its times as JSON numbers too
        spans.append(lookup("r1", span_id="11" * 8))
        spans[1]["startTimeUnixNano"] = 1_700_000_000_000_000_500
        spans[1]["endTimeUnixNano"] = 1_700_000_000_000_001_000
    read = traces.read_trace_files([write(tmp_path, line(*spans))])
    assert list(read.spans["request_id"]) == (["r1"] if len(spans) == 2 else [])
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [(1, 1, "malformed kvscope.lookup span: " + reason)]


@pytest.mark.parametrize(("value", "text"), [({"intValue": "7"}, "7"), ({"boolValue": True}, "true")])
@pytest.mark.arrow_declines
def test_a_text_attribute_given_another_type_reads_as_its_json_text(tmp_path, decoder, value, text):
    bad = lookup("r2", span_id="22" * 8)
    bad["attributes"][0]["value"] = value  # kvscope.request.id
    read = traces.read_trace_files([write(tmp_path, line(lookup("r1", span_id="11" * 8), bad))])
    assert read.problems == [] and list(read.spans["request_id"]) == ["r1", text]


def test_the_one_attribute_of_a_file_is_read(tmp_path, decoder):
    """The file's only attribute counts: the span lacks the lookup's next attribute, not its request id."""
    read = traces.read_trace_files([write(tmp_path, line(span("kvscope.lookup", {"kvscope.request.id": "r1"})))])
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [
        (1, 1, "kvscope.lookup span lacks kvscope.tokens.queried")]


def test_status_codes_read_alike_and_an_unknown_one_skips_its_span(tmp_path, decoder):
    spans = []
    for i, status in enumerate([{"code": 0}, {"code": 1}, {"code": 2}, {"code": None}, {}, {"code": 3}]):
        spans.append(lookup(f"r{i}", span_id=f"{i + 1:02d}" * 8))
        spans[-1]["status"] = status
    known = write(tmp_path, line(*spans[:5]), name="known.jsonl")
    if decoder == "arrow":
        assert otlp_arrow.decode(known.read_bytes(), str(known), known.read_bytes().split(b"\n")) is not None
    read = traces.read_trace_files([known])
    assert read.problems == [] and list(read.spans["status_code"]) == [0, 1, 2, 0, 0]  # null and absent: unset
    read = traces.read_trace_files([write(tmp_path, line(*spans))])
    assert list(read.spans["request_id"]) == ["r0", "r1", "r2", "r3", "r4"]
    assert [(p.line, p.spans) for p in read.problems] == [(1, 1)] and "unknown status code 3" in read.problems[0].reason


def test_a_kvscope_span_beside_others_in_a_file_without_attributes_is_reported(tmp_path, decoder):
    """No span of the file has attributes (Arrow has no column for them) and one is not kvscope's."""
    bare = lookup("r1", span_id="11" * 8)
    del bare["attributes"]
    other = span("llm_request", {}, span_id="22" * 8)
    del other["attributes"]
    path = write(tmp_path, line(bare, other))
    if decoder == "arrow":  # well-formed: the Arrow decoder takes it, the shared checks find the problem
        assert otlp_arrow.decode(path.read_bytes(), str(path), path.read_bytes().split(b"\n")) is not None
    read = traces.read_trace_files([path])
    assert read.spans.empty and read.other_spans == 1
    assert [(p.line, p.spans, p.reason) for p in read.problems] == [
        (1, 1, "kvscope.lookup span lacks kvscope.request.id")]
