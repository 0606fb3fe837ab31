"""Tracing for the connector: its own spans, sinks, sampling and W3C propagation.

Never the global ``TracerProvider``: vLLM (and the user's process) may own it; the connector
must neither replace it nor depend on it. Spans still join vLLM's request trace because the
parent comes from the request's ``traceparent`` header, not from a shared provider. Nor an SDK
provider of its own: on the engine's hot path an ended span is a record (a tuple, see
`span_records`) handed to a `SpanBatcher` (a deque append); JSON or SDK spans are made from it
off the engine thread: by default in a helper process (`export_process`), with
``KVSCOPE_TRACE_EXPORT=thread`` on the batcher's thread. The connector's own spans go through
`open_span`/`end_span`/`record` with their `RecordKind`, and a load with its scans and lookup
through `end_load` as one record; `start_span` gives a general OpenTelemetry `Span` (a `LightSpan`):
the connector itself uses none, its tests check sampling and propagation through it.

Free when off: with no sink configured nothing is built, ``enabled`` is False, every span is
``INVALID_SPAN`` (a shared non-recording span) and carriers are None. The connector checks
``enabled`` (or whether its parent is a recording `SpanRef`) before reading a clock or building
values; users of `start_span` check ``span.is_recording()``.

Sinks (`sinks`): the trace file and OTLP export as the standard ``OTEL_*`` variables ask for it.

A request that sampling drops builds no span objects either: its spans are all one shared,
ended, non-recording span, so an unsampled request costs a trace id and a comparison.

Sampling, with ``trace_sample_ratio`` r (the rule of ``ParentBased(root=TraceIdRatioBased(r),
remote_parent_sampled=TraceIdRatioBased(r))``): children of a local span follow it; a remote parent
that is not sampled drops the span. The ratio is also applied under a sampled remote parent (an
upstream ``traceparent`` or our own carrier on the worker): the decision is a function of the trace
id alone, so the scheduler and every worker agree and a request's trace is kept or dropped whole,
and ``trace_sample_ratio`` means the fraction of requests traced whether or not the client sent a
``traceparent``. Without it, ``OTEL_TRACES_SAMPLER`` keeps its standard meaning, as vLLM's own tracer
reads it: a ``parentbased_*`` sampler follows a remote parent's sampled flag (the ratio decides new
traces only), a plain one applies its ratio whatever the parent says. A worker follows the
scheduler's carrier either way, because the scheduler sends one only for a sampled request.
"""

from __future__ import annotations

import logging
import os
import random
import time
import weakref
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from connector.telemetry.export_process import ExportProcess
from connector.telemetry.otel_env import (
    REMOTE_PARENT_AND_RATIO,
    REMOTE_PARENT_FOLLOWED,
    REMOTE_PARENT_IGNORED,
    check_otlp_env,
    exporter_warnings,
    sampler_from_env,
)
from connector.telemetry.sinks import (
    DEFAULT_SERVICE_NAME,
    SdkSpanExporter,
    Sinks,
    build_exporters,
    otlp_requested,
    resource_from_env,
    truthy,
)
from connector.telemetry.span_batcher import RECORD_FAILED, SpanBatcher
from connector.telemetry.span_records import GENERIC_SPAN, LOAD_PLAN, RecordKind, check_shape

logger = logging.getLogger(__name__)

# Batch processor settings: a short delay keeps trace files fresh for live dashboards, and bounds
# what an abort (vLLM's default `--shutdown-timeout 0` SIGKILLs the engine and the helper) loses.
# Under load full batches leave at once; the delay only times the tail.
_BATCH_SCHEDULE_DELAY_S = 0.2
_BATCH_MAX_QUEUE = 8192
# Records per export batch, and how many queued records wake the export thread early. Each wake
# takes the GIL from the engine thread; at one record per load, 512 costs the engine less than
# 128 or 32 (measured) while the helper still works alongside the engine (2048 did not).
_BATCH_SIZE = 512
# With the helper process, the engine thread hands each full batch to its pipe itself (no wake):
# at 1g/128, 64 costs the same engine CPU as 512 and less wall clock waiting for the helper
# (1.25 vs 1.33x the uninstrumented planner), 32 and 16 cost more CPU (marshal calls, writes).
_HELPER_BATCH_SIZE = 64

