"""SpanBatcher: the engine thread only appends; the export thread batches, flushes and drops."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from connector.telemetry.span_batcher import SpanBatcher


# How long a test waits for the export thread to reach the exporter, and how long a held exporter
# waits for the test to let it go: far past any scheduling delay, so only a real hang trips them.
ENTER_DEADLINE_S = 30.0
HOLD_S = 30.0


class Collect(SpanExporter):
    def __init__(self, block: threading.Event | None = None):
        self.batches: list[list] = []
        self.threads: set[str] = set()
        self.block = block
        self.shut = False
        self.entered = threading.Event()  # the export thread is inside export()
        self.returned = threading.Event()  # ... and has come back out of it

    def export(self, spans):
        self.entered.set()
        try:
            if self.block is not None and not self.block.wait(HOLD_S):
                self.block.set()  # held past any test's patience (a hang): stop holding the rest
            self.threads.add(threading.current_thread().name)
            self.batches.append(list(spans))
            return SpanExportResult.SUCCESS
        finally:
            self.returned.set()

    def shutdown(self):
        self.shut = True

    @property
    def spans(self) -> list:
        return [s for b in self.batches for s in b]


def test_flush_exports_every_span_in_order_to_every_exporter_off_the_caller_thread():
    a, b = Collect(), Collect()
    batcher = SpanBatcher([a, b], schedule_delay_s=60, max_batch=4)
    for i in range(10):
        batcher.on_end(i)
    assert batcher.force_flush(5000)
    assert a.spans == b.spans == list(range(10))
    assert max(len(x) for x in a.batches) <= 4
    assert a.threads == {"kvscope-span-export"}
    batcher.shutdown()
    assert a.shut and b.shut


def test_a_full_batch_wakes_the_export_thread_without_waiting_for_the_delay():
    sink = Collect()
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=8)
    for i in range(8):
        batcher.on_end(i)
    deadline = time.monotonic() + 5
    while not sink.spans and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.spans == list(range(8))
    batcher.shutdown()


def test_a_full_queue_drops_instead_of_blocking_and_logs_once(caplog):
    gate = threading.Event()
    sink = Collect(block=gate)  # the exporter hangs: the queue fills up
    batcher = SpanBatcher([sink], schedule_delay_s=0.01, max_queue=16, max_batch=4)
    batcher.on_end("first")
    _wait_until_inside_export(sink)  # the export thread is stuck there until the test sets the gate
    with caplog.at_level(logging.WARNING, logger="connector.telemetry.span_batcher"):
        for i in range(100):
            batcher.on_end(i)
        # Every call came back while the only export is still held by the gate: none waited for it.
        assert not sink.returned.is_set(), "on_end waited for the blocked exporter instead of dropping"
        assert batcher.dropped_spans == 100 - 16
        gate.set()
        assert batcher.force_flush(5000) is False  # the spans dropped were ended before it: not flushed
        batcher.on_end("later")
        assert batcher.force_flush(5000) is True  # no loss since the last flush
    assert sink.spans == ["first", *range(16), "later"]
    drops = [r for r in caplog.records if "span queue full" in r.getMessage()]
    assert len(drops) == 1
    batcher.shutdown()


def test_a_raising_exporter_neither_stops_the_thread_nor_the_other_exporters(caplog):
    class Broken(SpanExporter):
        def export(self, spans):
            raise RuntimeError("boom")

    good = Collect()
    batcher = SpanBatcher([Broken(), good], schedule_delay_s=60)
    with caplog.at_level(logging.ERROR, logger="connector.telemetry.span_batcher"):
        batcher.on_end(1)
        assert batcher.force_flush(5000) is False  # a sink did not get it
        batcher.on_end(2)
        assert batcher.force_flush(5000) is False
    assert good.spans == [1, 2]
    assert batcher.lost_records == 2  # each failed by one sink: counted once
    batcher.shutdown()


def test_records_a_sink_fails_are_counted_once_however_many_sinks_fail_them():
    class Failing(Collect):
        def export(self, spans):
            super().export(spans)
            return SpanExportResult.FAILURE  # (an unwritable trace file, an unreachable endpoint)

    a, b, good = Failing(), Failing(), Collect()
    batcher = SpanBatcher([a, b, good], schedule_delay_s=60, max_batch=2)
    for i in range(5):
        batcher.on_end(i)
    assert batcher.force_flush(5000) is False
    assert batcher.lost_records == 5 and batcher.dropped_spans == 0 and good.spans == list(range(5))
    batcher.shutdown()


def test_shutdown_exports_what_is_queued_and_later_calls_are_harmless():
    sink = Collect()
    batcher = SpanBatcher([sink], schedule_delay_s=60)
    batcher.on_end("a")
    batcher.shutdown()
    assert sink.spans == ["a"] and sink.shut
    batcher.shutdown()
    assert batcher.force_flush(10) is True


def test_a_span_ended_after_shutdown_is_counted_and_said_not_queued_for_ever(caplog):
    sink = Collect()
    batcher = SpanBatcher([sink], schedule_delay_s=60)
    batcher.on_end("a")
    batcher.shutdown()
    with caplog.at_level(logging.WARNING, logger="connector.telemetry.span_batcher"):
        batcher.on_end("late")
        batcher.on_end("later")
    assert sink.spans == ["a"] and batcher.dropped_spans == 2 and not batcher._queue
    assert batcher.force_flush(10) is False  # it cannot export them
    assert len([r for r in caplog.records if "after tracing was shut down" in r.getMessage()]) == 1


def test_the_first_span_ended_after_shutdown_is_said_at_once_and_no_later_one(caplog):
    """The log says a record was lost when the first one is, not at some later one (nor at every later one)."""
    batcher = SpanBatcher([Collect()], schedule_delay_s=60)
    batcher.shutdown()

    def said() -> list:
        return [r for r in caplog.records if "after tracing was shut down" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="connector.telemetry.span_batcher"):
        batcher.on_end("late")
        assert len(said()) == 1
        batcher.on_end("later")
        batcher.on_end("latest")
    assert len(said()) == 1 and batcher.dropped_spans == 3


def test_needs_an_exporter():
    with pytest.raises(ValueError, match="exporter"):
        SpanBatcher([])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_queue_and_export_thread():
    sink = Collect()
    batcher = SpanBatcher([sink], schedule_delay_s=60)
    batcher.on_end("parent")
    pid = os.fork()
    if pid == 0:  # child: the parent's thread does not exist here
        try:
            batcher.on_end("child")
            ok = batcher.force_flush(5000) and sink.spans[-1:] == ["child"] and "parent" not in sink.spans
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert batcher.force_flush(5000)
    assert sink.spans == ["parent"]
    batcher.shutdown()


def test_spans_still_queued_at_interpreter_exit_reach_the_trace_file(tmp_path):
    """A process that ends without anyone calling shutdown still writes what it traced."""
    import json
    import subprocess
    import sys

    path = tmp_path / "exit.jsonl"
    script = (
        "from connector.telemetry.tracing import KVScopeTracing\n"
        f"t = KVScopeTracing.from_config(trace_file={str(path)!r}, sample_ratio=1.0)\n"
        "t.start_span('kvscope.load').end()\n"  # queued; the export thread waits up to 0.2 s
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    (line,) = path.read_text().splitlines()
    spans = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [s["name"] for s in spans] == ["kvscope.load"]


def _wait_until_inside_export(sink: Collect) -> None:
    assert sink.entered.wait(ENTER_DEADLINE_S), (
        f"the export thread did not reach export() within {ENTER_DEADLINE_S:.0f} s")


class CollectNowait(Collect):
    """An exporter with a non-blocking path, as the export helper's (`ExportProcess`) has."""

    def __init__(self, accepts: bool = True, block: threading.Event | None = None):
        super().__init__(block)  # `block` holds `export` (the export thread's path) only
        self.accepts_nowait = accepts
        self.caught_up = 0

    def export_nowait(self, spans):
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(spans))

    def catch_up(self):
        self.caught_up += 1


