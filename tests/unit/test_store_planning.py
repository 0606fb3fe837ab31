"""Store planning on the scheduler side: offloaded blocks stored piece by piece (no engine).

Offloaded blocks of 4 device blocks (64 tokens of 16), a sliding window of 24 tokens beside full
attention. The block ids given for each step are what vLLM's manager holds then: the window's
blocks that fell out of it are null. What runs under vLLM (chunked prefill, preemption, async
scheduling, aborts) is tested in tests/compat; these pin the bookkeeping's edge cases.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from connector.groups import GroupKind, GroupLayout
from connector.lookup_records import Lookup
from connector.metadata import LOAD, GroupTransfer, KVScopeWorkerMetadata, TransferJob
from connector.planning import NULL_BLOCK_ID
from connector.miss_reasons import Miss
from connector.scheduler import KVScopeScheduler, _RequestState
from connector.telemetry.tracing import KVScopeTracing

BS, B, WINDOW = 16, 64, 24
LAYOUTS = [GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=WINDOW), GroupLayout(1, GroupKind.FULL_ATTENTION, BS)]


# A device cache no load ever waits for room in (`load_admission`), for schedulers no test gives blocks
ROOMY_BLOCK_POOL = SimpleNamespace(num_gpu_blocks=1 << 20)
ROOMY_KV_CACHE_MANAGER = SimpleNamespace(block_pool=ROOMY_BLOCK_POOL)


def vllm_blocks(group_ids) -> SimpleNamespace:
    """What vLLM's `KVCacheManager.get_blocks` gives for these block ids per group."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return SimpleNamespace(blocks=tuple([KVCacheBlock(i) for i in ids] for ids in group_ids))


class _Manager:
    """vLLM's block ids per group for the request being stored, as the test sets them."""

    ids: tuple[list[int], list[int]] = ([], [])
    block_pool = ROOMY_BLOCK_POOL

    def get_blocks(self, req_id):
        return vllm_blocks(self.ids)


def _scheduler(num_slots: int = 16, world_size: int = 1) -> tuple[KVScopeScheduler, _Manager]:
    manager = _Manager()
    sched = KVScopeScheduler(LAYOUTS, offload_block_size=B, hash_block_size=BS, num_slots=num_slots,
                             slot_bytes=1024, world_size=world_size,
                             tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda: manager)
    return sched, manager


