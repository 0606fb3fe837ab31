"""What a load waited for before its first copy (`load_waits`): other requests' copies on its workers, or none."""

from __future__ import annotations

import pytest

from dashboard import traces

from .test_group_copies import group_copy
from .test_joins import load
from .test_reader import line, write

T = 1_700_000_000_000_000_000
MS = 1_000_000
TRACE = "ab" * 16


def _load(rid: str, owner: str, trace: str, start: int) -> dict:
    return load(rid, span_id=owner, trace=trace, start=start, end=start + 20 * MS)


def _copy(direction, rank, start_ms, end_ms, owner, n, rid, trace):
    sp = group_copy(direction, 0, rank, 100, T + start_ms * MS, T + end_ms * MS, owner=owner, rid=rid, n=n)
    sp["traceId"] = trace
    return sp


def test_a_load_that_waited_behind_other_requests_copies_on_its_worker(tmp_path):
    """Planned at 0 ms, its first copy at 10 ms; meanwhile another load's copy (2-6 ms) and a store's (5-8 ms)
    ran on rank 0: busy 6 ms of the 10 (their union). A copy on rank 1, which this load does not use, and
    one after its first copy are not counted."""
    mine, other_load, other_store = "01" * 8, "02" * 8, "03" * 8
    path = write(tmp_path, line(
        _load("r", mine, TRACE, T),
        _copy("load", 0, 10, 12, mine, 1, "r", TRACE),
        _load("o", other_load, "cd" * 16, T - 5 * MS),
        _copy("load", 0, 2, 6, other_load, 2, "o", "cd" * 16),
        _copy("store", 0, 5, 8, other_store, 3, "s", "ef" * 16),
        _copy("load", 1, 1, 9, other_load, 4, "o", "cd" * 16),
        _copy("store", 0, 11, 13, other_store, 5, "s", "ef" * 16)))
    spans = traces.read_trace_files([path]).spans
    wait = traces.load_wait(spans, TRACE, "r")
    assert wait == traces.LoadWait(wait_ms=10.0, loads=1, stores=1, busy_ms=6.0)
    assert traces.load_wait_text(wait) == ("Before its first copy its workers copied for other requests 6.000 ms of "
                                           "the 10.000 ms (1 load and 1 store copies): copies queued ahead, or "
                                           "sharing the copy engine, delayed it.")


def test_other_copies_that_filled_little_of_the_wait_are_not_blamed_for_it():
    """The review's request waited 18.05 ms and another request's copies ran 0.057 ms of it: the step came late."""
    text = traces.load_wait_text(traces.LoadWait(wait_ms=18.047, loads=2, stores=0, busy_ms=0.057))
    assert text == ("Before its first copy its workers copied for other requests 0.057 ms of the 18.047 ms (2 load "
                    "and 0 store copies): most of the wait was for the engine step that starts it (a long step "
                    "before it, or a busy scheduler), not for the host tier.")
    assert "delayed it" in traces.load_wait_text(traces.LoadWait(wait_ms=10.0, loads=1, stores=0, busy_ms=5.0))


def test_a_load_nothing_ran_before_says_the_step_came_late(tmp_path):
    mine = "01" * 8
    path = write(tmp_path, line(_load("r", mine, TRACE, T), _copy("load", 0, 4, 5, mine, 1, "r", TRACE)))
    spans = traces.read_trace_files([path]).spans
    wait = traces.load_wait(spans, TRACE, "r")
    assert wait == traces.LoadWait(wait_ms=4.0, loads=0, stores=0, busy_ms=0.0)
    assert "the engine step that starts it came late" in traces.load_wait_text(wait)


@pytest.mark.parametrize("case", ["no load", "no copy", "copy before its planning"])
def test_no_wait_is_told_without_a_timed_copy_after_the_planning(tmp_path, case):
    mine = "01" * 8
    spans = [_load("r", mine, TRACE, T)] if case != "no load" else []
    if case == "copy before its planning":  # another clock's copy
        spans.append(_copy("load", 0, -3, -2, mine, 1, "r", TRACE))
    path = write(tmp_path, line(*spans, _copy("store", 0, 1, 2, "09" * 8, 2, "s", "ef" * 16)))
    assert traces.load_wait(traces.read_trace_files([path]).spans, TRACE, "r") is None


