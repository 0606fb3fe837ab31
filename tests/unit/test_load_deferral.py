"""The scheduler side defers a load that could stall vLLM (`load_admission`), with vLLM's objects stood in
for: the real vLLM scheduler replays the stall and its end in `tests/compat/test_vllm_scheduler_loop.py`."""

from __future__ import annotations

import time
from types import SimpleNamespace

from connector.load_admission import Deferral
from connector.lookup_records import deferral_values
from connector.scheduler import KVScopeScheduler
from connector.telemetry.testing import in_memory_tracing
from connector.telemetry.tracing import KVScopeTracing
from tests.unit.test_store_planning import B, BS, LAYOUTS, _ids, _output, _report, _state, _stored


def _scheduler(num_gpu_blocks: int, tracing: KVScopeTracing | None = None) -> KVScopeScheduler:
    manager = SimpleNamespace(block_pool=SimpleNamespace(num_gpu_blocks=num_gpu_blocks))
    return KVScopeScheduler(LAYOUTS, offload_block_size=B, hash_block_size=BS, num_slots=16, slot_bytes=1024,
                            world_size=1, tracing=tracing or KVScopeTracing.disabled(),
                            kv_cache_manager_getter=lambda: manager)


def _admit_with_load(sched, request, hit: int) -> None:
    assert sched.get_num_new_matched_tokens(request, 0) == (hit, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), hit)


def _ran(sched, *req_ids) -> list:
    """A step that schedules ``req_ids`` to run; its load jobs."""
    output = _output()
    output.num_scheduled_tokens = {req_id: 1 for req_id in req_ids}
    return sched.build_connector_meta(output).loads


def _tier_with_a_prefix() -> tuple[KVScopeScheduler, KVScopeScheduler]:
    """Two schedulers whose tiers hold a 128-token prefix: 47 usable device blocks, and 48."""
    scheds = _scheduler(48), _scheduler(49)  # less the null block
    for sched in scheds:
        _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    return scheds


def test_a_load_that_could_stall_vllm_waits_uncounted_until_the_load_before_it_runs():
    """Requests of 192 tokens: 12 blocks at most in each of two groups with 16-token blocks, 24 in all.
    Two fit in 48 usable blocks, not in 47."""
    tight, roomy = _tier_with_a_prefix()
    for sched in tight, roomy:
        _admit_with_load(sched, _state("first", 192).request, 128)
    second = _state("second", 192).request
    assert roomy.get_num_new_matched_tokens(second, 0) == (128, True)
    assert tight.get_num_new_matched_tokens(second, 0) == (None, False)  # vLLM asks again next step
    (load,) = _ran(tight)  # the first one's load, its request waiting for it
    assert tight.get_num_new_matched_tokens(second, 0) == (None, False)
    _report(tight, load)
    assert tight.get_num_new_matched_tokens(second, 0) == (None, False)  # loaded, not yet run
    _ran(tight, "first")
    assert tight.get_num_new_matched_tokens(second, 0) == (128, True)
    # counted once, as vLLM counts it: when it admits the request
    tight.update_state_after_alloc(second, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 128)
    data = tight.take_stats().data
    assert data["lookup_tokens"] == 2 * 192 and data["hit_tokens"] == 2 * 128


def test_a_request_with_nothing_to_load_never_waits():
    tight, _ = _tier_with_a_prefix()
    _admit_with_load(tight, _state("first", 192).request, 128)
    miss = _state("miss", 192).request
    miss.block_hashes = [f"x{i}" for i in range(12)]
    assert tight.get_num_new_matched_tokens(miss, 0) == (0, False)


def test_a_request_vllm_takes_no_hit_from_is_never_deferred():
    """vLLM takes none of a connector's hit for a request asking for prompt logprobs (0.32's and 0.33's
    `skip_reading_prefix_cache`, 0.34's `skip_reading_external_kv`): its lookup answers at once (the hit
    counted as not taken) instead of waiting for loads it would not add to, or holding back the loads
    behind it. A request of the same prompt without the flag still waits."""
    for flag in ("skip_reading_prefix_cache", "skip_reading_external_kv"):
        tight, _ = _tier_with_a_prefix()
        _admit_with_load(tight, _state("first", 192).request, 128)
        tight.take_stats()
        logprobs = _state("logprobs", 192).request
        setattr(logprobs, flag, True)
        assert tight.get_num_new_matched_tokens(logprobs, 0) == (128, True), flag
        assert _deferred_loads(tight) is None
        ordinary = _state("ordinary", 192).request
        setattr(ordinary, flag, False)
        assert tight.get_num_new_matched_tokens(ordinary, 0) == (None, False), flag
        assert _deferred_loads(tight) == 1