def _state(rid: str, num_tokens: int) -> _RequestState:
    request = SimpleNamespace(request_id=rid, num_tokens=num_tokens, num_prompt_tokens=num_tokens,
                              num_computed_tokens=0, block_hashes=[f"h{i}" for i in range(num_tokens // BS)])
    return _RequestState(request=request)


def _ids(before: int, n: int = 8) -> tuple[list[int], list[int]]:
    """Block ids when vLLM schedules a step that starts with `before` tokens computed (and plans
    its stores): the window's blocks wholly out of it at `before` are null already."""
    first_kept = max(0, before - WINDOW + 1) // BS
    sw = [NULL_BLOCK_ID if i < first_kept else 100 + i for i in range(n)]
    return sw, [200 + i for i in range(n)]


def _report(sched, job, failed=False):
    meta = KVScopeWorkerMetadata(**({"failed_jobs": {job.job_id: 1}} if failed else {"completed_jobs": {job.job_id: 1}}))
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))


def _pieces(job, group):
    return [(p.block_ids, p.subs) for p in job.groups if p.group_index == group]


def test_a_block_larger_than_the_window_is_stored_piece_by_piece():
    sched, manager = _scheduler()
    state = _state("r", 128)
    key0 = (0, "h3")  # the first offloaded block's key: its last hash block
    manager.ids = _ids(0)
    first = sched._plan_store(state, 40)  # a step computes 40 tokens: pieces 0 and 1 of block 0
    assert _pieces(first, 0) == [([100, 101], [0, 1])] and _pieces(first, 1) == [([200, 201], [0, 1])]
    _report(sched, first)
    assert sched.index.contains(key0) and not sched.index.is_ready(key0)  # half of it: not loadable yet
    manager.ids = _ids(40)  # device block 0 of the window has left it by now
    assert manager.ids[0][0] == NULL_BLOCK_ID
    second = sched._plan_store(state, 64)
    assert _pieces(second, 0) == [([102, 103], [2, 3])]
    _report(sched, second)
    assert sched.index.is_ready(key0) and sched.index.is_ready((1, "h3"))
    assert sched.stores.by_key == {}


def test_a_failed_piece_aborts_the_block_and_its_later_pieces_are_not_stored():
    sched, manager = _scheduler()
    state = _state("r", 128)
    manager.ids = _ids(0)
    first = sched._plan_store(state, 32)
    _report(sched, first, failed=True)
    assert not sched.index.contains((0, "h3")) and not sched.index.contains((1, "h3"))  # slots freed
    manager.ids = _ids(32)
    assert sched._plan_store(state, 64) is None  # the rest of that block is not worth storing
    manager.ids = _ids(64)
    third = sched._plan_store(state, 128)
    assert _pieces(third, 1) == [([204, 205, 206, 207], [0, 1, 2, 3])]  # the next block is, whole
    assert sched.index.used_slots == 2  # (0, h7) and (1, h7), pinned until reported


def _finish_after_one_step(computed: int):
    """A request whose first step stores `computed` tokens' blocks, finishing before that store reports."""
    sched, manager = _scheduler()
    state = _state("r", 128)
    sched._requests["r"] = state
    manager.ids = _ids(0)
    job = sched._plan_store(state, computed)
    sched.request_finished(state.request)
    return sched, job


def test_a_request_finishing_mid_block_frees_its_slot_once_its_pieces_are_written():
    sched, job = _finish_after_one_step(32)
    assert sched.index.used_slots == 2  # a store still writes those slots: kept until it reports
    _report(sched, job)
    assert sched.index.used_slots == 0 and sched.stores.by_key == {}


def test_a_fully_planned_block_completes_after_its_request_finished():
    sched, job = _finish_after_one_step(64)
    _report(sched, job)
    assert sched.index.is_ready((1, "h3")) and sched.index.is_ready((0, "h3"))


def test_a_block_another_request_is_filling_is_left_to_it():
    sched, manager = _scheduler()
    a, b = _state("a", 128), _state("b", 128)  # the same tokens: the same keys
    manager.ids = _ids(0)
    job_a = sched._plan_store(a, 32)
    assert sched._plan_store(b, 32) is None
    manager.ids = _ids(32)
    job_a2 = sched._plan_store(a, 64)
    assert sched._plan_store(b, 64) is None
    for job in (job_a, job_a2):
        _report(sched, job)
    assert sched.index.is_ready((0, "h3"))


def test_blocks_another_request_stored_already_are_passed_over_once():
    """A request whose blocks another request has stored already skips them: its stored mark moves past
    them, so later steps neither look at them again (O(context) a step) nor miss the idle mark."""
    sched, manager = _scheduler()
    manager.ids = _ids(0)
    _report(sched, sched._plan_store(_state("a", 128), 64))
    b = _state("b", 128)  # the same tokens: the same keys
    assert sched._plan_store(b, 64) is None
    assert b.store_progress.stored_blocks == [4, 4]
    assert sched._plan_store(b, 64) is None and b.store_progress.idle_until == 80  # idle until the window's next block


def test_a_window_block_null_from_the_start_is_skipped_whole():
    sched, manager = _scheduler()
    state = _state("r", 128)
    # e.g. a request resumed after a prefix hit of 112 tokens: the window's blocks below token 80 are null
    manager.ids = _ids(112)
    job = sched._plan_store(state, 128)
    assert _pieces(job, 0) == []  # both window blocks start with a null device block: nothing to keep
    _report(sched, job)
    assert not sched.index.contains((0, "h3")) and not sched.index.contains((0, "h7"))
    assert sched.index.is_ready((1, "h3")) and sched.index.is_ready((1, "h7"))
    assert sched.stores.by_key == {} and sched.index.used_slots == 2


# --- blocks stored before their key exists (output tokens; the window shorter than a block) ---


def _decoding(rid: str = "r") -> _RequestState:
    """A request whose tokens are known up to 64 (one offloaded block's key, "h3") and that goes on
    to 128: the second block's key ("h7") exists only once its last token is sampled."""
    state = _state(rid, 128)
    state.request.block_hashes = state.request.block_hashes[:4]
    return state


def _sample_up_to(state: _RequestState, num_tokens: int) -> None:
    state.request.block_hashes = [f"h{i}" for i in range(num_tokens // BS)]


def test_the_window_stores_a_block_before_its_key_exists_and_full_attention_waits_for_it():
    sched, manager = _scheduler()
    state = _decoding()
    manager.ids = _ids(0)
    first = sched._plan_store(state, 96)  # block 0 whole; block 1's first two device blocks computed
    assert _pieces(first, 0) == [([100, 101, 102, 103, 104, 105], [0, 1, 2, 3, 0, 1])]
    assert _pieces(first, 1) == [([200, 201, 202, 203], [0, 1, 2, 3])]  # block 1 waits for its key
    _report(sched, first)
    assert not sched.index.contains((0, "h7")) and sched.index.used_slots == 3  # h3 twice, block 1 under a placeholder
    manager.ids = _ids(96)
    second = sched._plan_store(state, 112)
    assert _pieces(second, 0) == [([106], [2])] and _pieces(second, 1) == []
    _report(sched, second)
    _sample_up_to(state, 128)  # block 1's last token is known: its key exists
    manager.ids = _ids(112)
    assert manager.ids[0][4] == NULL_BLOCK_ID  # block 1's first piece has left the window by now
    third = sched._plan_store(state, 128)
    assert _pieces(third, 0) == [([107], [3])]
    assert _pieces(third, 1) == [([204, 205, 206, 207], [0, 1, 2, 3])]
    assert sched.index.contains((0, "h7")) and not sched.index.is_ready((0, "h7"))
    _report(sched, third)
    assert sched.index.is_ready((0, "h7")) and sched.index.is_ready((1, "h7"))
    assert sched.stores.by_key == {} and sched.index.used_slots == 4


def test_a_block_whose_key_arrives_after_its_last_piece_completes_then():
    """Async scheduling: the step computing a block's last token is scheduled before that token's
    value (so the block's key) is known."""
    sched, manager = _scheduler()
    state = _decoding()
    manager.ids = _ids(0)
    _report(sched, sched._plan_store(state, 128))  # every piece of block 1 written, its key unknown
    assert not sched.index.is_ready((0, "h7")) and sched.index.used_slots == 3
    _sample_up_to(state, 128)
    manager.ids = _ids(128)
    job = sched._plan_store(state, 128)  # nothing new for the window: its block gets its key
    assert _pieces(job, 0) == [] and sched.index.is_ready((0, "h7"))
    _report(sched, job)  # full attention stores block 1 now that its key exists
    assert sched.index.is_ready((1, "h7")) and sched.stores.by_key == {}


def test_a_block_stored_by_another_request_meanwhile_drops_the_placeholder():
    sched, manager = _scheduler()
    other = _state("other", 128)  # the same tokens, all known: it stores (0, h7) under its key
    manager.ids = _ids(0)
    _report(sched, sched._plan_store(other, 128))
    state = _decoding()
    _report(sched, sched._plan_store(state, 96))
    used = sched.index.used_slots
    _sample_up_to(state, 128)
    manager.ids = _ids(96)
    sched._plan_store(state, 128)
    assert sched.index.used_slots == used - 1  # the placeholder's slot is freed; the stored block is intact
    assert sched.index.is_ready((0, "h7")) and sched.stores.by_key == {}


def test_a_request_finishing_before_its_block_has_a_key_frees_the_placeholder():
    sched, manager = _scheduler()
    state = _decoding()
    sched._requests["r"] = state
    manager.ids = _ids(0)
    job = sched._plan_store(state, 128)  # every piece of block 1 planned; its last token never sampled
    sched.request_finished(state.request)
    assert sched.index.used_slots == 3  # block 0 of both groups, block 1 of the window: still being written
    _report(sched, job)
    assert sched.index.used_slots == 2 and sched.stores.by_key == {}  # block 1 never got its key: freed
    assert sched.index.is_ready((0, "h3")) and sched.index.is_ready((1, "h3"))


def test_a_block_the_request_cannot_complete_gets_no_placeholder():
    """The last token a request samples is never computed: with 64 prompt tokens and at most 64
    new ones, token 127 never is, so block 1 would only hold a slot (and evict another block for it)."""
    for max_tokens, placeholders in ((64, 0), (65, 1)):
        sched, manager = _scheduler()
        state = _decoding()
        state.request.num_prompt_tokens, state.request.max_tokens = 64, max_tokens
        manager.ids = _ids(0)
        _report(sched, sched._plan_store(state, 96))
        assert sched.index.used_slots == 2 + placeholders, max_tokens


def _output(new=(), cached=(), resumed=(), copies=()):
    """A scheduler output: `new` as (block ids per group, computed tokens), `cached` as
    (request id, new block ids per group, computed tokens)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=f"n{i}", block_ids=ids, num_computed_tokens=computed)
                            for i, (ids, computed) in enumerate(new)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid for rid, _, _ in cached], new_block_ids=[ids for _, ids, _ in cached],
            num_computed_tokens=[computed for _, _, computed in cached], resumed_req_ids=set(resumed)),
        kv_cache_block_copies=[SimpleNamespace(src_block_id=src, dst_block_id=dst) for src, dst in copies],
        num_scheduled_tokens={}, scheduled_spec_decode_tokens={})


def _pending_store(sched, manager):
    """A store job reading full-attention blocks 200..203 (and window blocks 100..103), unreported."""
    manager.ids = _ids(0)
    job = sched._plan_store(_state("r", 128), 64)
    assert {200, 203, 100} <= set(job.groups[0].block_ids + job.groups[1].block_ids)
    return job


def test_a_step_allocating_a_block_a_pending_store_reads_is_flagged():
    """Until its store is reported, a device block vLLM gives out again (freed by a finished,
    preempted or windowed request) makes the step fence the stores; blocks found in vLLM's prefix
    cache are not written and do not count."""
    sched, manager = _scheduler()
    job = _pending_store(sched, manager)
    flagged = sched.build_connector_meta
    assert not flagged(_output()).fence_stores
    assert not flagged(_output(new=[(([], [200, 201, 500]), 32)])).fence_stores  # 200, 201: prefix-cache hits
    assert flagged(_output(new=[(([], [200, 201, 500]), 16)])).fence_stores  # 201 newly allocated
    assert flagged(_output(cached=[("c", ([101], [600]), 96)])).fence_stores  # appended to a running request
    # a resumed request's list is whole: its first blocks are prefix-cache hits
    assert not flagged(_output(cached=[("c", ([101], [203, 601]), 16)], resumed=["c"])).fence_stores
    assert flagged(_output(cached=[("c", ([101], [203, 601]), 0)], resumed=["c"])).fence_stores
    assert not flagged(_output(cached=[("c", ([NULL_BLOCK_ID, 900], [602, 601]), 0)], resumed=["c"])).fence_stores
    _report(sched, job)
    assert sched.store_sources.readers == {}
    assert not flagged(_output(new=[(([100], [200, 201]), 0)])).fence_stores  # reported: read already


def test_every_block_appended_to_a_running_request_in_a_step_counts_not_only_its_last():
    """A running request can get several new blocks in one step (a prefill chunk): any of them that a
    pending store reads makes the step fence the stores."""
    sched, manager = _scheduler()
    _pending_store(sched, manager)
    assert sched.build_connector_meta(_output(cached=[("c", ([], [201, 600]), 96)])).fence_stores
    assert not sched.build_connector_meta(_output(cached=[("c", ([], [600, 601]), 96)])).fence_stores


def test_a_load_waits_for_the_stores_only_when_it_writes_a_block_a_pending_store_reads():
    """A load whose destination (in any group) is a block an unreported store reads waits for the
    stores in flight (`TransferJob.waits_for_stores`); one writing only other blocks does not, nor
    any load once the store is reported."""
    sched, manager = _scheduler()
    job = _pending_store(sched, manager)

    def load(*group_blocks):
        return TransferJob(sched._new_job_id(), "l", LOAD,
                           [GroupTransfer(g, ids, [0] * len(ids), [0] * len(ids)) for g, ids in group_blocks])

    overlapping_window, overlapping_full = load((0, [700]), (1, [701, 103])), load((0, [702, 201]))
    apart, failed_at_plan = load((0, [703]), (1, [704])), load()
    sched._pending_loads = [overlapping_window, apart, overlapping_full, failed_at_plan]
    sched.build_connector_meta(_output())
    assert [j.waits_for_stores for j in (overlapping_window, apart, overlapping_full, failed_at_plan)] == [
        True, False, True, False]
    _report(sched, job)
    later = load((0, [201]), (1, [103]))
    sched._pending_loads = [later]
    sched.build_connector_meta(_output())
    assert not later.waits_for_stores


def test_a_load_waits_for_a_store_until_every_worker_has_reported_it():
    """Under tensor parallelism each worker's store reads its own shard of the blocks: one worker's
    report leaves the other's copy in flight, so a load writing a block it reads still waits for the
    stores; once both have reported, it need not."""
    sched, manager = _scheduler(world_size=2)
    job = _pending_store(sched, manager)

    def waits_after_a_report() -> bool:
        _report(sched, job)  # one worker's
        load = TransferJob(sched._new_job_id(), "l", LOAD, [GroupTransfer(1, [201], [0], [0])])
        sched._pending_loads = [load]
        sched.build_connector_meta(_output())
        return load.waits_for_stores

    assert waits_after_a_report()  # the second worker's store may still read block 201
    assert not waits_after_a_report()


def test_a_block_two_pending_stores_read_is_fenced_until_both_are_reported():
    """Two unreported stores can read one device block (a block a request stores ahead under its placeholder
    key, which another request found in vLLM's prefix cache once full): one's report leaves it a source."""
    sched, manager = _scheduler()
    manager.ids = _ids(0)
    first = sched._plan_store(_state("a", 128), 64)
    other = _state("b", 128)
    other.request.block_hashes = [f"b{i}" for i in range(8)]
    second = sched._plan_store(other, 64)
    allocating_201 = _output(new=[(([], [201]), 0)])
    _report(sched, first)
    assert sched.build_connector_meta(allocating_201).fence_stores  # the second store still reads block 201
    _report(sched, second)
    assert not sched.build_connector_meta(allocating_201).fence_stores


# case: (its blocks per group, its device prefix hit, how this step lists it: None (not scheduled), "new" or
# "resumed" with its computed tokens, whether the pending store reading block 201 fails, whether the step is fenced)
_FOREIGN_LOADS = {
    "loaded asynchronously by another connector": (([300, 301], [500, 201]), 0, None, True, False),
    "loaded at once by another connector": (([300, 301], [201, 500]), 0, ("new", 32), True, False),
    "partly loaded at once: the block its forward goes on": (([300, 301], [500, 201]), 0, ("new", 24), True, True),
    "not written": (([300, 301], [500, 501]), 0, None, False, False),
    "its device prefix hit": (([300, 301], [201, 500]), 16, None, False, False),
    "scheduled with nothing loaded": (([300, 301], [201, 500]), 16, ("new", 16), False, False),
    "scheduled with nothing loaded, its device prefix hit inside a block": (
        ([300, 301], [500, 201]), 24, ("new", 24), False, True),
    "resumed with nothing loaded": (([300, 301], [500, 201]), 0, ("resumed", 0), False, True),
    "resumed after another connector's load": (([300, 301], [201, 500]), 0, ("resumed", 32), True, False),
    "loaded at once past its device prefix hit: one token": (([300, 301], [500, 201]), 16, ("new", 17), True, True),
}


@pytest.mark.parametrize("case", sorted(_FOREIGN_LOADS))
def test_a_block_another_connector_loads_into_fails_the_pending_store_that_reads_it(case):
    """Inside vLLM's MultiConnector kvscope hears of a request another connector loads with 0 external
    tokens; that connector writes the blocks past its device prefix hit this step (all of them while the
    request waits for an asynchronous load; up to where its forward starts when the load is at once),
    maybe outside CUDA streams (RDMA): no fence orders that, so a store reading one fails, and its
    offloaded block never becomes ready. Blocks of the device prefix hit are not written; what the
    step's forward writes is fenced, as before."""
    group_ids, local, listed, store_fails, fenced = _FOREIGN_LOADS[case]
    sched, manager = _scheduler()
    job = _pending_store(sched, manager)  # reads full-attention blocks 200..203
    request = _state("x", 64).request
    if local:
        assert sched.get_num_new_matched_tokens(request, local) == (0, False)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: group_ids), 0)
    output = _output()
    if listed is not None:
        how, computed = listed
        if how == "new":
            output.scheduled_new_reqs = [SimpleNamespace(req_id="x", block_ids=group_ids, num_computed_tokens=computed)]
        else:  # preempted before, vLLM 0.32 lists it with the running requests
            output = _output(cached=[("x", group_ids, computed)], resumed=["x"])
    assert sched.build_connector_meta(output).fence_stores is fenced
    _report(sched, job)
    assert sched.index.is_ready((1, "h3")) is not store_fails


def test_allocations_are_remembered_for_one_step_and_only_for_requests_admitted_afresh():
    sched, manager = _scheduler()
    job = _pending_store(sched, manager)
    request = _state("x", 64).request
    blocks = SimpleNamespace(get_block_ids=lambda: ([300, 301], [500, 201]))
    sched.update_state_after_alloc(request, blocks, 0)
    sched.build_connector_meta(_output(new=[(([300, 301], [500, 201]), 0)]))  # scheduled as "n0": not x
    assert sched._jobs[job.job_id].failed
    sched._jobs[job.job_id].failed = False
    sched.build_connector_meta(_output())  # the next step: x's allocation is not looked at again
    request.num_computed_tokens = 32  # rescheduled once an asynchronous load is done: its blocks are old
    sched.update_state_after_alloc(request, blocks, 0)
    sched.build_connector_meta(_output())
    _report(sched, job)
    assert sched.index.is_ready((1, "h3"))


def test_a_block_copy_into_a_block_a_pending_store_reads_fails_the_store():
    """vLLM's V2 runner applies block copies before the workers hear of the step, so no fence can
    come first: the store is failed, and its offloaded block never becomes ready."""
    sched, manager = _scheduler()
    job = _pending_store(sched, manager)
    sched.build_connector_meta(_output(copies=[(7, 202)]))
    _report(sched, job)
    assert not sched.index.is_ready((1, "h3")) and sched.index.used_slots == 0


def test_tokens_not_yet_verified_are_never_stored():
    """vLLM's async scheduler counts the previous step's draft tokens as computed before it knows
    which were accepted. A rejected draft's KV is rewritten at the same positions, so a store must
    stop at the tokens the request knows (`num_tokens`), in a group that stores ahead of the key
    (the window) as in one that waits for it."""
    sched, manager = _scheduler()
    state = _state("r", 79)  # 79 known tokens; the previous step's 3 drafts sit at 79, 80, 81
    sched._requests["r"] = state
    manager.ids = _ids(0)
    out = _output(cached=[("r", ([], []), 82)])  # computed: 79 + the 3 unverified drafts
    out.num_scheduled_tokens = {"r": 3}  # this step: a sampled token and 2 drafts
    out.scheduled_spec_decode_tokens = {"r": [1, 2]}
    meta = sched.build_connector_meta(out)
    stored = {p.group_index: p.block_ids for job in meta.stores for p in job.groups}
    assert stored[0] == [100, 101, 102, 103]  # not block 4: its position 79 holds a draft
    assert stored[1] == [200, 201, 202, 203]


def test_draft_tokens_of_this_step_are_never_final():
    """Whatever a request knows past them, the KV a step computes for its drafts is not final: with
    62 tokens computed and a token and 2 drafts scheduled, block 3 (tokens 48..63) waits."""
    sched, manager = _scheduler()
    sched._requests["r"] = _state("r", 200)
    manager.ids = _ids(0)
    out = _output(cached=[("r", ([], []), 62)])
    out.num_scheduled_tokens = {"r": 3}
    out.scheduled_spec_decode_tokens = {"r": [1, 2]}
    meta = sched.build_connector_meta(out)
    stored = {p.group_index: p.block_ids for job in meta.stores for p in job.groups}
    assert stored[0] == [100, 101, 102] and stored[1] == [200, 201, 202]


def test_tokens_a_drafter_may_write_again_are_not_stored():
    """vLLM's multi-module MTP re-prefills the last `num_prefill_lookahead_tokens - 1` tokens'
    drafter KV; vLLM does not cache them as final, nor does kvscope store them."""
    sched, manager = _scheduler()
    sched.reprefillable_tokens = 2
    state = _state("r", 200)
    sched._requests["r"] = state
    manager.ids = _ids(0)
    out = _output(cached=[("r", ([], []), 0)])
    out.num_scheduled_tokens = {"r": 65}  # 65 computed: 63 final
    meta = sched.build_connector_meta(out)
    stored = {p.group_index: p.block_ids for job in meta.stores for p in job.groups}
    # not block 3 (tokens 48..63): 62 and 63 are not final yet, in either group
    assert stored[0] == [100, 101, 102] and stored[1] == [200, 201, 202]


def test_a_cache_reset_never_lets_blocks_computed_before_it_load_after():
    """A reset (vLLM's `reset_prefix_cache(reset_connector=True)`, e.g. after a weight update)
    while an offloaded block is half filled and a stored one is being loaded: the half-filled one
    is given up and the loaded one forgotten; the request stores again from its first block (vLLM
    preempts it, so those blocks are computed again), each offloaded block from its first piece."""
    sched, manager = _scheduler()
    ready = (1, "h3")
    state = sched._requests["r"] = _state("r", 256)
    manager.ids = _ids(0, 16)
    _report(sched, sched._plan_store(state, 64))  # offloaded block 0: stored
    assert sched.index.is_ready(ready)
    sched.index.pin_for_load(ready)  # a load still reading it
    half = sched._plan_store(state, 96)  # offloaded block 1 half filled, its store unreported
    half_slot = sched.stores.by_key[(1, "h7")].slot
    state.request.num_computed_tokens = 0  # vLLM preempted it for the reset (`reset_running_requests`)
    sched.reset_cache()
    assert not sched.index.is_ready(ready) and sched.index.pin_for_load(ready) is None
    _report(sched, half)
    assert not sched.index.contains((1, "h7")) and half_slot in sched.index._free  # given up
    manager.ids = _ids(0, 16)
    again = sched._plan_store(state, 192)  # computed again after the reset, from token 0
    # block 0 is still being read under its old key: not stored again until that load is done
    assert _pieces(again, 1) == [(list(range(204, 212)), [0, 1, 2, 3] * 2)]
    _report(sched, again)
    assert sched.index.is_ready((1, "h7")) and sched.index.is_ready((1, "h11"))
    sched.index.unpin(ready)
    assert not sched.index.contains(ready) and sched.stores.by_key == {}


def test_a_cache_reset_empties_the_host_usage_gauge_at_once():
    """The reset's own stats carry the emptied tier (vLLM publishes them with its next step's)."""
    sched, manager = _scheduler()
    state = sched._requests["r"] = _state("r", 256)
    manager.ids = _ids(0, 16)
    _report(sched, sched._plan_store(state, 64))
    sched._update_capacity_stats()
    assert sched.take_stats().data["host_used_bytes"] > 0
    sched.reset_cache()
    assert sched.take_stats().data["host_used_bytes"] == 0


def test_a_request_that_keeps_running_through_a_reset_stores_nothing_more():
    """Without `reset_running_requests` vLLM resets the connector while a request keeps its KV from
    before (its own reset fails then, and the connector's runs anyway): everything that request
    computes next sits on that KV, so none of it is stored, not even blocks it computes after."""
    sched, manager = _scheduler()
    state = sched._requests["r"] = _state("r", 256)
    manager.ids = _ids(0, 16)
    _report(sched, sched._plan_store(state, 64))  # offloaded block 0 stored
    state.request.num_computed_tokens = 64  # still running: its KV predates the reset
    sched.reset_cache()
    manager.ids = _ids(64, 16)
    assert sched._plan_store(state, 192) is None
    assert not any(sched.index.contains((g, f"h{i}")) for g in (0, 1) for i in range(16))
    # a request that starts after the reset stores as usual
    fresh = sched._requests["s"] = _state("s", 256)
    assert sched._plan_store(fresh, 64) is not None


@pytest.mark.parametrize("local_hit", [0, 64], ids=["from-nothing", "device-prefix-hit"])
def test_a_request_restarted_after_a_reset_stores_again_unless_it_reuses_device_kv(local_hit):
    """The request that kept running through a reset is preempted later (vLLM frees its KV): with no
    device prefix hit it computes everything again with the new weights, so it is stored again. A
    device hit then may be its own KV from before the reset (vLLM's own reset failed, its blocks
    being in use): it still stores nothing."""
    sched, manager = _scheduler()
    state = sched._requests["r"] = _state("r", 256)
    state.request.num_computed_tokens = 64  # still running through the reset
    sched.reset_cache()
    manager.ids = _ids(64, 16)
    assert sched._plan_store(state, 128) is None
    state.request.num_computed_tokens = 0  # preempted, then scheduled again
    assert sched.get_num_new_matched_tokens(state.request, local_hit) == (0, False)
    sched.update_state_after_alloc(state.request, SimpleNamespace(get_block_ids=lambda: manager.ids), 0)
    manager.ids = _ids(0, 16)
    job = sched._plan_store(state, 128)
    if local_hit:
        assert job is None
    else:
        assert job is not None and _pieces(job, 1) == [(list(range(200, 208)), [0, 1, 2, 3] * 2)]


def _planned_load(sched, request):
    """The load job planned for `request`, which hits the host tier's 64 tokens, given blocks 0-15."""
    assert sched.get_num_new_matched_tokens(request, 0) == (64, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 64)
    (job,) = sched.build_connector_meta(_output()).loads
    return job


def _stored(sched, *keys):
    for key in keys:
        assert sched.index.reserve_for_store(key) is not None
        sched.index.complete_store(key)


def _fail_a_load_at_planning(sched, request_id, hit_tokens, gone):
    """Look ``request_id`` up (a hit of ``hit_tokens``), drop the host block ``gone`` between the lookup
    and the load (it cannot be in vLLM; a guard), allocate, check the load failed at planning and report
    it failed, as the worker would. Returns the request."""
    request = _state(request_id, 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (hit_tokens, True)
    sched.index.drop([gone])
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), hit_tokens)
    (job,) = sched.build_connector_meta(_output()).loads
    assert job.failed_at_plan
    _report(sched, job, failed=True)
    return request


def test_a_load_that_fails_at_planning_keeps_the_host_blocks_it_pinned():
    """A load planned while one of its host blocks is gone fails before any copy: vLLM recomputes,
    and the blocks it did pin are intact, so later requests still hit them."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"))  # offloaded block 0 of both groups; block 1 of neither
    _fail_a_load_at_planning(sched, "r", hit_tokens=64, gone=(0, "h3"))
    assert sched.index.is_ready((1, "h3")) and sched.index.pin_for_load((1, "h3")) is not None


def test_a_load_failed_at_planning_bars_its_request_from_loading_again_too():
    """vLLM keeps the reserve of any failed asynchronous load, one that failed before a copy too: its retry
    recomputes (offered the hit again, it could wait for ever), while other requests still hit its blocks."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    request = _fail_a_load_at_planning(sched, "r", hit_tokens=128, gone=(0, "h7"))
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(_state("other", 256).request, 0) == (64, True)


def test_a_store_report_counts_no_load_and_a_failed_store_bars_no_load():
    """A store's report is no load's: it records no load time or failure, and a failed store leaves its
    request free to load what the tier holds."""
    sched, manager = _scheduler()
    state = sched._requests["r"] = _state("r", 256)
    manager.ids = _ids(0, 16)
    _report(sched, sched._plan_store(state, 64))
    _report(sched, sched._plan_store(state, 128), failed=True)
    data = sched.take_stats().data
    assert "request_load_duration_s" not in data and not data.get("load_failures")
    assert sched.get_num_new_matched_tokens(state.request, 0) == (64, True)


def test_a_load_failed_in_its_copy_forgets_the_host_blocks_it_read():
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"))
    request = _state("r", 256).request
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 64)
    (job,) = sched.build_connector_meta(_output()).loads
    assert not job.failed_at_plan and [p.group_index for p in job.groups] == [0, 1]
    _report(sched, job, failed=True)
    assert not sched.index.contains((0, "h3")) and not sched.index.contains((1, "h3"))


