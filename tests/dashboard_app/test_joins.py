"""Copies and scans join their load or store: within one file and trace first, then across the trace's files
when one load or store there has the parent's id; by request id where ids do not tell."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from dashboard import traces

from .test_reader import line, lookup, span, write

T1 = 1_700_000_000_000_000_000
T2 = 1_800_000_000_000_000_000  # a second run, a day later
UPSTREAM = "77" * 8  # one upstream span (one traceparent) for a batch of prompts


def load(rid: str, **kw) -> dict:
    return span("kvscope.load", {"kvscope.request.id": rid, "kvscope.tokens.local": 0,
                                 "kvscope.tokens.external": 16, "kvscope.groups": 1}, **kw)


def store(rid: str, **kw) -> dict:
    return span("kvscope.store", {"kvscope.request.id": rid, "kvscope.groups": 1, "kvscope.blocks": 2}, **kw)


def scan(**kw) -> dict:
    return span("kvscope.group.scan", {"kvscope.group.index": 0, "kvscope.group.kind": "full_attention",
                                       "kvscope.group.blocks.total": 4, "kvscope.group.blocks.null_skipped": 0,
                                       "kvscope.group.blocks.pending": 4, "kvscope.group.blocks.start": 0}, **kw)


def copy(direction: str, nbytes: int, rid: str | None = None, **kw) -> dict:
    attrs = {"kvscope.group.index": 0, "kvscope.group.kind": "full_attention", "kvscope.copy.direction": direction,
             "kvscope.copy.blocks": 1, "kvscope.copy.bytes": nbytes}
    if rid is not None:  # the connector's copies carry it; a Collector's of other tools may not
        attrs["kvscope.request.id"] = rid
    return span("kvscope.group.copy", attrs, **kw)


def by_request(*paths) -> pd.DataFrame:
    read = traces.read_trace_files(list(paths))
    return traces.requests_table(read.spans).set_index("request_id")


def test_a_copy_whose_load_is_lost_does_not_join_another_requests_load(tmp_path):
    """Requests A and B share one upstream trace; A's load line is broken: A's copy is no copy of B's load."""
    path = write(
        tmp_path,
        line(lookup("A", span_id="a1" * 8, parent=UPSTREAM, start=T1),
             lookup("B", span_id="b1" * 8, parent=UPSTREAM, start=T1 + 5)),
        line(span("kvscope.load", {"kvscope.request.id": "A", "kvscope.tokens.local": 0, "kvscope.groups": 1},
                  span_id="a2" * 8, parent=UPSTREAM, start=T1 + 10)),  # lacks tokens.external: skipped
        line(load("B", span_id="b2" * 8, parent=UPSTREAM, start=T1 + 20)),
        line(copy("load", 64000, "A", span_id="a3" * 8, parent="a2" * 8, start=T1 + 50_000_000, end=T1 + 51_000_000),
             copy("load", 32000, "B", span_id="b3" * 8, parent="b2" * 8, start=T1 + 30, end=T1 + 1_000_020)),
    )
    read = traces.read_trace_files([path])
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert requests.loc["B", "bytes_loaded"] == 32000 and requests.loc["B", "load_ms"] == pytest.approx(1.0)
    assert requests.loc["A", "loads"] == 0 and pd.isna(requests.loc["A", "bytes_loaded"])
    rows = traces.waterfall_rows(read.spans, requests.reset_index(), "B")
    assert rows["span_id"].tolist() == ["b1" * 8, "b2" * 8, "b3" * 8]


def test_a_copy_without_parent_joins_the_only_load_of_its_request_in_its_trace(tmp_path):
    path = write(
        tmp_path,
        line(load("A", span_id="a2" * 8, parent=UPSTREAM, start=T1), load("B", span_id="b2" * 8, start=T1)),
        line(copy("load", 100, "A", span_id="a3" * 8, start=T1 + 1000, end=T1 + 2_000_000),
             copy("load", 7, "B", span_id="b3" * 8, start=T1 + 1000, end=T1 + 3_000_000),
             copy("load", 5, span_id="c3" * 8, start=T1 + 1000)),  # no request id, two loads: whose?
    )
    requests = by_request(path)
    assert requests["bytes_loaded"].to_dict() == {"A": 100, "B": 7}
    assert requests["load_ms"].to_dict() == pytest.approx({"A": 2.0, "B": 3.0})


