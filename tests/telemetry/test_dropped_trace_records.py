"""Span records that a trace sink does not get are counted, through vLLM's stats path, in
kvscope_dropped_trace_records_total (a load record, with its scans and lookup, counts once)."""

from __future__ import annotations

import os
import threading

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from connector.telemetry.metrics import KVScopeStats
from connector.telemetry.span_batcher import LOSS_REASONS, SpanBatcher
from connector.telemetry.testing import engine_labels
from connector.telemetry.tracing import KVScopeTracing
from connector.worker import KVScopeWorker
from tests.telemetry.test_scheduler_spans import make_scheduler, plan_loads


class HeldExporter(SpanExporter):
    """Takes batches only once the test lets it: until then the batcher's queue fills up. Its
    `dropped_spans` stands for records a helper process lost (it died holding them)."""

    def __init__(self):
        self.gate = threading.Event()
        self.exported = 0
        self.dropped_spans = 0

    def export(self, spans):
        self.gate.wait(30)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


def _tracing(max_queue: int) -> tuple[KVScopeTracing, HeldExporter]:
    exporter = HeldExporter()
    batcher = SpanBatcher([exporter], schedule_delay_s=60, max_queue=max_queue, max_batch=max_queue * 2)
    return KVScopeTracing(batcher, Resource.create({}), 1.0), exporter


def test_lost_records_are_the_batchers_drops_and_its_exporters():
    tracing, exporter = _tracing(max_queue=2)
    batcher = tracing._processor
    for i in range(5):
        batcher.on_end(i)  # 2 queued, 3 dropped
    exporter.dropped_spans = 4
    assert batcher.dropped_spans == 3 and batcher.lost_records == 7
    assert tracing.take_lost_records() == {"queue_full": 3, "helper_lost": 4}  # (no count of its own: the helper's)
    assert tracing.take_lost_records() == {}  # told once
    exporter.dropped_spans = 5
    assert tracing.take_lost_records() == {"helper_lost": 1}
    exporter.gate.set()
    tracing.shutdown()
    assert exporter.exported == 2
    assert KVScopeTracing.disabled().take_lost_records() == {}


def test_records_a_recording_fault_lost_are_told_once_beside_the_batchers():
    tracing, exporter = _tracing(max_queue=1)
    tracing._processor.on_end(0)
    tracing._processor.on_end(1)  # dropped: the queue holds one
    tracing.record_failed()
    tracing.record_failed(2)
    assert tracing.take_lost_records() == {"record_failed": 3, "queue_full": 1}
    assert tracing.take_lost_records() == {}
    exporter.gate.set()
    tracing.shutdown()
    disabled = KVScopeTracing.disabled()
    disabled.record_failed()  # tracing off: nothing was to be recorded, nothing lost
    assert disabled.take_lost_records() == {}


def test_the_schedulers_stats_count_the_spans_its_tracing_dropped_and_agree_with_what_was_exported():
    tracing, exporter = _tracing(max_queue=2)  # each load is one record: the third load's is dropped
    sched = make_scheduler(tracing)
    plan_loads(sched, "r1", "s2", "t3")
    data = sched.take_stats().data
    assert data["dropped_trace_records"] == {"queue_full": 1}  # the third load's record: its lookup, load, 2 scans
    assert "dropped_trace_records" not in (sched.take_stats() or KVScopeStats()).data  # counted once
    exporter.gate.set()
    assert tracing.force_flush() is False  # the flush cannot deliver the dropped one
    tracing.shutdown()
    assert exporter.exported == 2  # records: 3 loads, 1 dropped


def test_the_workers_stats_count_the_spans_its_tracing_dropped():
    tracing, exporter = _tracing(max_queue=1)
    worker = KVScopeWorker(None, None, 0, [], 0, tracing)
    for i in range(3):
        tracing._processor.on_end(i)
    assert worker.take_stats().data == {"dropped_trace_records": {"queue_full": 2}}
    assert worker.take_stats() is None
    exporter.gate.set()
    tracing.shutdown()


