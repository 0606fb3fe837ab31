"""The scheduler adapter's spans and stats for hand-built multi-group layouts (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

from connector.groups import GroupKind, GroupLayout
from connector.planning import scan_group
from connector.metadata import KVScopeMetadata, KVScopeWorkerMetadata
from connector.scheduler import KVScopeScheduler
from connector.telemetry.testing import in_memory_tracing
from connector.telemetry.tracing import KVScopeTracing, OsRandomIdGenerator
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.unit.test_store_planning import ROOMY_KV_CACHE_MANAGER, vllm_blocks

BS, B = 16, 32  # device block 16 tokens, offload block 32 tokens (factor 2)
LAYOUTS = [
    GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=40),
    GroupLayout(1, GroupKind.FULL_ATTENTION, BS),
]


def make_scheduler(tracing, world_size: int = 1, eagle_groups=frozenset()) -> KVScopeScheduler:
    return KVScopeScheduler(LAYOUTS, offload_block_size=B, hash_block_size=BS, num_slots=64,
                            slot_bytes=1024, world_size=world_size,
                            tracing=tracing, kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER,
                            eagle_groups=eagle_groups)


def make_request(rid: str, num_tokens: int, headers=None):
    # one hash per 16-token block; offload keys are every second one
    return SimpleNamespace(request_id=rid, num_tokens=num_tokens, num_computed_tokens=0,
                           block_hashes=[f"{rid[:1]}h{i}" for i in range(num_tokens // BS)],
                           trace_headers=headers)


def store_everything(sched, request):
    hashes = sched._offload_hashes(request)
    for layout in LAYOUTS:
        for k, h in enumerate(hashes):
            sched.index.reserve_for_store((layout.index, h))
            sched.index.complete_store((layout.index, h))


def blocks_for(num_tokens: int):
    """vLLM-like allocation after a hit of 192 tokens on a 200-token prompt: the sliding-window
    group has nulls below the window, the full-attention group none."""
    n = -(-num_tokens // BS)
    window_first = (192 - 40 + 1) // BS
    sw = [0 if i < window_first else 100 + i for i in range(n)]
    full = [200 + i for i in range(n)]
    return SimpleNamespace(get_block_ids=lambda: (sw, full)), (sw, full)


def plan(sched, request):
    external, is_async = sched.get_num_new_matched_tokens(request, 0)
    blocks, ids = blocks_for(request.num_tokens)
    sched.update_state_after_alloc(request, blocks, external)
    return external, is_async, ids


def plan_loads(sched, *request_ids: str, num_tokens: int = 200) -> None:
    """A stored prompt per request id, then each request's lookup and load, as in one busy step."""
    for rid in request_ids:
        request = make_request(rid, num_tokens)
        store_everything(sched, request)
        plan(sched, request)


def _attrs(span):
    return dict(span.attributes)


def test_one_scan_span_per_group_under_the_load_with_the_planners_counts():
    tracing, exporter = in_memory_tracing()
    sched = make_scheduler(tracing)
    request = make_request("r1", 200)
    store_everything(sched, request)
    external, is_async, ids = plan(sched, request)
    assert (external, is_async) == (192, True)
    spans = exporter.get_finished_spans()
    load = [s for s in spans if s.name == "kvscope.load"]
    scans = [s for s in spans if s.name == "kvscope.group.scan"]
    lookup = [s for s in spans if s.name == "kvscope.lookup"]
    assert len(load) == 1 and len(scans) == 2 and len(lookup) == 1
    assert {s.parent.span_id for s in scans} == {load[0].context.span_id}
    assert load[0].parent.span_id == lookup[0].context.span_id  # no headers: the lookup roots the trace
    assert len({s.context.trace_id for s in spans}) == 1
    assert _attrs(load[0]) == {"kvscope.request.id": "r1", "kvscope.tokens.local": 0,
                               "kvscope.tokens.external": 192, "kvscope.groups": 2}
    assert _attrs(lookup[0]) == {"kvscope.request.id": "r1", "kvscope.tokens.queried": 200,
                                 "kvscope.tokens.hit": 192, "kvscope.miss.reason": "tail", "kvscope.tokens.local": 0}
    # 192 cached tokens = 12 device blocks; the window (40 tokens) keeps blocks 9-11 at token 192
    expected = {0: ("sliding_window", 12, 9, 3, 9), 1: ("full_attention", 12, 0, 12, 0)}
    for span in scans:
        a = _attrs(span)
        g = a["kvscope.group.index"]
        kind, total, nulls, pending, start = expected[g]
        assert a == {
            "kvscope.group.index": g, "kvscope.group.kind": kind,
            "kvscope.group.blocks.total": total,
            "kvscope.group.blocks.null_skipped": nulls,
            "kvscope.group.blocks.pending": pending,
            "kvscope.group.blocks.start": start,
        }
        planned = scan_group(LAYOUTS[g], ids[g], 0, 192, B)  # and the planner's own counts
        assert (planned.blocks_total, planned.null_skipped, planned.pending, planned.start) == expected[g][1:]