def test_a_load_aborted_before_it_ran_makes_room():
    tight, _ = _tier_with_a_prefix()
    first = _state("first", 192).request
    _admit_with_load(tight, first, 128)
    second = _state("second", 192).request
    assert tight.get_num_new_matched_tokens(second, 0) == (None, False)
    tight.request_finished(first)
    assert tight.get_num_new_matched_tokens(second, 0) == (128, True)


def _deferred_loads(sched) -> int | None:
    """The deferred loads the scheduler's stats report now (None: no such key)."""
    stats = sched.take_stats()
    return None if stats is None else stats.data.get("deferred_loads")


def test_the_stats_count_each_deferred_load_once_however_many_steps_it_waits():
    """`kvscope_deferred_loads_total`: a load is counted when first deferred, not again each step vLLM
    asks, and no key at all is reported while none waits (as with evictions)."""
    tight, roomy = _tier_with_a_prefix()
    for sched in tight, roomy:
        _admit_with_load(sched, _state("first", 192).request, 128)
    assert _deferred_loads(tight) is None
    second, third = _state("second", 192).request, _state("third", 192).request
    assert roomy.get_num_new_matched_tokens(second, 0) == (128, True)
    _ran(roomy)
    assert _deferred_loads(roomy) is None  # a load that fits is not deferred
    for request in second, third:
        assert tight.get_num_new_matched_tokens(request, 0) == (None, False)
    (load,) = _ran(tight)
    assert _deferred_loads(tight) == 2
    for step in range(3):  # vLLM asks again each step: the same two loads, not counted again
        for request in second, third:
            assert tight.get_num_new_matched_tokens(request, 0) == (None, False)
        if step == 1:
            _report(tight, load)
        _ran(tight)
        assert _deferred_loads(tight) is None
    _ran(tight, "first")
    assert tight.get_num_new_matched_tokens(second, 0) == (128, True)
    tight.update_state_after_alloc(second, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 128)
    assert tight.get_num_new_matched_tokens(third, 0) == (None, False)  # behind "second" now, still once
    _ran(tight)
    assert _deferred_loads(tight) is None
    fourth = _state("fourth", 192).request
    assert tight.get_num_new_matched_tokens(fourth, 0) == (None, False)  # a new one counts
    assert _deferred_loads(tight) == 1


def _lookup_spans(exporter) -> dict[str, dict]:
    """Each request's lookup span attributes."""
    return {dict(span.attributes)["kvscope.request.id"]: dict(span.attributes)
            for span in exporter.get_finished_spans() if span.name == "kvscope.lookup"}