def test_copies_filling_just_under_half_the_wait_are_not_blamed_for_it():
    assert "most of the wait" in traces.load_wait_text(traces.LoadWait(wait_ms=10.0, loads=1, stores=0, busy_ms=4.9))


def test_the_busy_time_is_the_union_of_nested_and_chained_copies_and_each_direction_counts_its_own(tmp_path):
    """Planned at 0 ms, first copy at 10 ms. On rank 0: loads 1-5, 2-3 (inside it), 4-7 (reaching past it) and
    a store 6-9 (past that): busy 1-9, 8 ms; three load copies and one store copy."""
    mine, other, store_owner = "01" * 8, "02" * 8, "03" * 8
    path = write(tmp_path, line(
        _load("r", mine, TRACE, T),
        _copy("load", 0, 10, 12, mine, 1, "r", TRACE),
        _copy("load", 0, 1, 5, other, 2, "o", "cd" * 16),
        _copy("load", 0, 2, 3, other, 3, "o", "cd" * 16),
        _copy("load", 0, 4, 7, other, 4, "o", "cd" * 16),
        _copy("store", 0, 6, 9, store_owner, 5, "s", "ef" * 16)))
    wait = traces.load_wait(traces.read_trace_files([path]).spans, TRACE, "r")
    assert wait == traces.LoadWait(wait_ms=10.0, loads=3, stores=1, busy_ms=8.0)


def test_copies_that_only_touch_the_wait_at_either_end_are_not_counted(tmp_path):
    """Another request's copy ending at the planning (0 ms) and one starting with the first copy (10 ms) ran
    outside the wait."""
    mine, other = "01" * 8, "02" * 8
    path = write(tmp_path, line(
        _load("r", mine, TRACE, T),
        _copy("load", 0, 10, 12, mine, 1, "r", TRACE),
        _copy("load", 0, -3, 0, other, 2, "o", "cd" * 16),
        _copy("store", 0, 10, 11, other, 3, "s", "ef" * 16)))
    wait = traces.load_wait(traces.read_trace_files([path]).spans, TRACE, "r")
    assert wait == traces.LoadWait(wait_ms=10.0, loads=0, stores=0, busy_ms=0.0)


def test_a_copy_starting_at_its_loads_planning_waited_nothing(tmp_path):
    mine = "01" * 8
    path = write(tmp_path, line(_load("r", mine, TRACE, T), _copy("load", 0, 0, 1, mine, 1, "r", TRACE)))
    wait = traces.load_wait(traces.read_trace_files([path]).spans, TRACE, "r")
    assert wait == traces.LoadWait(wait_ms=0.0, loads=0, stores=0, busy_ms=0.0)


def test_the_wait_told_is_the_requests_first_loads(tmp_path):
    """Loaded twice (planned at 0 and 50 ms, first copies at 4 and 60 ms): the first load's wait, 4 ms."""
    first, second = "01" * 8, "04" * 8
    path = write(tmp_path, line(
        _load("r", second, TRACE, T + 50 * MS),
        _copy("load", 0, 60, 61, second, 2, "r", TRACE),
        _load("r", first, TRACE, T),
        _copy("load", 0, 4, 5, first, 1, "r", TRACE)))
    assert traces.load_wait(traces.read_trace_files([path]).spans, TRACE, "r").wait_ms == 4.0


def test_a_load_whose_copies_name_no_worker_counts_other_copies_on_every_worker(tmp_path):
    mine, other = "01" * 8, "02" * 8
    own_copy = _copy("load", 0, 10, 12, mine, 1, "r", TRACE)
    own_copy["attributes"] = [a for a in own_copy["attributes"] if a["key"] != "kvscope.worker.rank"]
    path = write(tmp_path, line(_load("r", mine, TRACE, T), own_copy,
                                _copy("load", 1, 2, 6, other, 2, "o", "cd" * 16)))
    wait = traces.load_wait(traces.read_trace_files([path]).spans, TRACE, "r")
    assert wait == traces.LoadWait(wait_ms=10.0, loads=1, stores=0, busy_ms=4.0)