def test_a_load_failed_in_its_copy_forgets_the_host_blocks_another_load_still_reads():
    """Two requests load the same host blocks and one copy fails: no later lookup finds those blocks,
    though the other load still reads them; their slots are freed once it reports."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"))
    jobs = []
    for rid in ("failing", "reading"):
        jobs.append(_planned_load(sched, _state(rid, 256).request))
    used = sched.index.used_slots
    _report(sched, jobs[0], failed=True)
    assert sched.get_num_new_matched_tokens(_state("later", 256).request, 0) == (0, False)
    assert sched.index.used_slots == used  # the other load's copy may still read them
    _report(sched, jobs[1])
    assert sched.index.used_slots == used - 2
    assert not sched.index.contains((0, "h3")) and not sched.index.contains((1, "h3"))


def test_a_load_names_only_the_groups_it_writes_blocks_into():
    """A group with no block to load in the hit's range (vLLM gave a Mamba group only null blocks there, as
    in `test_planning`'s review case c) gets no copy: workers would time an empty copy and trace its span."""
    layouts = [GroupLayout(0, GroupKind.FULL_ATTENTION, BS), GroupLayout(1, GroupKind.MAMBA, B)]
    sched = KVScopeScheduler(layouts, offload_block_size=B, hash_block_size=BS, num_slots=8, slot_bytes=1024,
                             world_size=1, tracing=KVScopeTracing.disabled(),
                             kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER)
    _stored(sched, (0, "h3"), (1, "h3"))
    request = _state("r", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (64, True)
    block_ids = ([200 + i for i in range(16)], [NULL_BLOCK_ID] * 4)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: block_ids), 64)
    (job,) = sched.build_connector_meta(_output()).loads
    assert [(p.group_index, p.block_ids) for p in job.groups] == [(0, [200, 201, 202, 203])]