def test_stats_agree_with_the_spans():
    """Several loads in one stats interval, as in a busy step: each is counted once."""
    tracing, exporter = in_memory_tracing()
    sched = make_scheduler(tracing)
    plan_loads(sched, "r1", "s2", "t3")
    data = sched.take_stats().data
    tracing.force_flush()
    scans = [_attrs(s) for s in exporter.get_finished_spans() if s.name == "kvscope.group.scan"]
    assert len(scans) == 3 * len(LAYOUTS)
    assert data["lookup_tokens"] == 3 * 200 and data["hit_tokens"] == 3 * 192
    assert data["missed_tokens"] == {"tail": 3 * 8}  # the partial block past the last whole one
    assert sum(data["scan_blocks"].values()) == sum(a["kvscope.group.blocks.total"] for a in scans)
    assert sum(data["null_blocks_skipped"].values()) == sum(a["kvscope.group.blocks.null_skipped"] for a in scans)


def _report(sched, completed=(), failed=()):
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVScopeWorkerMetadata(
        completed_jobs={job: 1 for job in completed}, failed_jobs={job: 1 for job in failed})))


def _planned_load(sched, rid):
    request = make_request(rid, 200)
    store_everything(sched, request)
    plan(sched, request)
    sched.take_stats()  # the lookup and scans: not what these tests count
    job = sched._pending_loads[-1]
    return request, job


def test_a_load_counts_its_blocks_once_every_worker_reported_it():
    sched = make_scheduler(KVScopeTracing.disabled(), world_size=2)
    _, job = _planned_load(sched, "r1")
    pending = sum(len(g.block_ids) for g in job.groups)
    _report(sched, completed=[job.job_id])
    early = sched.take_stats()
    assert early is None or "loaded_blocks" not in early.data  # one of two workers
    _report(sched, completed=[job.job_id])
    data = sched.take_stats().data
    assert sum(data["loaded_blocks"].values()) == pending and len(data["request_load_duration_s"]) == 1
    assert "load_bytes" not in data  # bytes are counted by the workers' copies


def test_a_load_failing_on_one_of_two_workers_counts_failures_not_loaded_blocks():
    sched = make_scheduler(KVScopeTracing.disabled(), world_size=2)
    _, job = _planned_load(sched, "r1")
    pending = sum(len(g.block_ids) for g in job.groups)
    _report(sched, completed=[job.job_id])
    _report(sched, failed=[job.job_id])
    data = sched.take_stats().data
    assert data["load_failures"] == pending
    assert "loaded_blocks" not in data and "request_load_duration_s" not in data