_PROPAGATOR = TraceContextTextMapPropagator()
# Where spans are encoded and exported: "process" (a helper process, the default) or "thread".
EXPORT_MODE_VARIABLE = "KVSCOPE_TRACE_EXPORT"


class KVScopeTracing:
    """The connector's tracer, sinks and propagation helpers (one per process)."""

    def __init__(self, processor=None, resource: Resource | None = None, sample_ratio: float = 1.0,
                 remote_parent: str = REMOTE_PARENT_AND_RATIO):
        # `processor` gets the record of every ended, sampled span (`on_end`); None means tracing
        # is off. No SDK TracerProvider/Tracer: records become SDK spans, if ever, on the export thread.
        self._processor = processor
        self.enabled: bool = processor is not None
        self.resource = resource if processor is not None else None
        self._ids = OsRandomIdGenerator() if processor is not None else None
        self._bound = trace_id_bound(sample_ratio)
        self._remote_parent = remote_parent  # how a remote parent samples (`otel_env.REMOTE_PARENT_*`)
        self._shutdown_done = False
        self._lost_told: dict[str, int] = {}  # lost span records `take_lost_records` has told of, by reason
        self._failed_records = 0  # records a recording fault lost (`record_failed`), not yet told of
        if processor is not None:  # a forked child's batcher counts its own from zero
            reset = weakref.WeakMethod(self._reset_lost_told)
            os.register_at_fork(after_in_child=lambda: (m := reset()) and m())
        # Every span of a request that sampling drops is this one shared, ended, non-recording
        # span (children of it too): an unsampled request costs a trace id and a comparison.
        self._dropped = LightSpan("kvscope.dropped", 0, 0, None, False, 0, processor)
        self._dropped.end_time = 0

    # ----------------------------------------------------------------- construction
    @classmethod
    def disabled(cls) -> KVScopeTracing:
        """Tracing that records nothing and builds nothing."""
        return cls(None)

    @classmethod
    def from_config(
        cls,
        trace_file: str | None,
        sample_ratio: float | None,
        env: Mapping[str, str] = os.environ,
        resource_attributes: Mapping[str, Any] | None = None,
    ) -> KVScopeTracing:
        """Build tracing from the connector config (``trace_file``, ``trace_sample_ratio``) and ``OTEL_*``.

        ``sample_ratio`` None means ``OTEL_TRACES_SAMPLER``'s ratio and remote-parent rule
        (`otel_env.sampler_from_env`), else 1.0. Raises ``ValueError`` for a ratio outside 0..1 and
        for ``OTEL_*`` values that are wrong (`otel_env`).
        ``resource_attributes`` join every span's resource (`resource_from_env`).
        """
        ratio = _check_ratio(sample_ratio)
        if truthy(env.get("OTEL_SDK_DISABLED")):
            if trace_file or otlp_requested(env):
                logger.warning("kvscope: OTEL_SDK_DISABLED is set: no spans are recorded (trace_file=%r is "
                               "not written)", trace_file)
            return cls.disabled()
        if not (trace_file or otlp_requested(env)):
            return cls.disabled()
        if otlp_requested(env):
            check_otlp_env(env)
        for warning in exporter_warnings(env):
            logger.warning(warning)
        remote_parent = REMOTE_PARENT_AND_RATIO
        if sample_ratio is None:
            ratio, remote_parent = sampler_from_env(env)
        resource = resource_from_env(env, resource_attributes)
        sinks = Sinks(trace_file or None, {k: v for k, v in env.items() if k.startswith("OTEL_")},
                      dict(resource.attributes))
        mode = export_mode(env)
        exporters = [ExportProcess(sinks)] if mode == "process" else build_exporters(sinks)
        if not exporters:
            return cls.disabled()
        batcher = SpanBatcher(exporters, schedule_delay_s=_BATCH_SCHEDULE_DELAY_S, max_queue=_BATCH_MAX_QUEUE,
                              max_batch=_HELPER_BATCH_SIZE if mode == "process" else _BATCH_SIZE)
        return cls(batcher, resource, ratio, remote_parent)

    @classmethod
    def for_exporter(
        cls,
        exporter: SpanExporter,
        sample_ratio: float = 1.0,
        *,
        resource: Resource | None = None,
    ) -> KVScopeTracing:
        """Tracing that hands every ended span synchronously to ``exporter`` as an SDK span (tests)."""
        resource = resource or Resource.create({"service.name": DEFAULT_SERVICE_NAME})
        return cls(SyncRecordProcessor(SdkSpanExporter(exporter, resource)), resource, _check_ratio(sample_ratio))

    # ----------------------------------------------------------------- spans
    def start_span(
        self,
        name: str,
        context: Parent | None = None,
        start_time: int | None = None,
    ) -> Span:
        """Start a span (caller ends it). ``INVALID_SPAN`` when disabled.

        ``context`` None starts a new trace (a request root); pass the request's parent (from
        ``context_of``, ``context_from_trace_headers`` or ``context_from_carrier``) for children.
        ``start_time`` is in ns since the epoch (``time.time_ns()``).
        """
        if self._processor is None:
            return trace.INVALID_SPAN
        decided = self._decide(context)
        if decided is None:
            return self._dropped
        trace_id, parent = decided
        return LightSpan(name, trace_id, self._ids.generate_span_id(), parent, True,
                         start_time if start_time is not None else time.time_ns(), self._processor)

    def _decide(self, context: Parent | None) -> tuple[int, Any] | None:
        """(trace id, parent) of a span started under ``context``, or None when sampling drops it.

        The parent is None (a new trace), a valid `SpanContext` (remote: a `traceparent` or a carrier),
        or a local kvscope span.
        """
        if type(context) is LightSpan or type(context) is SpanRef:  # a local parent decides for its children
            return (context.trace_id, context) if context.sampled else None
        parent = trace.get_current_span(context).get_span_context() if context is not None else None
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            if not parent.is_remote or self._remote_parent == REMOTE_PARENT_FOLLOWED:
                sampled = parent.trace_flags.sampled
            elif self._remote_parent == REMOTE_PARENT_IGNORED:  # a plain OTEL_TRACES_SAMPLER: the ratio alone
                sampled = self._keeps(trace_id)
            else:  # trace_sample_ratio: sampled upstream, and the ratio on the same trace id
                sampled = parent.trace_flags.sampled and self._keeps(trace_id)
            return (trace_id, parent) if sampled else None
        trace_id = self._ids.generate_trace_id()
        return (trace_id, None) if self._keeps(trace_id) else None

    def may_record(self, parent: Parent | None) -> bool:
        """False when nothing started under ``parent`` can record (tracing off, or its request was
        dropped by sampling): callers skip their span bookkeeping altogether."""
        return self._processor is not None and parent is not self._dropped

    def _keeps(self, trace_id: int) -> bool:
        return (trace_id & _TRACE_ID_LOW_BITS) < self._bound

    def record_span(
        self,
        name: str,
        context: Parent | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
    ) -> Span:
        """Record an already finished span whose interval was measured elsewhere (device events).

        Times are ns since the epoch (``time.time_ns()``, not ``perf_counter_ns``). ``context``
        None starts a new trace, as in ``start_span``; a worker whose job came without a carrier
        (tracing off, or the request not sampled) must therefore skip the call. Returns the span,
        ended, or a non-recording one (``context_of`` works on both). ``INVALID_SPAN`` when disabled.
        The span keeps ``attributes`` itself (a dict the caller no longer changes).
        """
        span = self.start_span(name, context=context, start_time=start_ns)
        if type(span) is not LightSpan or not span.sampled:  # tracing off, or the request dropped
            return span
        if attributes:
            span.attributes = attributes  # kept, not copied: callers pass a fresh dict
        span.end(end_ns if end_ns > start_ns else start_ns)
        return span

    # ----------------------------------------------------------------- the connector's own spans
    # The hot path: a `SpanRef` (ids only) while a span is open, one tuple when it ends.
    def open_span(self, parent: Parent | None, start_time: int | None = None) -> SpanRef | LightSpan:
        """Open a span that will end as a record (`end_span`); sampling as in ``start_span``.

        Returns a `SpanRef`, or the shared dropped span when sampling drops it (``may_record`` is
        then False for its children); ``INVALID_SPAN`` when tracing is off (callers on the hot path
        check ``may_record`` first and never get here then).
        """
        start = start_time if start_time is not None else time.time_ns()
        if type(parent) is SpanRef:  # the hot path: a child of an open kvscope span, sampled like it
            return SpanRef(parent.trace_id, self._ids.generate_span_id(), parent.span_id, parent.is_remote,
                           parent.trace_state, start)
        if self._processor is None:
            return trace.INVALID_SPAN
        if parent is None:  # the other hot path: a request's root (its lookup span), as `_decide` decides it
            trace_id = self._ids.generate_trace_id()
            if (trace_id & _TRACE_ID_LOW_BITS) >= self._bound:  # `_keeps`, inline
                return self._dropped
            return SpanRef(trace_id, self._ids.generate_span_id(), None, False, None, start)
        decided = self._decide(parent)
        if decided is None:
            return self._dropped
        trace_id, parent = decided
        if parent is None:
            return SpanRef(trace_id, self._ids.generate_span_id(), None, False, None, start)
        return SpanRef(trace_id, self._ids.generate_span_id(), parent.span_id, parent.is_remote,
                       parent.trace_state, start)

    def end_span(self, kind: RecordKind, span: SpanRef | LightSpan, end_ns: int, values: tuple) -> None:
        """End a span from `open_span` with its kind's attribute values; a dropped span is ignored."""
        if type(span) is SpanRef:
            start, state = span.start_time, span.trace_state
            self._processor.on_end((kind.code, span.trace_id, span.span_id, span.parent_span_id,
                                    span.parent_is_remote, state.to_header() if state else None,
                                    start, end_ns if end_ns > start else start, values))

    def record(self, kind: RecordKind, parent: Parent | None, start_ns: int, end_ns: int,
               values: tuple) -> SpanRef | LightSpan:
        """Record a finished span whose interval was measured elsewhere; returns it as a parent handle.

        ``parent`` None starts a new trace; a worker whose job came without a carrier (tracing off,
        or the request not sampled) must therefore skip the call.
        """
        span = self.open_span(parent, start_ns)
        self.end_span(kind, span, end_ns, values)
        return span

    def end_load(self, parent: SpanRef | None, start_ns: int, end_ns: int, values: tuple) -> TraceCarrier | None:
        """Record a request's load as one compound record (`span_records.LOAD_PLAN`: the load, its scans
        and the lookup; ``values`` as that kind describes) under ``parent`` (the lookup or upstream
        span, which sampling kept; None roots a new trace) and return the carrier that puts the
        workers' copy spans under the load (None when sampling drops the new trace).

        No span object under a parent: the load's id is drawn here, and the record is its only trace."""
        end = end_ns if end_ns > start_ns else start_ns
        if parent is None:  # rare (a load with no lookup span before it): the load is the trace's root
            root = self.open_span(None, start_ns)
            if type(root) is not SpanRef:
                return None
            self._processor.on_end((LOAD_PLAN, root.trace_id, root.span_id, None, False, None, start_ns, end, values))
            return (root.trace_id, root.span_id, None)
        state = parent.trace_state
        header = state.to_header() if state else None
        span_id = self._ids.generate_span_id()
        self._processor.on_end((LOAD_PLAN, parent.trace_id, span_id, parent.span_id, parent.is_remote, header,
                                start_ns, end, values))
        return (parent.trace_id, span_id, header)

    # ----------------------------------------------------------------- propagation
    def parent_from_trace_headers(self, headers: Mapping[str, str] | None) -> SpanRef | LightSpan | None:
        """The parent of a request's spans from its trace headers, decided once per request: None
        (no upstream trace: the request roots its own), the upstream span as a remote `SpanRef`, or
        the shared dropped span when sampling drops the trace."""
        context = self.context_from_trace_headers(headers)
        if context is None:
            return None
        decided = self._decide(context)
        if decided is None:
            return self._dropped
        upstream = decided[1]
        return SpanRef(upstream.trace_id, upstream.span_id, None, False, upstream.trace_state, 0, is_remote=True)

    def context_from_trace_headers(self, headers: Mapping[str, str] | None) -> Context | None:
        """Context of the request's upstream trace (vLLM's ``request.trace_headers``), or None."""
        if self._processor is None or not headers:
            return None
        return _extract({k.lower(): v for k, v in headers.items()})

    def context_of(self, span: Span) -> Parent | None:
        """A parent handle making ``span`` the parent of further spans of the same request.

        Also for a span dropped by sampling, so its children are dropped with it instead of
        starting new traces. None when disabled. For kvscope's own spans the handle is the
        span itself (no OTel ``Context`` to build on the hot path).
        """
        if self._processor is None:
            return None
        if type(span) is LightSpan or type(span) is SpanRef:
            return span
        if not span.get_span_context().is_valid:
            return None
        return trace.set_span_in_context(span)

    def carrier_of(self, span: Span) -> TraceCarrier | None:
        """What a worker needs to put its spans under ``span``: ``(trace id, span id, tracestate)``.

        The W3C ``traceparent`` fields as ints (``tracestate`` as its header text, or None): the
        carrier crosses vLLM's own metadata channel, not HTTP, and ints cost nothing to format
        on the engine's hot path. None when disabled or the span is not recording: the worker then
        builds no span.
        """
        if self._processor is None or not span.is_recording():
            return None
        if type(span) is SpanRef or type(span) is LightSpan:
            state = span.trace_state
            return (span.trace_id, span.span_id, state.to_header() if state else None)
        context = span.get_span_context()
        state = context.trace_state
        return (context.trace_id, context.span_id, state.to_header() if state else None)

    def parent_from_carrier(self, carrier: TraceCarrier | None) -> SpanRef | LightSpan | None:
        """The parent a carrier stands for, as a handle for `record`/`open_span` (the worker's copy
        spans): the scheduler's span as a remote `SpanRef`, the dropped span when the sample ratio
        drops its trace (the decision `context_from_carrier` leads to, made once), or None."""
        if self._processor is None or not carrier:
            return None
        trace_id, span_id, state = carrier
        # a carrier's span is sampled: a parent-based sampler follows it, the others ask the ratio (as
        # the scheduler did on the same trace id)
        if self._remote_parent != REMOTE_PARENT_FOLLOWED and not self._keeps(trace_id):
            return self._dropped
        return SpanRef(trace_id, span_id, None, False, TraceState.from_header([state]) if state else None, 0,
                       is_remote=True)

    def context_from_carrier(self, carrier: TraceCarrier | None) -> Context | None:
        """The parent a carrier from ``carrier_of`` stands for (worker side: a remote, sampled
        span, as the W3C propagator would extract it from the span's headers), or None."""
        if self._processor is None or not carrier:
            return None
        trace_id, span_id, state = carrier
        parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=_SAMPLED,
                             trace_state=TraceState.from_header([state]) if state else None)
        return trace.set_span_in_context(NonRecordingSpan(parent))

    # ----------------------------------------------------------------- lifecycle
    def end_step(self) -> None:
        """An engine step ends: spans recorded so far leave this process now, without waiting
        (`SpanBatcher.hand_over`)."""
        if self._processor is not None:
            self._processor.hand_over()

    def record_failed(self, records: int = 1) -> None:
        """A fault while recording (a bug: `failures.telemetry_failed` logs it) lost these records."""
        if self._processor is not None:
            self._failed_records += records

    def take_lost_records(self) -> dict[str, int]:
        """Span records lost since the last call, by why (`SpanBatcher.lost_by_reason`: a sink that
        failed them, a full queue, an export helper that fell behind or died, records ended after
        shutdown; and `record_failed`; reasons with none left out), for
        `kvscope_dropped_trace_records_total`. A record is a span, or a load with its scans and lookup."""
        new = {}
        if self._failed_records:
            new[RECORD_FAILED], self._failed_records = self._failed_records, 0
        by_reason = getattr(self._processor, "lost_by_reason", None)
        if by_reason is None:
            return new
        for reason, lost in by_reason().items():
            told = self._lost_told.get(reason, 0)
            if lost > told:  # (never less: a count read mid-update is told later, not twice)
                new[reason] = lost - told
                self._lost_told[reason] = lost
        return new

    def _reset_lost_told(self) -> None:
        self._lost_told = {}
        self._failed_records = 0  # the parent's to tell

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        """Export every span ended so far; False on a timeout or a loss (`SpanBatcher.force_flush`),
        also after shutdown, once spans ended after it were dropped."""
        if self._processor is None:
            return True
        return self._processor.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Flush and stop the sinks; idempotent. Spans ended afterwards are dropped and counted
        (`take_lost_records`: after_shutdown)."""
        if self._processor is None or self._shutdown_done:
            return
        self._shutdown_done = True
        self._processor.shutdown()


def export_mode(env: Mapping[str, str]) -> str:
    """Where spans are encoded and exported (``KVSCOPE_TRACE_EXPORT``): "process" or "thread";
    raises ``ValueError`` naming the accepted values."""
    raw = env.get(EXPORT_MODE_VARIABLE)
    mode = (raw or "process").strip().lower()
    if mode not in ("process", "thread"):
        raise ValueError(f"{EXPORT_MODE_VARIABLE}={raw!r} is invalid: accepted are 'process' "
                         "(spans are encoded in a helper process, the default) and 'thread'")
    return mode


class SyncRecordProcessor:
    """Hands each record to an exporter at once, on the caller's thread (tests: an in-memory
    exporter sees a span as soon as it ends, as with the SDK's `SimpleSpanProcessor`)."""

    def __init__(self, exporter: SpanExporter):
        self._exporter = exporter

    def on_end(self, record: tuple) -> None:
        check_shape(record)  # a miscounted record fails here, in the test that made it
        self._exporter.export((record,))

    def hand_over(self) -> None:
        pass  # every record left at once

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._exporter.shutdown()


