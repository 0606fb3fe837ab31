"""Compound load records and their expansion into plain span records."""

from __future__ import annotations

import pytest

from connector.telemetry.span_records import (
    DEFERRAL_WAIT_SPAN,
    COPY_SPAN,
    DEFERRED_LOAD_SPAN,
    DEFERRED_LOOKUP_SPAN,
    FAILED_COPY_SPAN,
    GENERIC_SPAN,
    KINDS,
    LOAD_PLAN,
    LOAD_SPAN,
    LOOKUP_SPAN,
    SCAN_SPAN,
    STORE_SPAN,
    check_shape,
    child_span_id,
    expand_records,
)


def test_span_names_and_attribute_keys_are_the_contracts():
    """DESIGN §2: queries, the dashboard and replays find spans by these names and keys. Both encoders
    (the trace file's and the SDK's) take them from this table, so they agree with each other whatever
    it says: only this test sees a renamed key. The order is the order of a record's values."""
    assert {kind.name: kind.keys for kind in (LOOKUP_SPAN, LOAD_SPAN, SCAN_SPAN, STORE_SPAN, COPY_SPAN)} == {
        "kvscope.lookup": ("kvscope.request.id", "kvscope.tokens.queried", "kvscope.tokens.hit",
                           "kvscope.miss.reason", "kvscope.tokens.local"),
        "kvscope.load": ("kvscope.request.id", "kvscope.tokens.local", "kvscope.tokens.external", "kvscope.groups"),
        "kvscope.group.scan": ("kvscope.group.index", "kvscope.group.kind", "kvscope.group.blocks.total",
                               "kvscope.group.blocks.null_skipped", "kvscope.group.blocks.pending",
                               "kvscope.group.blocks.start"),
        "kvscope.store": ("kvscope.request.id", "kvscope.groups", "kvscope.blocks"),
        "kvscope.group.copy": ("kvscope.group.index", "kvscope.group.kind", "kvscope.copy.direction",
                               "kvscope.copy.blocks", "kvscope.copy.bytes", "kvscope.worker.rank",
                               "kvscope.request.id"),
    }
    assert (FAILED_COPY_SPAN.name, FAILED_COPY_SPAN.attributes) == (COPY_SPAN.name, COPY_SPAN.attributes)
    # a deferred load's lookup: the lookup span with how long the load waited (beyond DESIGN §2)
    deferral = ("kvscope.deferred.lookups", "kvscope.deferred.wait_us")
    assert (DEFERRED_LOOKUP_SPAN.name, DEFERRED_LOOKUP_SPAN.keys) == (LOOKUP_SPAN.name, LOOKUP_SPAN.keys + deferral)
    assert (DEFERRED_LOAD_SPAN.name, DEFERRED_LOAD_SPAN.keys) == (LOAD_SPAN.name, LOAD_SPAN.keys + deferral)
    # a wait no lookup or load span tells (the request ended waiting, or was resumed and admitted with nothing to
    # load): a span of its own, the wait (beyond DESIGN §2)
    assert (DEFERRAL_WAIT_SPAN.name, DEFERRAL_WAIT_SPAN.keys) == (
        "kvscope.deferral",
        ("kvscope.request.id", "kvscope.tokens.external") + deferral + ("kvscope.deferred.outcome",))
    assert [kind.code for kind in KINDS] == list(range(len(KINDS))) and LOAD_PLAN not in range(len(KINDS))


def test_scan_ids_are_derived_distinct_and_never_zero():
    # 0x61C8864680B583EB: the one load id whose first scan would mix to 0
    for load_id in (1, 0xFFFFFFFFFFFFFFFF, 0x9E3779B97F4A7C15, 12345, 0x61C8864680B583EB):
        ids = [child_span_id(load_id, i) for i in range(1000)]
        assert len(set(ids)) == 1000 and load_id not in ids and all(0 < i < 1 << 64 for i in ids)
        assert ids == [child_span_id(load_id, i) for i in range(1000)]  # every process expands alike


def test_scan_ids_are_splitmix64_of_the_load_id():
    """SplitMix64 is a bijection, which is what keeps a load's scan ids distinct; a slip in one of
    its constants still gives distinct-looking ids, so its published outputs pin it (seed 0; seed
    1234567)."""
    assert child_span_id(0, 0) == 0xE220A8397B1DCDAF
    assert [child_span_id(1234567, i) for i in range(3)] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423]


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
    deferred = expand_records([record[:8] + (("r1", 0, 192, 2, scans, lookup + (4, 9000)),)])
    assert deferred[0] == (DEFERRED_LOOKUP_SPAN.code, 0xABC, 77, None, False, "v=1", 5, 9,
                           ("r1", 200, 192, "evicted", 64, 4, 9000))
    assert deferred[-1][0] == LOAD_SPAN.code
    resumed = expand_records([record[:8] + (("r1", 0, 192, 2, scans, None, 2, 700),)])  # its lookup has no span
    assert resumed[-1] == (DEFERRED_LOAD_SPAN.code, 0xABC, 99, 77, False, "v=1", 10, 14, ("r1", 0, 192, 2, 2, 700))