def _run(tmp_path: Path, name: str, rid: str, start: int, nbytes: int) -> Path:
    """One run's trace file; every run has the same trace and span ids (an id generator seeded alike)."""
    return write(
        tmp_path,
        line(lookup(rid, span_id="11" * 8, start=start), load(rid, span_id="33" * 8, parent="11" * 8, start=start + 10),
             scan(span_id="44" * 8, parent="33" * 8, start=start + 11),
             copy("load", nbytes, span_id="55" * 8, parent="33" * 8, start=start + 20, end=start + 1_000_010),
             store(rid, span_id="22" * 8, start=start + 2_000_000),
             copy("store", 3 * nbytes, span_id="66" * 8, parent="22" * 8, start=start + 2_000_010)),
        name=name,
    )


def test_runs_that_reuse_ids_keep_their_own_loads_and_stores(tmp_path):
    first = _run(tmp_path, "run1.jsonl", "run1", T1, 100)
    second = _run(tmp_path, "run2.jsonl", "run2", T2, 7)
    read = traces.read_trace_files([first, second])
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert requests["bytes_loaded"].to_dict() == {"run1": 100, "run2": 7}
    assert requests["bytes_stored"].to_dict() == {"run1": 300, "run2": 21}
    assert requests["load_ms"].to_dict() == pytest.approx({"run1": 1.0, "run2": 1.0})
    assert all("in another file" in p.reason for p in read.problems) and len(read.problems) == 2
    rows = traces.waterfall_rows(read.spans, requests.reset_index(), "run2")
    assert set(rows["trace_id"]) == {"ab" * 16} and (rows["end_ms"] < 5).all()  # none of run1's, a day earlier
    assert len(rows) == 6


def test_a_span_id_repeated_in_one_file_joins_by_request_id_and_is_reported(tmp_path):
    path = write(
        tmp_path,
        line(load("A", span_id="33" * 8, start=T1), load("B", span_id="33" * 8, start=T1 + 100)),
        line(copy("load", 100, "A", span_id="a3" * 8, parent="33" * 8, start=T1 + 1000, end=T1 + 2_000_000),
             copy("load", 7, "B", span_id="b3" * 8, parent="33" * 8, start=T1 + 1000, end=T1 + 3_000_100),
             copy("load", 5, span_id="c3" * 8, parent="33" * 8, start=T1 + 1000),  # whose? neither's
             scan(span_id="44" * 8, parent="33" * 8, start=T1 + 1)),  # no request id: neither's either
    )
    read = traces.read_trace_files([path])
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert requests["bytes_loaded"].to_dict() == {"A": 100, "B": 7}  # each copy counted once
    assert requests["load_ms"].to_dict() == pytest.approx({"A": 2.0, "B": 3.0})
    owners = read.spans.set_index("span_id")["owner_key"]
    assert pd.isna(owners["c3" * 8]) and pd.isna(owners["44" * 8])
    assert [(p.line, p.spans) for p in read.problems] == [(1, 0)]
    assert "different span of this file" in read.problems[0].reason
    assert read.problems[0].reason.endswith("(2 span(s), kept)")


def test_a_repeated_parent_id_takes_the_load_of_the_childs_request_even_when_that_request_loads_twice(tmp_path):
    """A's copy names the id that A's first load and B's load share: it is the first load's, not unknown, though
    A's request id alone would name two loads (A resumed after preemption loads again)."""
    path = write(tmp_path, line(
        load("A", span_id="33" * 8, start=T1), load("B", span_id="33" * 8, start=T1 + 100),
        load("A", span_id="55" * 8, start=T1 + 200),
        copy("load", 100, "A", span_id="a3" * 8, parent="33" * 8, start=T1 + 1000, end=T1 + 2_000_000)))
    spans = traces.read_trace_files([path]).spans.set_index("span_id")
    first_load = spans.loc[(spans["request_id"] == "A") & (spans["start_ns"] == T1), "span_key"].item()
    assert spans.loc["a3" * 8, "owner_key"] == first_load


