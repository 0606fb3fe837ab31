"""Telemetry on the real engine: the trace file of a two-round run, trace context, metric totals."""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict

import pytest

from connector.telemetry.testing import proto_span_attributes
from connector.telemetry.trace_file import parse_json_line

from .conftest import prompts_sharing_prefixes

pytestmark = pytest.mark.engine

PROMPTS = prompts_sharing_prefixes()
WINDOW = 64
TRACE_IDS = [f"{i + 1:032x}" for i in range(len(PROMPTS))]


def _traceparent(i: int) -> dict | None:
    # Every other request arrives with its own trace (as vLLM passes trace headers on).
    return {"traceparent": f"00-{TRACE_IDS[i]}-{i + 1:016x}-01"} if i % 2 == 0 else None


@pytest.fixture(scope="module")
def traced_run(scenarios):
    path = os.path.join(tempfile.mkdtemp(prefix="kvscope-trace-"), "spans.jsonl")
    spec = dict(model="gemma3", window=WINDOW, prompts=PROMPTS,
                extra={"cpu_bytes": 64 << 20, "trace_file": path},
                trace_headers=[_traceparent(i) for i in range(len(PROMPTS))],
                request_ids=[f"req-{i}" for i in range(len(PROMPTS))])
    result = scenarios.get("gemma3-traced", spec)
    spans = []
    with open(path) as f:
        for line in f:
            request = parse_json_line(line)
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    assert ss.scope.name == "kvscope"
                    spans.extend(ss.spans)
    result["trace_file"] = path
    return result, spans


def _by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_each_loading_request_has_one_scan_per_group_under_its_load(traced_run):
    result, spans = traced_run
    loads = _by_name(spans, "kvscope.load")
    loading = [s for s in loads if proto_span_attributes(s)["kvscope.tokens.external"] > 0]
    assert loading, "round 1 planned no load"
    scans_by_parent = defaultdict(list)
    for s in _by_name(spans, "kvscope.group.scan"):
        scans_by_parent[s.parent_span_id].append(s)
    groups = len(result["groups"])
    for load in loading:
        scans = scans_by_parent[load.span_id]
        assert len(scans) == groups == proto_span_attributes(load)["kvscope.groups"]
        assert {proto_span_attributes(s)["kvscope.group.index"] for s in scans} == set(range(groups))
        assert all(s.trace_id == load.trace_id for s in scans)


def test_sliding_window_scan_skips_null_blocks_for_prompts_longer_than_window(traced_run):
    result, spans = traced_run
    sw = [proto_span_attributes(s) for s in _by_name(spans, "kvscope.group.scan")
          if proto_span_attributes(s)["kvscope.group.kind"] == "sliding_window"]
    assert sw and all(a["kvscope.group.blocks.null_skipped"] > 0 for a in sw
                      if a["kvscope.group.blocks.total"] * 128 > WINDOW + 128)
    full = [proto_span_attributes(s) for s in _by_name(spans, "kvscope.group.scan")
            if proto_span_attributes(s)["kvscope.group.kind"] == "full_attention"]
    assert all(a["kvscope.group.blocks.null_skipped"] == 0 for a in full)


def test_copy_spans_join_the_request_trace_with_bytes(traced_run):
    _, spans = traced_run
    load_traces = {s.trace_id for s in _by_name(spans, "kvscope.load")
                   if proto_span_attributes(s)["kvscope.tokens.external"] > 0}
    copies = [s for s in _by_name(spans, "kvscope.group.copy")
              if proto_span_attributes(s)["kvscope.copy.direction"] == "load"]
    assert copies and {s.trace_id for s in copies} == load_traces
    assert all(proto_span_attributes(s)["kvscope.copy.bytes"] > 0 for s in copies)
    assert all(s.end_time_unix_nano >= s.start_time_unix_nano > 0 for s in copies)


def test_request_with_traceparent_has_its_connector_spans_in_that_trace(traced_run):
    _, spans = traced_run
    for i in range(0, len(PROMPTS), 2):
        mine = [s for s in spans if s.trace_id.hex() == TRACE_IDS[i]]
        names = {s.name for s in mine}
        assert "kvscope.lookup" in names, (i, names)
        assert all(proto_span_attributes(s).get("kvscope.request.id", f"req-{i}").startswith(f"req-{i}")
                   for s in mine if s.name != "kvscope.group.scan" and s.name != "kvscope.group.copy")


def test_requests_without_headers_get_a_trace_of_their_own(traced_run):
    _, spans = traced_run
    lookups = [s for s in _by_name(spans, "kvscope.lookup")
               if s.trace_id.hex() not in TRACE_IDS]
    assert lookups
    assert len({s.trace_id for s in lookups}) == len(lookups)