def test_a_load_whose_request_ended_first_counts_its_blocks_but_no_request_load_time():
    """vLLM frees an aborted request's blocks, unused, once its load is done: they were loaded
    (`kvscope_loaded_blocks_total`), but that load's time is no request's (`..._request_load_duration_seconds`)."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"))
    loads = []
    for rid in ("served", "aborted"):
        request = _state(rid, 256).request
        loads.append((request, _planned_load(sched, request)))
    sched.request_finished(loads[1][0])
    for _, job in loads:
        _report(sched, job)
    data = sched.take_stats().data
    assert len(data["request_load_duration_s"]) == 1
    assert sum(data["loaded_blocks"].values()) == sum(len(p.block_ids) for _, job in loads for p in job.groups)


def test_a_request_looked_up_but_never_scheduled_leaves_nothing_behind_when_it_ends():
    """vLLM looks a waiting request up each step it tries to schedule it; one that never gets blocks (the
    device cache is full) and is aborted while it waits keeps no lookup here (a server runs for months)."""
    sched, _ = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"))
    request = _state("r", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (64, True)
    sched.request_finished(request)
    assert sched._lookups == {} and sched._requests == {}


def test_a_load_vllm_asks_for_without_a_lookup_fails_whole_and_copies_nothing():
    """vLLM always looks a request up before it gives it external tokens; were it not to, the local
    hit (and so where the load starts) would be unknown: the load fails and vLLM recomputes."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    request = _state("r", 256).request
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(64, 16)), 72)
    (job,) = sched.build_connector_meta(_output()).loads
    assert job.failed_at_plan and job.groups == []
    assert all(entry.pins == 0 for entry in sched.index._entries.values())
    _report(sched, job, failed=True)
    assert sched._jobs == {} and sched.index.is_ready((1, "h7"))
    assert sched.take_stats().data["load_failures"] == 5 + 5  # the blocks 72 external tokens span, each group


def test_a_block_whose_key_changes_under_it_is_given_up():
    """A streaming-input session's next turn replaces the tokens past the computed ones (vLLM drops
    the last sampled token, truncates the block hashes and appends the new input): a block started
    under the old key must not be completed with the new tokens' KV."""
    sched, manager = _scheduler()
    state = _state("r", 64)  # all four hash blocks known: block 0's key is h3
    manager.ids = _ids(0)
    first = sched._plan_store(state, 48)  # pieces 0..2 of block 0, under (g, "h3")
    _report(sched, first)
    state.request.block_hashes = ["h0", "h1", "h2", "h3-next-turn", "h4-next-turn"]
    state.request.num_tokens = 80
    manager.ids = _ids(48)
    second = sched._plan_store(state, 80)
    if second is not None:
        _report(sched, second)
    for g in (0, 1):
        assert not sched.index.is_ready((g, "h3")), "the old key would load the new turn's KV"
        assert not sched.index.contains((g, "h3")) and not sched.index.contains((g, "h3-next-turn"))
    assert not any(key[1] == "h3" for key in sched.stores.by_key)  # given up and settled


def test_a_block_whose_key_is_gone_under_it_is_given_up_at_once():
    """A streaming-input session's next turn can leave a block started under its old key without a key
    (the new input ends before the block does): no later piece of it is stored under the old key."""
    sched, manager = _scheduler()
    state = _state("r", 64)
    manager.ids = _ids(0)
    _report(sched, sched._plan_store(state, 40))  # pieces 0 and 1 of block 0, under (g, "h3")
    state.request.block_hashes = ["h0", "h1", "h2-next-turn"]  # tokens from 40 replaced: 50 tokens now
    state.request.num_tokens = 50
    manager.ids = _ids(40)
    assert sched._plan_store(state, 50) is None  # not the window's piece 2: its block has no key now
    assert not sched.index.contains((0, "h3")) and not sched.index.contains((1, "h3"))
    assert sched.stores.by_key == {}