def test_a_load_whose_copies_are_in_the_next_file_joins_them(tmp_path):
    """A Collector's file exporter rotated between the load and its copies: one run, two files."""
    first = write(tmp_path, line(lookup("A", span_id="11" * 8, start=T1),
                                 load("A", span_id="33" * 8, parent="11" * 8, start=T1 + 10)), name="a.jsonl")
    second = write(tmp_path, line(scan(span_id="44" * 8, parent="33" * 8, start=T1 + 11),
                                  copy("load", 100, "A", span_id="55" * 8, parent="33" * 8, start=T1 + 20,
                                       end=T1 + 1_000_010),
                                  copy("load", 28, "A", span_id="56" * 8, parent="33" * 8, start=T1 + 20,
                                       end=T1 + 2_000_010)), name="b.jsonl")
    read = traces.read_trace_files([first, second])
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert requests.loc["A", "bytes_loaded"] == 128 and requests.loc["A", "load_ms"] == pytest.approx(2.0)
    spans = read.spans.set_index("span_id")
    # a list, not `(... == key).all()`: the scan carries no request id, and an NA owner compares as NA, which
    # `all` skips
    assert spans.loc[["44" * 8, "55" * 8, "56" * 8], "owner_key"].tolist() == [spans.loc["33" * 8, "span_key"]] * 3
    assert read.problems == []


def test_copies_split_from_their_load_do_not_join_a_later_load_in_their_file(tmp_path):
    """Request A loads again after preemption; the first load's copies rotated into the second load's file."""
    first = write(tmp_path, line(load("A", span_id="33" * 8, start=T1)), name="a.jsonl")
    second = write(tmp_path,
                   line(copy("load", 100, "A", span_id="55" * 8, parent="33" * 8, start=T1 + 20, end=T1 + 1_000_000),
                        load("A", span_id="34" * 8, start=T1 + 5_000_000),
                        copy("load", 7, "A", span_id="57" * 8, parent="34" * 8, start=T1 + 5_000_020,
                             end=T1 + 7_000_000)), name="b.jsonl")
    requests = by_request(first, second)
    assert requests.loc["A", "loads"] == 2 and requests.loc["A", "bytes_loaded"] == 107
    assert requests.loc["A", "load_ms"] == pytest.approx(3.0)  # 1 ms for the first load, 2 ms for the second


def test_a_copy_whose_parent_id_is_a_load_in_two_other_files_joins_neither(tmp_path):
    """Two runs reusing ids, each in its file, and copies in a third: whose load is `33`? Not told."""
    runs = [write(tmp_path, line(load("A", span_id="33" * 8, start=T1), load("B", span_id="34" * 8, start=T1),
                                 load("D", span_id="35" * 8, start=T1)), name="run1.jsonl"),
            write(tmp_path, line(load("A", span_id="33" * 8, start=T2)), name="run2.jsonl")]  # no `34` in run 2
    copies = write(tmp_path, line(copy("load", 100, "A", span_id="55" * 8, parent="33" * 8, start=T2 + 20),
                                  copy("load", 7, "B", span_id="57" * 8, parent="34" * 8, start=T1 + 20,
                                       end=T1 + 1_000_000)),
                   line(load("D", span_id="35" * 8, start=T1 + 1), load("E", span_id="35" * 8, start=T1 + 2),
                        copy("load", 5, span_id="58" * 8, parent="35" * 8, start=T1 + 20)),  # `35` reused here too
                   name="copies.jsonl")
    read = traces.read_trace_files([*runs, copies])
    owners = read.spans.set_index("span_id")["owner_key"]
    assert pd.isna(owners["55" * 8]) and pd.isna(owners["58" * 8])
    assert owners["57" * 8] == read.spans.set_index("span_id").loc["34" * 8, "span_key"]  # only run 1 has `34`
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert pd.isna(requests.loc["A", "bytes_loaded"]) and requests.loc["B", "bytes_loaded"] == 7