def test_full_batches_go_to_a_nonblocking_exporter_from_the_thread_that_filled_them():
    sink = CollectNowait()
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=4)
    for i in range(10):
        batcher.on_end(i)
    # Two full batches handed over at once, by this thread; the tail waits for the export thread.
    assert sink.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sink.threads == {threading.current_thread().name}
    assert batcher.force_flush(5000)
    assert sink.spans == list(range(10)) and "kvscope-span-export" in sink.threads
    assert sink.caught_up >= 1  # the export thread finishes what the handing over left behind
    batcher.shutdown()


def test_at_the_end_of_a_step_the_tail_leaves_at_once_without_waiting_for_the_delay():
    sink = CollectNowait()
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=64)
    for i in range(5):
        batcher.on_end(i)
    assert sink.batches == []  # a partial batch waits for the delay
    batcher.hand_over()
    assert sink.batches == [[0, 1, 2, 3, 4]] and sink.threads == {threading.current_thread().name}
    batcher.hand_over()  # nothing queued: nothing sent
    assert len(sink.batches) == 1
    batcher.shutdown()


def test_until_the_exporter_accepts_batches_without_blocking_the_export_thread_sends_them_in_order():
    sink = CollectNowait(accepts=False)  # e.g. the helper process has not started yet
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=4)
    for i in range(6):
        batcher.on_end(i)  # a full batch wakes the export thread instead
    deadline = time.monotonic() + 5
    while len(sink.spans) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.threads == {"kvscope-span-export"} and sink.spans[:4] == [0, 1, 2, 3]
    sink.accepts_nowait = True
    for i in range(6, 12):
        batcher.on_end(i)
    assert batcher.force_flush(5000)
    assert sink.spans == list(range(12))  # never out of order, whichever thread sent a batch
    batcher.shutdown()


