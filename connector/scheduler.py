"""Scheduler side: host-tier lookups, multi-group load plans and store jobs, as vLLM calls them.

This module adapts vLLM objects (`Request`, `KVCacheBlocks`, `SchedulerOutput`) to the pure
planning code (`lookup.py`, `planning.py`) and the host index (`host_store.py`). Lookups are
counted and traced by `lookup_records.py`. What a step stores is planned by `store_plans.py` (with
`piecewise_stores.py`); the device blocks unreported stores still read are tracked by `store_sources.py`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .groups import GroupKind, GroupLayout
from .host_store import HostIndex
from .load_admission import Deferral, LoadAdmission
from .lookup import find_hit_tokens
from .lookup_records import Lookup, LookupRecords, deferral_values, record_wait_span
from .metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, KVScopeWorkerMetadata, TransferJob
from .miss_reasons import Miss, barred_from_hit, lookup_miss, miss_order, missed_tokens_by_reason
from .offload_keys import OffloadKeys
from .piecewise_stores import PiecewiseStores
from .planning import GroupScan, gather_load, scan_group
from .prefix_recency import finished_prefix_keys
from .state_blocks import StateBlocks
from .store_plans import StorePlanner, StoreProgress
from .store_sources import StoreSources, allocated_anew
from .telemetry.failures import telemetry_failed
from .telemetry.metrics import KVScopeStats
from .telemetry.span_records import STORE_SPAN, WAIT_ADMITTED, WAIT_ENDED
from .telemetry.tracing import KVScopeTracing, SpanRef

logger = logging.getLogger(__name__)


def _pin_nothing(key) -> None:
    """A load planned to fail pins no host block."""
    return None


def _window_admission_caps(kv_cache_manager, layouts: list[GroupLayout]) -> dict[int, int]:
    """vLLM's per-request cap of each sliding-window group (`load_admission`): its manager's
    `max_admission_blocks_per_request` (0.32 to 0.34). A group without a readable one gets none: the
    bound counts it whole."""
    caps = {}
    managers = getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers", ())
    for layout in layouts:
        if layout.kind is GroupKind.SLIDING_WINDOW and layout.index < len(managers):
            cap = getattr(managers[layout.index], "max_admission_blocks_per_request", None)
            if type(cap) is int and cap > 0:
                caps[layout.index] = cap
    return caps


def _takes_no_external_kv(request) -> bool:
    """Whether vLLM takes none of a connector's hit for the request, whatever it is (prompt logprobs):
    kvscope then defers nothing for it. 0.34's `skip_reading_external_kv`, 0.32's and 0.33's
    `skip_reading_prefix_cache`."""
    skips = getattr(request, "skip_reading_external_kv", None)
    return bool(getattr(request, "skip_reading_prefix_cache", False) if skips is None else skips)


def _barred_after_failed_load(state: _RequestState, request) -> bool:
    """Whether a request whose load failed must still recompute rather than load. It may load again once
    preempted (vLLM dropped the failed load's reserve with its blocks), or at a streaming session's next
    turn (its prefill, recomputed, finished: vLLM dropped the reserve then; a retry right after the
    failure starts from 0 tokens)."""
    return not (getattr(request, "num_preemptions", 0) > state.load_failed_preemptions
                or request.num_computed_tokens > 0)


@dataclass(slots=True)
class _RequestState:
    request: object
    trace_context: object | None = None  # parent for this request's kvscope spans
    store_progress: StoreProgress | None = None  # None: no store planned yet (or since a cache reset)
    # Mamba blocks a forward of the request ended in: (group, block index) -> block id, or None for
    # one a forward started inside and left (`StateBlocks`)
    witnessed_states: dict = field(default_factory=dict)
    # its device KV predates a cache reset (it kept running through it): nothing it computes is stored
    stores_stopped: bool = False
    load_job: object | None = None  # its latest load's `_Job` (a request waits for its load: one at a time)
    # a load of it failed: it recomputes, never loads again, until vLLM preempts it or its streaming
    # session goes on (see `get_num_new_matched_tokens`); its preemptions when the load failed
    load_failed: bool = False
    load_failed_preemptions: int = 0


@dataclass(slots=True)
class _Job:
    direction: str
    req_id: str
    keys: list  # load: host keys pinned
    fillings: list | tuple = ()  # store: the offloaded blocks it has pieces of (no list made per load)
    sources: list | tuple = ()  # store: the device blocks it reads
    plan_ns: int = 0
    loaded: list[tuple[int, int]] = field(default_factory=list)  # load: (group, blocks)
    reports: int = 0
    failed: bool = False
    aborted: bool = False  # load: its request ended (aborted) before the load was reported
    failed_at_plan: bool = False  # load: failed before any copy (its pinned host blocks are intact)


class KVScopeScheduler:
    def __init__(
        self,
        layouts: list[GroupLayout],
        offload_block_size: int,
        hash_block_size: int,
        num_slots: int,
        slot_bytes: int,
        world_size: int,
        tracing: KVScopeTracing,
        kv_cache_manager_getter,
        reprefillable_tokens: int = 0,
        draft_tokens: int = 0,
        eagle_groups: frozenset[int] = frozenset(),
        host_events=None,
        mamba_decode_states: bool = False,
        engine: int = 0,
    ):
        self.layouts = layouts
        # Groups whose hits must prove their next token (EAGLE drafters' KV): `find_hit_tokens`
        self.eagle_groups = eagle_groups
        self._kind_names = [layout.kind.value for layout in layouts]  # plain str: an enum's .value is slow
        self._full_attention_groups = [layout.index for layout in layouts if layout.kind is GroupKind.FULL_ATTENTION]
        self.block_size = offload_block_size
        self.keys = OffloadKeys(offload_block_size // hash_block_size)
        self.index = HostIndex(num_slots)
        self.stores = PiecewiseStores(self.index, layouts, offload_block_size, self.keys, draft_tokens)
        # KV cache events of the host tier (`host_tier_events.HostTierEvents`), or None when vLLM's are off
        self.host_events = host_events
        if host_events is not None:
            self.index.journal = []
            self.stores.describe = host_events.describe
        self.slot_bytes = slot_bytes
        self.capacity_bytes = num_slots * slot_bytes
        self.engine = engine  # this data-parallel engine's index: its host tier's usage is its own
        self.world_size = world_size
        self.tracing = tracing
        self._kv_cache_manager = kv_cache_manager_getter
        self.states = StateBlocks(layouts, speculative=draft_tokens > 0, decode_states=mamba_decode_states)
        self.store_planner = StorePlanner(layouts, offload_block_size, self.keys, self.stores, self.states)
        # vLLM's drafts are its lookahead tokens: a request first running asks blocks for them too
        self.admission = LoadAdmission(layouts, lookahead_tokens=draft_tokens)
        self._deferral_logged = False
        # The last tokens whose KV a drafter may write again (vLLM's multi-module MTP re-prefills
        # them): not final, so not stored, as vLLM does not cache them (`get_num_cacheable_tokens`)
        self.reprefillable_tokens = reprefillable_tokens
        self._lookups: dict[str, Lookup] = {}
        # vLLM rounds its device hit down to a device block for the lookup, and keeps the hit whole when
        # the tier's does not reach past it: possible only with hash blocks smaller than a device block
        # (Mamba's align mode, groups of several block sizes). Requests first scheduled with no load are
        # then counted and traced at `build_connector_meta`, from the hit vLLM kept (`LookupRecords.settle`).
        self._device_hits_may_end_mid_block = hash_block_size < max((g.block_size for g in layouts), default=0)
        self._requests: dict[str, _RequestState] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_job_id = 0
        self._pending_loads: list[TransferJob] = []
        self.store_sources = StoreSources(layouts, self._jobs)
        self._stats = KVScopeStats()
        self._stats.declare_groups([(layout.index, layout.kind.value) for layout in layouts])  # series at 0
        # Per group, one (nanoseconds, blocks scanned, null blocks skipped) per scan: a single list
        # append on the planning path, folded into the stats payload once per stats interval.
        self._scan_log: list[list[tuple[int, int, int]]] = [[] for _ in layouts]
        self.lookup_records = LookupRecords()  # the first-scheduled requests' lookups, counted and traced
        self._miss_layouts = miss_order(layouts)  # `lookup_miss`
        self._evicted_reported = 0
        self._deferrals_reported = 0  # `admission.deferrals` already in the stats
        self._deferral_waits_ns: list[int] = []  # each deferred load's wait once it ended, for the stats

    # -- keys --
    def _offload_hashes(self, request) -> list:
        """The key hash of each full offload block of the request (`offload_keys`)."""
        return self.keys.hashes(request.block_hashes)

    # -- lookup (side-effect free towards vLLM: only memoises its answer, and notes a load it defers) --
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        start = time.time_ns()
        state = self._requests.get(request.request_id)
        if state is not None and state.load_failed and not _barred_after_failed_load(state, request):
            state.load_failed = False
        if state is not None and state.load_failed:
            # Recompute, do not load again: vLLM (0.32 to 0.34) keeps the in-flight reserve of a request
            # whose async load failed, and counts it against the request's own next async admission,
            # which then never fits once the request needs half the free blocks: it would wait for ever
            # (until the reserve is gone: above).
            hashes = self._offload_hashes(request)
            barred = self._hit_tokens(request, num_computed_tokens, hashes)  # what it would have been offered
            miss = barred_from_hit(self._miss(request, num_computed_tokens, barred, hashes), barred)
            self._lookups[request.request_id] = Lookup(num_computed_tokens, 0, start, start, miss)
            return 0, False
        hashes = self._offload_hashes(request)
        external = self._hit_tokens(request, num_computed_tokens, hashes)
        if external and not self._load_may_start(request, start, external):
            return None, False  # vLLM asks again next step (`load_admission`)
        end = time.time_ns()
        # Why it did not serve more, outside the lookup's span time, as the stats it feeds are
        miss = self._miss(request, num_computed_tokens, external, hashes)
        deferred = self.admission.deferred
        # (its hit may be gone since it was deferred: the wait is still the request's)
        deferral = deferred.get(request.request_id) if deferred else None
        self._lookups[request.request_id] = Lookup(num_computed_tokens, external, start, end, miss, deferral)
        # Asynchronous load: the request waits while others run; Mamba state must land
        # before vLLM's mamba preprocessing, which a synchronous load would miss.
        return external, external > 0

    def may_load_async(self, request) -> bool:
        """Whether the request's lookup may find a load (vLLM 0.34's `--max-num-inflight-kv-loads`: such
        a request may start its load while the running batch is full). Asked as the request enters a
        waiting queue, of the host tier and vLLM's device prefix cache as they stand then: a hit gone by
        the lookup is a false positive, which holds back the loads queued behind it until a running slot
        frees; a hit stored since is a false negative, which loads once a slot frees, as without the option."""
        if _takes_no_external_kv(request):
            return False
        state = self._requests.get(request.request_id)
        if state is not None and state.load_failed and _barred_after_failed_load(state, request):
            return False
        manager = self._kv_cache_manager()
        probe = getattr(manager, "get_num_cached_tokens", None)  # (vLLM 0.34, which alone asks this)
        local = probe(request) if probe is not None else 0
        # (a host hit is whole offload blocks: one past this bound is past vLLM's block-aligned local hit too)
        local -= local % self.block_size
        return self._hit_tokens(request, local, self._offload_hashes(request)) > 0

    def _load_may_start(self, request, lookup_start_ns: int, load_tokens: int) -> bool:
        """Whether the request's load may start beside the loads vLLM has not yet run (`load_admission`)."""
        admission = self.admission
        if not admission.waiting_loads or _takes_no_external_kv(request):  # (vLLM would load nothing for it)
            return True
        manager = self._kv_cache_manager()
        usable = manager.block_pool.num_gpu_blocks - 1  # less the null block
        self._learn_window_caps(manager)
        if admission.may_start(request.request_id, request.num_tokens, usable, lookup_start_ns, load_tokens):
            return True
        if not self._deferral_logged:
            self._deferral_logged = True
            logger.info("kvscope: a load waits for the %d load(s) vLLM has not yet run to run first: together "
                        "they could need more than the device cache's %d blocks, where vLLM would stall; "
                        "loads wait like this whenever the device cache is nearly full (logged once)",
                        admission.waiting_loads, usable)
        return False

    def _learn_window_caps(self, manager) -> None:
        """Read once, from vLLM's KV cache manager, what a sliding-window group holds at most (admission's bound)."""
        if self.admission.window_caps is None:
            self.admission.window_caps = _window_admission_caps(manager, self.layouts)

    def _hit_tokens(self, request, num_computed_tokens: int, hashes: list) -> int:
        """The tokens past the device's that the host tier can serve (`find_hit_tokens`)."""
        index = self.index
        hit = find_hit_tokens(
            self.layouts,
            num_tokens=request.num_tokens,
            num_local_tokens=num_computed_tokens,
            num_hashed_blocks=len(hashes),
            offload_block_size=self.block_size,
            is_stored=lambda group, k: index.is_ready((group, hashes[k])),
            proof_groups=self.eagle_groups,
        )
        return max(0, hit - num_computed_tokens)

    def _miss(self, request, num_computed_tokens: int, external: int, hashes: list) -> Miss:
        """Why the tier served no more than ``external`` tokens (`miss_reasons`), asked of the index as
        it stands now."""
        index = self.index
        return lookup_miss(self._miss_layouts, request.num_tokens, num_computed_tokens, external, len(hashes),
                           self.block_size, lambda group, k: index.why_absent((group, hashes[k])),
                           self.eagle_groups)

    # -- planning --
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            state = _RequestState(request=request)
            if self.tracing.enabled:
                headers = getattr(request, "trace_headers", None)
                if headers:
                    state.trace_context = self.tracing.parent_from_trace_headers(headers)
            self._requests[req_id] = state
        lookup = self._lookups.pop(req_id, None)
        if num_external_tokens:
            self._learn_window_caps(self._kv_cache_manager())
        self.admission.admitted(req_id, request.num_tokens, loads=num_external_tokens > 0)
        if lookup is not None and lookup.deferred is not None:
            self._deferral_waits_ns.append(max(0, lookup.start_ns - lookup.deferred.first_ns))
        if state.stores_stopped and lookup is not None and lookup.local_tokens == 0:
            # Restarted from nothing after a cache reset stopped its stores (preempted, or its load
            # failed): all its KV is computed anew (or loaded from the tier, emptied by the reset), so
            # it is stored again. Not with a device prefix hit: vLLM's own reset failed then (blocks
            # were in use), and that hit may be the request's own KV from before the reset.
            state.stores_stopped = False
        lookup_record = None
        first_scheduled = request.num_computed_tokens == 0 and not getattr(request, "num_preemptions", 0)
        if first_scheduled and lookup is not None:
            # Counted like vLLM's external prefix-cache hits: once per request, when first scheduled.
            # A request resumed after preemption is looked up again, but vLLM counts that apart
            # (`preempted_hits`, not exported): so neither the lookup metrics nor a lookup span
            # count it here either; its load is traced under the request's first lookup (or upstream span).
            if num_external_tokens == 0 and self._device_hits_may_end_mid_block:
                self.lookup_records.unsettled.append((state, lookup))  # vLLM's device hit is known once scheduled
            else:
                lookup_record = self.lookup_records.record(self.tracing, state, lookup, num_external_tokens)
        if num_external_tokens == 0:
            if not first_scheduled and lookup is not None and lookup.deferred is not None and self.tracing.enabled:
                # Resumed, deferred, then admitted with nothing to load: neither a lookup span nor a load
                # span tells its wait, which the histogram observed above.
                record_wait_span(self.tracing, request, state, lookup.deferred, lookup.start_ns, WAIT_ADMITTED)
            sources = self.store_sources
            if sources.readers and request.num_computed_tokens == 0:  # admitted afresh: new blocks
                sources.unplanned.append((req_id, blocks, lookup.local_tokens if lookup is not None else 0))
            return
        if lookup is None:
            # vLLM looks up every request it gives external tokens: without that lookup the local hit,
            # and so where the load starts, is unknown (`num_computed_tokens` is still 0 here).
            logger.error("kvscope: no lookup for request %s; its load fails and vLLM recomputes", req_id)
            self._fail_load_at_plan(state, req_id, num_external_tokens)
            return
        if num_external_tokens != lookup.external_tokens:
            # vLLM takes a hit whole or not at all; a part of one could end off an offloaded block,
            # and a Mamba group would then get the state of another token count.
            logger.error("kvscope: request %s asks for %d external tokens, its lookup found %d; its load "
                         "fails and vLLM recomputes", req_id, num_external_tokens, lookup.external_tokens)
            # Planned, scans and spans alike, over the blocks vLLM gave it, but copying nothing: its
            # failure counts the blocks a load would have brought, and its workers' copy spans say ERROR.
            self._plan_load(state, request, blocks.get_block_ids(), lookup.local_tokens, num_external_tokens,
                            lookup_record, fail=True, deferral=lookup.deferred if lookup_record is None else None)
            return
        self._plan_load(state, request, blocks.get_block_ids(), lookup.local_tokens, num_external_tokens,
                        lookup_record, deferral=lookup.deferred if lookup_record is None else None)

    def _fail_load_at_plan(self, state, req_id: str, external: int) -> None:
        """A load job, of a request without a lookup, that fails on every worker without copying anything:
        vLLM recomputes the request. Counted as failed: the blocks the external tokens span in each group
        (without the lookup's device hit no scan can tell more)."""
        job_id = self._new_job_id()
        # Reported like any other load (`_report`): the request waits for its workers' failures.
        state.load_job = self._jobs[job_id] = _Job(
            direction=LOAD, req_id=req_id, keys=[], plan_ns=time.perf_counter_ns(), failed_at_plan=True,
            loaded=[(layout.index, 1 if layout.kind is GroupKind.MAMBA else -(-external // layout.block_size))
                    for layout in self.layouts])
        self._pending_loads.append(TransferJob(job_id=job_id, req_id=req_id, direction=LOAD, groups=[],
                                               failed_at_plan=True))

    def _plan_load(self, state, request, group_block_ids, local: int, external: int,
                   lookup_record: tuple | None = None, fail: bool = False, deferral: Deferral | None = None) -> None:
        """``fail``: plan it, but pin and copy nothing (the workers fail it): vLLM recomputes. ``deferral``:
        how long kvscope deferred this load, told by its load span (a request resumed after preemption:
        its lookup has no span)."""
        req_id = request.request_id
        cached = local + external
        tracing = self.tracing
        parent = state.trace_context
        # Traced: under the lookup or upstream span (a SpanRef: sampling kept it); with no span before
        # it (tracing on, no lookup recorded), the load roots a trace. Not: tracing off, or dropped.
        traced = type(parent) is SpanRef or (parent is None and tracing.enabled)
        plan_ns = time.perf_counter_ns()  # the request's load latency starts here, and so do its scans
        if traced:
            load_start = time.time_ns()
            scans, scan_records = self._scan_groups_traced(group_block_ids, local, cached, load_start)
        else:
            scans = self._scan_groups(group_block_ids, local, cached, plan_ns)
        job_id = self._new_job_id()
        gathered = gather_load(scans, self._offload_hashes(request),
                               self.index.pin_for_load if not fail else _pin_nothing)
        job = state.load_job = _Job(direction=LOAD, req_id=req_id, keys=gathered.keys, plan_ns=plan_ns,
                                    loaded=gathered.loaded)
        parts = [GroupTransfer(scan.group_index, scan.block_ids, slots, scan.sub_indices)
                 for scan, slots in gathered.slots]
        failed = fail or gathered.missing
        # What it loads was used last, tail first: a prefix is evicted from its tail (here group by group,
        # for the hot path; the request's finish orders its prefix block by block across groups)
        self.index.touch(reversed(job.keys))
        carrier = None
        if traced:
            # One record for the lookup, the load and its scans; the carrier puts the copy spans under the load.
            try:
                values = (req_id, local, external, len(scans), scan_records, lookup_record)
                if deferral is not None:
                    values += deferral_values(deferral, load_start)
                carrier = tracing.end_load(parent, load_start, time.time_ns(), values)
            except Exception:  # the load's slots are pinned: it must reach the workers (`telemetry_failed`)
                telemetry_failed("the load span")
                tracing.record_failed()
        if failed:
            job.failed_at_plan = True
            if not fail:
                logger.warning("kvscope: host blocks for request %s vanished before the load; "
                               "vLLM will recompute", req_id)
        self._jobs[job_id] = job
        self._pending_loads.append(
            TransferJob(
                job_id=job_id,
                req_id=req_id,
                direction=LOAD,
                groups=parts,
                trace_carrier=carrier,
                failed_at_plan=failed,
            )
        )

    def _touch_prefix(self, hashes: list, loaded: list) -> None:
        """Mark a finished request's prefix used, block by block from the last, so the tier evicts it from
        its tail and what stays is still a hit (as vLLM's own offloading LRU orders a request's blocks when
        it finishes): the run of offloaded blocks from the first that every full-attention group holds (a
        hit needs them all; blocks past a gap no lookup reaches); in the other groups, only the blocks a
        hit at that run's end needs and the ones the request loaded (``loaded``: the keys of its last load).
        A sliding window's or Mamba group's other blocks serve only hits ending elsewhere: marking them all
        cost 1-3% of the hit tokens on a prefix-sharing workload (`bench/eviction_bench.py`)."""
        reachable = self.index.ready_run(self._full_attention_groups, hashes)
        self.index.touch(finished_prefix_keys(self.layouts, hashes, reachable, self.block_size, loaded))

    def _scan_groups(self, group_block_ids, local, cached, t0: int) -> list[GroupScan]:
        """Each group's scan, timed from ``t0`` (``perf_counter_ns``) for the scan histogram."""
        scans = []
        clock = time.perf_counter_ns
        for layout, ids, log in zip(self.layouts, group_block_ids, self._scan_log):
            scan = scan_group(layout, ids, local, cached, self.block_size)
            t1 = clock()  # one clock read per group: each scan's end starts the next
            log.append((t1 - t0, scan.blocks_total, scan.null_skipped))
            scans.append(scan)
            t0 = t1
        return scans

    def _scan_groups_traced(self, group_block_ids, local, cached, t0: int) -> tuple[list[GroupScan], list[tuple]]:
        """`_scan_groups` for a sampled load starting at ``t0`` (epoch ns): also each group's
        ``kvscope.group.scan`` values, as the load's record carries them (``(start_ns, end_ns,
        *SCAN_SPAN values)``, `span_records.LOAD_PLAN`)."""
        scans, records = [], []
        clock = time.time_ns  # span times are epoch ns; the scan histogram takes the same interval
        for layout, kind, ids, log in zip(self.layouts, self._kind_names, group_block_ids, self._scan_log):
            scan = scan_group(layout, ids, local, cached, self.block_size)
            t1 = clock()  # one clock read per group: each scan's end starts the next
            records.append((t0, t1, layout.index, kind, scan.blocks_total, scan.null_skipped,
                            len(scan.block_ids), scan.start))
            log.append((t1 - t0 if t1 > t0 else 0, scan.blocks_total, scan.null_skipped))
            scans.append(scan)
            t0 = t1
        return scans, records

    def _new_job_id(self) -> int:
        self._next_job_id += 1
        return self._next_job_id

    # -- per step --
    def build_connector_meta(self, scheduler_output) -> KVScopeMetadata:
        meta = KVScopeMetadata(loads=self._pending_loads)
        self._pending_loads = []
        sources = self.store_sources
        sources.order_loads(meta.loads)
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        if self.lookup_records.unsettled:  # before the stores: a lookup span may root its request's trace
            self.lookup_records.settle(self.tracing, computed)
        self.admission.ran(scheduler_output.num_scheduled_tokens)
        if sources.readers:
            meta.fence_stores = sources.reallocated(scheduler_output, computed)
        sources.unplanned.clear()
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        restarted = None
        if self.states.groups:
            restarted = self._restarted(scheduler_output)
            self.states.given_out_anew(allocated_anew(self.layouts, scheduler_output))  # before this step's forwards
        requests, count_keys, reprefillable = self._requests, self.keys.count, self.reprefillable_tokens
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = requests.get(req_id)
            if state is None or req_id not in computed:
                continue
            if restarted is not None:
                self._note_state_end(state, computed[req_id], scheduled, req_id in restarted)
            # KV final by the end of this step: not its drafts, nor, under async scheduling, the
            # previous step's (counted as computed before vLLM knows which it accepts; a rejected
            # one's KV is rewritten in place): only tokens the request knows
            done_after_step = computed[req_id] + scheduled - reprefillable
            if spec:
                done_after_step -= len(spec.get(req_id, ()))
            request = state.request
            # Most decode steps store nothing (`StoreProgress.idle_until`), checked here: once per
            # scheduled request per step
            progress = state.store_progress
            if progress is not None and done_after_step < progress.idle_until \
                    and progress.idle_known == count_keys(request.block_hashes):
                continue
            done_after_step = min(done_after_step, request.num_tokens - reprefillable)
            job = self._plan_store(state, done_after_step)
            if job is not None:
                meta.stores.append(job)
        try:
            self._update_capacity_stats()
            self.tracing.end_step()  # this step's lookup, load and store spans are all recorded
        except Exception:  # the step's loads and stores are in `meta` (`telemetry_failed`)
            telemetry_failed("the scheduler's end of step")
        return meta

    @staticmethod
    def _restarted(scheduler_output) -> set[str]:
        """Requests that start again this step (new, or resumed after preemption): new blocks."""
        restarted = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        restarted.update(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        return restarted

    def _note_state_end(self, state: _RequestState, computed: int, scheduled: int, restarted: bool) -> None:
        """Witness the Mamba blocks this step's forward of the request ends in (`StateBlocks`); a
        request that starts again has new blocks: forget the old ones."""
        if restarted:
            state.witnessed_states.clear()
        req_id = state.request.request_id
        self.states.note_forward(state.witnessed_states, computed, computed + scheduled,
                                 lambda: self._kv_cache_manager().get_blocks(req_id).blocks,
                                 state.request.num_prompt_tokens)

    def _plan_store(self, state: _RequestState, computed_tokens: int) -> TransferJob | None:
        """The request's store job of this step (`StorePlanner.plan`), traced; None when it stores nothing."""
        if state.stores_stopped:
            return None
        request = state.request
        if state.store_progress is None:
            state.store_progress = self.store_planner.start()
        parts, fillings = self.store_planner.plan(
            request, state.store_progress, computed_tokens, state.witnessed_states,
            lambda: self._kv_cache_manager().get_blocks(request.request_id).blocks)
        if not parts:
            return None
        job_id = self._new_job_id()
        sources = [block_id for part in parts for block_id in part.block_ids]
        self._jobs[job_id] = _Job(direction=STORE, req_id=request.request_id, keys=[], fillings=fillings,
                                  sources=sources)
        self.store_sources.add(job_id, sources)
        carrier = None
        tracing = self.tracing
        if tracing.may_record(state.trace_context):
            try:
                span = tracing.open_span(state.trace_context)
                carrier = tracing.carrier_of(span)  # None when sampling dropped it
                tracing.end_span(STORE_SPAN, span, time.time_ns(),
                                 (request.request_id, len(parts), sum(len(p.block_ids) for p in parts)))
            except Exception:  # the job holds slots and is in `_jobs`: it must reach the workers
                carrier = None
                telemetry_failed("the store span")
                tracing.record_failed()
        return TransferJob(job_id, request.request_id, STORE, parts, trace_carrier=carrier)

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVScopeWorkerMetadata):
            return
        for job_id, n in meta.completed_jobs.items():
            self._report(job_id, n, failed=False)
        for job_id, n in meta.failed_jobs.items():
            self._report(job_id, n, failed=True)

    def has_unreported_jobs(self) -> bool:
        """Whether a load or store job still waits for a worker's report."""
        return bool(self._jobs)

    def _report(self, job_id: int, workers: int, failed: bool) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            return
        job.reports += workers
        job.failed |= failed
        if job.reports < self.world_size:
            return  # a transfer is done only when every worker has reported it
        del self._jobs[job_id]
        if job.direction == STORE:
            self.store_sources.release(job_id, job.sources)
            self.stores.job_reported(job.fillings, job.failed)
            return
        for key in job.keys:
            self.index.unpin(key)
        if job.failed:
            state = self._requests.get(job.req_id)
            if state is not None:
                state.load_failed = True
                state.load_failed_preemptions = getattr(state.request, "num_preemptions", 0)
            if not job.failed_at_plan:
                # A copy failed: whatever those slots hold cannot be trusted. Forget them, so the
                # retry that vLLM schedules misses and recomputes instead of failing the same way again.
                # (A load failed at planning copied nothing: its blocks stay for later hits.)
                self.index.drop(job.keys)
        try:  # the report's bookkeeping is done: a fault here costs its stats (`telemetry_failed`)
            if job.failed:
                self._stats.record_load_failures(sum(blocks for _, blocks in job.loaded))
            else:
                # Blocks loaded into device KV (its load bytes are counted where they move: each worker's
                # copy), an aborted request's too: loaded plus failed blocks are its scans' pending blocks.
                # Its load time is not a request's: vLLM frees its blocks, unused, once the load is done.
                if not job.aborted:
                    self._stats.record_request_load((time.perf_counter_ns() - job.plan_ns) / 1e9)
                for group, blocks in job.loaded:
                    self._stats.record_loaded_blocks(group, self.layouts[group].kind.value, blocks)
        except Exception:
            telemetry_failed("a job report's stats")

    def _update_capacity_stats(self) -> None:
        evicted = self.index.evicted_total - self._evicted_reported
        if evicted:
            self._stats.record_evictions(evicted)
            self._evicted_reported = self.index.evicted_total
        self._stats.set_host_usage(self.index.used_slots * self.slot_bytes, self.capacity_bytes, self.engine)

    # -- request end / cache reset --
    def request_finished(self, request) -> tuple[bool, None]:
        req_id = request.request_id
        state = self._requests.pop(req_id, None)
        self._lookups.pop(req_id, None)
        deferral = self.admission.ended(req_id)
        if deferral is not None:
            # Aborted while its load waited for device KV room (a client gave up, say): its wait is
            # observed too, or the longest waits, the ones clients give up on, would never be.
            end_ns = time.time_ns()
            self._deferral_waits_ns.append(max(0, end_ns - deferral.first_ns))
            if self.tracing.enabled:
                record_wait_span(self.tracing, request, state, deferral, end_ns, WAIT_ENDED)
        if state is not None:
            # Its prefix was used last: its stores went in head first, so this puts the head last in line
            self._touch_prefix(self._offload_hashes(request), state.load_job.keys if state.load_job else [])
        if state is not None and state.store_progress is not None:
            self.stores.request_finished(request, state.store_progress.filling)
        if state is not None and state.load_job is not None:
            # Aborted while its load runs: vLLM frees the blocks, uncached, once the load is done
            # (a load already reported is out of `_jobs`: the mark changes nothing there).
            state.load_job.aborted = True
        # Stores are complete (CPU) or fenced before block reuse (CUDA): free at once.
        return False, None

    def reset_cache(self) -> bool:
        """vLLM resets its caches (`reset_prefix_cache(reset_connector=True)`, e.g. after a weight
        update): KV computed before must never load after. Every stored block is forgotten (one a
        load still reads, once read); offloaded blocks still being filled or written are given up,
        so their earlier pieces never complete with later ones. Requests vLLM preempted for the
        reset (`reset_running_requests`: no tokens computed now) store again from their first
        block, as vLLM's own offloading does: they compute it all again. Requests that still hold
        KV (vLLM resets anyway without `reset_running_requests`, though its own cache stays;
        requests loading) keep computing on KV from before, so they store nothing more."""
        for filling in list(self.stores.by_key.values()):
            self.stores.give_up(filling)
        for state in self._requests.values():
            state.store_progress = None
            if state.request.num_computed_tokens > 0:
                state.stores_stopped = True
        self.index.clear()
        try:  # the reset's own stats carry the emptied tier (out with the next step)
            self._update_capacity_stats()
        except Exception:  # the tier is reset: vLLM must hear so (`telemetry_failed`)
            telemetry_failed("the host tier's stats after a reset")
        return True

    def take_events(self) -> list | tuple:
        """The host tier's KV cache events since the last call (none when vLLM's are off)."""
        journal = self.index.journal
        if not journal:
            return ()
        return self.host_events.take(journal)

    def take_stats(self) -> KVScopeStats | None:
        # Taken out first: a recording that raises (`telemetry_failed`) loses this step's entries, never
        # counts them twice, nor keeps them to fail again at every step
        records = self.lookup_records
        lookups, records.log = records.log, []
        scan_logs, self._scan_log = self._scan_log, [[] for _ in self.layouts]
        deferrals = self.admission.deferrals
        deferred, self._deferrals_reported = deferrals - self._deferrals_reported, deferrals
        if deferred:  # no key (nor a non-empty payload) while no load waits for device KV room
            self._stats.record_deferred_loads(deferred)
        waits, self._deferral_waits_ns = self._deferral_waits_ns, []
        for wait_ns in waits:
            self._stats.record_deferral_wait(wait_ns / 1e9)
        record_missed = self._stats.record_missed
        for queried, hit, lookup in lookups:
            self._stats.record_lookup(queried, hit)
            for reason, tokens in missed_tokens_by_reason(queried, hit, lookup.external_tokens, lookup.miss):
                record_missed(reason, tokens)
        for layout, log in zip(self.layouts, scan_logs):
            if log:
                self._stats.record_scans(layout.index, layout.kind.value, sum(entry[1] for entry in log),
                                         sum(entry[2] for entry in log), [entry[0] / 1e9 for entry in log])
        try:
            for reason, records in self.tracing.take_lost_records().items():
                self._stats.record_dropped_trace_records(reason, records)
        except Exception:
            telemetry_failed("the scheduler's lost span count")
        return self._stats.take()
