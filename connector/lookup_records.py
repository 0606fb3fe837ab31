"""Host-tier lookups as the telemetry tells them: counted and traced once per request, when vLLM first
schedules it, as vLLM counts its own prefix-cache queries.

The scheduler (`scheduler.py`) makes a `Lookup` at each `get_num_new_matched_tokens` and hands the
first-scheduled request's to `LookupRecords.record`: an entry for the step's stats, and the lookup span
(or, when a load follows, the lookup part of the load's record). `record_wait_span` tells a wait for
device KV room that no lookup or load span tells. The tracing is the scheduler's, passed in at each call:
it may be swapped on a running scheduler (tracing toggled).
"""

from __future__ import annotations

from dataclasses import dataclass

from .load_admission import Deferral
from .miss_reasons import NOT_TAKEN, Miss, past_kept_tokens
from .telemetry.failures import telemetry_failed
from .telemetry.span_records import DEFERRAL_WAIT_SPAN, DEFERRED_LOOKUP_SPAN, LOOKUP_SPAN
from .telemetry.tracing import SpanRef


@dataclass(slots=True)
class Lookup:
    """One answer of `get_num_new_matched_tokens`, kept until vLLM schedules the request."""

    local_tokens: int
    external_tokens: int
    start_ns: int
    end_ns: int
    miss: Miss  # what the tier did not serve, and why, as the index stood at the lookup
    deferred: Deferral | None = None  # how long kvscope deferred the request's load before this lookup


def deferral_values(deferral: Deferral, wait_end_ns: int) -> tuple[int, int]:
    """The `kvscope.deferred.*` values of the span that tells a deferred load's wait: the wait ends at
    its start (`DEFERRED_LOOKUP_SPAN`, `DEFERRED_LOAD_SPAN`) or its end (`DEFERRAL_WAIT_SPAN`)."""
    return deferral.lookups, max(0, wait_end_ns - deferral.first_ns) // 1000


class LookupRecords:
    """The first-scheduled requests' lookups: ``log`` holds one ``(tokens queried, tokens hit, its
    lookup)`` per request for the stats (a list append on the planning path, folded into the stats
    payload once per stats interval); ``unsettled`` the ones counted only once vLLM's device hit is
    known (`settle`)."""

    def __init__(self):
        self.log: list[tuple[int, int, Lookup]] = []
        self.unsettled: list[tuple[object, Lookup]] = []  # (the request's state, its lookup)

    def record(self, tracing, state, lookup: Lookup, hit: int) -> tuple | None:
        """Count a first-scheduled request's lookup (``hit``: the tokens vLLM takes of it) and trace it
        (`span`: the lookup part of its load's record, when one follows)."""
        request = state.request
        queried = request.num_tokens - lookup.local_tokens
        self.log.append((queried, hit, lookup))
        if not tracing.enabled:
            return None
        # why the hit stopped where it did; vLLM taking less than was found is its own reason
        reason = lookup.miss.reason if hit >= lookup.external_tokens else NOT_TAKEN
        try:
            return self.span(tracing, state, request.request_id, lookup, queried, hit, reason)
        except Exception:  # a load may follow, and the step's stores: they must go on (`telemetry_failed`)
            telemetry_failed("the lookup span")
            tracing.record_failed()
            return None

    def settle(self, tracing, computed: dict[str, int]) -> None:
        """Count and trace the ``unsettled`` lookups (requests first scheduled this step with no load)
        from the device hit vLLM kept (``computed``: their computed tokens as scheduled), as vLLM counts
        its queries. vLLM asked with that hit rounded down to a device block: the tokens it kept past
        that were not looked up after all, and the tier's hit, if any, lay within them (vLLM took none
        of it)."""
        for state, lookup in self.unsettled:
            kept = computed.get(state.request.request_id, lookup.local_tokens) - lookup.local_tokens
            if kept > 0:
                within = min(kept, lookup.external_tokens)
                lookup = Lookup(lookup.local_tokens + kept, lookup.external_tokens - within, lookup.start_ns,
                                lookup.end_ns, past_kept_tokens(lookup.miss, kept - within), lookup.deferred)
            self.record(tracing, state, lookup, 0)
        self.unsettled.clear()

    def span(self, tracing, state, req_id, lookup, queried, hit, miss_reason: str) -> tuple | None:
        """The request's lookup span: recorded at once when no load follows (``hit`` 0); otherwise
        returned as the lookup part of the load's record (`span_records.LOAD_PLAN`). None when
        sampling drops the request."""
        span = tracing.open_span(state.trace_context, lookup.start_ns)
        if state.trace_context is None:
            # No incoming trace: the lookup span roots this request's own trace (or drops it whole).
            state.trace_context = span
        if type(span) is not SpanRef:
            return None
        deferral = lookup.deferred
        if not hit:
            if deferral is None:
                tracing.end_span(LOOKUP_SPAN, span, lookup.end_ns,
                                 (req_id, queried, hit, miss_reason, lookup.local_tokens))
            else:
                tracing.end_span(DEFERRED_LOOKUP_SPAN, span, lookup.end_ns,
                                 (req_id, queried, hit, miss_reason, lookup.local_tokens,
                                  *deferral_values(deferral, lookup.start_ns)))
            return None
        record = (span.span_id, span.parent_span_id, span.parent_is_remote, span.start_time, lookup.end_ns,
                  queried, hit, miss_reason, lookup.local_tokens)
        return record if deferral is None else record + deferral_values(deferral, lookup.start_ns)


def record_wait_span(tracing, request, state, deferral: Deferral, end_ns: int, outcome: str) -> None:
    """The span of a wait for device KV room no lookup or load span tells (`DEFERRAL_WAIT_SPAN`): the
    request ended waiting, or was resumed and admitted with nothing to load (``outcome``). Under the
    request's other spans (``state``: one admitted before, then preempted, deferred on resuming) and
    sampled like them; else in the trace it came with."""
    try:
        parent = state.trace_context if state is not None and state.trace_context is not None else \
            tracing.parent_from_trace_headers(getattr(request, "trace_headers", None))
        if tracing.may_record(parent):
            tracing.record(DEFERRAL_WAIT_SPAN, parent, deferral.first_ns, end_ns,
                           (request.request_id, deferral.load_tokens, *deferral_values(deferral, end_ns), outcome))
    except Exception:  # the request's end (or its scheduling) must go on (`telemetry_failed`)
        telemetry_failed("the span of a wait for device KV room")
        tracing.record_failed()