def test_while_the_export_thread_exports_the_engine_thread_neither_waits_nor_reorders():
    gate = threading.Event()
    sink = CollectNowait(block=gate)  # the export thread's export() is stuck (a full pipe)
    batcher = SpanBatcher([sink], schedule_delay_s=0.01, max_batch=4)
    batcher.on_end("tail")
    _wait_until_inside_export(sink)  # the export thread now holds the export lock inside export()
    for i in range(12):  # three full batches
        batcher.on_end(i)
    # Every call came back while the stuck export is still held by the gate: none waited for it.
    assert not sink.returned.is_set(), "on_end waited for the export thread's export()"
    assert sink.spans == []  # nothing handed over past the stuck export: it would reorder
    gate.set()
    assert batcher.force_flush(5000)
    assert sink.spans == ["tail", *range(12)]
    batcher.shutdown()


def test_a_failing_nonblocking_path_never_reaches_the_engine_thread_and_loses_nothing(caplog):
    class Failing(CollectNowait):
        def export_nowait(self, spans):
            raise RuntimeError("boom")

    sink = Failing()
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=4)
    with caplog.at_level(logging.ERROR, logger="connector.telemetry.span_batcher"):
        for i in range(10):
            batcher.on_end(i)  # must not raise
        assert batcher.force_flush(5000)
    assert sink.spans == list(range(10)) and sink.threads == {"kvscope-span-export"}
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
    batcher.shutdown()


def test_with_several_exporters_every_one_gets_every_span_even_if_one_can_take_batches_without_blocking():
    """The engine thread hands batches over itself only to a lone exporter: a batch handed to one
    exporter of several would be lost to the others."""
    fast, other = CollectNowait(), Collect()
    batcher = SpanBatcher([fast, other], schedule_delay_s=60, max_batch=4)
    for i in range(8):
        batcher.on_end(i)
    assert batcher.force_flush(5000)
    assert fast.spans == other.spans == list(range(8))
    batcher.shutdown()


def test_at_the_end_of_a_step_nothing_is_handed_over_to_an_exporter_that_could_block():
    """`hand_over` runs on the engine thread after every step: with an ordinary exporter (the export
    thread's only) it does nothing, and never raises into the engine."""
    sink = Collect()
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=64)
    batcher.on_end(1)
    batcher.hand_over()
    assert sink.batches == []
    assert batcher.force_flush(5000) and sink.spans == [1]
    batcher.shutdown()