def test_a_request_aborted_while_loading_counts_its_loaded_blocks_but_no_load_time():
    """Its blocks were loaded into device KV (their bytes and copy spans are counted), so loaded plus
    failed blocks stay its scans' pending blocks; but vLLM frees them, uncached, once the load is
    done: no request waited for that load."""
    sched = make_scheduler(KVScopeTracing.disabled())
    request, job = _planned_load(sched, "r1")
    other, other_job = _planned_load(sched, "s2")
    sched.request_finished(request)
    _report(sched, completed=[job.job_id, other_job.job_id])
    data = sched.take_stats().data
    assert sum(data["loaded_blocks"].values()) == sum(len(g.block_ids) for j in (job, other_job) for g in j.groups)
    assert len(data["request_load_duration_s"]) == 1  # the other request's only
    assert not sched.has_unreported_jobs()
    assert sched.index.is_ready((0, sched._offload_hashes(request)[-1]))  # unpinned, still stored


def test_with_an_eagle_drafter_the_hit_leaves_the_last_stored_block_to_compute():
    """Its drafter KV at that block's end came from a next token no stored key proves."""
    sched = make_scheduler(KVScopeTracing.disabled(), eagle_groups=frozenset({0, 1}))
    request = make_request("r1", 200)
    store_everything(sched, request)  # 6 offload blocks of 32 tokens
    external, _, _ = plan(sched, request)
    assert external == 5 * B  # block 5 proves block 4's next token, and is computed again
    data = sched.take_stats().data
    assert data["hit_tokens"] == external and data["lookup_tokens"] == 200


def test_incoming_traceparent_parents_the_connector_spans():
    tracing, exporter = in_memory_tracing()
    sched = make_scheduler(tracing)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    request = make_request("r1", 200, headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01",
                                               "tracestate": "vendor=1"})
    store_everything(sched, request)
    plan(sched, request)
    spans = exporter.get_finished_spans()
    assert spans and {format(s.context.trace_id, "032x") for s in spans} == {trace_id}
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (lookup,), (load,), scans = by_name["kvscope.lookup"], by_name["kvscope.load"], by_name["kvscope.group.scan"]
    for span in (lookup, load):  # both directly under the upstream span, a remote parent
        assert span.parent.span_id == 0xB7AD6B7169203331 and span.parent.is_remote
    assert len(scans) == 2 and all(s.parent.span_id == load.context.span_id and not s.parent.is_remote for s in scans)
    assert len({s.context.span_id for s in spans}) == len(spans) == 4
    assert all(s.context.trace_state.to_header() == "vendor=1" for s in spans)
    carrier = sched._pending_loads[0].trace_carrier
    assert carrier == (int(trace_id, 16), load.context.span_id, "vendor=1")  # copy spans go under the load


def test_an_upstream_trace_that_is_not_sampled_or_not_kept_by_the_ratio_gets_no_span():
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    for flags, ratio in (("00", 1.0), ("01", 0.0)):
        tracing, exporter = in_memory_tracing(sample_ratio=ratio)
        sched = make_scheduler(tracing)
        request = make_request("r1", 200, headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-{flags}"})
        store_everything(sched, request)
        external, _, _ = plan(sched, request)
        assert external == 192 and len(sched._pending_loads[0].groups) == 2  # the load is planned all the same
        assert sched._pending_loads[0].trace_carrier is None
        assert exporter.get_finished_spans() == ()


def test_a_store_under_an_upstream_trace_hangs_under_the_upstream_span():
    tracing, exporter = in_memory_tracing()
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    request = make_request("r1", 200, headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01",
                                               "tracestate": "vendor=1"})
    _, ids = blocks_for(request.num_tokens)
    sched = KVScopeScheduler(LAYOUTS, offload_block_size=B, hash_block_size=BS, num_slots=64, slot_bytes=1024,
                             world_size=1, tracing=tracing,
                             kv_cache_manager_getter=lambda: SimpleNamespace(get_blocks=lambda rid: vllm_blocks(ids)))
    plan(sched, request)  # a miss: the lookup alone
    job = sched._plan_store(sched._requests["r1"], 192)
    assert job is not None and job.groups
    store = next(s for s in exporter.get_finished_spans() if s.name == "kvscope.store")
    assert store.parent.span_id == 0xB7AD6B7169203331 and store.parent.is_remote
    assert format(store.context.trace_id, "032x") == trace_id and store.context.trace_state.to_header() == "vendor=1"
    assert job.trace_carrier == (int(trace_id, 16), store.context.span_id, "vendor=1")  # copy spans under it


