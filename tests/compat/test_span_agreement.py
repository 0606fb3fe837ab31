"""`span_agreement`: a run's spans against kvscope's stats, on hand-made spans and stats (the random workloads
replay it on real trace files: `workload_fuzz.execute`)."""

from __future__ import annotations

import pytest

from tests.compat import workload_fuzz
from tests.compat.span_agreement import (prometheus_stats, replay_app_mismatches, span_stat_mismatches,
                                         trace_file_attributes)


def _run() -> tuple[list[tuple[str, dict]], dict]:
    """One lookup that loaded 2 blocks into each of two groups on two workers, after a deferral; one that
    missed; one request that ended waiting for device KV room; the stats of the same."""
    spans = [
        ("kvscope.lookup", {"kvscope.tokens.queried": 100, "kvscope.tokens.hit": 64,
                            "kvscope.deferred.lookups": 2, "kvscope.deferred.wait_us": 1500}),
        ("kvscope.lookup", {"kvscope.tokens.queried": 40, "kvscope.tokens.hit": 0}),
        ("kvscope.load", {"kvscope.tokens.external": 64}),
        ("kvscope.group.scan", {"kvscope.group.index": 0, "kvscope.group.kind": "sliding_window",
                                "kvscope.group.blocks.total": 6, "kvscope.group.blocks.null_skipped": 4,
                                "kvscope.group.blocks.pending": 2}),
        ("kvscope.group.scan", {"kvscope.group.index": 1, "kvscope.group.kind": "full_attention",
                                "kvscope.group.blocks.total": 6, "kvscope.group.blocks.null_skipped": 0,
                                "kvscope.group.blocks.pending": 2}),
        *[("kvscope.group.copy", {"kvscope.group.index": g, "kvscope.group.kind": kind,
                                  "kvscope.copy.direction": "load", "kvscope.copy.blocks": 2,
                                  "kvscope.copy.bytes": 4096, "kvscope.worker.rank": rank})
          for g, kind in ((0, "sliding_window"), (1, "full_attention")) for rank in (0, 1)],
        ("kvscope.deferral", {"kvscope.deferred.lookups": 3, "kvscope.deferred.wait_us": 2000,
                              "kvscope.deferred.outcome": "ended"}),
    ]
    data = {"lookup_tokens": 140, "hit_tokens": 64,
            "scan_blocks": {"0|sliding_window": 6, "1|full_attention": 6},
            "null_blocks_skipped": {"0|sliding_window": 4, "1|full_attention": 0},
            "loaded_blocks": {"0|sliding_window": 2, "1|full_attention": 2},
            "copy_blocks": {"0|sliding_window|load": 4, "1|full_attention|load": 4},
            "copy_bytes": {"0|sliding_window|load": 8192, "1|full_attention|load": 8192},
            "load_bytes": {"0|sliding_window": 8192, "1|full_attention": 8192},
            "deferred_loads": 2, "load_deferral_wait_s": [0.0015, 0.002],
            "dropped_trace_records": {"sink_failed": 0}}
    return spans, data


def test_a_run_whose_spans_tell_what_its_stats_count_agrees():
    assert span_stat_mismatches(*_run()) == []


def test_a_failed_load_counts_its_scans_pending_blocks_as_failures():
    spans, data = _run()
    data["loaded_blocks"] = {"0|sliding_window": 2}
    data["load_failures"] = 2
    assert span_stat_mismatches(spans, data) == []


def _changed(change) -> list[str]:
    spans, data = _run()
    change(spans, data)
    return span_stat_mismatches(spans, data)


@pytest.mark.parametrize(("change", "said"), [
    (lambda spans, data: data.update(hit_tokens=63), "hit_tokens in the spans {'': 64}, in the stats {'': 63}"),
    (lambda spans, data: spans.pop(1), "lookup_tokens in the spans {'': 100}, in the stats {'': 140}"),
    # the same blocks counted under the other group
    (lambda spans, data: data.update(scan_blocks={"0|sliding_window": 12}), "scan_blocks"),
    (lambda spans, data: data["null_blocks_skipped"].update({"0|sliding_window": 3}), "null_blocks_skipped"),
    (lambda spans, data: data.update(loaded_blocks={"0|sliding_window": 2}), "pending_blocks"),
    (lambda spans, data: data["copy_blocks"].update({"0|sliding_window|load": 3}), "copy_blocks"),
    (lambda spans, data: data["copy_bytes"].update({"1|full_attention|load": 8000}), "copy_bytes"),
    (lambda spans, data: spans.pop(), "1 spans tell a wait for device KV room, the histogram observed 2"),
    (lambda spans, data: data["load_deferral_wait_s"].append(0.001), "the histogram observed 3"),
    (lambda spans, data: data.update(load_deferral_wait_s=[0.0015, 0.0021]), "the spans' waits for device KV room"),
    (lambda spans, data: data.update(dropped_trace_records={"helper_lost": 3}), "3 trace records dropped"),
])
def test_each_disagreement_is_told(change, said):
    problems = _changed(change)
    assert len(problems) == 1 and said in problems[0], problems


