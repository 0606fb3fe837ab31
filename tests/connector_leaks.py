"""What kvscope still holds once vLLM is done with every request, shared by the model-free engine's
check and the real-engine fuzz's: a server runs for months, so nothing may outlive its request."""

from __future__ import annotations


def connector_leaks(sched, vllm_requests, workers) -> list[str]:
    """Pinned or never completed host entries, transfer jobs without their reports, device blocks still
    sources of stores, unsettled fillings, lookups never counted, copies in flight on a worker, and state of
    requests vLLM let go of (load admission's too). ``sched``: kvscope's scheduler side; ``vllm_requests``:
    vLLM's scheduler's live requests; ``workers``: kvscope's worker connectors. Empty when nothing leaked."""
    leaks = [f"{key}: pins={e.pins} ready={e.ready}" for key, e in sched.index._entries.items()
             if e.pins or not e.ready]
    leaks += [f"job {job_id}: {job.direction} of {job.req_id}" for job_id, job in sched._jobs.items()]
    leaks += [f"device block {block} still a source of stores {jobs}"
              for block, jobs in sched.store_sources.readers.items()]
    leaks += [f"unsettled filling of {key}" for key in sched.stores.by_key]
    # (counted at the step's `build_connector_meta`: one left holds its request's state)
    leaks += [f"lookup of {state.request.request_id} never counted" for state, _ in sched.lookup_records.unsettled]
    leaks += [f"worker {rank}: {len(w._worker._in_flight)} copies in flight"
              for rank, w in enumerate(workers) if w._worker is not None and w._worker._in_flight]
    admission = sched.admission  # (a deferred or waiting request vLLM let go of would hold the others back)
    gone = [r for r in (*sched._requests, *sched._lookups, *admission.deferred, *admission.waiting_requests)
            if r not in vllm_requests]
    return leaks + [f"state of finished request {r}" for r in gone]