def test_the_metric_sums_the_scheduler_and_workers_drops(registry, prom_metrics):
    scheduler, worker = KVScopeStats(), KVScopeStats()
    scheduler.record_dropped_trace_records("queue_full", 3)
    worker.record_dropped_trace_records("queue_full", 2)
    worker.record_dropped_trace_records("sink_failed", 1)
    for reason in LOSS_REASONS:  # every series exists before any drop
        assert registry.get_sample_value("kvscope_dropped_trace_records_total", engine_labels(0, reason=reason)) == 0
    prom_metrics.observe(KVScopeStats().aggregate(scheduler).aggregate(worker).data, engine_idx=0)
    get = registry.get_sample_value
    assert get("kvscope_dropped_trace_records_total", engine_labels(0, reason="queue_full")) == 5
    assert get("kvscope_dropped_trace_records_total", engine_labels(0, reason="sink_failed")) == 1
    summary = scheduler.aggregate(worker).reduce()
    assert summary["dropped_trace_records_queue_full"] == 5 and summary["dropped_trace_records_sink_failed"] == 1


def test_spans_a_dead_export_helper_held_are_counted_from_the_real_helper(tmp_path):
    """The real path: the export helper process dies with spans in its pipe; what it lost reaches
    the stats through `SpanBatcher.lost_records`."""
    import os
    import signal

    from connector.telemetry.span_records import LOOKUP_SPAN
    from tests.telemetry.test_export_process import _wait_until_dead

    tracing = KVScopeTracing.from_config(str(tmp_path / "t.jsonl"), 1.0)
    helper = tracing._processor._exporters[0]
    tracing.record(LOOKUP_SPAN, None, 1, 2, ("warm-up", 1, 1, "tail", 0))
    assert tracing.force_flush() and helper.pid is not None  # the helper runs
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)  # reads nothing: what follows waits in its pipe
    for i in range(300):
        tracing.record(LOOKUP_SPAN, None, 1, 2, (f"req-{i}", 64, 32, "evicted", 0))
    tracing.end_step()  # handed to the helper's pipe
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    assert tracing.force_flush() is False  # fails over: what the dead helper held is lost
    assert helper.dropped_spans > 0
    worker = KVScopeWorker(None, None, 0, [], 0, tracing)
    assert worker.take_stats().data == {"dropped_trace_records": {"helper_lost": helper.dropped_spans}}
    tracing.shutdown()


@pytest.mark.parametrize("export_mode", ["process", "thread"])
def test_records_an_unwritable_trace_file_failed_reach_the_schedulers_stats(tmp_path, export_mode):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "KVSCOPE_TRACE_EXPORT": export_mode}
    tracing = KVScopeTracing.from_config(str(blocker / "traces.jsonl"), 1.0, env=env)  # cannot be created
    sched = make_scheduler(tracing)
    plan_loads(sched, "r1", "s2", "t3")
    assert tracing.force_flush() is False
    assert sched.take_stats().data["dropped_trace_records"] == {"sink_failed": 3}  # one load record a request
    tracing.shutdown()


def test_a_span_ended_after_tracing_shut_down_is_counted_and_makes_a_flush_false(tmp_path):
    from connector.telemetry.span_records import LOOKUP_SPAN

    tracing = KVScopeTracing.from_config(str(tmp_path / "t.jsonl"), 1.0)
    tracing.record(LOOKUP_SPAN, None, 1, 2, ("before", 1, 1, "tail", 0))
    tracing.shutdown()
    assert tracing.force_flush() is True
    tracing.record(LOOKUP_SPAN, None, 3, 4, ("after", 1, 1, "tail", 0))  # (a worker's late copy, say)
    assert tracing.force_flush() is False
    assert tracing.take_lost_records() == {"after_shutdown": 1}