def test_a_worker_copy_untold_is_told_by_blocks_and_bytes():
    problems = _changed(lambda spans, data: spans.pop(5))
    assert [p.split(" in the spans")[0] for p in problems] == ["telemetry: copy_blocks", "telemetry: copy_bytes"]


def test_a_wait_the_spans_tell_longer_agrees():
    """A load span's wait runs on to the load's start, past the lookup that ended the histogram's."""
    assert _changed(lambda spans, data: data.update(load_deferral_wait_s=[0.0012, 0.002])) == []


def _through_prometheus(data: dict, engines: int = 2) -> dict:
    """`data` observed by kvscope's Prometheus metrics in a registry of their own, split over ``engines`` engines
    as vLLM's front end would observe each engine's payload, and read back."""
    from prometheus_client import CollectorRegistry

    from connector.telemetry.metrics import KVScopeStats
    from connector.telemetry.testing import build_prom_metrics

    registry = CollectorRegistry()
    metrics = build_prom_metrics(registry, engines=engines)
    metrics.observe(data, engine_idx=0)
    metrics.observe(KVScopeStats().data, engine_idx=1)  # an engine with nothing to tell: its zeros
    return prometheus_stats(registry)


def test_stats_read_back_from_prometheus_agree_with_the_spans_but_for_copied_blocks_no_metric_counts():
    spans, data = _run()
    stats = _through_prometheus(data)
    assert stats["copy_blocks"] is None
    assert (stats["load_deferral_wait_s_count"], stats["load_deferral_wait_s_sum"]) == (2, pytest.approx(0.0035))
    assert span_stat_mismatches(spans, stats) == []
    spans[5][1]["kvscope.copy.blocks"] = 1  # blocks no metric counts: not compared
    assert span_stat_mismatches(spans, stats) == []


@pytest.mark.parametrize(("change", "said"), [
    (lambda data: data.update(hit_tokens=63), "hit_tokens in the spans {'': 64}, in the stats {'': 63}"),
    (lambda data: data["null_blocks_skipped"].update({"0|sliding_window": 3}), "null_blocks_skipped"),
    (lambda data: data.update(loaded_blocks={"0|sliding_window": 2}), "pending_blocks"),
    (lambda data: data["copy_bytes"].update({"1|full_attention|load": 8000}),
     "copy_bytes in the spans {'0|sliding_window|load': 8192, '1|full_attention|load': 8192}, in the stats "
     "{'0|sliding_window|load': 8192, '1|full_attention|load': 8000}"),
    (lambda data: data["load_deferral_wait_s"].append(0.001), "the histogram observed 3"),
    (lambda data: data.update(load_deferral_wait_s=[0.0015, 0.0021]), "the spans' waits for device KV room"),
    (lambda data: data.update(dropped_trace_records={"helper_lost": 3}), "3 trace records dropped"),
])
def test_each_disagreement_with_the_stats_read_back_from_prometheus_is_told(change, said):
    """Bytes reach Prometheus through kvscope_load_bytes_total (`record_copy` counts both)."""
    spans, data = _run()
    change(data)
    data["load_bytes"] = {key.rsplit("|", 1)[0]: n for key, n in data["copy_bytes"].items()}
    problems = span_stat_mismatches(spans, _through_prometheus(data))
    assert len(problems) == 1 and said in problems[0], problems


def test_a_random_workloads_trace_file_agrees_with_its_stats_and_the_replay_app_shows_the_same_run(tmp_path):
    """Seed 55 ("fast": it loads from the host tier, on two workers) on a real trace file; the
    same file against stats one hit token off, and against a copy span gone."""
    trace_file = tmp_path / "spans.jsonl"
    with workload_fuzz._played(workload_fuzz.make_plan(55, "fast"), trace_file) as replay:
        result = replay.finish()
    assert result.verdict == "ok" and result.external_hit_tokens > 0, (result.leaks, result.unfinished)
    data = dict(replay.engine.stats.connector.data)
    spans = trace_file_attributes(trace_file)
    assert span_stat_mismatches(spans, data) == replay_app_mismatches(trace_file, data) == []
    off = {**data, "hit_tokens": data["hit_tokens"] + 1}
    assert "hit_tokens in the spans" in span_stat_mismatches(spans, off)[0]
    assert replay_app_mismatches(trace_file, off) == [
        f"replay app: tokens_hit sum to {data['hit_tokens']}, the stats count hit_tokens {data['hit_tokens'] + 1}"]
    lines = trace_file.read_text().splitlines()
    without_copies = [line for line in lines if '"kvscope.group.copy"' not in line]
    assert len(without_copies) < len(lines)  # (a line holds one batch of spans)
    trace_file.write_text("\n".join(without_copies) + "\n")
    assert "loads without a copy span" in replay_app_mismatches(trace_file, data)[-1]
