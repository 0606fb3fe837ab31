"""Ended kvscope spans as plain tuples: what the engine's hot path hands to the span batcher.

An object per span with an attribute dict costs microseconds to build on the engine thread,
as much as a small group scan. A record is one tuple of ints and strings instead; names and
attribute keys come from its kind, and the exporter (the export helper process, or the export
thread) turns it into JSON or an SDK span.

A record is ``(kind, trace_id, span_id, parent_span_id, parent_is_remote, trace_state, start_ns,
end_ns, values)``:

- ``kind``: the code of a `RecordKind` (`KINDS[code]`); its span name and attribute keys.
- ``parent_span_id``: None for a trace's root; ``parent_is_remote`` True when the parent came from
  another process (an upstream ``traceparent``, or the scheduler's carrier on a worker).
- ``trace_state``: the W3C ``tracestate`` header of the trace, or None.
- ``values``: the attribute values in the order of the kind's keys; for `GENERIC_SPAN` (spans made
  through the OpenTelemetry span API) ``(name, attributes dict)``.

Only sampled spans become records, so every record's trace flags are "sampled".

One compound record stands for several spans: a `LOAD_PLAN` record is a request's load with its
per-group scans (and its lookup, when it was not recorded alone), handed over as one tuple because
each record costs the engine thread about a microsecond. `expand_records` turns it back into the
plain records of those spans before anything encodes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

KIND, TRACE_ID, SPAN_ID, PARENT_ID, PARENT_REMOTE, TRACE_STATE, START, END, VALUES = range(9)


@dataclass(frozen=True)
class RecordKind:
    """A span kind of the contract (DESIGN.md §2): its name and attribute keys with value types."""

    code: int
    name: str
    attributes: tuple[tuple[str, type], ...]  # (key, int or str), in the order of a record's values
    error: str | None = None  # spans of this kind have status ERROR with this message

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.attributes)


GENERIC_SPAN = RecordKind(0, "", ())
LOOKUP_SPAN = RecordKind(1, "kvscope.lookup", (
    ("kvscope.request.id", str), ("kvscope.tokens.queried", int), ("kvscope.tokens.hit", int),
    ("kvscope.miss.reason", str),  # why it served no more (`connector.miss_reasons`)
    ("kvscope.tokens.local", int)))  # vLLM's device prefix-cache hit before it (not queried), block-aligned
LOAD_SPAN = RecordKind(2, "kvscope.load", (
    ("kvscope.request.id", str), ("kvscope.tokens.local", int), ("kvscope.tokens.external", int),
    ("kvscope.groups", int)))
SCAN_SPAN = RecordKind(3, "kvscope.group.scan", (
    ("kvscope.group.index", int), ("kvscope.group.kind", str), ("kvscope.group.blocks.total", int),
    ("kvscope.group.blocks.null_skipped", int), ("kvscope.group.blocks.pending", int),
    ("kvscope.group.blocks.start", int)))
STORE_SPAN = RecordKind(4, "kvscope.store", (
    ("kvscope.request.id", str), ("kvscope.groups", int), ("kvscope.blocks", int)))
COPY_SPAN = RecordKind(5, "kvscope.group.copy", (
    ("kvscope.group.index", int), ("kvscope.group.kind", str), ("kvscope.copy.direction", str),
    ("kvscope.copy.blocks", int), ("kvscope.copy.bytes", int), ("kvscope.worker.rank", int),
    ("kvscope.request.id", str)))
# A copy that failed on this worker (a load vLLM then recomputes, a store that is dropped): the
# copy span with status ERROR, its blocks and bytes 0, so replays see why a hit loaded nothing.
FAILED_COPY_SPAN = RecordKind(6, COPY_SPAN.name, COPY_SPAN.attributes,
                              error="copy failed on this worker: a load is recomputed, a store dropped")
# How long kvscope deferred a request's load for device KV room (`connector.load_admission`): the wait
# lies just before the span's start. On the lookup span vLLM admitted the request on; on the load span
# of a request resumed after preemption, whose lookup has no span. Kinds apart from LOOKUP_SPAN and
# LOAD_SPAN, so that the many spans never deferred carry (and encode) nothing more.
DEFERRAL_ATTRIBUTES = (
    ("kvscope.deferred.lookups", int),  # vLLM's lookups kvscope answered "not yet" before admitting it
    ("kvscope.deferred.wait_us", int))  # from the first of them to this span's start
DEFERRED_LOOKUP_SPAN = RecordKind(7, LOOKUP_SPAN.name, LOOKUP_SPAN.attributes + DEFERRAL_ATTRIBUTES)
DEFERRED_LOAD_SPAN = RecordKind(8, LOAD_SPAN.name, LOAD_SPAN.attributes + DEFERRAL_ATTRIBUTES)
# A wait for device KV room that no lookup or load span tells, as the span itself. Either the request ended
# (a client gave up) while kvscope deferred its load: vLLM never admitted it (nor counted its lookup). Or,
# resumed after preemption (its lookups get no span: vLLM counts them apart), vLLM admitted it with nothing
# to load (its hit left the tier, or vLLM's device cache covered it): no load span follows.
WAIT_ENDED, WAIT_ADMITTED = DEFERRAL_OUTCOMES = ("ended", "admitted")
DEFERRAL_WAIT_SPAN = RecordKind(9, "kvscope.deferral", (
    ("kvscope.request.id", str),
    ("kvscope.tokens.external", int),  # the tokens its load would have brought (at its last deferred lookup)
    *DEFERRAL_ATTRIBUTES,  # the wait: the span's own length
    ("kvscope.deferred.outcome", str)))  # how the wait ended: `DEFERRAL_OUTCOMES`
KINDS = (GENERIC_SPAN, LOOKUP_SPAN, LOAD_SPAN, SCAN_SPAN, STORE_SPAN, COPY_SPAN, FAILED_COPY_SPAN,
         DEFERRED_LOOKUP_SPAN, DEFERRED_LOAD_SPAN, DEFERRAL_WAIT_SPAN)  # by code
# A resource attribute of every kvscope span: the engine that recorded it, as vLLM's metrics label it
# (`engine`: vLLM's data-parallel index). Each engine has its own host tier.
ENGINE_RESOURCE_ATTRIBUTE = "kvscope.engine"

# The compound load record's kind code (not in KINDS: it is never encoded as itself). Its ids,
# parent, trace state and times are the load span's; its values are
# ``(request id, local tokens, external tokens, groups, scans, lookup)``, with the two
# `DEFERRED_LOAD_SPAN` values after them when the load span tells a deferral, and
# - ``scans``: one ``(start_ns, end_ns, *SCAN_SPAN values)`` per group, in the load's group order;
# - ``lookup``: None, or ``(span_id, parent_span_id, parent_is_remote, start_ns, end_ns, queried, hit,
#   miss reason, local tokens)``, with the two `DEFERRED_LOOKUP_SPAN` values after them when the
#   request's load was deferred.
LOAD_PLAN = 10

_LOOKUP_VALUES = len(LOOKUP_SPAN.attributes) - 1  # a compound record's lookup values: all but the request id
_MASK64 = (1 << 64) - 1


def child_span_id(parent_span_id: int, index: int) -> int:
    """The span id of a load's ``index``-th scan: SplitMix64 of the load's (random) span id.

    Derived, not drawn, so that the engine thread draws one id per load and every process that
    expands the record (the export helper, the engine's export thread, a test) writes the same
    ids. SplitMix64 is a bijection of 64-bit ints: the scans of one load never share an id.
    """
    z = (parent_span_id + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) or 1


def expand_records(records) -> list[tuple]:
    """The plain records of a batch: compound `LOAD_PLAN` records become their lookup, scan and
    load spans (in the order they ended), every other record passes through."""
    out: list[tuple] = []
    for r in records:
        if r[KIND] != LOAD_PLAN:
            out.append(r)
            continue
        _, trace_id, span_id, parent_id, parent_remote, state, start, end, values = r
        req_id, local, external, groups, scans, lookup, *deferral = values
        # Times are the wall clock's, read on the hot path unclamped: a clock stepped back would end a
        # span before its start, which OTLP consumers reject; `end_span` and `end_load` clamp theirs.
        if lookup is not None:
            lookup_id, lookup_parent, lookup_remote, lookup_start, lookup_end, *lookup_values = lookup
            kind = LOOKUP_SPAN.code if len(lookup_values) == _LOOKUP_VALUES else DEFERRED_LOOKUP_SPAN.code
            out.append((kind, trace_id, lookup_id, lookup_parent, lookup_remote, state,
                        lookup_start, max(lookup_start, lookup_end), (req_id, *lookup_values)))
        for i, scan in enumerate(scans):
            out.append((SCAN_SPAN.code, trace_id, child_span_id(span_id, i), span_id, False, state,
                        scan[0], max(scan[0], scan[1]), scan[2:]))
        if deferral:
            out.append((DEFERRED_LOAD_SPAN.code, trace_id, span_id, parent_id, parent_remote, state, start, end,
                        (req_id, local, external, groups, *deferral)))
        else:
            out.append((LOAD_SPAN.code, trace_id, span_id, parent_id, parent_remote, state, start, end,
                        (req_id, local, external, groups)))
    return out


def check_shape(record: tuple) -> None:
    """Raise ValueError when ``record``'s values do not match its kind's attributes in number.

    Values are positional: one too few fails a trace-file batch deep in its encoder, one too many is
    dropped by the SDK path's `zip`, and a compound record's lookup of the wrong length is read as the
    other lookup kind. Checked where records are handed over synchronously (tests), not on the hot path.
    """
    kind, values = record[KIND], record[VALUES]
    if kind == GENERIC_SPAN.code:
        return
    if kind != LOAD_PLAN:
        _check_count(KINDS[kind], len(values))
        return
    if len(values) not in (6, 6 + len(DEFERRAL_ATTRIBUTES)):
        raise ValueError(f"a load record has {len(values)} values: expected 6, or 8 when deferred")
    for scan in values[4]:
        _check_count(SCAN_SPAN, len(scan) - 2)
    lookup = values[5]
    if lookup is not None and len(lookup) - 5 not in (_LOOKUP_VALUES, _LOOKUP_VALUES + len(DEFERRAL_ATTRIBUTES)):
        raise ValueError(f"a load record's lookup has {len(lookup) - 5} values after its ids and times: expected "
                         f"{_LOOKUP_VALUES} ({', '.join(LOOKUP_SPAN.keys[1:])}), with the deferral's 2 after them "
                         "when deferred")


def _check_count(kind: RecordKind, count: int) -> None:
    if count != len(kind.attributes):
        raise ValueError(f"a {kind.name} record has {count} values: expected {len(kind.attributes)} "
                         f"({', '.join(kind.keys)})")


def record_name(record: tuple) -> str:
    kind = record[KIND]
    return record[VALUES][0] if kind == GENERIC_SPAN.code else KINDS[kind].name


def record_attributes(record: tuple) -> dict[str, Any]:
    kind = record[KIND]
    if kind == GENERIC_SPAN.code:
        return dict(record[VALUES][1])
    return dict(zip(KINDS[kind].keys, record[VALUES]))


_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)


def _status(record: tuple) -> Status:
    error = KINDS[record[KIND]].error
    return Status(StatusCode.ERROR, error) if error else _UNSET


def _unicode(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (an id decoded with surrogateescape) made the
    OTLP encoder drop the attribute and log an error per span; it becomes "?", as in the trace file."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def to_readable_span(record: tuple, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """The SDK span a record stands for (for SDK exporters: OTLP, in-memory)."""
    header = record[TRACE_STATE]
    trace_state = TraceState.from_header([header]) if header else None
    trace_id = record[TRACE_ID]
    parent = None
    if record[PARENT_ID] is not None:
        parent = SpanContext(trace_id, record[PARENT_ID], is_remote=record[PARENT_REMOTE],
                             trace_flags=_SAMPLED, trace_state=trace_state)
    return ReadableSpan(
        name=record_name(record),
        context=SpanContext(trace_id, record[SPAN_ID], is_remote=False, trace_flags=_SAMPLED,
                            trace_state=trace_state),
        parent=parent,
        resource=resource,
        attributes={key: _unicode(value) if type(value) is str else value
                    for key, value in record_attributes(record).items()},
        kind=SpanKind.INTERNAL,
        status=_status(record),
        start_time=record[START],
        end_time=record[END],
        instrumentation_scope=scope,
    )