def test_metric_totals_agree_with_span_attributes_and_vllm(traced_run):
    result, spans = traced_run
    kv = result["kvscope"]
    scans = [proto_span_attributes(s) for s in _by_name(spans, "kvscope.group.scan")]
    assert kv["kvscope_scan_blocks_total"] == sum(a["kvscope.group.blocks.total"] for a in scans)
    assert kv["kvscope_null_blocks_skipped_total"] == sum(a["kvscope.group.blocks.null_skipped"] for a in scans)
    assert kv["kvscope_loaded_blocks_total"] == sum(a["kvscope.group.blocks.pending"] for a in scans)
    lookups = [proto_span_attributes(s) for s in _by_name(spans, "kvscope.lookup")]
    assert kv["kvscope_hit_tokens_total"] == sum(a["kvscope.tokens.hit"] for a in lookups)
    assert kv["kvscope_lookup_tokens_total"] == sum(a["kvscope.tokens.queried"] for a in lookups)
    assert kv["kvscope_hit_tokens_total"] <= kv["kvscope_lookup_tokens_total"]
    # why the rest was not served: the reasons add up to it; the lookups' spans tell the same reasons
    missed = result["kvscope_by_reason"]["kvscope_missed_tokens_total"]
    assert sum(missed.values()) == kv["kvscope_lookup_tokens_total"] - kv["kvscope_hit_tokens_total"]
    not_served = defaultdict(int)
    for a in lookups:
        not_served[a["kvscope.miss.reason"]] += a["kvscope.tokens.queried"] - a["kvscope.tokens.hit"]
    assert missed["new"] > 0 and not_served["new"] > 0  # round 0 is cold
    assert missed["tail"] >= len(lookups)  # each lookup leaves at least its last token to compute
    # a lookup whose hit stopped only at the tail has nothing else to count (every reason has a series,
    # at 0 until it is counted)
    blocks_missed = sum(tokens for reason, tokens in missed.items() if reason != "tail")
    assert 0 < blocks_missed <= sum(tokens for reason, tokens in not_served.items() if reason != "tail")
    vllm_external_hits = sum(c["vllm:external_prefix_cache_hits"] for c in result["counters"])
    assert kv["kvscope_hit_tokens_total"] == vllm_external_hits
    # each lookup names vLLM's device prefix-cache hit before it: together, vLLM's own count of them
    device_hits = sum(c["vllm:prefix_cache_hits"] for c in result["counters"])
    assert sum(a["kvscope.tokens.local"] for a in lookups) == device_hits > 0
    copies = [proto_span_attributes(s) for s in _by_name(spans, "kvscope.group.copy")]
    load_bytes = sum(a["kvscope.copy.bytes"] for a in copies if a["kvscope.copy.direction"] == "load")
    store_bytes = sum(a["kvscope.copy.bytes"] for a in copies if a["kvscope.copy.direction"] == "store")
    assert kv["kvscope_load_bytes_total"] == load_bytes > 0
    assert kv["kvscope_store_bytes_total"] == store_bytes > 0
    # and kind by kind: a count under the wrong group would pass the totals
    by_kind = result["kvscope_by_kind"]
    kinds = {a["kvscope.group.kind"] for a in scans}
    assert kinds == {"full_attention", "sliding_window"}
    for kind in kinds:
        mine = [a for a in scans if a["kvscope.group.kind"] == kind]
        def metric(name):  # a labelled series exists once it was first incremented
            return by_kind.get(name, {}).get(kind, 0)

        assert metric("kvscope_scan_blocks_total") == sum(a["kvscope.group.blocks.total"] for a in mine) > 0
        assert metric("kvscope_null_blocks_skipped_total") == sum(a["kvscope.group.blocks.null_skipped"] for a in mine)
        assert metric("kvscope_loaded_blocks_total") == sum(a["kvscope.group.blocks.pending"] for a in mine)
        for direction in ("load", "store"):
            assert metric(f"kvscope_{direction}_bytes_total") == sum(
                a["kvscope.copy.bytes"] for a in copies
                if a["kvscope.group.kind"] == kind and a["kvscope.copy.direction"] == direction)


def test_replay_app_shows_this_runs_hit_rate(traced_run, monkeypatch):
    """The Streamlit app on the trace file this engine run just wrote."""
    from tests.dashboard_app.test_pages import PAGES, app, metrics, number

    result, spans = traced_run
    at = app(monkeypatch, result["trace_file"])
    assert not at.exception, [e.value for e in at.exception]
    # one engine process wrote its lookups (the export helper writes them under the engine's resource)
    assert not any("several processes" in w.value for w in at.warning), [w.value for w in at.warning]
    lookups = [proto_span_attributes(s) for s in _by_name(spans, "kvscope.lookup")]  # every one counts, as in the metrics
    rate = sum(a["kvscope.tokens.hit"] for a in lookups) / sum(a["kvscope.tokens.queried"] for a in lookups)
    assert number(metrics(at)["Token hit rate"]) == pytest.approx(round(rate * 100, 1))
    for page in PAGES[1:3]:
        at.switch_page(page).run()
        assert not at.exception


def test_records_a_trace_sink_fails_are_counted_on_the_engines_metrics_and_loads_go_on(scenarios, tmp_path_factory):
    """A trace file that passes the start-up check but takes no write (a named pipe nothing reads):
    every record the helper's sink fails reaches kvscope_dropped_trace_records_total through vLLM's
    stats path, under `sink_failed` alone; loads and the hit metrics go on as ever."""
    fifo = tmp_path_factory.mktemp("sink-down") / "traces.jsonl"
    os.mkfifo(fifo)
    spec = dict(model="gemma3", window=WINDOW, prompts=PROMPTS,
                extra={"cpu_bytes": 64 << 20, "trace_file": str(fifo)})
    result = scenarios.get("gemma3-trace-sink-down", spec)
    dropped = result["kvscope_by_reason"]["kvscope_dropped_trace_records_total"]
    assert dropped["sink_failed"] > 0, dropped
    assert all(n == 0 for reason, n in dropped.items() if reason != "sink_failed"), dropped
    loads = result["counters"][1]
    assert loads["vllm:external_prefix_cache_hits"] > 0  # round 1 loaded from the host tier all the same
    assert result["kvscope"]["kvscope_hit_tokens_total"] == sum(c["vllm:external_prefix_cache_hits"]
                                                                for c in result["counters"])