def test_a_store_whose_span_failed_to_record_carries_no_trace_to_its_copies(monkeypatch):
    """A fault recording the store span (`telemetry_failed`) costs that span only: the job still goes to the
    workers, with no carrier, so its copy spans do not hang under a span that was never recorded."""
    tracing, exporter = in_memory_tracing()
    upstream = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    request = make_request("r1", 200, headers={"traceparent": upstream})
    _, ids = blocks_for(request.num_tokens)
    sched = KVScopeScheduler(LAYOUTS, offload_block_size=B, hash_block_size=BS, num_slots=64, slot_bytes=1024,
                             world_size=1, tracing=tracing,
                             kv_cache_manager_getter=lambda: SimpleNamespace(get_blocks=lambda rid: vllm_blocks(ids)))
    plan(sched, request)  # a miss: the lookup alone

    def failing_end_span(*args):
        raise RuntimeError("injected telemetry fault")

    monkeypatch.setattr(tracing, "end_span", failing_end_span)
    job = sched._plan_store(sched._requests["r1"], 192)
    assert job is not None and job.groups and job.trace_carrier is None
    assert not any(s.name == "kvscope.store" for s in exporter.get_finished_spans())


def test_a_miss_records_its_lookup_alone():
    tracing, exporter = in_memory_tracing()
    sched = make_scheduler(tracing)
    request = make_request("r1", 200)  # nothing stored
    external, _, _ = plan(sched, request)
    assert external == 0
    (lookup,) = exporter.get_finished_spans()
    assert lookup.name == "kvscope.lookup" and lookup.parent is None
    assert _attrs(lookup) == {"kvscope.request.id": "r1", "kvscope.tokens.queried": 200, "kvscope.tokens.hit": 0,
                              "kvscope.miss.reason": "new", "kvscope.tokens.local": 0}


def test_a_lookup_after_a_device_prefix_hit_says_how_many_tokens_the_device_had():
    """The tokens vLLM's own prefix cache computed are not looked up: the lookup span says how many, so a
    replay can tell a short query after a long device hit from a short prompt."""
    exporter = InMemorySpanExporter()
    sched = make_scheduler(KVScopeTracing.for_exporter(exporter))
    request = make_request("r1", 200)
    external, _ = sched.get_num_new_matched_tokens(request, 64)
    assert external == 0
    sched.update_state_after_alloc(request, blocks_for(200)[0], 0)
    (lookup,) = exporter.get_finished_spans()
    assert _attrs(lookup) == {"kvscope.request.id": "r1", "kvscope.tokens.queried": 136, "kvscope.tokens.hit": 0,
                              "kvscope.miss.reason": "new", "kvscope.tokens.local": 64}