def test_after_the_nonblocking_path_fails_its_batch_leaves_without_waiting_for_the_delay():
    """The batch the engine thread could not hand over is the export thread's at once, not after
    `schedule_delay_s` (nor only at the next flush)."""
    class Failing(CollectNowait):
        def export_nowait(self, spans):
            raise RuntimeError("boom")

    sink = Failing()
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=4)
    for i in range(4):
        batcher.on_end(i)
    deadline = time.monotonic() + 5
    while len(sink.spans) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.spans == [0, 1, 2, 3]
    batcher.shutdown()


def test_flush_gives_up_after_its_timeout_when_an_exporter_hangs():
    """`force_flush(timeout_millis)` is what vLLM's shutdown waits on: a hung exporter costs it the
    timeout, in milliseconds, not more."""
    gate = threading.Event()
    sink = Collect(block=gate)
    batcher = SpanBatcher([sink], schedule_delay_s=60)
    batcher.on_end(1)
    result = []
    flusher = threading.Thread(target=lambda: result.append(batcher.force_flush(200)), daemon=True)
    flusher.start()
    flusher.join(10)
    assert result == [False]
    gate.set()
    batcher.shutdown()


def test_a_second_shutdown_does_not_shut_the_exporters_down_again():
    """vLLM's shutdown and the interpreter's exit both shut the batcher down: its exporters (a helper
    process, a connection) are closed once."""
    class CountShutdowns(Collect):
        shutdowns = 0

        def shutdown(self):
            self.shutdowns += 1

    sink = CountShutdowns()
    batcher = SpanBatcher([sink], schedule_delay_s=60)
    batcher.shutdown()
    batcher.shutdown()
    assert sink.shutdowns == 1


def test_between_flushes_a_partial_batch_waits_for_the_delay():
    """The export thread sleeps until a full batch, a flush or the delay: one that spins instead costs
    the engine process a core."""
    sink = Collect()
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=64)
    batcher.on_end(1)
    assert batcher.force_flush(5000)
    batcher.on_end(2)
    time.sleep(0.5)
    assert sink.spans == [1]
    batcher.shutdown()


def test_flush_flushes_the_exporters_too():
    """An exporter may hold spans of its own (the export helper process): a flush reaches it, and
    only a flush does."""
    class CountFlushes(Collect):
        flushes = 0

        def force_flush(self, timeout_millis=30000):
            self.flushes += 1
            return True

    sink = CountFlushes()
    batcher = SpanBatcher([sink], schedule_delay_s=0.01)
    batcher.on_end(1)
    deadline = time.monotonic() + 30
    while sink.spans != [1] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # several more scheduled exports
    assert sink.spans == [1] and sink.flushes == 0
    assert batcher.force_flush(5000)
    assert sink.flushes == 1
    batcher.shutdown()


def test_exporters_run_with_instrumentation_suppressed():
    """An instrumented HTTP client inside an OTLP exporter would trace its own exports, whose spans
    would be exported in turn: the export thread suppresses instrumentation."""
    from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, get_value

    class Probe(Collect):
        suppressed = None

        def export(self, spans):
            self.suppressed = get_value(_SUPPRESS_INSTRUMENTATION_KEY)
            return super().export(spans)

    sink = Probe()
    batcher = SpanBatcher([sink], schedule_delay_s=60)
    batcher.on_end(1)
    assert batcher.force_flush(5000)
    assert sink.suppressed is True
    batcher.shutdown()


