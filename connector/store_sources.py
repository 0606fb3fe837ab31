"""The device blocks that unreported store jobs read, and this step's writes to them.

A store copies device blocks to the host after the step that computes them; until every worker has
reported it, vLLM may free a block it reads and give it out again. `StoreSources` knows which blocks
are read, and each step tells whether the step writes one: loads into it wait for the stores, the
step's forwards are fenced (`KVScopeMetadata.fence_stores`), and stores under a write no fence orders
fail.
"""

from __future__ import annotations

from collections.abc import Iterator

from .groups import GroupLayout
from .metadata import TransferJob


def allocated_anew(layouts: list[GroupLayout], scheduler_output) -> Iterator[int]:
    """The device blocks a step gives out afresh: each scheduled request's blocks past those it found
    in vLLM's prefix cache (a resumed request's list is whole, its hits first; others' are appended)."""
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    for new in scheduler_output.scheduled_new_reqs:
        yield from _past_hits(layouts, new.block_ids, new.num_computed_tokens)
    for i, (req_id, groups) in enumerate(zip(cached.req_ids, cached.new_block_ids)):
        if groups is not None:
            yield from _past_hits(layouts, groups, cached.num_computed_tokens[i] if req_id in resumed else 0)


def _past_hits(layouts: list[GroupLayout], group_block_ids, computed_tokens: int) -> Iterator[int]:
    for layout, ids in zip(layouts, group_block_ids):
        yield from ids[computed_tokens // layout.block_size:]


class StoreSources:
    def __init__(self, layouts: list[GroupLayout], jobs: dict):
        self.layouts = layouts
        # The scheduler's unreported jobs by id (each with a `failed` flag): a store this step's writes
        # would race is marked failed there, so its host blocks never become ready.
        self._jobs = jobs
        # device block -> unreported store jobs reading it: a step that allocates such a block
        # again must not write it before they have read it (`reallocated`)
        self.readers: dict[int, set[int]] = {}
        # This step's allocations kvscope loads nothing into, while stores are unreported: (request id,
        # its blocks, its device prefix hit). One that is not scheduled this step is loaded by another
        # connector (vLLM's MultiConnector), whose copies write its blocks now (`reallocated`).
        self.unplanned: list[tuple[str, object, int]] = []

    def add(self, job_id: int, block_ids: list[int]) -> None:
        """A store job reads these device blocks until it is reported."""
        for block_id in block_ids:
            self.readers.setdefault(block_id, set()).add(job_id)

    def release(self, job_id: int, block_ids: list[int]) -> None:
        """A store job is reported: it reads its blocks no more."""
        readers = self.readers
        for block_id in block_ids:
            jobs = readers.get(block_id)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del readers[block_id]

    def order_loads(self, loads: list[TransferJob]) -> None:
        """A load waits for the stores in flight only when one of them reads a block it writes (vLLM
        freed the block, its request finished or was preempted, and gave it to this load's request).
        This step's stores read only blocks of requests it schedules, never one a load writes (a
        request kvscope loads for waits, unscheduled, until its load is done)."""
        readers = self.readers
        for job in loads:
            job.waits_for_stores = bool(readers) and any(
                not readers.keys().isdisjoint(part.block_ids) for part in job.groups)

    def reallocated(self, scheduler_output, computed: dict[str, int]) -> bool:
        """Whether this step allocates a device block that an unreported store reads (vLLM freed it,
        its request finished, was preempted or left it behind its window, and gives it out again).

        This step's writes to such a block must wait for those stores (`KVScopeMetadata.fence_stores`).
        A block copy vLLM applies before the workers hear of the step (V2 runner) cannot wait: the
        stores reading its destination are failed instead, so their host blocks never become ready;
        so are the stores reading a block given to a request another connector loads (inside vLLM's
        MultiConnector), which writes it this step, maybe outside CUDA streams.
        Blocks a request finds in vLLM's prefix cache are not written, so they do not count.
        ``computed``: the tokens each request this step schedules has computed before it."""
        readers = self.readers
        found = any(block_id in readers for block_id in allocated_anew(self.layouts, scheduler_output))
        if self.unplanned:
            self._fail_stores_under_foreign_loads(computed)
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
            for job_id in readers.get(copy.dst_block_id, ()):
                self._jobs[job_id].failed = True
        return found

    def _fail_stores_under_foreign_loads(self, computed: dict[str, int]) -> None:
        """Fail the unreported stores reading a block that another connector loads into this step (inside
        vLLM's MultiConnector kvscope gets such a request with 0 external tokens): past the request's
        device prefix hit, all of its blocks when it waits for that load (not scheduled), else up to
        where this step's forward starts (which `allocated_anew` fences). That connector may write
        outside CUDA streams (RDMA), which no fence orders; so, as with a block copy, the stores fail."""
        readers, jobs = self.readers, self._jobs
        for req_id, blocks, local in self.unplanned:
            end = computed.get(req_id)
            if end is not None and end <= local:
                continue  # scheduled with nothing loaded: only its forward writes (kvscope alone: always)
            for layout, ids in zip(self.layouts, blocks.get_block_ids()):
                stop = None if end is None else -(-end // layout.block_size)  # with a partly loaded block
                for block_id in ids[local // layout.block_size:stop]:
                    for job_id in readers.get(block_id, ()):
                        jobs[job_id].failed = True