def test_a_deferred_loads_lookup_span_says_how_many_lookups_it_waited_and_how_long():
    """`kvscope.deferred.*`: the wait lies before the lookup span vLLM admitted the request on, from
    the first lookup answered "not yet"; a load never deferred carries neither attribute."""
    tracing, exporter = in_memory_tracing()
    tight = _scheduler(48, tracing)
    _stored(tight, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    _admit_with_load(tight, _state("first", 192).request, 128)
    second = _state("second", 192).request
    before = time.time_ns()
    for _ in range(3):  # three steps: vLLM asks, kvscope answers "not yet"
        assert tight.get_num_new_matched_tokens(second, 0) == (None, False)
        time.sleep(0.002)
    _ran(tight, "first")
    assert tight.get_num_new_matched_tokens(second, 0) == (128, True)
    waited_at_most_us = (time.time_ns() - before) // 1000
    tight.update_state_after_alloc(second, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 128)
    spans = _lookup_spans(exporter)
    assert not any(key.startswith("kvscope.deferred.") for key in spans["first"])
    assert spans["second"]["kvscope.tokens.hit"] == 128
    assert spans["second"]["kvscope.deferred.lookups"] == 3
    assert 6000 <= spans["second"]["kvscope.deferred.wait_us"] <= waited_at_most_us
    loads = [span.attributes for span in exporter.get_finished_spans() if span.name == "kvscope.load"]
    assert len(loads) == 2 and not any("kvscope.deferred.lookups" in load for load in loads)  # told once
    # kvscope_load_deferral_wait_seconds: the same wait, observed once (the span's is in whole µs)
    (wait_s,) = tight.take_stats().data["load_deferral_wait_s"]
    assert int(wait_s * 1e6) == spans["second"]["kvscope.deferred.wait_us"]


def test_a_wait_the_wall_clock_stepped_back_over_is_told_as_no_wait():
    """`kvscope.deferred.wait_us` in whole µs from the first lookup answered "not yet"; a wait that ends
    before it (the wall clock stepped back) is 0, never negative, as the histogram observes it."""
    assert deferral_values(Deferral(lookups=2, first_ns=5_000_000), 7_500_999) == (2, 2500)
    assert deferral_values(Deferral(lookups=2, first_ns=5_000_000), 1_000_000) == (2, 0)


def test_a_deferred_request_whose_hit_is_gone_still_shows_its_wait():
    """Its hit evicted while it waited: admitted with nothing to load, its lookup span (alone, no
    load follows) still carries the wait."""
    tracing, exporter = in_memory_tracing()
    tight = _scheduler(48, tracing)
    _stored(tight, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    _admit_with_load(tight, _state("first", 192).request, 128)
    second = _state("second", 192).request
    assert tight.get_num_new_matched_tokens(second, 0) == (None, False)
    second.block_hashes = [f"x{i}" for i in range(12)]  # as if its blocks had left the tier
    assert tight.get_num_new_matched_tokens(second, 0) == (0, False)
    tight.update_state_after_alloc(second, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 0)
    span = _lookup_spans(exporter)["second"]
    assert (span["kvscope.tokens.hit"], span["kvscope.deferred.lookups"]) == (0, 1)
    assert span["kvscope.deferred.wait_us"] >= 0
    assert len(tight.take_stats().data["load_deferral_wait_s"]) == 1  # it waited, load or not


def test_a_request_aborted_while_its_load_waited_tells_its_wait_in_a_span_and_the_histogram():
    """A client that gives up on a load deferred for device KV room. vLLM never admitted the request (nor
    counted its lookup): no lookup or load span, so a `kvscope.deferral` span of its own spans the wait, in
    the trace the request came with; `kvscope_load_deferral_wait_seconds` observes the same wait at its end
    (else the longest waits, the ones given up on, would never be), once."""
    tracing, exporter = in_memory_tracing()
    tight = _scheduler(48, tracing)
    _stored(tight, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    _admit_with_load(tight, _state("first", 192).request, 128)
    second = _state("second", 192).request
    second.trace_headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    before = time.time_ns()
    for _ in range(2):
        assert tight.get_num_new_matched_tokens(second, 0) == (None, False)
        time.sleep(0.002)
    assert tight.take_stats().data.get("load_deferral_wait_s") is None  # still waiting: nothing observed
    tight.request_finished(second)
    after = time.time_ns()
    (wait_s,) = tight.take_stats().data["load_deferral_wait_s"]
    assert 0.004 <= wait_s <= (after - before) / 1e9
    assert "second" not in _lookup_spans(exporter) and not tight.admission.deferred
    (span,) = [span for span in exporter.get_finished_spans() if span.name == "kvscope.deferral"]
    assert dict(span.attributes) == {"kvscope.request.id": "second", "kvscope.tokens.external": 128,
                                     "kvscope.deferred.lookups": 2,
                                     "kvscope.deferred.wait_us": (span.end_time - span.start_time) // 1000,
                                     "kvscope.deferred.outcome": "ended"}
    assert before <= span.start_time < span.start_time + 4_000_000 <= span.end_time <= after
    assert int(wait_s * 1e6) == span.attributes["kvscope.deferred.wait_us"]
    assert (span.context.trace_id, span.parent.span_id) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    tight.request_finished(_state("first", 192).request)  # not deferred: nothing more observed, no such span
    stats = tight.take_stats()
    assert stats is None or "load_deferral_wait_s" not in stats.data
    assert len([span for span in exporter.get_finished_spans() if span.name == "kvscope.deferral"]) == 1


def _preempted_while_a_load_waits():
    """A traced scheduler in which "first" loaded and ran, "second" was admitted with a load not yet run, and
    "first" was then preempted: resuming, its load would not fit beside second's."""
    tracing, exporter = in_memory_tracing()
    tight = _scheduler(48, tracing)
    _stored(tight, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    first = _state("first", 192).request
    _admit_with_load(tight, first, 128)
    _ran(tight, "first")
    _admit_with_load(tight, _state("second", 192).request, 128)
    first.num_preemptions = 1
    return tight, exporter, first


def test_a_resumed_request_aborted_while_deferred_has_its_wait_span_under_its_first_lookup():
    """Admitted with a load, preempted, deferred on resuming, then aborted: its wait span joins the trace its
    lookup rooted (no traceparent), as its load span did, rather than starting a trace of its own."""
    tight, exporter, first = _preempted_while_a_load_waits()
    assert tight.get_num_new_matched_tokens(first, 0) == (None, False)
    tight.request_finished(first)
    spans = [span for span in exporter.get_finished_spans() if span.attributes.get("kvscope.request.id") == "first"]
    (lookup,) = [span for span in spans if span.name == "kvscope.lookup"]
    (wait,) = [span for span in spans if span.name == "kvscope.deferral"]
    assert (wait.context.trace_id, wait.parent.span_id) == (lookup.context.trace_id, lookup.context.span_id)


def test_a_resumed_request_deferred_then_admitted_with_nothing_to_load_tells_its_wait_in_a_span():
    """Admitted with a load, preempted, deferred on resuming, then admitted with nothing to load (its hit left
    the tier meanwhile). Its lookups have no span (vLLM counts a resumed request's apart) and no load follows:
    a `kvscope.deferral` span, outcome "admitted", is the wait the histogram observed, under its first lookup."""
    tight, exporter, first = _preempted_while_a_load_waits()
    before = time.time_ns()
    for _ in range(2):
        assert tight.get_num_new_matched_tokens(first, 0) == (None, False)
        time.sleep(0.002)
    first.block_hashes = [f"x{i}" for i in range(12)]  # as if its blocks had left the tier
    assert tight.get_num_new_matched_tokens(first, 0) == (0, False)
    tight.update_state_after_alloc(first, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 0)
    after = time.time_ns()
    spans = [span for span in exporter.get_finished_spans() if span.attributes.get("kvscope.request.id") == "first"]
    (lookup,) = [span for span in spans if span.name == "kvscope.lookup"]  # its first scheduling's
    (wait,) = [span for span in spans if span.name == "kvscope.deferral"]
    assert dict(wait.attributes) == {"kvscope.request.id": "first", "kvscope.tokens.external": 128,
                                     "kvscope.deferred.lookups": 2,
                                     "kvscope.deferred.wait_us": (wait.end_time - wait.start_time) // 1000,
                                     "kvscope.deferred.outcome": "admitted"}
    assert before <= wait.start_time < wait.start_time + 4_000_000 <= wait.end_time <= after
    assert (wait.context.trace_id, wait.parent.span_id) == (lookup.context.trace_id, lookup.context.span_id)
    (wait_s,) = tight.take_stats().data["load_deferral_wait_s"]
    assert int(wait_s * 1e6) == wait.attributes["kvscope.deferred.wait_us"]  # the span and the histogram agree
    # admitted again later (preempted once more, nothing deferred): no other such span
    tight.update_state_after_alloc(first, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 0)
    assert len([span for span in exporter.get_finished_spans() if span.name == "kvscope.deferral"]) == 1


def test_an_aborted_deferred_request_sampling_dropped_gets_no_span():
    tracing, exporter = in_memory_tracing(sample_ratio=0.0)
    tight = _scheduler(48, tracing)
    _stored(tight, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    _admit_with_load(tight, _state("first", 192).request, 128)
    second = _state("second", 192).request
    assert tight.get_num_new_matched_tokens(second, 0) == (None, False)
    tight.request_finished(second)
    assert not exporter.get_finished_spans()
    assert len(tight.take_stats().data["load_deferral_wait_s"]) == 1  # the metric is never sampled


def test_a_resumed_requests_deferred_load_tells_its_wait_on_its_load_span():
    """A request preempted and loading again has no lookup span (vLLM counts its lookup apart): its load
    span says how long kvscope deferred it, from the first deferred lookup to the load's start."""
    tracing, exporter = in_memory_tracing()
    tight = _scheduler(48, tracing)
    _stored(tight, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    _admit_with_load(tight, _state("first", 192).request, 128)
    resumed = _state("resumed", 192).request
    resumed.num_preemptions = 1
    before = time.time_ns()
    for _ in range(2):
        assert tight.get_num_new_matched_tokens(resumed, 0) == (None, False)
        time.sleep(0.002)
    _ran(tight, "first")
    _admit_with_load(tight, resumed, 128)
    waited_at_most_us = (time.time_ns() - before) // 1000
    assert "resumed" not in _lookup_spans(exporter)
    (load,) = [dict(span.attributes) for span in exporter.get_finished_spans()
               if span.name == "kvscope.load" and span.attributes["kvscope.request.id"] == "resumed"]
    assert load["kvscope.deferred.lookups"] == 2
    assert 4000 <= load["kvscope.deferred.wait_us"] <= waited_at_most_us
    # the metric's wait ends at the lookup vLLM admitted it on, the load span's at the load's start
    (wait_s,) = tight.take_stats().data["load_deferral_wait_s"]
    assert 4000 <= wait_s * 1e6 <= load["kvscope.deferred.wait_us"]
    (first_load,) = [span for span in exporter.get_finished_spans()
                     if span.name == "kvscope.load" and span.attributes["kvscope.request.id"] == "first"]
    assert "kvscope.deferred.lookups" not in first_load.attributes


def test_the_sliding_window_caps_are_read_from_vllms_managers():
    """`max_admission_blocks_per_request` of each sliding-window group's manager, read once, before the
    first load is admitted; full-attention groups and unreadable caps get none (counted whole)."""
    from connector.scheduler import _window_admission_caps

    managers = [SimpleNamespace(max_admission_blocks_per_request=cap) for cap in (5, 9)]
    manager = SimpleNamespace(block_pool=SimpleNamespace(num_gpu_blocks=48),
                              coordinator=SimpleNamespace(single_type_managers=managers))
    assert [layout.kind.value for layout in LAYOUTS] == ["sliding_window", "full_attention"]
    assert _window_admission_caps(manager, LAYOUTS) == {0: 5}
    assert _window_admission_caps(SimpleNamespace(), LAYOUTS) == {}
    managers[0].max_admission_blocks_per_request = None
    assert _window_admission_caps(manager, LAYOUTS) == {}
    managers[0].max_admission_blocks_per_request = 5
    sched = KVScopeScheduler(LAYOUTS, offload_block_size=B, hash_block_size=BS, num_slots=16, slot_bytes=1024,
                             world_size=1, tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda: manager)
    _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    assert sched.admission.window_caps is None
    _admit_with_load(sched, _state("first", 192).request, 128)
    assert sched.admission.window_caps == {0: 5}
    # 5 + 12 blocks each now, where 24 before: a second load fits 47 usable blocks
    assert sched.get_num_new_matched_tokens(_state("second", 192).request, 0) == (128, True)


def test_a_deferred_or_waiting_request_vllm_let_go_of_is_a_leak():
    """`connector_leaks` (every model-free and real-engine run checks it) sees load admission's state too:
    a deferred request left behind would hold back every load after it."""
    from tests.connector_leaks import connector_leaks

    def request_states(live) -> list[str]:
        return [leak for leak in connector_leaks(tight, live, []) if leak.startswith("state of")]

    tight, _ = _tier_with_a_prefix()
    first, second = _state("first", 192).request, _state("second", 192).request
    _admit_with_load(tight, first, 128)
    assert tight.get_num_new_matched_tokens(second, 0) == (None, False)
    assert request_states({"first": first, "second": second}) == []
    tight._requests.pop("first")  # as if vLLM's finish had not reached kvscope: the admission holds both still
    assert request_states({}) == ["state of finished request second", "state of finished request first"]
    tight.admission.ended("first")
    tight.admission.ended("second")
    assert request_states({}) == []