class OsRandomIdGenerator(IdGenerator):
    """Trace and span ids from a private generator seeded by the OS, not Python's global
    `random`: vLLM seeds that one (seed 0 by default), so the SDK's default generator would
    repeat the same ids in every run. One `os.urandom` per process (and again after a fork),
    since a system call per id is slow on some kernels/sandboxes."""

    def __init__(self):
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._rng = random.Random(int.from_bytes(os.urandom(32), "big"))

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._rng.getrandbits(128) or 1


_TRACE_ID_LOW_BITS = (1 << 64) - 1


def trace_id_bound(ratio: float) -> int:
    """Keep a trace when the low 64 bits of its id are below this (as `TraceIdRatioBased`): the
    decision is a function of the trace id alone, so the scheduler and every worker agree and a
    request's trace is kept or dropped whole."""
    return round(ratio * (1 << 64))


class SpanRef:
    """An open (or recorded) kvscope span of a known kind: the ids its record, its children and
    the worker's carrier need, and nothing else. Always sampled: a dropped span is never a SpanRef."""

    __slots__ = ("trace_id", "span_id", "parent_span_id", "parent_is_remote", "trace_state", "start_time",
                 "is_remote")

    sampled = True

    def __init__(self, trace_id, span_id, parent_span_id, parent_is_remote, trace_state, start_time,
                 is_remote=False):
        # is_remote: True for an upstream span standing in as a parent (`parent_from_trace_headers`),
        # never for a span of this process; as a parent a SpanRef reads like a SpanContext
        self.is_remote = is_remote
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.parent_is_remote = parent_is_remote
        self.trace_state = trace_state  # W3C TraceState of the trace, or None
        self.start_time = start_time

    def is_recording(self) -> bool:
        return True

    def get_span_context(self) -> SpanContext:
        return SpanContext(self.trace_id, self.span_id, is_remote=self.is_remote, trace_flags=_SAMPLED,
                           trace_state=self.trace_state)