def test_records_whose_values_do_not_match_their_kind_in_number_fail_their_check_naming_what_is_expected():
    """Values are positional: a miscounted record fails a trace-file batch in its encoder, loses values on the SDK
    path or, as a load's lookup, reads as the other lookup kind. The synchronous (test) path checks each."""
    copy = (COPY_SPAN.code, 1, 2, 3, False, None, 0, 1, (0, "full_attention", "load", 2, 128, 0, "r1"))
    scans = [(11, 12, 0, "sliding_window", 8, 3, 2, 5)]
    lookup = (77, None, False, 5, 9, 200, 192, "evicted", 64)
    load = (LOAD_PLAN, 0xABC, 99, 77, False, None, 10, 14, ("r1", 0, 192, 1, scans, lookup))
    generic = (GENERIC_SPAN.code, 1, 2, None, False, None, 0, 1, ("name", {"k": 1}))  # any attributes
    for good in (copy, load, load[:8] + (("r1", 0, 192, 1, scans, lookup + (4, 9000), 2, 700),), generic):
        check_shape(good)
    with pytest.raises(ValueError, match=r"a kvscope.group.copy record has 6 values: expected 7 \(kvscope.group"):
        check_shape(copy[:8] + (copy[8][:-1],))
    with pytest.raises(ValueError, match="a load record has 7 values: expected 6, or 8 when deferred"):
        check_shape(load[:8] + (load[8] + (4,),))
    with pytest.raises(ValueError, match="a kvscope.group.scan record has 5 values"):
        check_shape(load[:8] + (("r1", 0, 192, 1, [scans[0][:-1]], lookup),))
    with pytest.raises(ValueError, match="a load record's lookup has 5 values after its ids and times: expected 4"):
        check_shape(load[:8] + (("r1", 0, 192, 1, scans, lookup + (4,)),))


def test_the_synchronous_processor_refuses_a_miscounted_record_before_its_exporter_sees_it():
    from connector.telemetry.testing import in_memory_tracing

    tracing, exporter = in_memory_tracing()
    copy = (COPY_SPAN.code, 1, 2, 3, False, None, 0, 1, (0, "full_attention", "load", 2, 128, 0))
    with pytest.raises(ValueError, match="kvscope.group.copy record has 6 values"):
        tracing._processor.on_end(copy)
    assert not exporter.get_finished_spans()


def test_a_clock_stepped_back_never_ends_a_lookup_or_scan_before_its_start():
    """The hot path reads the wall clock unclamped; a step back (NTP) between two reads would give an
    end before its start, which OTLP consumers reject: the expansion ends such spans at their start."""
    scans = [(5000, 4000, 0, "full_attention", 8, 0, 2, 6)]
    lookup = (77, None, False, 1000, 900, 200, 192, "evicted", 64)
    out = expand_records([(LOAD_PLAN, 0xABC, 99, None, False, None, 800, 4000, ("r1", 0, 192, 1, scans, lookup))])
    assert [(r[0], r[6], r[7]) for r in out] == [(LOOKUP_SPAN.code, 1000, 1000), (SCAN_SPAN.code, 5000, 5000),
                                                 (LOAD_SPAN.code, 800, 4000)]


def test_a_request_id_no_utf8_carries_reaches_sdk_exporters_as_valid_text():
    """A lone surrogate (an id decoded with surrogateescape) made the OTLP encoder drop the attribute
    and log an error with a traceback for every such span; it is "?" there, as in the trace file."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from connector.telemetry.span_records import to_readable_span

    odd = b"req-\xff".decode("utf-8", "surrogateescape")
    span = to_readable_span((LOOKUP_SPAN.code, 1, 2, None, False, None, 10, 20, (odd, 64, 32, "evicted", 16)),
                            Resource.create({}), InstrumentationScope("kvscope"))
    assert span.attributes["kvscope.request.id"] == "req-?" and span.attributes["kvscope.tokens.queried"] == 64
    span.attributes["kvscope.request.id"].encode("utf-8")
