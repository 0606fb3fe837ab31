"""Per-request load planning: kvscope's scheduler adapter beside vLLM's own OffloadingConnector.

    python -m bench.planner_vs_vllm [--quick]

Both sides get identical inputs: one real vLLM `Request` (block hashes from vLLM's own block
hasher) and one real `KVCacheBlocks` of `KVCacheBlock` objects per case, with vLLM's null
placement (a sliding-window group holds the shared null block before its window; blocks of the
external range are unhashed, local ones hashed). Every offload chunk is already stored on both
sides, so the lookups hit and each side plans a load of exactly the same device blocks (asserted,
block id by block id, per group).

vLLM's side is the installed `OffloadingConnectorScheduler`, built the way vLLM builds it: a real
`VllmConfig` from `EngineArgs` (tiny model, no engine started), a hand-made `KVCacheConfig`, and
`OffloadingConnector(role=SCHEDULER)`, whose `CPUOffloadingSpec` manager holds the stored chunks.
Timed: `update_state_after_alloc` (vLLM's telemetry is its always-on stats; it has no tracing).

kvscope's side is `KVScopeScheduler.update_state_after_alloc` (the whole adapter path: block-id
translation, the per-group scans, host pins, the transfer job), with tracing off and on (a real
trace file behind kvscope's span batcher, sample ratio 1.0; the timed region ends with a flush,
so exporting the spans is counted, and none is dropped), and with its telemetry taken out
(`kvscope_bare`, `UninstrumentedScheduler`: the reference for what telemetry costs). Also: the
adapter path with spans recorded and queued as for a trace file, each full batch then dropped by
the engine thread instead of marshalled for the helper (`*_noexport`: recording and queueing, apart
from the export); a bound, not a tracer (`kvscope_on_floor`): the traced path keeping only its values
(the lookup's, the load's and each scan's, as plain tuples in a list) with no span ids, record queue or
export, the least any per-load record made on the planning thread could cost;
tracing a tenth of the requests (`*_sampled`, `trace_sample_ratio` 0.1, what an operator would
run under load); and the scans alone (`_scan_groups`; traced: `_scan_groups_traced` and the load's record).
Also the lookup that comes before (`get_num_new_matched_tokens`, the same stored blocks) on both sides
(`vllm_lookup`, `kvscope_lookup`): vLLM calls it for every request it tries to schedule from scratch.

Sides are sampled alternately (rotating order) in one process; the per-request bookkeeping that
must be undone between calls (pins, jobs, request state) is undone outside the timed region.
`run(quick)` returns {name, median, unit, ratio, ratio_of} records; medians in µs per request.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: E402

from bench.stand_ins import ROOMY_KV_CACHE_MANAGER  # noqa: E402
from bench.table import render_table  # noqa: E402
from connector.groups import GroupKind, GroupLayout  # noqa: E402
from connector.load_admission import LoadAdmission  # noqa: E402
from connector.lookup_records import LookupRecords  # noqa: E402
from connector.planning import NULL_BLOCK_ID, cdiv, scan_group  # noqa: E402
from connector.scheduler import KVScopeScheduler  # noqa: E402
from connector.telemetry.span_batcher import SpanBatcher  # noqa: E402
from connector.telemetry.tracing import (  # noqa: E402
    _HELPER_BATCH_SIZE,
    EXPORT_MODE_VARIABLE,
    KVScopeTracing,
    SyncRecordProcessor,
)

DEVICE_BLOCK_SIZE = 16  # tokens per device block, every group (vLLM's chunking needs one size)
OFFLOAD_BLOCK_SIZE = 256  # tokens per offloaded block: kvscope `block_size`, vLLM `block_size`
NEW_TOKENS = 100  # tokens after the hit: allocated, not loaded
FULL, SWA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW

# (kind, sliding window in tokens) per group.
GROUP_MIXES: dict[int, list[tuple[GroupKind, int | None]]] = {
    1: [(FULL, None)],
    2: [(FULL, None), (SWA, 1024)],
    4: [(FULL, None), (SWA, 4096), (FULL, None), (SWA, 128)],
}
SIZES_FULL = (128, 1024, 8192, 32768)  # device blocks per group (the prompt length / 16)
SIZES_QUICK = (128, 2048, 32768)

SIDES = ("vllm", "kvscope_bare", "kvscope_off", "kvscope_on", "kvscope_on_thread", "kvscope_on_noexport",
         "kvscope_on_floor", "kvscope_on_sampled", "kvscope_scan_off", "kvscope_scan_on", "kvscope_scan_on_noexport",
         "kvscope_scan_bare")
LOOKUP_SIDES = ("vllm_lookup", "kvscope_lookup")  # get_num_new_matched_tokens, sampled with SIDES
# Sides also reported as the engine process's CPU time per request (all its threads, not the
# export helper process): the flush that ends each traced sample waits for the helper (or the export
# thread), and wall time counts that wait, which no engine step does.
CPU_SIDES = ("vllm", "kvscope_bare", "kvscope_on", "kvscope_on_thread", "kvscope_on_noexport", "kvscope_on_floor",
             "kvscope_on_sampled")
_SIZING_REQUESTS = 20  # requests timed to size the samples
_MAX_SAMPLE_REQUESTS = 10000
SAMPLED_RATIO = 0.1  # `kvscope_on_sampled`: the trace file with trace_sample_ratio 0.1
# Telemetry's cost (issue 3), per request: the planner with telemetry off / tracing on / tracing
# without the export thread's work, against the same planner with its telemetry taken out.
TELEMETRY_SIDES = {"telemetry_off": "kvscope_off", "telemetry_on": "kvscope_on",
                   "telemetry_on_thread": "kvscope_on_thread", "telemetry_on_noexport": "kvscope_on_noexport",
                   "telemetry_on_floor": "kvscope_on_floor",
                   "telemetry_on_sampled": "kvscope_on_sampled"}
# The group scans alone as the scheduler runs them, against plain `scan_group` calls.
SCAN_SIDES = ("kvscope_scan_off", "kvscope_scan_on", "kvscope_scan_on_noexport")


class _DropSpans(SpanExporter):
    """A span exporter that drops everything: the cost of recording spans without exporting them.
    Batches reach it as they reach the helper's exporter: full ones from the engine thread."""

    accepts_nowait = True

    def export(self, spans):
        return SpanExportResult.SUCCESS

    def export_nowait(self, spans) -> None:
        pass

    def catch_up(self) -> None:
        pass