def test_a_copy_never_joins_another_requests_load_in_another_file(tmp_path):
    """A's load line is lost; its copy's parent id is B's load in the other file (another run's id): not B's copy."""
    loads = write(tmp_path, line(load("B", span_id="33" * 8, start=T1), load("C", span_id="34" * 8, start=T1)),
                  name="loads.jsonl")
    copies = write(tmp_path, line(copy("load", 100, "A", span_id="55" * 8, parent="33" * 8, start=T1 + 20),
                                  copy("load", 7, "C", span_id="57" * 8, parent="34" * 8, start=T1 + 20,
                                       end=T1 + 1_000_000)), name="copies.jsonl")
    read = traces.read_trace_files([loads, copies])
    owners = read.spans.set_index("span_id")["owner_key"]
    assert pd.isna(owners["55" * 8]) and owners["57" * 8] == read.spans.set_index("span_id").loc["34" * 8, "span_key"]
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert pd.isna(requests.loc["B", "bytes_loaded"]) and requests.loc["C", "bytes_loaded"] == 7


def test_copies_of_a_lost_first_load_do_not_join_the_requests_later_load(tmp_path):
    """A request loads twice (resumed after preemption); the first load's line is lost: its copies,
    which started before the second load, are not that load's."""
    path = write(
        tmp_path,
        line(lookup("A", span_id="a1" * 8, start=T1)),
        line(span("kvscope.load", {"kvscope.request.id": "A", "kvscope.tokens.local": 0, "kvscope.groups": 1},
                  span_id="a2" * 8, parent="a1" * 8, start=T1 + 10)),  # lacks tokens.external: skipped
        line(copy("load", 3000, "A", span_id="a3" * 8, parent="a2" * 8, start=T1 + 20, end=T1 + 1_000_020)),
        line(load("A", span_id="a4" * 8, parent="a1" * 8, start=T1 + 5_000_000)),
        line(copy("load", 1000, "A", span_id="a5" * 8, parent="a4" * 8, start=T1 + 5_000_010, end=T1 + 7_000_010)),
    )
    requests = by_request(path)
    assert requests.loc["A", "bytes_loaded"] == 1000 and requests.loc["A", "load_ms"] == pytest.approx(2.0, abs=1e-3)


def test_two_runs_with_the_same_request_ids_are_two_requests_each(tmp_path):
    """A benchmark rerun with client-set request ids, both runs' files read together: a request is
    (trace id, request id), never the two runs' spans of one id merged."""
    runs = []
    for n, (t, nbytes) in enumerate(((T1, 100), (T2, 7))):
        trace = f"{n + 1}f" * 16
        runs.append(write(tmp_path, line(
            lookup("A", 100, 64, trace=trace, span_id="11" * 8, start=t),
            load("A", trace=trace, span_id="33" * 8, parent="11" * 8, start=t + 10),
            copy("load", nbytes, "A", trace=trace, span_id="55" * 8, parent="33" * 8, start=t + 20,
                 end=t + (n + 1) * 1_000_000),
            store("A", trace=trace, span_id="22" * 8, parent="11" * 8, start=t + 2_000_000),
            copy("store", 3 * nbytes, "A", trace=trace, span_id="66" * 8, parent="22" * 8, start=t + 2_000_010),
            lookup("B", 50, 0, trace=f"{n + 1}e" * 16, span_id="77" * 8, start=t + 5)), name=f"run{n + 1}.jsonl"))
    read = traces.read_trace_files(runs)
    requests = traces.requests_table(read.spans)
    assert len(requests) == 4
    a = requests[requests["request_id"] == "A"].set_index("trace_id")
    assert a["request"].tolist() == ["A · trace 1f1f1f1f", "A · trace 2f2f2f2f"]
    assert a["tokens_queried"].tolist() == [100, 100] and a["loads"].tolist() == [1, 1]
    assert a["load_ms"].tolist() == pytest.approx([1.0, 2.0], abs=1e-4)  # not 3.0 each
    assert a["bytes_loaded"].tolist() == [100, 7] and a["bytes_stored"].tolist() == [300, 21]
    assert traces.hit_rate(requests) == pytest.approx(128 / 300)
    rows = traces.waterfall_rows(read.spans, requests, "A", "2f" * 16)
    assert set(rows["trace_id"]) == {"2f" * 16} and len(rows) == 5
    with pytest.raises(ValueError, match="names 2 requests"):
        traces.waterfall_rows(read.spans, requests, "A")
    timeline = traces.replay_timeline(requests, read.spans)
    assert timeline["request"].tolist()[:2] == ["A · trace 1f1f1f1f", "B · trace 1e1e1e1e"]
    assert traces.find_request(requests, "2f" * 16, "A")["bytes_loaded"] == 7