def _scheduled_new(rid: str, computed: int):
    """A scheduler output in which vLLM schedules request ``rid`` afresh with ``computed`` tokens."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=([], []), num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        kv_cache_block_copies=[], num_scheduled_tokens={}, scheduled_spec_decode_tokens={})


def test_a_lookup_is_counted_from_the_device_hit_vllm_kept_inside_a_block():
    """Hash blocks (16) finer than a group's blocks (32): vLLM asks from its device hit rounded down to a
    block (64 of 80) and keeps its 80 when it takes nothing of the tier's hit, which then lies partly
    within them. The lookup counts and traces from 80, once vLLM schedules the request (as vLLM counts
    its queries), and the tier's hit past 80 is found but not taken."""
    tracing, exporter = in_memory_tracing()
    layouts = [GroupLayout(0, GroupKind.FULL_ATTENTION, BS), GroupLayout(1, GroupKind.SLIDING_WINDOW, 32, 40)]
    sched = KVScopeScheduler(layouts, offload_block_size=B, hash_block_size=BS, num_slots=64, slot_bytes=1024,
                             world_size=1, tracing=tracing, kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER)
    request = make_request("r1", 200)
    hashes = sched._offload_hashes(request)
    for layout in layouts:  # the tier holds tokens 64..128
        for h in hashes[2:4]:
            sched.index.reserve_for_store((layout.index, h))
            sched.index.complete_store((layout.index, h))
    external, _ = sched.get_num_new_matched_tokens(request, 64)
    assert external == 64
    sched.update_state_after_alloc(request, blocks_for(200)[0], 0)  # vLLM kept its own 80 tokens instead
    assert exporter.get_finished_spans() == ()  # vLLM's hit is known once the request is scheduled
    sched.build_connector_meta(_scheduled_new("r1", 80))
    (lookup,) = exporter.get_finished_spans()
    assert _attrs(lookup) == {"kvscope.request.id": "r1", "kvscope.tokens.queried": 120, "kvscope.tokens.hit": 0,
                              "kvscope.miss.reason": "not_taken", "kvscope.tokens.local": 80}
    data = sched.take_stats().data
    assert data["lookup_tokens"] == 120 and data.get("hit_tokens", 0) == 0
    assert data["missed_tokens"] == {"not_taken": 48, "new": 64, "tail": 8}
    sched.build_connector_meta(_no_step())  # a later step: that lookup was counted and traced once, for good
    assert len(exporter.get_finished_spans()) == 1
    again = sched.take_stats()
    assert again is None or not again.data.get("lookup_tokens"), again.data


def test_a_device_hit_kept_one_token_past_the_block_vllm_asked_from_is_not_looked_up():
    """vLLM asks from 64 and keeps its device hit of 65: that one token was not looked up either; the
    lookup counts and traces from 65."""
    tracing, exporter = in_memory_tracing()
    layouts = [GroupLayout(0, GroupKind.FULL_ATTENTION, BS), GroupLayout(1, GroupKind.SLIDING_WINDOW, 32, 40)]
    sched = KVScopeScheduler(layouts, offload_block_size=B, hash_block_size=BS, num_slots=64, slot_bytes=1024,
                             world_size=1, tracing=tracing, kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER)
    request = make_request("r1", 200)
    assert sched.get_num_new_matched_tokens(request, 64)[0] == 0
    sched.update_state_after_alloc(request, blocks_for(200)[0], 0)
    sched.build_connector_meta(_scheduled_new("r1", 65))
    (lookup,) = exporter.get_finished_spans()
    attrs = _attrs(lookup)
    assert (attrs["kvscope.tokens.queried"], attrs["kvscope.tokens.local"]) == (135, 65)
    assert sched.take_stats().data["lookup_tokens"] == 135


def test_a_load_without_a_lookup_span_roots_its_own_trace():
    tracing, exporter = in_memory_tracing()
    sched = make_scheduler(tracing)
    request = make_request("r1", 200)
    store_everything(sched, request)
    sched.get_num_new_matched_tokens(request, 0)
    request.num_computed_tokens = 16  # not scheduled from scratch: no lookup span (nor lookup stats)
    blocks, _ = blocks_for(request.num_tokens)
    sched.update_state_after_alloc(request, blocks, 192)
    spans = exporter.get_finished_spans()
    (load,) = [s for s in spans if s.name == "kvscope.load"]
    assert load.parent is None and {s.name for s in spans} == {"kvscope.load", "kvscope.group.scan"}
    assert sched._pending_loads[0].trace_carrier[:2] == (load.context.trace_id, load.context.span_id)


def test_sampling_keeps_or_drops_whole_requests():
    tracing, exporter = in_memory_tracing(sample_ratio=0.5)
    sched = make_scheduler(tracing)
    for i in range(40):
        request = make_request(f"{i:02d}", 200)
        store_everything(sched, request)
        plan(sched, request)
    spans = exporter.get_finished_spans()
    per_trace = {}
    for s in spans:
        per_trace.setdefault(s.context.trace_id, set()).add(s.name)
    assert 0 < len(per_trace) < 40
    assert all(names == {"kvscope.lookup", "kvscope.load", "kvscope.group.scan"} for names in per_trace.values())


