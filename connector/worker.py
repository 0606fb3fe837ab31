"""Worker side: executes the scheduler's transfer jobs on this worker's shard of the KV cache."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from .copy_engine import CopyEngine, CopyResult
from .metadata import LOAD, STORE, KVScopeMetadata, KVScopeWorkerMetadata, TransferJob
from .planning import NULL_BLOCK_ID
from .telemetry.failures import telemetry_failed
from .telemetry.metrics import KVScopeStats
from .telemetry.span_records import COPY_SPAN, FAILED_COPY_SPAN
from .telemetry.tracing import KVScopeTracing

logger = logging.getLogger(__name__)

FAIL_LOADS_VARIABLE = "KVSCOPE_TEST_FAIL_LOADS_ON_RANK"


# Where a worker orders later compute after its stores (CUDA; CPU copies finish inside the step):
FENCE_AT_ONCE = "at_once"  # right after the step's stores
# when the next step begins (`handle_preemptions`), under a runner that writes nothing before it
# (vLLM's V1 runner, which saves before the sampling: the sampling need not wait)
FENCE_AT_NEXT_STEP = "at_next_step"
# only in a step that allocates a block an unreported store reads (`KVScopeMetadata.fence_stores`),
# when it begins: for caches whose blocks nothing rewrites in place or zeroes (no Mamba, one precision)
FENCE_WHEN_REUSED = "when_reused"


@dataclass
class _InFlight:
    job: TransferJob
    copies: list[tuple[int, CopyResult]]  # (group index, copy)
    failed: bool = False


class KVScopeWorker:
    def __init__(self, kv_cache_config, slot_layout, num_slots, group_kinds, rank, tracing: KVScopeTracing):
        self.kv_cache_config = kv_cache_config
        self.slot_layout = slot_layout
        self.num_slots = num_slots
        self.group_kinds = group_kinds  # GroupKind value per group, for labels
        self.rank = rank
        self.tracing = tracing
        self.engine: CopyEngine | None = None
        self._in_flight: list[_InFlight] = []
        self._done_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._meta = KVScopeWorkerMetadata()
        self._stats = KVScopeStats()
        # CUDA: later compute must not overwrite blocks the stores still read (`store_fence`).
        self.store_fence = FENCE_AT_ONCE
        self._stores_unfenced = False
        self._step_announced = False
        self.lost_slots: set[int] = set()  # host data known to be gone (fault injection, errors)
        self._range_logged = False
        # Fault injection for tests of multi-worker runs, where no test can reach a worker object:
        # KVSCOPE_TEST_FAIL_LOADS_ON_RANK=<rank> makes every load on that worker fail (each is recomputed).
        fail_rank = os.environ.get(FAIL_LOADS_VARIABLE)
        self.fail_all_loads = fail_rank is not None and fail_rank.strip() == str(rank)
        if self.fail_all_loads:  # a test's variable left in a server's environment costs every load: say so
            logger.warning("kvscope: %s=%s: every load on worker rank %d fails (a test's fault injection; unset it "
                           "to load from the host tier)", FAIL_LOADS_VARIABLE, fail_rank, rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.engine = CopyEngine(kv_caches, self.kv_cache_config, self.slot_layout, self.num_slots)

    # -- per step --
    def start_load_kv(self, meta: KVScopeMetadata) -> None:
        assert self.engine is not None
        for job in meta.loads:
            self._run(job)
        if meta.loads:
            self._collect()  # once a call, not once a job: each collect polls every copy in flight

    def wait_for_save(self, meta: KVScopeMetadata) -> None:
        for job in meta.stores:
            self._run(job)
        if meta.stores:
            self._collect()
            # CUDA: later work on the compute stream (zeroing, the next forward) may write blocks
            # these stores still read once vLLM frees them; order it after the stores.
            if self.store_fence == FENCE_AT_ONCE:
                self.engine.fence_compute_stream()
            elif self.store_fence == FENCE_AT_NEXT_STEP:
                self._stores_unfenced = True

    def begin_step(self, meta: KVScopeMetadata | None = None) -> None:
        """The model runner starts a step (`handle_preemptions`), before the step's forward writes
        the KV cache: order those writes after the stores, where the fence was left for now."""
        self._step_announced = True
        if self._stores_unfenced or (self.store_fence == FENCE_WHEN_REUSED and meta is not None and meta.fence_stores):
            self._stores_unfenced = False
            self.engine.fence_compute_stream()

    def check_stores_fenced(self, meta: KVScopeMetadata | None = None) -> None:
        """A step's metadata is bound: the stores' fence must be in. If the runner did not announce
        the step (`begin_step`), fence now if it was due, and from now on at once after the stores."""
        announced, self._step_announced = self._step_announced, False
        if announced or self.store_fence == FENCE_AT_ONCE:
            return
        due = self._stores_unfenced or (meta is not None and meta.fence_stores)
        logger.error("kvscope: this model runner did not call handle_preemptions before its step; "
                     "stores are fenced at once from now on")
        self.store_fence = FENCE_AT_ONCE
        if due:
            self._stores_unfenced = False
            self.engine.fence_compute_stream()

    def _run(self, job: TransferJob) -> None:
        flight = _InFlight(job=job, copies=[])
        if job.direction == LOAD and (
            job.failed_at_plan or self.fail_all_loads or self._touches_lost_slot(job)
        ):
            flight.failed = True
        elif not self._well_formed(job):
            flight.failed = True
        else:
            try:
                engine = self.engine
                for part in job.groups:
                    if job.direction == LOAD:
                        copy = engine.load(part.group_index, part.slots, part.subs, part.block_ids,
                                           waits_for_stores=job.waits_for_stores)
                    else:
                        copy = engine.store(part.group_index, part.slots, part.subs, part.block_ids)
                    flight.copies.append((part.group_index, copy))
                if job.direction == STORE:
                    for part in job.groups:
                        self.lost_slots.difference_update(part.slots)
            except Exception:  # a copy must never take the engine down: fail the job instead
                logger.exception("kvscope: %s job %d for request %s failed", job.direction, job.job_id, job.req_id)
                flight.failed = True
                self._drain()  # part of it may be enqueued: its slots and blocks are in use until done
        self._in_flight.append(flight)

    def _drain(self) -> None:
        """Wait for every enqueued copy (`CopyEngine.drain`) after a job failed; an error doing so
        (a device that failed) is logged, not raised into the engine."""
        try:
            self.engine.drain()
        except Exception:
            logger.exception("kvscope: waiting for the copies in flight after a failed copy failed")

    def _well_formed(self, job: TransferJob) -> bool:
        """Whether every slot of the job lies in this worker's host buffer, every piece in its slot
        and every block in the KV cache and not vLLM's null block (the placeholder of skipped positions,
        which the planner skips), with one slot and piece per block of a known group. Never
        copy otherwise: on CUDA each is a raw address, and past a buffer it reads or writes another's
        memory. Nor when two copies of it write one place (`_targets_distinct`). Only a scheduler
        that sized its slots differently from this worker, or a scheduler bug, should get here
        (start-up refuses the layouts known to)."""
        n, blocks, factors = self.num_slots, self.engine.num_blocks, self.slot_layout.group_factors
        if all(0 <= p.group_index < len(factors) and len(p.slots) == len(p.subs) == len(p.block_ids)
               and (not p.slots or (0 <= min(p.slots) and max(p.slots) < n
                                    and 0 <= min(p.subs) and max(p.subs) < factors[p.group_index]
                                    and NULL_BLOCK_ID < min(p.block_ids) and max(p.block_ids) < blocks))
               for p in job.groups) and self._targets_distinct(job):
            return True
        if not self._range_logged:
            self._range_logged = True
            logger.error("kvscope: %s job %d for request %s addresses host slots, slot pieces or device blocks "
                         "outside this worker's (%d slots, %d blocks), vLLM's null block, or one of them twice; it "
                         "fails (a load is recomputed). Please report the model and its parallel configuration",
                         job.direction, job.job_id, job.req_id, n, blocks)
        return False

    @staticmethod
    def _targets_distinct(job: TransferJob) -> bool:
        """Whether no copy of the job writes where another of it does: a load's device blocks (one
        block pool serves every group, and groups may share a layer's tensor), a store's host slot
        pieces (per group). Two copies to one place leave whichever landed last: wrong KV. Nor may
        two groups of one job name the same host slot: a slot holds one group's block (every group's
        pieces start at its byte 0), so the other group would store over it or load its KV."""
        slot_sets = [set(p.slots) for p in job.groups]
        if len(set().union(*slot_sets)) != sum(map(len, slot_sets)):
            return False
        if job.direction == LOAD:
            targets = [b for p in job.groups for b in p.block_ids]
            return len(set(targets)) == len(targets)
        return all(len(set(zip(p.slots, p.subs))) == len(p.slots) for p in job.groups)

    def _touches_lost_slot(self, job: TransferJob) -> bool:
        return bool(self.lost_slots) and any(
            s in self.lost_slots for part in job.groups for s in part.slots
        )

    def _collect(self) -> None:
        """Move finished copies into results, stats and spans (CPU: at once; CUDA: when done)."""
        still = []
        for flight in self._in_flight:
            try:
                done = all(self.engine.poll(c) for _, c in flight.copies)
            except Exception:  # asking the device failed: the job fails (a load is recomputed), reported
                logger.exception("kvscope: checking the copies of %s job %d for request %s failed",
                                 flight.job.direction, flight.job.job_id, flight.job.req_id)
                flight.failed, done = True, True
                self._drain()
            if not done:
                still.append(flight)
                continue
            self._finish(flight)
        self._in_flight = still

    def _finish(self, flight: _InFlight) -> None:
        job = flight.job
        if flight.failed:
            self._meta.failed_jobs[job.job_id] = 1
            if job.direction == LOAD:
                self._failed_loads.add(job.req_id)
        else:
            self._meta.completed_jobs[job.job_id] = 1
        if job.direction == LOAD:
            self._done_loads.add(job.req_id)
        try:  # reported above whatever happens here: telemetry must never lose a job or stop the engine
            if flight.failed:
                self._record_failure(job)
            else:
                self._record(job, flight.copies)
        except Exception:
            telemetry_failed("a copy's stats or spans")

    def _record(self, job: TransferJob, copies: list[tuple[int, CopyResult]]) -> None:
        traced = job.trace_carrier is not None
        spans = []
        for group, copy in copies:
            kind = self.group_kinds[group]
            measured = copy.start_ns is not None  # (not when the device-event clock failed: `CopyEngine.poll`)
            seconds = (copy.end_ns - copy.start_ns) / 1e9 if measured else None
            self._stats.record_copy(group, kind, job.direction, copy.blocks, copy.nbytes, seconds)
            if traced and measured:
                spans.append((COPY_SPAN, copy.start_ns, copy.end_ns,
                              (group, kind, job.direction, copy.blocks, copy.nbytes, self.rank, job.req_id)))
        self._record_copy_spans(job, spans)

    def _record_failure(self, job: TransferJob) -> None:
        """A copy span with status ERROR per group of a failed job (no blocks, no bytes), so a trace
        replay tells a hit whose load failed, and was recomputed, from one that loaded."""
        if job.trace_carrier is None:
            return
        now = time.time_ns()
        kinds = self.group_kinds
        self._record_copy_spans(job, [
            (FAILED_COPY_SPAN, now, now, (part.group_index, kinds[part.group_index], job.direction, 0, 0,
                                          self.rank, job.req_id))
            for part in job.groups
            # a job naming a group this worker lacks (it failed for that): no such group's span
            if 0 <= part.group_index < len(kinds)])

    def _record_copy_spans(self, job: TransferJob, spans: list[tuple]) -> None:
        """The job's copy spans, ``(kind, start_ns, end_ns, values)``, under its load or store span;
        one a fault loses is counted (`KVScopeTracing.record_failed`), the others still recorded."""
        if not spans:
            return
        try:
            parent = self.tracing.parent_from_carrier(job.trace_carrier)
        except Exception:
            telemetry_failed("a copy span")
            self.tracing.record_failed(len(spans))
            return
        if parent is None:  # a carrier naming no span: nothing to record under
            return
        for kind, start_ns, end_ns, values in spans:
            try:
                self.tracing.record(kind, parent, start_ns, end_ns, values)
            except Exception:
                telemetry_failed("a copy span")
                self.tracing.record_failed()

    # -- results back to vLLM --
    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished loads, failed loads) since the last call; failed ones are also finished."""
        if self._in_flight:
            self._collect()
        done, failed = self._done_loads, self._failed_loads
        self._done_loads, self._failed_loads = set(), set()
        return done, failed

    def build_worker_meta(self) -> KVScopeWorkerMetadata | None:
        # The step's copy spans are recorded: vLLM asks this last, except with speculative decoding
        # (the V1 runner, and the V2 runner from 0.33), where the stores run after it (after the drafter):
        # those are reported a step later.
        try:
            self.tracing.end_step()
        except Exception:  # the job reports below must reach the scheduler (`telemetry_failed`)
            telemetry_failed("the worker's end of step")
        if not (self._meta.completed_jobs or self._meta.failed_jobs):
            return None
        meta, self._meta = self._meta, KVScopeWorkerMetadata()
        return meta

    def take_stats(self) -> KVScopeStats | None:
        try:
            for reason, records in self.tracing.take_lost_records().items():
                self._stats.record_dropped_trace_records(reason, records)
        except Exception:
            telemetry_failed("the worker's lost span count")
        return self._stats.take()

    def shutdown(self) -> None:
        if self.engine is None:
            return
        if self.engine.is_cuda:
            torch.cuda.synchronize(self.engine.device)
        self._collect()
        self.engine.close()