def test_a_load_of_part_of_a_hit_fails_whole():
    """vLLM takes a hit whole or not at all; a part of one (which no vLLM path asks for today) could
    end off an offloaded block: the load fails and vLLM recomputes. It is planned over the blocks
    vLLM gave (so its failure counts the blocks a load would have brought, and its workers' copy
    spans say ERROR) but pins no host block: all stay for later hits."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    request = _state("r", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (128, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 96)
    (job,) = sched.build_connector_meta(_output()).loads
    assert job.failed_at_plan and [p.group_index for p in job.groups] == [0, 1]
    assert all(slot == -1 for p in job.groups for slot in p.slots)
    assert not any(e.pins for e in sched.index._entries.values())
    pending = sum(len(p.block_ids) for p in job.groups)
    _report(sched, job, failed=True)
    assert sched.take_stats().data["load_failures"] == pending > 0
    assert all(sched.index.is_ready(key) for key in ((0, "h3"), (1, "h3"), (0, "h7"), (1, "h7")))


# The tier evicts a prefix from its tail: a hit needs every block from the first, so a prefix that
# lost its head would keep the rest in slots no lookup reaches (its later blocks counted as misses
# of other blocks, not evictions).
def _lookup_after_one_more_store(sched):
    """Store one more offloaded block (both groups) into the full tier, then look the prefix up again."""
    _stored(sched, (0, "other"), (1, "other"))
    request = _state("again", 256).request
    hit, _ = sched.get_num_new_matched_tokens(request, 0)
    return hit, sched._lookups["again"].miss


def _full_attention_scheduler(num_slots: int, manager=None) -> KVScopeScheduler:
    return KVScopeScheduler([GroupLayout(0, GroupKind.FULL_ATTENTION, BS)], offload_block_size=B,
                            hash_block_size=BS, num_slots=num_slots, slot_bytes=1024, world_size=1,
                            tracing=KVScopeTracing.disabled(),
                            kv_cache_manager_getter=lambda: manager or ROOMY_KV_CACHE_MANAGER)


def test_a_prefix_stored_by_a_finished_request_is_evicted_from_its_tail():
    manager = _Manager()
    sched = _full_attention_scheduler(num_slots=2, manager=manager)
    state = _state("r", 128)
    sched._requests["r"] = state
    manager.ids = ([200 + i for i in range(8)],)
    _report(sched, sched._plan_store(state, 128))
    sched.request_finished(state.request)
    assert sched.index.used_slots == 2
    _stored(sched, (0, "other"))
    request = _state("again", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (64, True)
    assert sched._lookups["again"].miss.reason == "evicted"


def test_a_finished_request_leaves_blocks_past_a_gap_in_its_prefix_as_old_as_they_were():
    """No lookup reaches them (a hit needs every block from the first): refreshed, they would outlast
    blocks that can still be hits."""
    sched = _full_attention_scheduler(num_slots=3)
    _stored(sched, (0, "h7"), (0, "h11"), (0, "useful"))  # the prefix's first block, h3, is not held
    request = _state("r", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([200 + i for i in range(16)],)), 0)
    sched.request_finished(request)
    _stored(sched, (0, "other"))
    assert sched.index.contains((0, "useful")) and not sched.index.contains((0, "h7"))


def test_a_finished_requests_window_blocks_that_no_hit_at_its_end_needs_go_first():
    """At 128 tokens a window of 24 needs only the second offloaded block: the first goes before
    anything a hit of the whole prefix reads."""
    sched, manager = _scheduler(num_slots=4)
    state = _state("r", 128)
    sched._requests["r"] = state
    manager.ids = _ids(0)
    _report(sched, sched._plan_store(state, 128))
    sched.request_finished(state.request)
    _stored(sched, (1, "other"))
    assert not sched.index.contains((0, "h3"))
    assert sched.get_num_new_matched_tokens(_state("again", 256).request, 0) == (128, True)


def test_a_prefix_a_finished_request_loaded_is_evicted_from_its_tail():
    """Block by block across the groups (the load alone marks them group by group: the full-attention
    group's, then the window's)."""
    sched, manager = _scheduler(num_slots=4)
    _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    request = _state("r", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (128, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 128)
    (job,) = sched.build_connector_meta(_output()).loads
    _report(sched, job)
    sched.request_finished(request)
    hit, miss = _lookup_after_one_more_store(sched)
    assert hit == 64 and miss.reason == "evicted"


def test_a_load_marks_what_it_read_used_tail_first():
    """While the request still runs: the blocks it loaded, tail first (one full-attention group)."""
    sched = _full_attention_scheduler(num_slots=2)
    _stored(sched, (0, "h3"), (0, "h7"))
    request = _state("r", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (128, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([200 + i for i in range(16)],)),
                                   128)
    (job,) = sched.build_connector_meta(_output()).loads
    _report(sched, job)
    _stored(sched, (0, "other"))
    assert sched.get_num_new_matched_tokens(_state("again", 256).request, 0) == (64, True)


@pytest.mark.parametrize("preempted_before", [0, 1])
def test_a_request_whose_load_failed_loads_again_only_once_vllm_preempted_it(monkeypatch, preempted_before):
    """After a failed load vLLM keeps the request's in-flight reserve until it is preempted (its retry
    must recompute, or it could wait for ever); once preempted, it starts over and may load. Preemptions
    before the failure do not count: they dropped no reserve of it."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"))
    monkeypatch.setattr(sched.index, "drop", lambda keys: 0)  # the host blocks stay after the failure
    request = _state("r", 256).request
    request.num_preemptions = preempted_before
    assert sched.get_num_new_matched_tokens(request, 0) == (128, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 128)
    (job,) = sched.build_connector_meta(_output()).loads
    _report(sched, job, failed=True)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched._lookups["r"].miss.reason == "load_failed"
    request.num_preemptions = preempted_before + 1
    assert sched.get_num_new_matched_tokens(request, 0) == (128, True)


def test_a_streaming_session_whose_load_failed_may_load_in_its_next_turn(monkeypatch):
    """The turn whose load failed recomputed its prefill (vLLM drops the failed load's reserve when a
    prefill ends); the next turn keeps its computed tokens, unlike a retry, which starts from 0."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"), (0, "h11"), (1, "h11"))
    monkeypatch.setattr(sched.index, "drop", lambda keys: 0)
    request = _state("s", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (192, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 192)
    (job,) = sched.build_connector_meta(_output()).loads
    _report(sched, job, failed=True)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # the retry, from 0 tokens
    request.num_computed_tokens = 64  # its prefill recomputed, the session's next turn waits to be scheduled
    assert sched.get_num_new_matched_tokens(request, 64) == (128, True)


# ---------------------------------------------------------------- decode steps that store nothing
class _NeverIdle(KVScopeScheduler):
    """Store planning without the idle mark: every scheduled request is planned in full every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.store_planner.next_store_tokens = lambda stored_blocks, known: -math.inf  # no count below it: never idle


_IDLE_LAYOUTS = {
    "window stores ahead": LAYOUTS,
    "window waits for keys": [GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=200),
                              GroupLayout(1, GroupKind.FULL_ATTENTION, BS)],
    "full attention": [GroupLayout(0, GroupKind.FULL_ATTENTION, BS)],
    "two block sizes": [GroupLayout(0, GroupKind.FULL_ATTENTION, 2 * BS), GroupLayout(1, GroupKind.FULL_ATTENTION, BS)],
}


