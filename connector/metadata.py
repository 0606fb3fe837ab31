"""Messages between the scheduler side and the workers (both directions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

LOAD = "load"
STORE = "store"


@dataclass(slots=True)
class GroupTransfer:
    """One group's share of a job: device block `block_ids[i]` <-> host `slots[i]`, part `subs[i]`."""

    group_index: int
    block_ids: list[int]
    slots: list[int]
    subs: list[int]


@dataclass(slots=True)
class TransferJob:
    job_id: int
    req_id: str
    direction: str  # LOAD or STORE
    groups: list[GroupTransfer]
    # (trace id, span id, tracestate) of the request's kvscope span, so worker copy spans join its
    # trace (`KVScopeTracing.carrier_of`).
    trace_carrier: tuple[int, int, str | None] | None = None
    # Load only: the scheduler could not map every block; the worker fails the load.
    failed_at_plan: bool = False
    # Load only: a destination block is one an unreported store still reads (vLLM freed it and gave
    # it out again), so on CUDA the load waits for the stores in flight. Others need not: a store
    # running past the step's forward would otherwise hold up the hit's first token.
    waits_for_stores: bool = True


@dataclass
class KVScopeMetadata(KVConnectorMetadata):
    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    # This step allocates a device block that an unreported store (of an earlier step) reads:
    # workers that fence stores only when needed order the step's writes after the stores.
    fence_stores: bool = False


@dataclass
class KVScopeWorkerMetadata(KVConnectorWorkerMetadata):
    """Per step: {job_id: number of workers that finished it}; summed across workers."""

    completed_jobs: dict[int, int] = field(default_factory=dict)
    failed_jobs: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVScopeWorkerMetadata)
        done = dict(self.completed_jobs)
        for job_id, n in other.completed_jobs.items():
            done[job_id] = done.get(job_id, 0) + n
        failed = dict(self.failed_jobs)
        for job_id, n in other.failed_jobs.items():
            failed[job_id] = failed.get(job_id, 0) + n
        return KVScopeWorkerMetadata(completed_jobs=done, failed_jobs=failed)