@pytest.mark.parametrize("loss", ["flush says so", "dropped_spans grew", "flush raised"])
def test_a_flush_during_which_an_exporter_lost_spans_is_false_and_the_next_one_true(loss):
    """`force_flush` says whether it flushed: an exporter whose own flush failed, or that lost spans
    while the flush exported and flushed (a helper process that died), makes it False."""
    class Lossy(Collect):
        dropped_spans = 0
        failing = True

        def export(self, spans):
            if self.failing and loss == "dropped_spans grew":
                self.dropped_spans += len(spans)
            return super().export(spans)

        def force_flush(self, timeout_millis=30000):
            if self.failing and loss == "flush raised":
                raise RuntimeError("broken sink")
            return not (self.failing and loss == "flush says so")

    sink, other = Lossy(), Collect()
    batcher = SpanBatcher([sink, other], schedule_delay_s=60)
    batcher.on_end(1)
    assert batcher.force_flush(5000) is False
    sink.failing = False
    batcher.on_end(2)
    assert batcher.force_flush(5000) is True  # the loss is this flush's, not every later one's
    batcher.shutdown()
    assert other.spans == [1, 2]


def test_spans_an_exporter_lost_before_a_flush_make_that_flush_false_and_only_that_one():
    """A helper process that died between flushes lost spans ended before the next flush: that
    flush did not flush them, though nothing was lost while it ran."""
    class LosesOnExport(Collect):
        dropped_spans = 0

        def export(self, spans):
            self.dropped_spans += len(spans)  # (as a helper that took the batch and died)
            return super().export(spans)

    sink = LosesOnExport()
    batcher = SpanBatcher([sink], schedule_delay_s=0.01)
    batcher.on_end(1)
    deadline = time.monotonic() + ENTER_DEADLINE_S
    while not sink.dropped_spans and time.monotonic() < deadline:  # exported (and lost) on the schedule
        time.sleep(0.01)
    assert sink.dropped_spans == 1
    assert batcher.force_flush(5000) is False
    assert batcher.force_flush(5000) is True
    batcher.shutdown()


# --- found by the mutation campaign of the telemetry export path ----------------------------------


def test_records_an_exporter_counts_as_lost_itself_are_not_counted_again_when_it_fails_them():
    """The export helper's exporter counts what it fails (a sink failing after a fail-over) in its own
    `lost_by_reason`: the batcher must not add those records to its sink_failed count a second time."""
    class CountsItsOwn(Collect):
        def __init__(self):
            super().__init__()
            self.failed = 0

        def export(self, spans):
            super().export(spans)
            self.failed += len(spans)
            return SpanExportResult.FAILURE

        @property
        def dropped_spans(self):
            return self.failed

        def lost_by_reason(self):
            return {"helper_lost": 0, "sink_failed": self.failed}

    sink = CountsItsOwn()
    batcher = SpanBatcher([sink], schedule_delay_s=60, max_batch=2)
    for i in range(3):
        batcher.on_end(i)
    assert batcher.force_flush(5000) is False
    assert sink.spans == [0, 1, 2]
    assert batcher.lost_by_reason()["sink_failed"] == 3 and batcher.lost_records == 3
    batcher.shutdown()


def test_spans_ended_while_a_flush_is_under_way_when_shutdown_comes_are_still_exported():
    """The export thread is inside an exporter's flush when the engine ends more spans and shuts
    down: they were queued before the shutdown, and its last drain exports them."""
    class HeldFlush(Collect):
        def __init__(self):
            super().__init__()
            self.flush_gate = threading.Event()
            self.flushing = threading.Event()

        def force_flush(self, timeout_millis=30000):
            self.flushing.set()
            self.flush_gate.wait(HOLD_S)
            return True

    sink = HeldFlush()
    batcher = SpanBatcher([sink], schedule_delay_s=60)
    batcher.on_end("a")
    flusher = threading.Thread(target=batcher.force_flush, daemon=True)
    flusher.start()
    assert sink.flushing.wait(ENTER_DEADLINE_S), "the export thread never flushed the exporter"
    batcher.on_end("b")  # queued after the export thread's drain, before the shutdown
    stopper = threading.Thread(target=batcher.shutdown, daemon=True)
    stopper.start()
    deadline = time.monotonic() + ENTER_DEADLINE_S
    while not batcher._shutdown and time.monotonic() < deadline:
        time.sleep(0.001)
    assert batcher._shutdown
    sink.flush_gate.set()
    stopper.join(ENTER_DEADLINE_S)
    flusher.join(ENTER_DEADLINE_S)
    assert sink.spans == ["a", "b"] and batcher.dropped_spans == 0