def _serve_step_by_step(scheduler_class, layouts, prompt: int, chunks: list[int], drafts: list[int],
                        decode: int) -> tuple[list, int]:
    """One request through `build_connector_meta`: its prompt in `chunks` (cycled), then `decode` steps of
    one token plus `drafts[i]` drafts (cycled); every store reported before the next step. Returns each
    step's stores as plain data, and how often the full store planning ran."""
    manager = _Manager()
    sched = scheduler_class(layouts, offload_block_size=B, hash_block_size=BS, num_slots=64, slot_bytes=1024,
                            world_size=1, tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda: manager)
    planned = 0
    plan_store = sched._plan_store

    def counting_plan_store(state, computed):
        nonlocal planned
        planned += 1
        return plan_store(state, computed)

    sched._plan_store = counting_plan_store
    state = _state("r", prompt)
    sched._requests["r"] = state
    request, computed, steps, step = state.request, 0, [], 0
    while computed < prompt + decode:
        if computed < prompt:
            scheduled, spec = min(chunks[step % len(chunks)], prompt - computed), []
        else:
            spec = [7] * drafts[step % len(drafts)]
            scheduled = 1 + len(spec)
        n = max(layout.block_size for layout in layouts)
        manager.ids = tuple([NULL_BLOCK_ID if layout.kind is GroupKind.SLIDING_WINDOW
                             and (i + 1) * layout.block_size <= computed - layout.sliding_window + 1
                             else 1000 * (layout.index + 1) + i for i in range(4 * (prompt + decode + 64) // n)]
                            for layout in layouts)
        out = _output(cached=[("r", None, computed)])
        out.num_scheduled_tokens = {"r": scheduled}
        out.scheduled_spec_decode_tokens = {"r": spec} if spec else {}
        meta = sched.build_connector_meta(out)
        steps.append([(p.group_index, p.block_ids, p.slots, p.subs) for job in meta.stores for p in job.groups])
        for job in meta.stores:
            _report(sched, job)
        computed += scheduled - len(spec)  # the drafts are all rejected: their positions are written again
        if computed >= request.num_tokens:  # a token sampled: its hash block's hash once that block is full
            request.num_tokens += 1
            request.block_hashes = [f"h{i}" for i in range(request.num_tokens // BS)]
        step += 1
    return steps, planned


def test_a_decoding_request_is_planned_only_when_a_block_can_be_stored():
    """Decode steps one token at a time: with full attention alone, only the steps that complete an offloaded
    block (its key appears) plan a store, and the steps right after the one that last stored nothing."""
    layouts = _IDLE_LAYOUTS["full attention"]
    steps, planned = _serve_step_by_step(KVScopeScheduler, layouts, 64, [64], [0], 256)
    _, planned_every_step = _serve_step_by_step(_NeverIdle, layouts, 64, [64], [0], 256)
    assert planned_every_step == 257
    stored_steps = [i for i, stores in enumerate(steps) if stores]
    assert len(stored_steps) == 5  # the prompt's block, then one per 64 decoded tokens
    assert planned <= 2 * len(stored_steps) + 2


# ---------------------------------------------------------------- the idle mark over random histories
_HISTORY_LAYOUTS = [
    *_IDLE_LAYOUTS.values(),
    [GroupLayout(0, GroupKind.SLIDING_WINDOW, 2 * BS, sliding_window=16), GroupLayout(1, GroupKind.FULL_ATTENTION, BS),
     GroupLayout(2, GroupKind.SLIDING_WINDOW, BS, sliding_window=40)],
    [GroupLayout(0, GroupKind.FULL_ATTENTION, 4 * BS), GroupLayout(1, GroupKind.SLIDING_WINDOW, BS, sliding_window=8)],
]


def _chained_hashes(tokens: list[int]) -> list:
    """Block hashes as vLLM chains them: each names every token before its block's end."""
    out, previous = [], 0
    for i in range(len(tokens) // BS):
        previous = hash((previous, tuple(tokens[i * BS:(i + 1) * BS])))
        out.append(previous)
    return out


def _scheduler_state(sched) -> tuple:
    """What store planning leaves behind: host entries, fillings, each request's store progress, open jobs."""
    def filling(f):
        return None if f is None else (f.key, f.slot, f.planned, f.jobs, f.failed, f.keyed, f.block_index)

    entries = {k: (e.slot, e.ready, e.pins, e.stale) for k, e in sched.index._entries.items()}
    fillings = {k: filling(f) for k, f in sched.stores.by_key.items()}
    def progress(p):
        return None if p is None else (p.stored_blocks, [filling(f) for f in p.filling])

    requests = {rid: (progress(s.store_progress), s.stores_stopped) for rid, s in sched._requests.items()}
    return entries, fillings, requests, sorted(sched._jobs)


class _Managers:
    """vLLM's block ids per group of each request, as the history sets them."""

    ids: dict[str, tuple[list[int], ...]] = {}
    block_pool = ROOMY_BLOCK_POOL

    def get_blocks(self, req_id):
        return vllm_blocks(self.ids[req_id])


def _random_history(seed: int) -> None:
    """Two schedulers, one skipping idle requests and one planning every request every step, through the
    same random history: 1-3 requests sharing a prefix (their keys collide), chunked prefill, decode with
    drafts, async scheduling's lag (computed tokens not yet known), preemption (back to 0 or to a prefix
    hit), streaming turns (the last sampled token dropped, input appended: hashes cut and regrown), cache
    resets, requests finishing and coming back, reports late or failed, a small tier. After every step
    the stores and everything store planning keeps must be the same."""
    rng = random.Random(seed)
    layouts = rng.choice(_HISTORY_LAYOUTS)
    num_slots, reprefillable = rng.choice([4, 16, 64]), rng.choice([0, 0, 1, 3])
    managers = [_Managers(), _Managers()]
    scheds = [cls(layouts, offload_block_size=B, hash_block_size=BS, num_slots=num_slots, slot_bytes=1024,
                  world_size=1, tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda m=m: m,
                  reprefillable_tokens=reprefillable)
              for cls, m in zip((KVScopeScheduler, _NeverIdle), managers)]
    prefix = [rng.randint(0, 3) for _ in range(rng.randint(0, 200))]
    requests: dict[str, dict] = {}

    def arrive(rid: str) -> None:
        tokens = prefix[:rng.randint(0, len(prefix))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 250))]
        requests[rid] = {"tokens": tokens, "computed": 0, "generation": requests.get(rid, {}).get("generation", -1) + 1}
        for sched in scheds:
            sched._requests[rid] = _RequestState(request=SimpleNamespace(
                request_id=rid, num_tokens=len(tokens), num_computed_tokens=0, block_hashes=_chained_hashes(tokens)))

    for i in range(rng.randint(1, 3)):
        arrive(f"r{i}")
    unreported: list[int] = []
    for step in range(rng.randint(5, 120)):
        if rng.random() < 0.02:
            for sched in scheds:
                sched.reset_cache()
        for rid, r in list(requests.items()):
            event = rng.random()
            if event < 0.03:
                for sched in scheds:
                    sched.request_finished(sched._requests[rid].request)
                arrive(rid)
            elif event < 0.07:  # preempted: computes again from 0, or from a prefix-cache hit
                r["computed"] = rng.choice([0, rng.randint(0, r["computed"]) // BS * BS])
            elif event < 0.12 and r["computed"] < len(r["tokens"]):  # a streaming session's next turn
                keep = max(r["computed"], len(r["tokens"]) - 1)
                r["tokens"] = r["tokens"][:keep] + [rng.randint(0, 3) for _ in range(rng.randint(0, 40))]
            for sched in scheds:
                request = sched._requests[rid].request
                request.num_tokens, request.num_computed_tokens = len(r["tokens"]), r["computed"]
                request.block_hashes = _chained_hashes(r["tokens"])
        scheduled = []  # (request id, computed tokens as vLLM counts them, scheduled tokens, drafts)
        for rid, r in requests.items():
            if rng.random() < 0.2:
                continue  # not scheduled this step
            if r["computed"] < len(r["tokens"]) - 1:
                new, drafts = rng.randint(1, min(96, len(r["tokens"]) - r["computed"])), []
            else:
                drafts = [7] * rng.randint(0, 3)
                new = 1 + len(drafts)
            scheduled.append((rid, r["computed"] + rng.choice([0, 0, 0, 1, 2]), new, drafts))
        ids = {rid: tuple([NULL_BLOCK_ID if layout.kind is GroupKind.SLIDING_WINDOW
                           and (i + 1) * layout.block_size <= computed - layout.sliding_window + 1
                           else 100000 * (layout.index + 1) + 1000 * requests[rid]["generation"] + i
                           for i in range((computed + new) // layout.block_size + 2)] for layout in layouts)
               for rid, computed, new, _ in scheduled}
        stores = []
        for sched, manager in zip(scheds, managers):
            manager.ids = ids
            out = _output(cached=[(rid, None, computed) for rid, computed, _, _ in scheduled])
            out.num_scheduled_tokens = {rid: new for rid, _, new, _ in scheduled}
            out.scheduled_spec_decode_tokens = {rid: drafts for rid, _, _, drafts in scheduled if drafts}
            meta = sched.build_connector_meta(out)
            stores.append([(job.job_id, job.req_id, [(p.group_index, p.block_ids, p.slots, p.subs) for p in job.groups])
                           for job in meta.stores])
        assert stores[0] == stores[1], f"seed {seed}, step {step}"
        unreported += [job_id for job_id, _, _ in stores[0]]
        reported = [(job_id, rng.random() < 0.1) for job_id in unreported if rng.random() < 0.6]
        for job_id, failed in reported:
            for sched in scheds:
                _report(sched, SimpleNamespace(job_id=job_id), failed=failed)
        unreported = [job_id for job_id in unreported if job_id not in dict(reported)]
        assert _scheduler_state(scheds[0]) == _scheduler_state(scheds[1]), f"seed {seed}, step {step}"
        for rid, _, new, drafts in scheduled:  # the drafts rejected; a token sampled once caught up
            r = requests[rid]
            r["computed"] = min(r["computed"] + new - len(drafts), len(r["tokens"]))
            if r["computed"] >= len(r["tokens"]):
                r["tokens"].append(rng.randint(0, 3))


@pytest.mark.parametrize("first_seed", range(0, 300, 50))
def test_skipping_idle_requests_changes_nothing_over_random_histories(first_seed):
    for seed in range(first_seed, first_seed + 50):
        _random_history(seed)


def test_a_request_preempted_by_a_cache_reset_stores_its_blocks_again():
    """A cache reset forgets every stored block and preempts the running requests (no tokens computed
    now): one that was idle (its prompt's block stored, decoding inside the next block) computes its
    prompt again and must store it again, though no new key has appeared since it was marked idle."""
    layouts = _IDLE_LAYOUTS["full attention"]
    manager = _Manager()
    sched = KVScopeScheduler(layouts, offload_block_size=B, hash_block_size=BS, num_slots=8, slot_bytes=1024,
                             world_size=1, tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda: manager)
    state = _state("r", 64)
    sched._requests["r"] = state
    manager.ids = ([300 + i for i in range(8)],)

    def step(computed: int, new: int):
        out = _output(cached=[("r", None, computed)])
        out.num_scheduled_tokens = {"r": new}
        jobs = sched.build_connector_meta(out).stores
        for job in jobs:
            _report(sched, job)
        return jobs

    assert step(0, 64)  # the prompt's block stored
    state.request.num_tokens = 65
    assert not step(64, 1)  # decoding: idle until the next key
    assert sched.index.is_ready((0, "h3"))
    state.request.num_computed_tokens = 0  # vLLM preempts it for the reset (`reset_running_requests`)
    sched.reset_cache()
    assert not sched.index.is_ready((0, "h3"))
    (job,) = step(0, 64)  # its prompt computed again: stored again
    assert job.groups[0].block_ids == [300, 301, 302, 303]
    assert sched.index.is_ready((0, "h3"))


# ------------------------------------------------- host tier stats and vLLM-facing return values
def test_the_host_tier_gauges_carry_the_bytes_of_its_slots():
    """`kvscope_host_capacity_bytes` is every slot's bytes; `kvscope_host_used_bytes` the used slots'."""
    sched, manager = _scheduler(num_slots=16)
    state = sched._requests["r"] = _state("r", 256)
    manager.ids = _ids(0, 16)
    _report(sched, sched._plan_store(state, 64))  # offloaded block 0 of both groups: two slots
    sched._update_capacity_stats()
    data = sched.take_stats().data
    assert data["host_capacity_bytes"] == 16 * 1024 and data["host_used_bytes"] == 2 * 1024
    assert data["host_engine"] == 0
    sched.engine = 3  # the connector gives it its data-parallel engine: the tier described is that engine's
    sched._update_capacity_stats()
    assert sched.take_stats().data["host_engine"] == 3


def test_every_step_reports_the_host_tier_usage_and_its_new_evictions():
    """Each step's stats (`build_connector_meta`) carry the used bytes as they stand and the blocks evicted
    since the last step, so the gauges and the eviction counter follow the tier step by step."""
    sched = _full_attention_scheduler(num_slots=2)
    _stored(sched, (0, "a"), (0, "b"), (0, "c"))  # the third evicts one
    sched.build_connector_meta(_output())
    data = sched.take_stats().data
    assert data["host_used_bytes"] == 2 * 1024 and data["evicted_blocks"] == 1


def test_evictions_are_counted_once_each_and_only_when_they_happen():
    sched = _full_attention_scheduler(num_slots=2)
    _stored(sched, (0, "a"), (0, "b"))
    sched._update_capacity_stats()
    assert "evicted_blocks" not in (sched.take_stats().data or {})  # a full tier has evicted nothing
    _stored(sched, (0, "c"))
    sched._update_capacity_stats()
    assert sched.take_stats().data["evicted_blocks"] == 1
    sched._update_capacity_stats()  # nothing new: not counted again
    assert "evicted_blocks" not in sched.take_stats().data
    _stored(sched, (0, "d"), (0, "e"))
    sched._update_capacity_stats()
    assert sched.take_stats().data["evicted_blocks"] == 2


def test_a_loads_scans_are_counted_in_one_stats_interval_only():
    """The scan counters (`take_stats`): blocks scanned and null blocks skipped as the load's scans found them,
    once: the next interval counts no scan again."""
    sched, manager = _scheduler()
    _stored(sched, *[(group, f"h{k}") for k in (3, 7) for group in (0, 1)])
    request = _state("r", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (128, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(112, 16)), 128)
    data = sched.take_stats().data
    assert data["scan_blocks"] == {"0|sliding_window": 8, "1|full_attention": 8}
    assert data["null_blocks_skipped"] == {"0|sliding_window": 5, "1|full_attention": 0}  # the window's first 5
    again = sched.take_stats()
    assert again is None or not any(again.data.get("scan_blocks", {}).values()), again.data


def test_a_cache_reset_tells_vllm_it_succeeded():
    """vLLM's `reset_prefix_cache(reset_connector=True)` reports failure unless the connector says True."""
    sched, _ = _scheduler()
    assert sched.reset_cache() is True


def test_a_cache_reset_whose_stats_fail_still_resets_and_says_so(monkeypatch):
    """A fault in the stats a reset updates (`telemetry_failed`) must not reach vLLM's reset, which has
    emptied the tier by then: the reset still reports success, and nothing stored before it loads."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"))

    def failing_usage(*args):
        raise RuntimeError("injected telemetry fault")

    monkeypatch.setattr(sched._stats, "set_host_usage", failing_usage)
    assert sched.reset_cache() is True
    assert not sched.index.is_ready((0, "h3")) and not sched.index.is_ready((1, "h3"))


def test_a_report_of_a_job_the_scheduler_does_not_know_is_ignored():
    sched, manager = _scheduler()
    job = _pending_store(sched, manager)
    _report(sched, SimpleNamespace(job_id=job.job_id + 100))
    _report(sched, SimpleNamespace(job_id=job.job_id + 100), failed=True)
    assert sched.has_unreported_jobs()
    _report(sched, job)
    assert not sched.has_unreported_jobs()


@pytest.mark.parametrize("chunks", [[8, 120], [8, 8, 112]])
@pytest.mark.parametrize("name", sorted(_IDLE_LAYOUTS))
def test_a_prefill_chunk_that_completes_no_block_leaves_the_next_chunks_blocks_to_store(name, chunks):
    """A first chunk inside the first device block stores nothing and marks the request idle until
    that block is computed (its key is known from the start; the chunk that ends exactly on it
    stores it), not until a new key appears: the prompt's keys are all known already."""
    layouts = _IDLE_LAYOUTS[name]
    steps, _ = _serve_step_by_step(KVScopeScheduler, layouts, 128, chunks, [0], 0)
    reference, _ = _serve_step_by_step(_NeverIdle, layouts, 128, chunks, [0], 0)
    assert steps[0] == [] and steps[1] and steps == reference


def test_requests_resumed_after_preemption_restart_like_new_ones():
    """Both get new device blocks: their Mamba blocks' witnessed states are forgotten."""
    out = _output(new=[(([], []), 0)], cached=[("c", None, 0), ("d", None, 32)], resumed=["c"])
    assert KVScopeScheduler._restarted(out) == {"n0", "c"}
    out.scheduled_cached_reqs.resumed_req_ids = None  # a vLLM without resumed requests this step
    assert KVScopeScheduler._restarted(out) == {"n0"}


def test_a_restarted_request_forgets_the_mamba_states_it_witnessed_and_a_running_one_keeps_them():
    layouts = [GroupLayout(0, GroupKind.MAMBA, B), GroupLayout(1, GroupKind.FULL_ATTENTION, BS)]
    sched = KVScopeScheduler(layouts, offload_block_size=B, hash_block_size=BS, num_slots=8, slot_bytes=1024,
                             world_size=1, tracing=KVScopeTracing.disabled(),
                             kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER)
    state = sched._requests["r"] = _state("r", 256)
    state.witnessed_states[(0, 1)] = 7

    def step(resumed):
        out = _output(cached=[("r", ([], []), 0)], resumed=resumed)
        out.num_scheduled_tokens = {"r": 1}  # inside the first block: vLLM is not asked for blocks
        assert sched.build_connector_meta(out).stores == []

    step(resumed=[])
    assert state.witnessed_states == {(0, 1): 7}
    step(resumed=["r"])  # preempted and resumed: new blocks
    assert state.witnessed_states == {}


def test_only_a_mamba_block_holding_the_state_of_another_token_count_is_logged(caplog):
    """The log says why Mamba states are stored less often than blocks end: a block vLLM keys for another
    token count (a checkpoint at a finer hash boundary). A block keyed for its own end that a forward
    started inside is not such a block: it does not use up the one message."""
    layouts = [GroupLayout(0, GroupKind.MAMBA, B), GroupLayout(1, GroupKind.FULL_ATTENTION, BS)]

    def block(block_id, keyed_tokens):
        return SimpleNamespace(block_id=block_id, block_hash_num_tokens=keyed_tokens, block_hash=f"k{keyed_tokens}")

    blocks = ([block(10, 64), block(11, 112)], [block(200 + i, 16 * (i + 1)) for i in range(8)])
    manager = SimpleNamespace(get_blocks=lambda req_id: SimpleNamespace(blocks=blocks))
    sched = KVScopeScheduler(layouts, offload_block_size=B, hash_block_size=BS, num_slots=16, slot_bytes=1024,
                             world_size=1, tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda: manager)
    state = _state("r", 128)
    state.witnessed_states[(0, 0)] = None  # a forward started inside block 0 and left it
    caplog.set_level("INFO", logger="connector.store_plans")
    job = sched._plan_store(state, 128)
    assert _pieces(job, 0) == []  # neither holds the state at its own end
    sched._plan_store(_state("other", 128), 128)  # another request with such a block: said once for all
    said = [r.getMessage() for r in caplog.records if "holds vLLM's state at token" in r.getMessage()]
    assert len(said) == 1 and "ending at token 128 holds vLLM's state at token 112" in said[0], said


def test_an_offloaded_mamba_block_with_a_device_block_not_holding_its_own_state_frees_its_slot():
    """An offloaded block of several Mamba state blocks (vLLM keeping every state) is stored only if each
    holds the state at its own end. One that does not leaves the block incomplete for ever: its host slot
    is freed once the pieces already planned are written, not held until a cache reset."""
    layouts = [GroupLayout(0, GroupKind.MAMBA, BS), GroupLayout(1, GroupKind.FULL_ATTENTION, BS)]

    def block(block_id, keyed_tokens):
        return SimpleNamespace(block_id=block_id, block_hash_num_tokens=keyed_tokens, block_hash=f"k{keyed_tokens}")

    blocks = tuple([block(first + i, BS * (i + 1)) for i in range(4)] for first in (10, 200))
    manager = SimpleNamespace(get_blocks=lambda req_id: SimpleNamespace(blocks=blocks))
    sched = KVScopeScheduler(layouts, offload_block_size=B, hash_block_size=BS, num_slots=16, slot_bytes=1024,
                             world_size=1, tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda: manager)
    state = _state("r", 64)
    state.witnessed_states[(0, 1)] = None  # a forward started inside Mamba block 1 and left it
    job = sched._plan_store(state, 64)
    assert _pieces(job, 0) == [([10], [0])]  # block 0 holds its own state; block 1 does not: the rest never comes
    _report(sched, job)
    assert not sched.index.contains((0, "h3")) and sched.index.is_ready((1, "h3"))
    assert sched.stores.by_key == {} and sched.index.used_slots == 1


def test_the_retry_of_a_failed_load_counts_its_blocks_as_load_failed_and_nothing_as_not_taken(monkeypatch):
    """The retry (from 0 tokens) is offered no hit: every block the tier holds is missed as load_failed,
    the last one's tokens as tail; vLLM took all it was offered (nothing), so nothing is not_taken."""
    sched, manager = _scheduler()
    _stored(sched, (0, "h3"), (1, "h3"), (0, "h7"), (1, "h7"), (0, "h11"), (1, "h11"))
    monkeypatch.setattr(sched.index, "drop", lambda keys: 0)  # the host blocks stay after the failure
    request = _state("r", 256).request
    assert sched.get_num_new_matched_tokens(request, 0) == (192, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 192)
    (job,) = sched.build_connector_meta(_output()).loads
    _report(sched, job, failed=True)
    sched.take_stats()
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 16)), 0)
    data = sched.take_stats().data
    assert (data["lookup_tokens"], data.get("hit_tokens", 0)) == (256, 0)
    assert data["missed_tokens"] == {"load_failed": 192, "tail": 64}


def test_the_retry_of_a_failed_load_counts_as_load_failed_only_what_the_tier_still_held():
    """Blocks the failed load read are dropped, blocks nobody stored are new: the bar on loading again
    cost the retry only the hit the tier still held, and that alone is load_failed."""
    sched, manager = _scheduler()
    _stored(sched, *[(group, f"h{k}") for k in (3, 7, 11) for group in (0, 1)])
    request = _state("r", 320).request  # offloaded blocks h3..h19: h15 and h19 never stored
    assert sched.get_num_new_matched_tokens(request, 0) == (192, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(192, 20)), 192)
    (job,) = sched.build_connector_meta(_output()).loads
    _report(sched, job, failed=True)  # drops what it read: h3..h11 of full attention, the window's h11
    assert sched.index.why_absent((1, "h3")) == "dropped" and sched.index.is_ready((0, "h7"))
    _stored(sched, (1, "h3"), (1, "h7"))  # another request stores the first two blocks again
    sched.take_stats()
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched._lookups["r"].miss.reason == "load_failed"
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: _ids(0, 20)), 0)
    data = sched.take_stats().data
    assert data["missed_tokens"] == {"load_failed": 128, "dropped": 64, "new": 64, "tail": 64}
    assert sum(data["missed_tokens"].values()) == data["lookup_tokens"] == 320


def test_missed_tokens_by_reason_add_up_to_the_tokens_looked_up_when_vllm_counts_fewer_than_the_lookup():
    """vLLM's looked-up tokens are counted when it schedules the request and may be fewer than the lookup
    saw: the reasons are cut to them, so missed and hit tokens still add up to the tokens looked up."""
    sched, _ = _scheduler()
    sched.lookup_records.log.append((100, 0, Lookup(0, 0, 0, 0, Miss("new", (("new", 128),), 64))))
    assert sched.take_stats().data["missed_tokens"] == {"new": 100}


def test_tokens_a_drafter_may_write_again_are_not_stored_when_unverified_drafts_count_as_computed():
    """Both bounds at once: under async scheduling the known tokens bound the store (65 known, the
    previous step's 3 drafts counted as computed), and the last 2 known ones are re-prefillable."""
    sched, manager = _scheduler()
    sched.reprefillable_tokens = 2
    sched._requests["r"] = _state("r", 65)
    manager.ids = _ids(0)
    out = _output(cached=[("r", ([], []), 68)])
    out.num_scheduled_tokens = {"r": 3}
    out.scheduled_spec_decode_tokens = {"r": [1, 2]}
    meta = sched.build_connector_meta(out)
    stored = {p.group_index: p.block_ids for job in meta.stores for p in job.groups}
    # 63 final tokens: not block 3 (tokens 48..63), whose 63 may be written again
    assert stored[0] == [100, 101, 102] and stored[1] == [200, 201, 202]


def test_a_block_two_unreported_jobs_fill_is_ready_only_once_both_are_reported():
    """Pieces 0-1 and 2-3 of offloaded block 0 go in two steps' jobs; the first reported must not
    make the block loadable while the second still writes its last pieces."""
    sched, manager = _scheduler()
    state = _state("r", 128)
    manager.ids = _ids(0)
    first = sched._plan_store(state, 40)
    manager.ids = _ids(40)
    second = sched._plan_store(state, 64)
    assert _pieces(second, 1) == [([202, 203], [2, 3])]
    _report(sched, first)
    assert not sched.index.is_ready((1, "h3")) and not sched.index.is_ready((0, "h3"))
    _report(sched, second)
    assert sched.index.is_ready((1, "h3")) and sched.index.is_ready((0, "h3"))


def test_a_request_with_a_single_computed_token_keeps_its_kv_through_a_reset_and_stores_nothing_more():
    sched, manager = _scheduler()
    state = sched._requests["r"] = _state("r", 256)
    state.request.num_computed_tokens = 1
    sched.reset_cache()
    manager.ids = _ids(0, 16)
    assert sched._plan_store(state, 192) is None


def test_a_prefill_in_small_chunks_plans_its_stores_only_when_a_block_is_computed():
    """The idle mark also spares the prefill's steps that complete no device block (keys all known)."""
    layouts = _IDLE_LAYOUTS["full attention"]
    steps, planned = _serve_step_by_step(KVScopeScheduler, layouts, 64, [2], [0], 0)
    reference, planned_every_step = _serve_step_by_step(_NeverIdle, layouts, 64, [2], [0], 0)
    assert steps == reference and planned_every_step == 32
    assert planned <= 2 * 4  # a step completing each device block, and the one after it


def test_a_load_failed_at_planning_counts_one_failed_block_per_mamba_group():
    """A Mamba group loads one state, whatever the external tokens span: one failed block."""
    layouts = [GroupLayout(0, GroupKind.MAMBA, B), GroupLayout(1, GroupKind.FULL_ATTENTION, BS)]
    sched = KVScopeScheduler(layouts, offload_block_size=B, hash_block_size=BS, num_slots=8, slot_bytes=1024,
                             world_size=1, tracing=KVScopeTracing.disabled(),
                             kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER)
    request = _state("r", 256).request
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([], [])), 128)  # no lookup
    (job,) = sched.build_connector_meta(_output()).loads
    assert job.failed_at_plan
    _report(sched, job, failed=True)
    assert sched.take_stats().data["load_failures"] == 1 + 128 // BS