class _ExplodingTracing(KVScopeTracing):
    """Disabled tracing that fails the test if any span, id or trace context is asked for."""

    def __init__(self):
        super().__init__(None)
        self._ids = None  # drawing an id would raise too
        self.asked = []  # what was asked for, seen even where the connector catches the fault (`telemetry_failed`)

    def _explode(self, *a, **k):
        self.asked.append(a)
        raise AssertionError("span bookkeeping with tracing off")

    start_span = record_span = open_span = end_span = record = end_load = _explode
    parent_from_trace_headers = context_from_trace_headers = carrier_of = _explode


def test_tracing_off_builds_no_span_and_still_plans():
    sched = make_scheduler(_ExplodingTracing())
    assert not sched.tracing.enabled
    request = make_request("r1", 200, {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    store_everything(sched, request)
    external, _, _ = plan(sched, request)
    assert external == 192
    job = sched._pending_loads[0]
    assert job.trace_carrier is None and [len(g.block_ids) for g in job.groups] == [3, 12]
    assert sched.tracing.asked == []


def test_a_request_dropped_by_sampling_costs_one_decision_and_no_span_bookkeeping():
    drawn = []

    class CountingIds(OsRandomIdGenerator):  # a span's (or trace's) existence starts with its id
        def generate_trace_id(self):
            drawn.append("trace")
            return super().generate_trace_id()

        def generate_span_id(self):
            drawn.append("span")
            return super().generate_span_id()

    tracing, exporter = in_memory_tracing(sample_ratio=0.0)
    tracing._ids = CountingIds()
    sched = make_scheduler(tracing)
    request = make_request("r1", 200)
    store_everything(sched, request)
    external, _, _ = plan(sched, request)
    assert external == 192 and len(sched._pending_loads[0].groups) == 2
    assert sched._pending_loads[0].trace_carrier is None
    assert drawn == ["trace"]  # the lookup's sampling decision (a new trace); no span id, no load or scan span
    assert exporter.get_finished_spans() == ()
    assert "dropped_trace_records" not in sched.take_stats().data  # a record sampling dropped is no lost one


def test_ids_do_not_repeat_when_python_random_is_seeded():
    """vLLM seeds `random`; trace ids must still differ between runs."""
    import random

    ids = []
    for _ in range(2):
        random.seed(0)
        tracing, exporter = in_memory_tracing()
        span = tracing.start_span("kvscope.lookup")
        span.end()
        ids.append(exporter.get_finished_spans()[0].context.trace_id)
    assert ids[0] != ids[1]


def test_a_load_failed_at_planning_still_records_its_lookup_span_with_the_metrics_counts():
    """A load of part of a hit fails whole at planning: the lookup it came from is a span (in the
    request's upstream trace, or rooting its own), counted as the metrics count it, and its load's."""
    upstream = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for headers in (None, {"traceparent": upstream}):
        tracing, exporter = in_memory_tracing()
        sched = make_scheduler(tracing)
        request = make_request("r1", 200, headers)
        store_everything(sched, request)
        external, _ = sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, blocks_for(200)[0], external - B)  # part of the hit
        sched.build_connector_meta(_no_step())  # the step's records go out
        tracing.force_flush()
        spans = exporter.get_finished_spans()
        assert sorted(s.name for s in spans) == ["kvscope.group.scan"] * 2 + ["kvscope.load", "kvscope.lookup"]
        (lookup,) = [s for s in spans if s.name == "kvscope.lookup"]
        assert _attrs(lookup) == {"kvscope.request.id": "r1", "kvscope.tokens.queried": 200,
                                  "kvscope.tokens.hit": external - B, "kvscope.miss.reason": "not_taken",
                                  "kvscope.tokens.local": 0}
        data = sched.take_stats().data
        assert data["lookup_tokens"] == 200
        assert data["missed_tokens"] == {"not_taken": B, "tail": 8}  # found, vLLM took less; the partial block
        if headers:
            assert f"{lookup.context.trace_id:032x}" == upstream.split("-")[1]
            assert lookup.parent.span_id == int(upstream.split("-")[2], 16) and lookup.parent.is_remote
        else:
            assert lookup.parent is None


def test_a_lookup_tells_why_the_tier_missed_in_its_span_and_in_the_stats():
    """Evicted, being stored, forgotten by a reset, never seen: each miss's reason, as the index stood at
    the lookup, on its span and in `missed_tokens`, which with the hits add up to the looked-up tokens."""
    tracing, exporter = in_memory_tracing()
    sched = KVScopeScheduler(LAYOUTS, offload_block_size=B, hash_block_size=BS, num_slots=24, slot_bytes=1024,
                             world_size=1, tracing=tracing, kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER)
    for rid in ("a1", "b1"):  # 6 blocks in each of 2 groups, block by block: the tier is full
        for h in sched._offload_hashes(make_request(rid, 200)):
            for layout in LAYOUTS:
                sched.index.reserve_for_store((layout.index, h))
                sched.index.complete_store((layout.index, h))
    first = sched._offload_hashes(make_request("c1", 200))[0]
    for layout in LAYOUTS:  # c's first block is being stored, in place of a's (the least recently used)
        sched.index.reserve_for_store((layout.index, first))
    for rid in ("a2", "c2", "d2"):
        external, _, _ = plan(sched, make_request(rid, 200))
        assert external == 0
    sched.reset_cache()
    store_everything(sched, make_request("e1", 200))
    sched.reset_cache()
    plan(sched, make_request("e2", 200))
    tracing.force_flush()
    reasons = {_attrs(s)["kvscope.request.id"]: _attrs(s)["kvscope.miss.reason"]
               for s in exporter.get_finished_spans() if s.name == "kvscope.lookup"}
    assert reasons == {"a2": "evicted", "c2": "storing", "d2": "new", "e2": "reset"}
    data = sched.take_stats().data
    # block by block: a2 lost its first block only (the rest was there, past the hit), c2's first block
    # was being stored and the rest never was, d2 and e2 as their first block
    assert data["missed_tokens"] == {"evicted": 32, "other_blocks": 160, "storing": 32, "new": 160 + 192,
                                     "reset": 192, "tail": 4 * 8}
    assert sum(data["missed_tokens"].values()) + data.get("hit_tokens", 0) == data["lookup_tokens"] == 4 * 200


def test_a_requests_load_duration_is_in_seconds():
    """`kvscope_request_load_duration_seconds`: from the load's planning to its last worker's report."""
    import time

    sched = make_scheduler(KVScopeTracing.disabled())
    start = time.perf_counter()
    _, job = _planned_load(sched, "r1")
    _report(sched, completed=[job.job_id])
    elapsed = time.perf_counter() - start
    (duration,) = sched.take_stats().data["request_load_duration_s"]
    assert 0 < duration <= elapsed


def test_a_traced_loads_scan_durations_are_its_scan_spans_in_seconds():
    """Traced scans are timed with the span clock: the histogram gets each scan span's interval."""
    tracing, exporter = in_memory_tracing()
    sched = make_scheduler(tracing)
    request = make_request("r1", 200)
    store_everything(sched, request)
    plan(sched, request)
    durations = sched.take_stats().data["scan_duration_s"]
    tracing.force_flush()
    scans = {s.attributes["kvscope.group.index"]: s for s in exporter.get_finished_spans()
             if s.name == "kvscope.group.scan"}
    assert durations == {f"{g}|{LAYOUTS[g].kind.value}": [(scans[g].end_time - scans[g].start_time) / 1e9]
                         for g in (0, 1)}
    assert all(d[0] > 0 for d in durations.values())
    assert scans[1].start_time == scans[0].end_time  # one clock read per group: each scan's end starts the next


def test_an_untraced_loads_scan_durations_are_in_seconds():
    import time

    sched = make_scheduler(KVScopeTracing.disabled())
    request = make_request("r1", 200)
    store_everything(sched, request)
    start = time.perf_counter()
    plan(sched, request)
    elapsed = time.perf_counter() - start
    durations = sched.take_stats().data["scan_duration_s"]
    assert sorted(durations) == ["0|sliding_window", "1|full_attention"]
    assert all(len(d) == 1 and 0 < d[0] <= elapsed for d in durations.values())


def test_each_untraced_groups_scan_is_timed_alone(monkeypatch):
    """One clock read per group, each scan's end starting the next: a group's scan duration is its own,
    not the time since the load's planning started."""
    import itertools
    import time

    sched = make_scheduler(KVScopeTracing.disabled())
    request = make_request("r1", 200)
    store_everything(sched, request)
    ticks = itertools.count(0, 1000)  # each read of the clock a microsecond after the last
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(ticks))
    plan(sched, request)
    monkeypatch.undo()
    assert sched.take_stats().data["scan_duration_s"] == {"0|sliding_window": [1e-6], "1|full_attention": [1e-6]}