class LightSpan(Span):
    """A general OpenTelemetry span with plain fields, no SDK machinery.

    The OpenTelemetry SDK spends tens of microseconds per span (sampler, attribute cleaning,
    locks); that is more than a group scan. A `LightSpan` costs a few and ends as a record
    (`span_records.GENERIC_SPAN`); kvscope's own spans skip even that (`KVScopeTracing.open_span`).
    """

    __slots__ = ("name", "trace_id", "span_id", "parent", "sampled", "start_time", "end_time",
                 "attributes", "_processor", "_trace_state", "_context")

    is_remote = False  # as a parent, a LightSpan reads like a local SpanContext to the encoders

    def __init__(self, name, trace_id, span_id, parent, sampled, start_time, processor):
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent = parent  # None, a remote SpanContext, or the parent LightSpan
        self.sampled = sampled
        self.start_time = start_time
        self.end_time = None
        self.attributes = {}
        self._processor = processor
        self._trace_state = parent.trace_state if parent is not None else None  # W3C tracestate
        self._context = None  # SpanContext, built on first use (parents, carriers, processors ask)

    def is_recording(self) -> bool:
        return self.sampled and self.end_time is None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.is_recording():
            self.attributes.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.is_recording():
            self.attributes[key] = value

    @property
    def trace_state(self):
        return self._trace_state

    def get_span_context(self) -> SpanContext:
        if self._context is None:
            self._context = SpanContext(self.trace_id, self.span_id, is_remote=False,
                                        trace_flags=_SAMPLED if self.sampled else _NOT_SAMPLED,
                                        trace_state=self._trace_state)
        return self._context

    # The rest of the Span API: kvscope spans carry attributes only.
    def add_event(self, name, attributes=None, timestamp=None) -> None:
        pass

    def update_name(self, name: str) -> None:
        if self.is_recording():
            self.name = name

    def set_status(self, status, description=None) -> None:
        pass

    def record_exception(self, exception, attributes=None, timestamp=None, escaped=False) -> None:
        pass

    @property
    def context(self) -> SpanContext:  # what span processors look at
        return self.get_span_context()

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time if end_time is not None else time.time_ns()
        if self.sampled:
            parent, state = self.parent, self._trace_state
            self._processor.on_end((GENERIC_SPAN.code, self.trace_id, self.span_id,
                                    parent.span_id if parent is not None else None,
                                    parent is not None and parent.is_remote,
                                    state.to_header() if state else None,
                                    self.start_time, self.end_time, (self.name, self.attributes)))


# How a span's identity travels to the workers (`carrier_of`): trace id, span id, tracestate header.
TraceCarrier = tuple[int, int, str | None]

# What `start_span`'s context may be: an OTel Context (request headers, a worker's carrier) or a
# kvscope span itself (`context_of`), which costs nothing to make on the hot path.
Parent = Context | LightSpan | SpanRef


_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)


# --------------------------------------------------------------------- helpers
def _extract(carrier: Mapping[str, str]) -> Context | None:
    context = _PROPAGATOR.extract(carrier)
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


def _check_ratio(sample_ratio: float | None) -> float:
    if sample_ratio is None:
        return 1.0
    try:
        ratio = float(sample_ratio)
    except (TypeError, ValueError):
        ratio = float("nan")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"trace_sample_ratio={sample_ratio!r} is invalid: accepted is a number from 0 to 1")
    return ratio