def test_a_step_planning_fewer_computed_tokens_than_an_earlier_one_never_plans_a_piece_twice():
    """A resumed request's first chunk after preemption can compute fewer tokens than were already
    stored, while another group, held back by a key that did not exist then, now has blocks to store.
    The group that went further keeps its mark: planning its third piece again would count four
    pieces for an offloaded block whose fourth (tokens 48..63) was never written, and make it ready."""
    sched, manager = _scheduler()
    state = _state("r", 128)
    hashes = state.request.block_hashes
    state.request.block_hashes = hashes[:2]  # no key yet: the window stores ahead, full attention waits
    manager.ids = _ids(0)
    first = sched._plan_store(state, 48)
    assert _pieces(first, 0) == [([100, 101, 102], [0, 1, 2])] and _pieces(first, 1) == []
    _report(sched, first)
    state.request.block_hashes = hashes  # keys now exist; the next step plans fewer computed tokens
    second = sched._plan_store(state, 32)
    assert _pieces(second, 0) == [] and _pieces(second, 1) == [([200, 201], [0, 1])]
    _report(sched, second)
    third = sched._plan_store(state, 48)
    assert _pieces(third, 0) == [] and _pieces(third, 1) == [([202], [2])]
    _report(sched, third)
    assert not sched.index.is_ready((0, "h3")) and not sched.index.is_ready((1, "h3"))  # piece 3 is not written


def test_a_store_reads_only_the_block_ids_vllm_has_allocated_and_stores_the_rest_once_it_has():
    """vLLM allocates a block for every token it schedules, so its lists are never shorter than the computed
    tokens: a guard. Were one shorter, the store stops at its end and goes on from there once it is longer."""
    sched, manager = _scheduler()
    state = _state("r", 128)
    manager.ids = tuple(ids[:3] for ids in _ids(0))
    first = sched._plan_store(state, 128)
    assert _pieces(first, 0) == [([100, 101, 102], [0, 1, 2])] and _pieces(first, 1) == [([200, 201, 202], [0, 1, 2])]
    _report(sched, first)
    manager.ids = _ids(0)
    second = sched._plan_store(state, 128)
    assert _pieces(second, 1) == [([203, 204, 205, 206, 207], [3, 0, 1, 2, 3])]
    _report(sched, second)
    assert sched.index.is_ready((1, "h3")) and sched.index.is_ready((1, "h7"))