def test_a_load_failed_at_planning_is_traced_and_counted_like_one_failed_in_its_copy():
    """vLLM asking part of a hit (no vLLM path does today) fails the load at planning: its lookup and
    load spans carry the scans of the blocks vLLM gave, the worker's copy spans say ERROR, and the
    failure counts those scans' pending blocks, as a failed copy does."""
    from opentelemetry.trace import StatusCode

    from tests.unit.test_copy_engine import _shared_attention_engine
    from connector.worker import KVScopeWorker

    tracing, exporter = in_memory_tracing()
    sched = make_scheduler(tracing)
    request = make_request("r1", 200)
    store_everything(sched, request)
    external, _ = sched.get_num_new_matched_tokens(request, 0)
    blocks, _ = blocks_for(request.num_tokens)
    sched.update_state_after_alloc(request, blocks, external - B)  # one offloaded block short
    (job,) = sched.build_connector_meta(_no_step()).loads
    assert job.failed_at_plan and job.trace_carrier is not None
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = KVScopeWorker(None, engine.layout, engine.num_slots, ["sliding_window", "full_attention"], 0, tracing)
    worker.engine = engine
    worker.start_load_kv(KVScopeMetadata(loads=[job]))
    _report(sched, failed=list(worker.build_worker_meta().failed_jobs))
    data = sched.take_stats().data
    tracing.force_flush()
    spans = exporter.get_finished_spans()
    (load,) = [s for s in spans if s.name == "kvscope.load"]
    scans = [_attrs(s) for s in spans if s.name == "kvscope.group.scan"]
    copies = [s for s in spans if s.name == "kvscope.group.copy"]
    assert [s.name for s in spans].count("kvscope.lookup") == 1
    assert _attrs(load)["kvscope.tokens.external"] == external - B and len(scans) == len(LAYOUTS)
    assert data["load_failures"] == sum(a["kvscope.group.blocks.pending"] for a in scans) > 0
    assert sum(data["loaded_blocks"].values()) == 0
    assert len(copies) == len(LAYOUTS) and all(s.status.status_code is StatusCode.ERROR for s in copies)
    assert {s.parent.span_id for s in copies} == {load.context.span_id}


def _no_step():
    """A scheduler output that schedules nothing."""
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, scheduled_spec_decode_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]))


def test_every_step_hands_the_schedulers_spans_over_at_its_end(monkeypatch):
    """The step's lookup, load and store spans leave the process when the step ends, not on the export
    thread's schedule: vLLM's shutdown can kill the engine core after its last step."""
    tracing, _ = in_memory_tracing()
    sched = make_scheduler(tracing)
    ended = []
    monkeypatch.setattr(tracing, "end_step", lambda: ended.append(1))
    plan_loads(sched, "r1")
    sched.build_connector_meta(_no_step())
    sched.build_connector_meta(_no_step())
    assert ended == [1, 1]