def test_a_copy_without_request_id_of_a_lost_first_load_does_not_join_the_second(tmp_path):
    """A request resumed after preemption loads twice; the first load's line is lost, and its copy
    carries no request id: it started before the second load, so it is not that load's."""
    path = write(
        tmp_path,
        line(span("kvscope.load", {"kvscope.request.id": "A", "kvscope.tokens.local": 0, "kvscope.groups": 1},
                  span_id="a2" * 8, start=T1)),  # lacks tokens.external: skipped
        line(copy("load", 3000, span_id="a3" * 8, parent="a2" * 8, start=T1 + 20, end=T1 + 1_000_020)),
        line(load("A", span_id="a4" * 8, start=T1 + 5_000_000)),
        line(copy("load", 1000, span_id="a5" * 8, parent="a4" * 8, start=T1 + 5_000_010, end=T1 + 7_000_000)),
    )
    read = traces.read_trace_files([path])
    assert [p.line for p in read.problems] == [1]  # the lost load; no copy "starts before its load"
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert requests.loc["A", "bytes_loaded"] == 1000 and requests.loc["A", "load_ms"] == pytest.approx(2.0)


def test_a_copy_exactly_a_millisecond_before_its_load_is_on_its_clock_a_nanosecond_more_is_not(tmp_path):
    """The tolerance (`CLOCK_TOLERANCE_NS`, 1 ms) is inclusive, also for a copy that joins its load by request id."""
    path = write(tmp_path, line(
        load("on", span_id="a2" * 8, trace="aa" * 16, start=T1 + 5_000_000),
        copy("load", 100, "on", span_id="a3" * 8, trace="aa" * 16, parent="a2" * 8, start=T1 + 4_000_000,
             end=T1 + 6_000_000),
        load("off", span_id="b2" * 8, trace="bb" * 16, start=T1 + 5_000_000),
        copy("load", 100, "off", span_id="b3" * 8, trace="bb" * 16, parent="b2" * 8, start=T1 + 3_999_999,
             end=T1 + 6_000_000),
        load("orphan", span_id="c2" * 8, trace="cc" * 16, start=T1 + 5_000_000),  # its copy names no parent
        copy("load", 100, "orphan", span_id="c3" * 8, trace="cc" * 16, start=T1 + 4_000_000, end=T1 + 6_000_000)))
    read = traces.read_trace_files([path])
    assert read.spans.set_index("span_id")["clock_ok"].to_dict() == {
        "a2" * 8: True, "a3" * 8: True, "b2" * 8: True, "b3" * 8: False, "c2" * 8: True, "c3" * 8: True}
    requests = traces.requests_table(read.spans).set_index("request_id")
    assert requests.loc["on", "load_ms"] == 1.0 and pd.isna(requests.loc["off", "load_ms"])
    assert requests.loc["orphan", "load_ms"] == 1.0 and requests.loc["orphan", "bytes_loaded"] == 100
