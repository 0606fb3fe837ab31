"""A batching span processor whose hot path is one deque append.

Why not the SDK's `BatchSpanProcessor`: its `on_end` costs about 4.5 µs per span here (locks,
checks, a condition per span), more than a small group scan. kvscope's light spans only need
to reach the exporters on a background thread, in batches, without ever blocking the engine:

- `on_end` appends to a `collections.deque` (thread-safe, no lock) and wakes the export thread
  only when a full batch is waiting; otherwise the thread wakes every `schedule_delay_s`.
- An exporter that can take a batch without ever blocking (`export_nowait`: the helper process's
  pipe) gets each full batch from the thread that filled it, at once: waking the export thread
  instead costs the engine more than the handing over (two GIL handoffs per batch, and records
  freed long after they were made: ~0.8 µs a record at 1g/128, measured). The export thread
  then only takes what the engine thread could not hand over: the tail, the helper's start, a
  full pipe, a failure.
- The queue is bounded: past `max_queue` spans are dropped and counted, never waited for, and
  the first drop is logged once (from the export thread, not the engine's).
- All exporters share one queue, so a second sink (file and OTLP) costs no second append.
- After a fork the child gets a fresh queue and thread (as the SDK's processor does).
- At interpreter exit whatever is queued is exported (as the SDK's provider does), for processes
  that end without vLLM calling the connector's `shutdown`.
- A span ended after shutdown has nothing left to export it: dropped, counted, logged once.
- `force_flush` says False once for each loss since the flush before it (a full queue, an
  exporter that lost spans), not only for losses while it ran.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, set_value
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)


# A fault while recording them (a bug, logged): counted by `KVScopeTracing.record_failed`, not here.
RECORD_FAILED = "record_failed"
# Why records were lost (`lost_by_reason`; the `reason` label of kvscope_dropped_trace_records_total).
LOSS_REASONS = (
    "sink_failed",  # a sink failed to take them: an OTLP endpoint down (or in its cool-down), an unwritable file
    "queue_full",  # the span queue was full: the sinks did not keep up
    "helper_lost",  # the export helper fell too far behind, or died holding them
    "after_shutdown",  # ended after tracing shut down
    RECORD_FAILED,
)


class SpanBatcher:
    """Queues ended spans; a daemon thread hands them to every exporter in batches."""

    def __init__(
        self,
        exporters: Sequence[SpanExporter],
        schedule_delay_s: float = 1.0,
        max_queue: int = 8192,
        max_batch: int = 512,
    ):
        if not exporters:
            raise ValueError("SpanBatcher needs at least one exporter")
        self._exporters = list(exporters)
        # Full batches go straight to the exporter when it has a non-blocking path (one exporter).
        self._nowait = exporters[0] if len(exporters) == 1 and hasattr(exporters[0], "export_nowait") else None
        self._delay_s = schedule_delay_s
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._shutdown = False
        self._refused = 0  # spans ended after shutdown
        self._init_thread_state()
        reinit = weakref.WeakMethod(self._init_thread_state)
        os.register_at_fork(after_in_child=lambda: (m := reinit()) and m())
        stop = weakref.WeakMethod(self.shutdown)
        atexit.register(lambda: (m := stop()) and m())

    def _init_thread_state(self) -> None:
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._flush_waiters: deque[_FlushWaiter] = deque()
        self._dropped = 0
        self._failed_exports = 0  # records a sink failed (export thread only; exporters with counts of their own apart)
        self._drops_logged = False
        self._losses_answered = 0  # spans lost (queue and exporters) when the last flush answered
        self._export_lock = threading.Lock()  # one exporting thread at a time: the batches stay in order
        self._thread = threading.Thread(target=self._run, name="kvscope-span-export", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    def on_end(self, span) -> None:
        queue = self._queue
        if len(queue) >= self._max_queue:
            self._dropped += 1
            return
        queue.append(span)
        if len(queue) >= self._max_batch:
            if self._nowait is not None:
                self._export_nowait()
            elif len(queue) == self._max_batch:
                self._wake.set()

    def hand_over(self) -> None:
        """Hand what is queued to the exporter now, if that cannot block (the helper's pipe): called
        at the end of each engine step, so no span waits for the delay in a process that may die
        before it ends (vLLM's shutdown can SIGTERM the engine core while it tears down, after its
        last step). With the export thread only, nothing: it exports on its schedule."""
        if self._queue and self._nowait is not None:
            self._export_nowait()

    def _export_nowait(self) -> None:
        """Hand a full batch to the exporter from this thread, if that cannot block; else wake
        the export thread (the exporter is not ready, or the export thread is exporting)."""
        exporter = self._nowait
        if not exporter.accepts_nowait or not self._export_lock.acquire(False):
            if not self._wake.is_set():
                self._wake.set()
            return
        queue = self._queue
        batch = [queue.popleft() for _ in range(min(self._max_batch, len(queue)))]
        try:
            exporter.export_nowait(batch)
        except Exception:  # a bug guard: the engine thread never sees an exporter fail
            logger.exception("kvscope: span exporter %r failed; its spans go through the export thread "
                             "from now on", exporter)
            self._nowait = None
            queue.extendleft(reversed(batch))
            self._wake.set()
        finally:
            self._export_lock.release()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export every span ended before this call; False if that took longer than the timeout, if
        an exporter's flush failed, or if spans were lost since the last flush that answered (the
        queue was full, or an exporter's `dropped_spans` grew: a helper process that died). Each
        loss makes one flush False, not every later one."""
        if self._shutdown:  # everything queued before it was exported then; only later spans are not
            return self._refused == 0
        waiter = _FlushWaiter()
        self._flush_waiters.append(waiter)
        self._wake.set()
        return waiter.done.wait(timeout_millis / 1000) and waiter.flushed

    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        # Nothing exports a span ended from now on: counted and said, not queued for ever. (An
        # instance attribute over the method: the hot path pays no check for it.)
        self.on_end = self._refuse
        self._wake.set()
        self._thread.join(timeout=30)
        for exporter in self._exporters:
            try:
                exporter.shutdown()
            except Exception:  # a sink that fails to close must not stop the engine's shutdown
                logger.exception("kvscope: span exporter %r failed to shut down", exporter)

    def _refuse(self, span) -> None:
        """`on_end` once shut down."""
        self._refused += 1
        if self._refused == 1:
            logger.warning("kvscope: a span ended after tracing was shut down is dropped; further ones "
                           "are not logged")

    # ------------------------------------------------------------ export thread
    def _run(self) -> None:
        # Exporters (HTTP, gRPC clients) must not produce spans of their own from this thread.
        attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        while True:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            # Waiters taken before draining: every span they wait for is already queued.
            waiters = [self._flush_waiters.popleft() for _ in range(len(self._flush_waiters))]
            with self._export_lock:
                self._drain()
                flushed = False
                if waiters:
                    # an exporter may hold spans of its own (a helper process), or lose some (one that died)
                    flushed = self._flush_exporters()
                    losses = self.lost_records
                    flushed = flushed and losses == self._losses_answered
                    self._losses_answered = losses
            for waiter in waiters:
                waiter.flushed = flushed
                waiter.done.set()
            if self._shutdown:
                with self._export_lock:
                    self._drain()
                for waiter in list(self._flush_waiters):
                    waiter.done.set()
                return

    def _drain(self) -> None:
        if self._nowait is not None:
            self._catch_up(self._nowait)
        queue, limit = self._queue, self._max_batch
        while queue:
            batch = [queue.popleft() for _ in range(min(limit, len(queue)))]
            failed = False
            for exporter in self._exporters:
                try:
                    result = exporter.export(batch)
                except Exception:  # kvscope's exporters log their own failures; this is a bug guard
                    logger.exception("kvscope: span exporter %r raised", exporter)
                    result = SpanExportResult.FAILURE
                # a sink that failed them (it logs why); the helper's exporter counts its own
                failed = failed or (result is not SpanExportResult.SUCCESS and not hasattr(exporter, "dropped_spans"))
            if failed:
                self._failed_exports += len(batch)
        if self._dropped and not self._drops_logged:
            self._drops_logged = True
            logger.warning(
                "kvscope: span queue full (%d spans): spans are dropped until the exporters keep up; "
                "further drops are not logged",
                self._max_queue,
            )

    def _catch_up(self, exporter) -> None:
        try:
            exporter.catch_up()  # what the engine thread's batches left behind (a full pipe, a failure)
        except Exception:
            logger.exception("kvscope: span exporter %r failed to catch up", exporter)

    def _flush_exporters(self) -> bool:
        flushed = True
        for exporter in self._exporters:
            try:
                # (the SDK's base `SpanExporter.force_flush` returns None: only False is a failure)
                flushed = exporter.force_flush() is not False and flushed
            except Exception:
                logger.exception("kvscope: span exporter %r failed to flush", exporter)
                flushed = False
        return flushed

    def lost_by_reason(self) -> dict[str, int]:
        """`lost_records` by why (`LOSS_REASONS`): an exporter that keeps its own count says why
        (`lost_by_reason`), or its losses count as the export helper's."""
        lost = {"sink_failed": self._failed_exports, "queue_full": self._dropped, "helper_lost": 0,
                "after_shutdown": self._refused}
        for exporter in self._exporters:
            by_reason = getattr(exporter, "lost_by_reason", None)
            if by_reason is not None:
                for reason, n in by_reason().items():
                    lost[reason] += n
            else:
                lost["helper_lost"] += getattr(exporter, "dropped_spans", 0)
        return lost

    @property
    def dropped_spans(self) -> int:
        """Spans this batcher dropped itself: its queue was full, or they ended after shutdown."""
        return self._dropped + self._refused

    @property
    def lost_records(self) -> int:
        """Every record (span) ended here that a sink will not get: this batcher's drops, the records
        its sinks failed to take, and what its exporters lost or had failed."""
        return sum(self.lost_by_reason().values())


class _FlushWaiter:
    """A `force_flush` call waiting for the export thread: whether everything got through."""

    __slots__ = ("done", "flushed")

    def __init__(self):
        self.done = threading.Event()
        self.flushed = True