# ----------------------------------------------------------------------------- vLLM objects
def _vllm_config():
    """A real VllmConfig for the tiny llama, asking for vLLM's OffloadingConnector (no engine)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from connector.tiny_models import build_model

    args = EngineArgs(
        model=build_model("llama"),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=DEVICE_BLOCK_SIZE,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 40, "block_size": OFFLOAD_BLOCK_SIZE},
        ),
    )
    return args.create_engine_config()


def _kv_cache_config(mix, num_blocks: int):
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    groups = []
    for i, (kind, window) in enumerate(mix):
        common = dict(block_size=DEVICE_BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        spec = FullAttentionSpec(**common) if kind is FULL else SlidingWindowSpec(**common, sliding_window=window)
        groups.append(KVCacheGroupSpec([f"layer{i}"], spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_scheduler(vllm_config, mix, num_blocks: int):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, _kv_cache_config(mix, num_blocks))
    return connector.connector_scheduler


# ----------------------------------------------------------------------------- the case
@dataclass
class Case:
    name: str
    num_groups: int
    blocks: int  # device blocks per group covering the cached tokens
    layouts: list[GroupLayout]
    local: int  # locally computed tokens (device prefix-cache hit)
    external: int  # tokens to load
    prompt: list[int]
    hashes: list  # vLLM block hashes of the prompt (hash block size 16)
    kv_blocks: object  # vLLM KVCacheBlocks
    expected_block_ids: list[list[int]] = field(default_factory=list)  # per group, what must load


def make_case(num_groups: int, blocks: int, hash_fn) -> Case:
    """A quarter of the cached prompt local, the rest external (offload-block aligned), then
    NEW_TOKENS more allocated; a sliding window holds the null block before its window."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

    mix = GROUP_MIXES[num_groups]
    layouts = [GroupLayout(i, kind, DEVICE_BLOCK_SIZE, window) for i, (kind, window) in enumerate(mix)]
    b = OFFLOAD_BLOCK_SIZE
    cached = blocks * DEVICE_BLOCK_SIZE // b * b
    local = cached // 4 // b * b
    allocated = cached + NEW_TOKENS
    prompt = [(i * 7919 + 13) % 509 + 1 for i in range(allocated)]
    hashes = _block_hashes(prompt, hash_fn)
    null = KVCacheBlock(NULL_BLOCK_ID, is_null=True)
    next_id = 1
    groups, expected = [], []
    for layout in layouts:
        n = cdiv(allocated, DEVICE_BLOCK_SIZE)
        first_real = layout.first_retained_token(cached) // DEVICE_BLOCK_SIZE
        group = []
        for i in range(n):
            if i < first_real:
                group.append(null)
                continue
            block = KVCacheBlock(next_id)
            next_id += 1
            if (i + 1) * DEVICE_BLOCK_SIZE <= local:  # a device prefix-cache hit: hashed
                block.set_block_hash(make_block_hash_with_group_id(hashes[i], layout.index))
            group.append(block)
        groups.append(group)
        end = cdiv(cached, DEVICE_BLOCK_SIZE)
        expected.append([blk.block_id for blk in group[local // DEVICE_BLOCK_SIZE:end] if not blk.is_null])
    name = f"{num_groups}g/{blocks}"
    return Case(name, num_groups, blocks, layouts, local, cached - local, prompt, hashes,
                KVCacheBlocks(tuple(groups)), expected)


def _block_hashes(prompt: list[int], hash_fn) -> list:
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    request = _request("hasher", prompt, get_request_block_hasher(DEVICE_BLOCK_SIZE, hash_fn))
    return list(request.block_hashes)


def _request(request_id: str, prompt: list[int], block_hasher):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=block_hasher)


# ----------------------------------------------------------------------------- the two sides
class VllmSide:
    """vLLM's OffloadingConnectorScheduler with every chunk of the case stored in its manager."""

    def __init__(self, vllm_config, case: Case):
        self.case = case
        self.sched = _vllm_scheduler(vllm_config, GROUP_MIXES[case.num_groups], 1 << 20)
        from vllm.v1.kv_offload.base import make_offload_key

        store = self._requests(1, "store")[0]
        self.sched.on_new_request(store)
        ctx = self.sched._req_status[store.request_id].req_context
        step = OFFLOAD_BLOCK_SIZE // DEVICE_BLOCK_SIZE
        keys = [make_offload_key(h, g) for g in range(case.num_groups)
                for h in case.hashes[step - 1: (case.local + case.external) // DEVICE_BLOCK_SIZE: step]]
        manager = self.sched.manager
        assert manager.prepare_store(keys, ctx) is not None
        manager.complete_store(keys, ctx)
        self.sched._req_status.clear()

    def _requests(self, n: int, tag: str):
        hashes = self.case.hashes
        return [_request(f"{tag}-{i}", self.case.prompt, lambda r: list(hashes)) for i in range(n)]

    def prepare(self, n: int) -> list:
        reqs = self._requests(n, "vllm")
        for req in reqs:
            self.sched.on_new_request(req)
            hit, is_async = self.sched.get_num_new_matched_tokens(req, self.case.local)
            if hit != self.case.external:
                raise AssertionError(f"{self.case.name}: vLLM found {hit} tokens, expected {self.case.external}")
        return reqs

    def call(self, reqs: list) -> None:
        update, blocks, external = self.sched.update_state_after_alloc, self.case.kv_blocks, self.case.external
        for req in reqs:
            update(req, blocks, external)

    def prepare_lookup(self, n: int) -> list:
        reqs = self._requests(n, "lookup")
        for req in reqs:
            self.sched.on_new_request(req)
        return reqs

    def planned(self) -> list[list[int]]:
        """Per group, the device blocks of the last planned load."""
        job = next(reversed(self.sched._current_batch_load_jobs.values()))
        ids, out, pos = list(job.dst_spec.block_ids), [], 0
        for size in job.dst_spec.group_sizes:
            out.append(ids[pos:pos + size])
            pos += size
        return out

    def reset(self) -> None:
        s = self.sched
        for status in s._jobs.values():
            req_status = s._req_status[status.req_id]
            s.manager.complete_load(status.keys, req_status.req_context)
        s._jobs.clear()
        s._current_batch_load_jobs.clear()
        s._current_batch_allocated_block_ids.clear()
        if s._chunks_being_loaded is not None:
            s._chunks_being_loaded.clear()
        s._req_status.clear()


def no_export_tracing() -> KVScopeTracing:
    """The `*_noexport` sides' tracing: spans recorded and queued as for the helper, full batches dropped."""
    return KVScopeTracing(SpanBatcher([_DropSpans()], max_batch=_HELPER_BATCH_SIZE),
                          Resource.create({"service.name": "bench"}))


class UninstrumentedScheduler(KVScopeScheduler):
    """kvscope's planner with its telemetry taken out: no scan timers, no tracing.

    The reference for what telemetry costs (issue 3: within 2% when off, 15% when tracing).
    Two cheap bits stay in, which makes telemetry look cheaper only by their cost: the
    load-latency start stamp (`_Job.plan_ns`, one clock read) and the lookup log (one list append).
    """

    def _scan_groups(self, group_block_ids, local, cached, t0):
        block = self.block_size
        return [scan_group(layout, ids, local, cached, block) for layout, ids in zip(self.layouts, group_block_ids)]


class FloorLookupRecords(LookupRecords):
    """The lookup's values as a plain tuple: no span, no ids (`FloorScheduler`)."""

    def span(self, tracing, state, req_id, lookup, queried, hit, miss_reason):
        return (lookup.start_ns, lookup.end_ns, queried, hit, miss_reason, lookup.local_tokens)


class FloorScheduler(KVScopeScheduler):
    """A bound, not a tracer: the traced planning path keeping the lookup's values as a plain tuple
    (`FloorLookupRecords`); with `FloorTracing` the load's record is that tuple, the load's values and the
    scans' (`_scan_groups_traced`, as traced) kept in a list. What any per-load record made on the
    planning thread costs at the least: ids, the record queue and the export come on top."""

    lookup_records_type = FloorLookupRecords

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lookup_records = self.lookup_records_type()


class FloorTracing(KVScopeTracing):
    """Tracing that keeps each load's values in a list, dropped every `_HELPER_BATCH_SIZE` loads as
    a full batch would leave: no ids, no carrier (`FloorScheduler`)."""

    def __init__(self):
        super().__init__(processor=SyncRecordProcessor(_DropSpans()))  # never handed a record
        self._kept: list[tuple] = []

    def end_load(self, parent, start_ns, end_ns, values):
        kept = self._kept
        kept.append((start_ns, end_ns, values))
        if len(kept) >= _HELPER_BATCH_SIZE:
            kept.clear()
        return None

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class KVScopeSide:
    """KVScopeScheduler with every offload block of the case ready in its host index."""

    def __init__(self, case: Case, tracing: KVScopeTracing, scheduler_class=KVScopeScheduler):
        self.case = case
        self.tracing = tracing
        chunks = (case.local + case.external) // OFFLOAD_BLOCK_SIZE
        self.sched = scheduler_class(
            layouts=case.layouts,
            offload_block_size=OFFLOAD_BLOCK_SIZE,
            hash_block_size=DEVICE_BLOCK_SIZE,
            num_slots=case.num_groups * chunks + 1,
            slot_bytes=1,
            world_size=1,
            tracing=tracing,
            kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER,
        )
        step = OFFLOAD_BLOCK_SIZE // DEVICE_BLOCK_SIZE
        for layout in case.layouts:
            for k in range(chunks):
                key = (layout.index, case.hashes[(k + 1) * step - 1])
                assert self.sched.index.reserve_for_store(key) is not None
                self.sched.index.complete_store(key)
        self.group_block_ids = case.kv_blocks.get_block_ids()

    def prepare(self, n: int) -> list:
        hashes = self.case.hashes
        reqs = [_request(f"kvscope-{i}", self.case.prompt, lambda r: list(hashes)) for i in range(n)]
        for req in reqs:
            hit, _ = self.sched.get_num_new_matched_tokens(req, self.case.local)
            if hit != self.case.external:
                raise AssertionError(f"{self.case.name}: kvscope found {hit} tokens, expected {self.case.external}")
        return reqs

    def call(self, reqs: list) -> None:
        update, blocks, external = self.sched.update_state_after_alloc, self.case.kv_blocks, self.case.external
        for req in reqs:
            update(req, blocks, external)
        if self.tracing.enabled:
            self.tracing.force_flush()  # the span export is part of the cost

    def prepare_lookup(self, n: int) -> list:
        hashes = self.case.hashes
        return [_request(f"lookup-{i}", self.case.prompt, lambda r: list(hashes)) for i in range(n)]

    def scan(self, reqs: list) -> None:
        """The scans alone, as `_plan_load` runs them (with a load span when tracing)."""
        sched, ids = self.sched, self.group_block_ids
        local, cached = self.case.local, self.case.local + self.case.external
        if self.tracing.enabled:
            tracing = self.tracing
            for _ in reqs:
                start = time.time_ns()
                scans, records = sched._scan_groups_traced(ids, local, cached, start)
                tracing.end_load(None, start, time.time_ns(), ("scan", local, cached - local, len(scans), records, None))
            self.tracing.force_flush()
        else:
            for _ in reqs:
                sched._scan_groups(ids, local, cached, time.perf_counter_ns())

    def scan_bare(self, reqs: list) -> None:
        """The same scans with no instrumentation: no timer, no stats, no span."""
        layouts, ids, block = self.sched.layouts, self.group_block_ids, self.sched.block_size
        local, cached = self.case.local, self.case.local + self.case.external
        for _ in reqs:
            for layout, group_ids in zip(layouts, ids):
                scan_group(layout, group_ids, local, cached, block)

    def planned(self) -> list[list[int]]:
        job = self.sched._pending_loads[-1]
        assert not job.failed_at_plan
        by_group = {g.group_index: g.block_ids for g in job.groups}
        return [by_group.get(i, []) for i in range(self.case.num_groups)]

    def reset(self) -> None:
        s = self.sched
        for job in s._jobs.values():
            for key in job.keys:
                s.index.unpin(key)
        s._jobs.clear()
        s._pending_loads.clear()
        s._requests.clear()
        s._lookups.clear()
        s.admission = LoadAdmission(s.layouts, s.admission.lookahead_tokens)  # no load left waiting to run
        s.take_stats()


def _lookups(sched, local: int):
    """A sampler's run: `sched`'s lookup (`get_num_new_matched_tokens`) of each prepared request."""
    def run(reqs: list) -> None:
        lookup = sched.get_num_new_matched_tokens
        for req in reqs:
            lookup(req, local)
    return run


# ----------------------------------------------------------------------------- timing
@dataclass
class Result:
    case: Case
    pending_blocks: int
    seconds: dict[str, float]  # side -> median seconds per request
    cpu_seconds: dict[str, float]  # CPU_SIDES -> median CPU seconds of this process per request
    export_process_cpu: float = 0.0  # CPU seconds per request of `kvscope_on`'s helper process (mean)


def _sample(prepare, run, reset, number: int) -> float:
    """Seconds per request of `run` over `number` prepared requests (gc off while timed)."""
    return _sample_with_cpu(prepare, run, reset, number)[0]


def _sample_with_cpu(prepare, run, reset, number: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) per request of `run` over `number` requests."""
    reqs = prepare(number)
    gc.disable()
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        run(reqs)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        gc.enable()
        reset()
    return elapsed / number, cpu / number


def measure(case: Case, vllm_config, trace_dir: str, repeats: int, min_sample_s: float) -> Result:
    vllm = VllmSide(vllm_config, case)
    bare = KVScopeSide(case, KVScopeTracing.disabled(), UninstrumentedScheduler)
    off = KVScopeSide(case, KVScopeTracing.disabled())
    on_tracing = KVScopeTracing.from_config(
        trace_file=os.path.join(trace_dir, f"planner-{case.name.replace('/', '-')}.jsonl"), sample_ratio=1.0)
    on = KVScopeSide(case, on_tracing)
    # The same sink with the spans encoded by the engine process's export thread, not a helper.
    thread_tracing = KVScopeTracing.from_config(
        trace_file=os.path.join(trace_dir, f"thread-{case.name.replace('/', '-')}.jsonl"), sample_ratio=1.0,
        env={**os.environ, EXPORT_MODE_VARIABLE: "thread"})
    on_thread = KVScopeSide(case, thread_tracing)
    sampled_tracing = KVScopeTracing.from_config(
        trace_file=os.path.join(trace_dir, f"sampled-{case.name.replace('/', '-')}.jsonl"), sample_ratio=SAMPLED_RATIO)
    sampled = KVScopeSide(case, sampled_tracing)
    # Recording and queueing: spans recorded and queued exactly as with a trace file, then dropped
    # instead of marshalled.
    noexport_tracing = no_export_tracing()
    noexport = KVScopeSide(case, noexport_tracing)
    floor = KVScopeSide(case, FloorTracing(), FloorScheduler)
    try:
        # Same plan on every side: the same device blocks, group by group.
        for side in (vllm, bare, off, on, on_thread, noexport, floor, sampled):
            side.call(side.prepare(1))
            planned = side.planned()
            side.reset()
            if planned != case.expected_block_ids:
                sizes = [len(p) for p in planned]
                raise AssertionError(f"{case.name}: {type(side).__name__} planned {sizes} blocks per group, "
                                     f"expected {[len(e) for e in case.expected_block_ids]}")
        samplers = {
            "vllm": (vllm.prepare, vllm.call, vllm.reset),
            "kvscope_bare": (bare.prepare, bare.call, bare.reset),
            "kvscope_off": (off.prepare, off.call, off.reset),
            "kvscope_on": (on.prepare, on.call, on.reset),
            "kvscope_on_thread": (on_thread.prepare, on_thread.call, on_thread.reset),
            "kvscope_on_noexport": (noexport.prepare, noexport.call, noexport.reset),
            "kvscope_on_floor": (floor.prepare, floor.call, floor.reset),
            "kvscope_on_sampled": (sampled.prepare, sampled.call, sampled.reset),
            "kvscope_scan_off": (lambda n: [None] * n, off.scan, off.reset),
            "kvscope_scan_on": (lambda n: [None] * n, on.scan, on.reset),
            "kvscope_scan_on_noexport": (lambda n: [None] * n, noexport.scan, noexport.reset),
            "kvscope_scan_bare": (lambda n: [None] * n, off.scan_bare, off.reset),
            # the same lookups as `prepare` runs (and checks: both find the whole hit), timed
            "vllm_lookup": (vllm.prepare_lookup, _lookups(vllm.sched, case.local), vllm.reset),
            "kvscope_lookup": (off.prepare_lookup, _lookups(off.sched, case.local), off.reset),
        }
        # Requests per sample from the planners' own time: a flush's fixed wait (the export
        # thread, the helper process) must not shrink the samples it is then spread over. Timed
        # over a few requests, not one: a lone first call is several times slower, and samples
        # sized by it were a few ms long, shorter than CPython's 5 ms GIL switch interval, so the
        # export thread never ran before the flush and the whole export landed in the wait for it.
        one = max(_sample(*samplers[s], _SIZING_REQUESTS) for s in ("vllm", "kvscope_off"))
        number = max(1, min(_MAX_SAMPLE_REQUESTS, int(min_sample_s / max(one, 1e-9))))
        sides = SIDES + LOOKUP_SIDES
        samples: dict[str, list[float]] = {s: [] for s in sides}
        cpu_samples: dict[str, list[float]] = {s: [] for s in CPU_SIDES}
        helper_cpu = 0.0
        for r in range(repeats):
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            for side in order:
                before = _export_process_cpu_s(on_tracing) if side == "kvscope_on" else 0.0
                wall, cpu = _sample_with_cpu(*samplers[side], number)
                samples[side].append(wall)
                if side in cpu_samples:
                    cpu_samples[side].append(cpu)
                if side == "kvscope_on":
                    helper_cpu += _export_process_cpu_s(on_tracing) - before
    finally:
        on_tracing.shutdown()
        thread_tracing.shutdown()
        noexport_tracing.shutdown()
        sampled_tracing.shutdown()
        vllm.sched.shutdown()
    pending = sum(len(ids) for ids in case.expected_block_ids)
    medians = {s: statistics.median(v) for s, v in samples.items()}
    cpu_medians = {s: statistics.median(v) for s, v in cpu_samples.items()}
    return Result(case, pending, medians, cpu_medians, helper_cpu / (repeats * number))


def _export_process_cpu_s(tracing: KVScopeTracing) -> float:
    """CPU seconds the span export helper process of `tracing` has used so far (0 if none runs)."""
    pid = tracing._processor._exporters[0].pid  # the ExportProcess behind the batcher
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/schedstat") as f:  # ns on a CPU (its main thread: the one that encodes)
        return int(f.read().split()[0]) / 1e9


def measure_all(quick: bool, sizes=None, groups=None, repeats=None, min_sample_s=None) -> list[Result]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    vllm_config = _vllm_config()
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    sizes = sizes or (SIZES_QUICK if quick else SIZES_FULL)
    repeats = repeats or (7 if quick else 15)
    # Long samples: the export helper runs behind the engine by up to CPython's 5 ms GIL switch
    # interval plus a batch, and each sample's flush waits for that tail, which no engine does;
    # at 30 ms a sample it was a tenth of the sample at 128 blocks.
    min_sample_s = min_sample_s or (0.05 if quick else 0.1)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvscope-planner-bench-") as trace_dir:
        for num_groups in groups or sorted(GROUP_MIXES):
            for blocks in sizes:
                case = make_case(num_groups, blocks, hash_fn)
                results.append(measure(case, vllm_config, trace_dir, repeats, min_sample_s))
                del case
                gc.collect()
    return results


def to_records(results: list[Result]) -> list[dict]:
    """{name, median, unit, ratio, ratio_of}; median in µs per request.

    Each side against vLLM; `telemetry_*` repeat a side's median against the uninstrumented
    planner (`kvscope_bare`); `kvscope_scan_*` against the bare scans.
    """
    records = []

    def record(name: str, side: str, reference: str | None, cpu: bool = False) -> None:
        seconds, suffix = (r.cpu_seconds, "_cpu") if cpu else (r.seconds, "")
        records.append({
            "name": f"planner_vs_vllm.{name}[{r.case.name}]",
            "median": seconds[side] * 1e6,
            "unit": "us",
            "ratio": seconds[side] / seconds[reference] if reference else None,
            "ratio_of": f"planner_vs_vllm.{reference}{suffix}[{r.case.name}]" if reference else None,
        })

    for r in results:
        record("vllm", "vllm", None)
        for side in SIDES[1:]:
            record(side, side, "kvscope_scan_bare" if side in SCAN_SIDES else "vllm")
        record("vllm_lookup", "vllm_lookup", None)
        record("kvscope_lookup", "kvscope_lookup", "vllm_lookup")
        for name, side in TELEMETRY_SIDES.items():
            record(name, side, "kvscope_bare")
        # The engine process's CPU per request (all its threads; not the export helper's).
        record("vllm_cpu", "vllm", None, cpu=True)
        for side in CPU_SIDES[1:]:
            record(f"{side}_cpu", side, "vllm", cpu=True)
        for name, side in TELEMETRY_SIDES.items():
            if side in CPU_SIDES:
                record(f"{name}_cpu", side, "kvscope_bare", cpu=True)
        # Not the engine's time: the CPU that encoding and writing the spans takes in the helper
        # process (`kvscope_on`), per request, against the uninstrumented planner's time.
        records.append({
            "name": f"planner_vs_vllm.export_process_cpu[{r.case.name}]",
            "median": r.export_process_cpu * 1e6,
            "unit": "us",
            "ratio": r.export_process_cpu / r.seconds["kvscope_bare"],
            "ratio_of": f"planner_vs_vllm.kvscope_bare[{r.case.name}]",
        })
    return records


def run(quick: bool = False) -> list[dict]:
    return to_records(measure_all(quick))


def format_table(results: list[Result]) -> str:
    rows = [("case", "pending", "vLLM µs", "kvscope off µs", "on µs", "off/vLLM", "on/vLLM",
             "on no export/vLLM", "off/bare", "on/bare", "on CPU/bare", "on thread/bare", "on no export/bare",
             "floor/bare",
             f"on {SAMPLED_RATIO:.0%}/bare", f"on {SAMPLED_RATIO:.0%} CPU/bare", "helper CPU µs", "scan off/bare",
             "scan on/bare",
             "lookup vLLM µs", "lookup kvscope/vLLM")]
    for r in results:
        s = r.seconds
        rows.append((r.case.name, str(r.pending_blocks), f"{s['vllm'] * 1e6:.1f}",
                     f"{s['kvscope_off'] * 1e6:.1f}", f"{s['kvscope_on'] * 1e6:.1f}",
                     f"{s['kvscope_off'] / s['vllm']:.2f}", f"{s['kvscope_on'] / s['vllm']:.2f}",
                     f"{s['kvscope_on_noexport'] / s['vllm']:.2f}",
                     f"{s['kvscope_off'] / s['kvscope_bare']:.3f}",
                     f"{s['kvscope_on'] / s['kvscope_bare']:.2f}",
                     f"{r.cpu_seconds['kvscope_on'] / r.cpu_seconds['kvscope_bare']:.2f}",
                     f"{s['kvscope_on_thread'] / s['kvscope_bare']:.2f}",
                     f"{s['kvscope_on_noexport'] / s['kvscope_bare']:.2f}",
                     f"{s['kvscope_on_floor'] / s['kvscope_bare']:.2f}",
                     f"{s['kvscope_on_sampled'] / s['kvscope_bare']:.2f}",
                     f"{r.cpu_seconds['kvscope_on_sampled'] / r.cpu_seconds['kvscope_bare']:.2f}",
                     f"{r.export_process_cpu * 1e6:.1f}",
                     f"{s['kvscope_scan_off'] / s['kvscope_scan_bare']:.3f}",
                     f"{s['kvscope_scan_on'] / s['kvscope_scan_bare']:.2f}",
                     f"{s['vllm_lookup'] * 1e6:.1f}", f"{s['kvscope_lookup'] / s['vllm_lookup']:.2f}"))
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    results = measure_all(args.quick)
    print(f"update_state_after_alloc per request, device blocks of {DEVICE_BLOCK_SIZE} tokens, "
          f"offload blocks of {OFFLOAD_BLOCK_SIZE}; case = groups/device blocks per group")
    print(format_table(results))
    print("ratios below 1: kvscope faster than vLLM's uninstrumented planner")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
