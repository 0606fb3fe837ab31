"""A request resumed after preemption loads again: its load time is the sum over its loads that did not fail,
and unknown when one of those has no time (no copy span, or a copy timed on another clock)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dashboard import traces

from .test_group_copies import group_copy
from .test_joins import load
from .test_pages import app, assert_ok, metrics
from .test_reader import line, lookup, write

T = 1_700_000_000_000_000_000
MS = 1_000_000
TRACE = "ab" * 16  # what `group_copy` writes


def _two_loads(rid: str, second_copy: tuple[int, int] | None, *, failed: bool = False, base: int = 0) -> list[dict]:
    """`rid` looks up at T + base, loads at +1 ms (one copy, 1..4 ms: 3.00 ms) and again at +20 ms; the second
    load's copy runs `second_copy` (ms after the second load's start), none when None."""
    n = base // MS
    first, second = f"{0xA00 + n:016x}", f"{0xB00 + n:016x}"
    spans = [lookup(rid, 100, 64, span_id=f"{0x900 + n:016x}", trace=TRACE, start=T + base),
             load(rid, span_id=first, trace=TRACE, start=T + base + MS),
             group_copy("load", 0, 0, 4096, T + base + MS, T + base + 4 * MS, owner=first, rid=rid, n=n),
             load(rid, span_id=second, trace=TRACE, start=T + base + 20 * MS)]
    if second_copy is not None:
        start, end = (T + base + 20 * MS + ms * MS for ms in second_copy)
        spans.append(group_copy("load", 0, 0, 4096, start, end, owner=second, rid=rid, n=n + 1, failed=failed))
    return spans


@pytest.fixture()
def resumed(tmp_path) -> traces.Traces:
    """mistimed: its second load's copy starts 5 ms before that load; uncopied: its second load has no copy span;
    summed: both loads timed (3 ms, then 2 ms); failed: its second load failed (left out)."""
    return traces.read_trace_files([write(tmp_path, line(
        *_two_loads("mistimed", (-5, 1)),
        *_two_loads("uncopied", None, base=100 * MS),
        *_two_loads("summed", (0, 2), base=200 * MS),
        *_two_loads("failed", (0, 9), failed=True, base=300 * MS)))])


def test_a_load_with_no_time_makes_its_requests_load_time_unknown(resumed):
    requests = traces.requests_table(resumed.spans).set_index("request_id")
    assert math.isnan(requests.loc["mistimed", "load_ms"]) and math.isnan(requests.loc["uncopied", "load_ms"])
    assert math.isnan(requests.loc["mistimed", "load_copy_ms"]) and math.isnan(requests.loc["uncopied", "load_copy_ms"])
    assert requests.loc["summed", "load_ms"] == pytest.approx(3.0 + 2.0)
    assert requests.loc["failed", "load_ms"] == pytest.approx(3.0)  # a failed load is left out, not unknown
    assert requests["loads_without_copies"].to_dict() == {"mistimed": 0, "uncopied": 1, "summed": 0, "failed": 0}


def test_the_overview_leaves_requests_of_unknown_load_time_out(resumed):
    requests = traces.requests_table(resumed.spans)
    assert traces.top_slow_loads(requests)["request_id"].tolist() == ["summed", "failed"]
    numbers = traces.request_numbers(requests)
    assert (numbers["loads_timed"], numbers["load_p99_ms"]) == (2, pytest.approx(5.0))


@pytest.mark.parametrize(("rid", "warning"), [
    ("uncopied", "1 of its 2 loads has no copy span"),
    ("mistimed", "A copy span of one of its loads ends before it starts or starts more than 1 ms before"),
])
def test_the_request_view_says_why_its_load_time_is_unknown(monkeypatch, tmp_path, rid, warning):
    path = write(tmp_path, line(*_two_loads(rid, (-5, 1) if rid == "mistimed" else None)))
    at = app(monkeypatch, path)
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    assert metrics(at)["Load time"] == "–"
    shown = [w.value for w in at.warning]
    assert any(warning in w for w in shown), shown
    assert pd.notna(traces.requests_table(traces.read_trace_files([path]).spans)["bytes_loaded"].iloc[0])


def test_the_request_view_gives_both_reasons_when_one_load_has_no_copy_and_another_a_mistimed_one(
        monkeypatch, tmp_path):
    """Its second load's copy is mistimed and a third load has no copy span: each alone leaves the load time
    unknown, and the view says both."""
    path = write(tmp_path, line(*_two_loads("both", (-5, 1)), load("both", span_id=f"{0xD00:016x}", trace=TRACE,
                                                                     start=T + 40 * MS)))
    at = app(monkeypatch, path)
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    shown = [w.value for w in at.warning]
    assert any("1 of its 3 loads has no copy span" in w for w in shown), shown
    assert any("A copy span of one of its loads ends before it starts" in w for w in shown), shown


def test_the_slowest_loads_count_the_tokens_of_the_loads_they_time(resumed):
    """Each load brings 16 tokens (`kvscope.tokens.external`): two timed loads 32; a failed one none, as its time."""
    slowest = traces.top_slow_loads(traces.requests_table(resumed.spans)).set_index("request_id")
    assert slowest["tokens_loaded"].to_dict() == {"summed": 32, "failed": 16}


def test_a_repeated_request_id_is_told_apart_by_the_end_of_its_trace_id():
    """64-bit trace ids padded to 128 bits all begin with 16 zeros: the last digits tell the traces apart, and
    where even the last 8 are the same, the whole id does."""
    padded = ["0" * 16 + "aaaaaaaa11111111", "0" * 16 + "bbbbbbbb22222222", "0" * 16 + "cccccccc11111111",
              "0" * 16 + "dddddddd33333333"]
    requests = pd.DataFrame({"request_id": ["r2", "r2", "r2", "r3"], "trace_id": padded})
    assert traces.request_labels(requests).tolist() == [
        f"r2 · trace {padded[0]}", "r2 · trace 22222222", f"r2 · trace {padded[2]}", "r3"]


def test_a_request_with_one_failed_load_among_others_is_a_failed_load(resumed):
    """`failed` loaded once, then its second load failed: it is a request whose load failed (the Requests page's
    filter and the overview's count), not only a request whose every load failed."""
    requests = traces.requests_table(resumed.spans)
    assert requests.set_index("request_id")["load_failed"].to_dict() == {
        "mistimed": False, "uncopied": False, "summed": False, "failed": True}
    assert traces.search_requests(requests, "", show="failed loads")["request_id"].tolist() == ["failed"]
    assert traces.request_numbers(requests)["requests_load_failed"] == 1


def test_the_request_view_says_a_load_time_of_several_loads_is_their_sum_and_whose_wait_it_explains(
        monkeypatch, tmp_path):
    """Its two loads copied 3 and 2 ms: "first copy's start to last copy's end" read as one span of 21 ms."""
    at = app(monkeypatch, write(tmp_path, line(*_two_loads("summed", (0, 2)))))
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    captions = [c.value for c in at.caption]
    assert any(c.startswith("Load time, summed over its 2 loads: 5.00 ms copying (a load's first copy's start")
               for c in captions), captions
    assert any(c.startswith("Its first load: no other request's copy ran on its workers in the 0.000 ms")
               for c in captions), captions


def test_the_request_view_says_a_request_that_loaded_more_than_its_lookup_hit_was_resumed(monkeypatch, tmp_path):
    """Preempted, it is looked up again without a span and loads its own blocks back: hit 0 of 100, 16 loaded."""
    first = f"{0xA00:016x}"
    resumed = [lookup("resumed", 100, 0, span_id=f"{0x900:016x}", trace=TRACE, start=T),
               load("resumed", span_id=first, trace=TRACE, start=T + 20 * MS),
               group_copy("load", 0, 0, 4096, T + 21 * MS, T + 22 * MS, owner=first, rid="resumed", n=0)]
    at = app(monkeypatch, write(tmp_path, line(*resumed)))
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    said = ("It loaded 16 tokens from the host tier, more than its lookup hit: resumed after preemption, it was "
            "looked up again (vLLM counts that lookup apart: it has no span) and loaded its own stored blocks back.")
    assert said in [c.value for c in at.caption]
    at = app(monkeypatch, write(tmp_path, line(*_two_loads("summed", (0, 2)))))  # 32 loaded of a 64-token hit
    at.switch_page("views/request_explorer.py").run()
    assert said.split(":")[0] not in " ".join(c.value for c in at.caption)
