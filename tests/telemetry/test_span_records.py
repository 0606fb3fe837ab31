"""Compound load records and their expansion into plain span records."""

from __future__ import annotations

from connector.telemetry.span_records import (
    LOAD_PLAN,
    LOAD_SPAN,
    LOOKUP_SPAN,
    SCAN_SPAN,
    child_span_id,
    expand_records,
)


def test_scan_ids_are_derived_distinct_and_never_zero():
    for load_id in (1, 0xFFFFFFFFFFFFFFFF, 0x9E3779B97F4A7C15, 12345):
        ids = [child_span_id(load_id, i) for i in range(1000)]
        assert len(set(ids)) == 1000 and load_id not in ids and all(0 < i < 1 << 64 for i in ids)
        assert ids == [child_span_id(load_id, i) for i in range(1000)]  # every process expands alike


def test_a_load_plan_expands_to_lookup_scans_and_load_in_the_order_they_ended():
    scans = [(11, 12, 0, "sliding_window", 8, 3, 2, 5), (12, 13, 1, "full_attention", 8, 0, 2, 6)]
    lookup = (77, None, False, 5, 9, 200, 192, "evicted", 64)
    plain = (SCAN_SPAN.code, 1, 2, 3, False, None, 0, 1, (0, "full_attention", 1, 0, 1, 0))
    record = (LOAD_PLAN, 0xABC, 99, 77, False, "v=1", 10, 14, ("r1", 0, 192, 2, scans, lookup))
    out = expand_records([plain, record])
    assert out[0] is plain
    assert out[1] == (LOOKUP_SPAN.code, 0xABC, 77, None, False, "v=1", 5, 9, ("r1", 200, 192, "evicted", 64))
    assert out[2] == (SCAN_SPAN.code, 0xABC, child_span_id(99, 0), 99, False, "v=1", 11, 12,
                      (0, "sliding_window", 8, 3, 2, 5))
    assert out[3][2] == child_span_id(99, 1) and out[3][8] == (1, "full_attention", 8, 0, 2, 6)
    assert out[4] == (LOAD_SPAN.code, 0xABC, 99, 77, False, "v=1", 10, 14, ("r1", 0, 192, 2))
    without_lookup = expand_records([record[:8] + (("r1", 0, 192, 2, scans, None),)])
    assert [r[0] for r in without_lookup] == [SCAN_SPAN.code, SCAN_SPAN.code, LOAD_SPAN.code]
