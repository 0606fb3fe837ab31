"""The pure multi-group load planner: scan_group, plan_load and LoadPlan.

Examples pin the review cases; property tests compare against `reference_plan`, which reasons
token by token and computes every index a different way from the planner.
"""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector import planning
from connector.groups import GroupKind, GroupLayout
from connector.planning import NULL_BLOCK_ID, LoadPlan, cdiv, gather_load, plan_load, scan_group

from .strategies import block_lists, hybrid_layouts, token_counts, vllm_null_mask

FULL, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
N = NULL_BLOCK_ID


# --- reference -------------------------------------------------------------------------------


def reference_group(layout, block_ids, num_local_tokens, num_cached_tokens, offload_block_size):
    """Token by token: the device blocks holding tokens [local, cached) that exist and aren't null."""
    bs, b = layout.block_size, offload_block_size
    touched: list[int] = []  # device block indices in token order, each once
    for token in range(num_local_tokens, num_cached_tokens):
        i = token // bs
        if i < len(block_ids) and (not touched or touched[-1] != i):
            touched.append(i)
    pending = [i for i in touched if block_ids[i] != NULL_BLOCK_ID]
    return {
        "group_index": layout.index,
        "blocks_total": len(touched),
        "null_skipped": len(touched) - len(pending),
        "start": pending[0] if pending else -1,
        "block_ids": [block_ids[i] for i in pending],
        # The offload block (and the device-block slot in it) that holds the block's first token.
        "offload_indices": [i * bs // b for i in pending],
        "sub_indices": [(i * bs % b) // bs for i in pending],
    }


def reference_plan(layouts, group_block_ids, num_local_tokens, num_external_tokens, b):
    cached = num_local_tokens + num_external_tokens
    groups = [
        reference_group(layout, ids, num_local_tokens, cached, b)
        for layout, ids in zip(layouts, group_block_ids)
    ]
    keys = [
        (g["group_index"], k) for g in groups for k in sorted(set(g["offload_indices"]))
    ]
    # The offload block holding the first token that is not computed locally.
    return groups, num_local_tokens // b, keys


def scan_as_dict(scan):
    return {
        "group_index": scan.group_index,
        "blocks_total": scan.blocks_total,
        "null_skipped": scan.null_skipped,
        "start": scan.start,
        "block_ids": scan.block_ids,
        "offload_indices": offload_indices(scan),
        "sub_indices": scan.sub_indices,
    }


def offload_indices(scan):
    """The offload block of each pending block, from the scan's runs."""
    return [k for k, count in scan.runs for _ in range(count)]


# --- naive versions the review rejected --------------------------------------------------------


def naive_scan_all_allocated(layout, block_ids, num_local_tokens):
    """(a) No slice to the cached end: also counts the blocks allocated for new tokens."""
    begin = num_local_tokens // layout.block_size
    return [b for b in block_ids[begin:] if b != NULL_BLOCK_ID]


def naive_pending_by_subtraction(num_allocated_blocks, num_hashed_blocks):
    """(a) vLLM's single-group arithmetic: allocated minus hashed."""
    return num_allocated_blocks - num_hashed_blocks


def naive_start_first_unhashed(hashed, skip_nulls=False):
    """(b) Load start = first block without a hash, searched from index 0.

    Null blocks carry no hash; `skip_nulls` is the kinder variant that ignores them.
    """
    for i, (block_id, has_hash) in enumerate(hashed):
        if skip_nulls and block_id == NULL_BLOCK_ID:
            continue
        if not has_hash:
            return i
    return len(hashed)


def naive_pending_from_first_unhashed(layout, hashed, num_cached_tokens, skip_nulls=False):
    start = naive_start_first_unhashed(hashed, skip_nulls)
    end = cdiv(num_cached_tokens, layout.block_size)
    return [b for b, _ in hashed[start:end] if b != NULL_BLOCK_ID]


def naive_first_key_from_hashed_tokens(num_hashed_blocks, block_size, b):
    """(c) First key from the hashed token count (includes external blocks once vLLM hashed them)."""
    return num_hashed_blocks * block_size // b


def naive_first_key_rounded_up(num_local_tokens, b):
    """(c) First key = first offload block not touched by local tokens."""
    return cdiv(num_local_tokens, b)


def naive_keys_every_group(layouts, num_local_tokens, num_cached_tokens, b):
    """(c) The same key range for every group, pending blocks or not."""
    return [
        (g.index, k) for g in layouts for k in range(num_local_tokens // b, cdiv(num_cached_tokens, b))
    ]


# --- examples --------------------------------------------------------------------------------


def test_single_full_attention_group_aligned():
    g = GroupLayout(0, FULL, 16)
    ids = list(range(1, 12))  # 11 blocks: 4 local, 4 external, 3 for new tokens
    plan = plan_load([g], [ids], 64, 64, 64)
    (scan,) = plan.scans
    assert scan.blocks_total == 4
    assert scan.null_skipped == 0
    assert scan.start == 4
    assert scan.block_ids == [5, 6, 7, 8]
    assert offload_indices(scan) == [1, 1, 1, 1]
    assert scan.sub_indices == [0, 1, 2, 3]
    assert plan.first_offload_index == 1
    assert plan.keys() == [(0, 1)]


def test_unaligned_local_boundary_loads_the_partial_offload_block():
    # B = 64, bs = 32, local 96: device block 3 is the second half of offload block 1.
    g = GroupLayout(0, FULL, 32)
    plan = plan_load([g], [[1, 2, 3, 4, 5]], 96, 32, 64)
    assert plan.scans[0].block_ids == [4]
    assert offload_indices(plan.scans[0]) == [1]
    assert plan.scans[0].sub_indices == [1]
    assert plan.first_offload_index == 1
    assert plan.keys() == [(0, 1)]


def test_nulls_are_skipped_and_counted():
    g = GroupLayout(0, SWA, 16, sliding_window=40)
    ids = [N, N, N, N, N, 6, N, 8, 9, 10]
    scan = scan_group(g, ids, 32, 160, 64)
    assert scan.blocks_total == 8
    assert scan.null_skipped == 4
    assert scan.start == 5
    assert scan.block_ids == [6, 8, 9, 10]
    assert offload_indices(scan) == [1, 1, 2, 2]
    assert scan.sub_indices == [1, 3, 0, 1]


def test_all_null_group_has_no_pending_blocks_and_no_keys():
    g = GroupLayout(0, MAMBA, 16)
    scan = scan_group(g, [N] * 8, 0, 128, 64)
    assert (scan.blocks_total, scan.null_skipped, scan.pending, scan.start) == (8, 8, 0, -1)
    assert LoadPlan([scan], 0).keys() == []


def test_nothing_external_gives_an_empty_plan():
    g = GroupLayout(0, FULL, 16)
    plan = plan_load([g], [[1, 2, 3, 4, 5]], 64, 0, 64)
    assert plan.num_blocks == 0
    assert plan.group_starts == [-1]
    assert plan.scans[0].blocks_total == 0
    assert plan.keys() == []


def test_no_external_tokens_with_unaligned_local_boundary_plans_nothing():
    # local 40 ends inside device block 2; with nothing external that block is not loaded
    # (it is locally computed, and its host block was never looked up).
    g = GroupLayout(0, FULL, 16)
    plan = plan_load([g], [[1, 2, 3, 4]], 40, 0, 64)
    assert plan.num_blocks == 0
    assert plan.scans[0].blocks_total == 0
    assert plan.keys() == []


def test_short_block_list_is_not_indexed_past_its_end():
    g = GroupLayout(0, FULL, 16)
    scan = scan_group(g, [1, 2, 3, 4, 5, 6], 64, 256, 64)
    assert scan.block_ids == [5, 6]
    assert scan.blocks_total == 2


def test_hybrid_plan_gathers_groups_in_order():
    # B = 128; full attention bs 16, sliding window (W=100) bs 32, mamba bs 64.
    # local 128 (offload block 0), external 256 (offload blocks 1, 2), 20 new tokens.
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 32, 100), GroupLayout(2, MAMBA, 64)]
    full = list(range(1, 27))  # cdiv(404, 16) = 26 blocks
    swa = [N] * 8 + [101, 102, 103, 104, 105]  # first kept token 285 -> block 8
    mamba = [N, N, N, N, N, 201, 202]  # state at token 383 -> block 5
    plan = plan_load(layouts, [full, swa, mamba], 128, 256, 128)
    assert plan.group_sizes == [16, 4, 1]
    assert plan.group_starts == [8, 8, 5]
    assert plan.num_blocks == 21
    assert plan.block_ids == full[8:24] + [101, 102, 103, 104, 201]
    assert [s.null_skipped for s in plan.scans] == [0, 4, 3]
    assert plan.first_offload_index == 1
    assert plan.keys() == [(0, 1), (0, 2), (1, 2), (2, 2)]


def test_a_hybrid_load_gathers_one_pin_per_offload_block_and_a_slot_per_device_block():
    """`test_hybrid_plan_gathers_groups_in_order`'s plan, gathered: the host block of offload block k of a group
    is keyed (group, key k); its slot serves each of its pending device blocks."""
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 32, 100), GroupLayout(2, MAMBA, 64)]
    full, swa, mamba = list(range(1, 27)), [N] * 8 + [101, 102, 103, 104, 105], [N, N, N, N, N, 201, 202]
    plan = plan_load(layouts, [full, swa, mamba], 128, 256, 128)
    slot_of = {(0, "h1"): 10, (0, "h2"): 11, (1, "h2"): 12, (2, "h2"): 13}
    pinned = []
    gathered = gather_load(plan.scans, ["h0", "h1", "h2", "h3"], lambda key: pinned.append(key) or slot_of[key])
    assert gathered.keys == pinned == [(0, "h1"), (0, "h2"), (1, "h2"), (2, "h2")]
    assert [(scan.group_index, slots) for scan, slots in gathered.slots] == [
        (0, [10] * 8 + [11] * 8), (1, [12] * 4), (2, [13])]
    assert gathered.loaded == [(0, 16), (1, 4), (2, 1)] and not gathered.missing


def test_a_load_missing_a_host_block_is_gathered_failed_with_its_other_keys_pinned():
    """A key no longer in the tier, or past the request's keys: slot -1, the load must fail, and the keys that
    were pinned are listed so that the caller unpins them."""
    layouts = [GroupLayout(0, FULL, 16)]
    plan = plan_load(layouts, [list(range(1, 17))], 0, 256, 128)  # offload blocks 0 and 1
    gone = gather_load(plan.scans, ["h0", "h1"], lambda key: None if key == (0, "h1") else 7)
    assert gone.missing and gone.keys == [(0, "h0")]
    assert gone.slots[0][1] == [7] * 8 + [-1] * 8
    short = gather_load(plan.scans, ["h0"], lambda key: 7)  # the request has one key only
    assert short.missing and short.keys == [(0, "h0")] and short.slots[0][1] == [7] * 8 + [-1] * 8


def test_a_group_with_nothing_pending_is_not_gathered():
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, MAMBA, 64)]
    plan = plan_load(layouts, [list(range(1, 9)), [N, N]], 0, 128, 128)
    gathered = gather_load(plan.scans, ["h0"], lambda key: 3)
    assert [scan.group_index for scan, _ in gathered.slots] == [0] and gathered.loaded == [(0, 8)]


def test_mismatched_group_count_is_rejected():
    with pytest.raises(ValueError, match="2 groups but 1 block lists"):
        plan_load([GroupLayout(0, FULL, 16), GroupLayout(1, FULL, 16)], [[1]], 0, 16, 16)


def test_no_groups():
    plan = plan_load([], [], 0, 64, 64)
    assert (plan.num_blocks, plan.keys(), plan.first_offload_index) == (0, [], 0)


# --- review case (a): only the blocks covering the cached tokens -------------------------------


def test_review_a_blocks_for_new_tokens_are_not_pending():
    # 168-token prompt, 64 local + 64 external, 40 tokens still to compute: 11 blocks allocated.
    g = GroupLayout(0, FULL, 16)
    ids = list(range(1, 12))
    plan = plan_load([g], [ids], 64, 64, 64)
    # Rejected: every allocated block past the local boundary (7: the 3 for new tokens too).
    assert plan.scans[0].block_ids != naive_scan_all_allocated(g, ids, 64)
    # Rejected: subtraction. vLLM has hashed the 10 full prompt blocks, so "pending" comes out as 1.
    assert plan.group_sizes[0] != naive_pending_by_subtraction(len(ids), 168 // 16)
    assert plan.group_sizes == [4]


def test_review_a_subtraction_goes_negative_for_a_coarser_group():
    # Request hashes are kept at 16 tokens; a 64-token group allocates only 3 blocks for 168 tokens.
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, FULL, 64)]
    ids = [list(range(1, 12)), [21, 22, 23]]
    plan = plan_load(layouts, ids, 64, 64, 64)
    # Rejected: subtraction, naive_pending_by_subtraction(3, 168 // 16), gives -7 pending blocks for
    # the 64-token group (no assert: a block count can never equal it).
    assert plan.group_sizes == [4, 1]
    assert plan.scans[1].block_ids == [22]


# --- review case (b): start at the local boundary, not at the first unhashed block --------------


def test_review_b_sliding_window_leading_nulls():
    # W = 100, bs 16, B 64: local 128 (blocks 0..7), external 64 (blocks 8..11).
    # At 192 computed tokens vLLM keeps tokens from 93: blocks 0..4 are null, 5..7 local and hashed.
    g = GroupLayout(0, SWA, 16, sliding_window=100)
    ids = [N] * 5 + [6, 7, 8, 9, 10, 11, 12]
    hashed = [(b, b != N and i < 8) for i, b in enumerate(ids)]  # async: external not hashed yet
    plan = plan_load([g], [ids], 128, 64, 64)
    # Rejected: start at the first unhashed block, 0 (the null block has no hash), loading local
    # blocks 6, 7, 8 again.
    assert plan.group_starts[0] != naive_start_first_unhashed(hashed)
    assert plan.scans[0].block_ids != naive_pending_from_first_unhashed(g, hashed, 192)
    assert plan.group_starts == [8]
    assert plan.scans[0].block_ids == [9, 10, 11, 12]


def test_review_b_mamba_unhashed_block_below_local_boundary():
    # Mamba keeps a running-state block (id 3) below the local boundary that was never hashed.
    g = GroupLayout(0, MAMBA, 16)
    ids = [N, N, 3, 4, N, N, N, 8]
    hashed = [(N, False), (N, False), (3, False), (4, True)] + [(b, False) for b in ids[4:]]
    plan = plan_load([g], [ids], 64, 64, 64)
    # Rejected, even skipping nulls: start at the unhashed block 2, loading local blocks 3 and 4.
    assert plan.group_starts[0] != naive_start_first_unhashed(hashed, skip_nulls=True)
    assert plan.scans[0].block_ids != naive_pending_from_first_unhashed(g, hashed, 128, skip_nulls=True)
    assert plan.group_starts == [7]
    assert plan.scans[0].block_ids == [8]


def test_review_b_external_blocks_already_hashed():
    # Sync case: vLLM hashed the external blocks before asking us, so nothing is unhashed.
    g = GroupLayout(0, FULL, 16)
    ids = list(range(1, 9))
    hashed = [(b, True) for b in ids]
    plan = plan_load([g], [ids], 64, 64, 64)
    # Rejected: start at the first unhashed block, 8 (past the end), loading nothing.
    assert plan.group_starts[0] != naive_start_first_unhashed(hashed)
    assert plan.scans[0].block_ids != naive_pending_from_first_unhashed(g, hashed, 128)
    assert plan.group_sizes == [4]
    assert plan.group_starts == [4]


# --- review case (c): first key from local device blocks; keys only for pending blocks ----------


def test_review_c_first_key_is_not_from_hashed_tokens():
    # Sync case: 8 hashed device blocks (128 tokens), but only 64 tokens are local.
    g = GroupLayout(0, FULL, 16)
    plan = plan_load([g], [list(range(1, 9))], 64, 64, 64)
    # Rejected: from the hashed tokens, offload block 2 (past the first external one).
    assert plan.first_offload_index != naive_first_key_from_hashed_tokens(8, 16, 64)
    assert plan.first_offload_index == 1


def test_review_c_first_key_is_not_rounded_up():
    # local 96 with B 64: offload block 1 is half local, and it is where the load starts.
    layouts = [GroupLayout(0, FULL, 32), GroupLayout(1, FULL, 16)]
    plan = plan_load(layouts, [[1, 2, 3, 4], list(range(11, 19))], 96, 32, 64)
    # Rejected: rounded up, offload block 2 (skipping the half-local block 1).
    assert plan.first_offload_index != naive_first_key_rounded_up(96, 64)
    assert plan.first_offload_index == 1
    assert plan.keys() == [(0, 1), (1, 1)]


def test_review_c_no_keys_for_blocks_a_group_does_not_load():
    # Sliding window W=40 keeps only offload block 3 of 1..3; the Mamba group has nothing in range.
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 16, 40), GroupLayout(2, MAMBA, 64)]
    full = list(range(1, 17))
    swa = [N] * 13 + [114, 115, 116]  # first kept token 217 -> block 13
    mamba = [N, N, N, N]
    plan = plan_load(layouts, [full, swa, mamba], 64, 192, 64)
    # Rejected: the same key range for every group, (1, 1) and (2, 3) among them.
    naive = naive_keys_every_group(layouts, 64, 256, 64)
    assert set(plan.keys()) < set(naive)
    assert plan.group_sizes == [12, 3, 0]
    assert plan.keys() == [(0, 1), (0, 2), (0, 3), (1, 3)]


# --- properties ------------------------------------------------------------------------------


@st.composite
def load_requests(draw):
    layouts, b = draw(hybrid_layouts())
    local, external, new = draw(token_counts(b))
    ids = draw(block_lists(layouts, local + external + new, local + external))
    return layouts, ids, local, external, b


@settings(max_examples=300, deadline=None)
@given(load_requests())
def test_plan_matches_token_by_token_reference(req):
    layouts, ids, local, external, b = req
    plan = plan_load(layouts, ids, local, external, b)
    groups, first, keys = reference_plan(layouts, ids, local, external, b)
    assert [scan_as_dict(s) for s in plan.scans] == groups
    assert plan.first_offload_index == first
    assert plan.keys() == keys


@settings(max_examples=300, deadline=None)
@given(load_requests())
def test_plan_invariants(req):
    layouts, ids, local, external, b = req
    cached = local + external
    plan = plan_load(layouts, ids, local, external, b)
    for layout, block_ids, scan in zip(layouts, ids, plan.scans):
        bs = layout.block_size
        factor = layout.blocks_per_offload_block(b)
        assert scan.group_index == layout.index
        assert 0 <= scan.pending <= scan.blocks_total <= max(0, cdiv(cached, bs) - local // bs)
        assert scan.null_skipped == scan.blocks_total - scan.pending
        assert NULL_BLOCK_ID not in scan.block_ids
        # (offload index, sub index) names the device block the id came from, inside the scan range.
        device = [k * factor + s for k, s in zip(offload_indices(scan), scan.sub_indices)]
        assert device == sorted(set(device))
        assert all(local // bs <= i < cdiv(cached, bs) for i in device)
        assert [block_ids[i] for i in device] == scan.block_ids
        assert all(0 <= s < factor for s in scan.sub_indices)
        assert scan.start == (device[0] if device else -1)
        # One run per offload block read, counting its pending device blocks (what gets pinned).
        read = [k for k, _ in scan.runs]
        assert read == sorted(set(read)) and all(count > 0 for _, count in scan.runs)
        # Every group's own derivation of the first key agrees with the plan's.
        assert (local // bs) // factor == plan.first_offload_index
        assert all(k >= plan.first_offload_index for k in read)
        if layout.kind is FULL and scan.pending and not scan.null_skipped:
            assert read[0] == plan.first_offload_index


@settings(max_examples=200, deadline=None)
@given(load_requests())
def test_load_plan_accessors_are_consistent(req):
    layouts, ids, local, external, b = req
    plan = plan_load(layouts, ids, local, external, b)
    sizes, starts = plan.group_sizes, plan.group_starts
    assert sizes == [len(s.block_ids) for s in plan.scans]
    assert plan.num_blocks == sum(sizes) == len(plan.block_ids)
    assert all((start == -1) == (size == 0) for start, size in zip(starts, sizes))
    # block_ids is the groups' ids concatenated in group order; the sizes cut it back apart.
    offset = 0
    for scan, size, start, block_ids in zip(plan.scans, sizes, starts, ids):
        chunk = plan.block_ids[offset : offset + size]
        assert chunk == scan.block_ids
        if size:
            assert chunk[0] == block_ids[start]
        offset += size
    keys = plan.keys()
    assert len(keys) == len(set(keys))
    assert set(keys) == {
        (s.group_index, k) for s in plan.scans for k in offload_indices(s)
    }
    assert [g for g, _ in keys] == sorted(g for g, _ in keys)  # plan (group) order
    for scan in plan.scans:
        mine = [k for g, k in keys if g == scan.group_index]
        assert mine == sorted(set(offload_indices(scan)))


@settings(max_examples=200, deadline=None)
@given(load_requests())
def test_pending_never_includes_blocks_for_new_tokens(req):
    layouts, ids, local, external, b = req
    plan = plan_load(layouts, ids, local, external, b)
    for layout, block_ids, scan in zip(layouts, ids, plan.scans):
        covered = block_ids[: cdiv(local + external, layout.block_size)]
        beyond = set(block_ids[len(covered) :]) - {NULL_BLOCK_ID}
        assert not beyond & set(scan.block_ids)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_vllm_null_pattern_loads_exactly_the_retained_blocks(data):
    # With vLLM's own null placement the plan loads, per group, the device blocks holding the
    # tokens [local, cached) that the group keeps: all, the window's, or Mamba's last state.
    layouts, b = data.draw(hybrid_layouts())
    local, external, new = data.draw(token_counts(b))
    cached = local + external
    ids = [
        [i + 1 for i in range(cdiv(cached + new, g.block_size))] for g in layouts
    ]
    for g, block_ids in zip(layouts, ids):
        for i, null in enumerate(vllm_null_mask(g, len(block_ids), cached)):
            if null:
                block_ids[i] = NULL_BLOCK_ID
    plan = plan_load(layouts, ids, local, external, b)
    for g, scan in zip(layouts, plan.scans):
        # vLLM frees whole blocks only: the block holding the first retained token stays.
        first_kept_block = g.first_retained_token(cached) // g.block_size
        kept = range(max(local, first_kept_block * g.block_size), cached)
        assert scan.block_ids == sorted({t // g.block_size + 1 for t in kept})


def test_a_block_id_sequence_that_is_not_a_list_still_gives_list_block_ids():
    # The adapter may hand any sequence (a tuple here): the pending ids come back as a list.
    g = GroupLayout(0, FULL, 16)
    scan = scan_group(g, tuple(range(1, 9)), 64, 128, 64)
    assert scan.block_ids == [5, 6, 7, 8]
    assert scan.sub_indices == [0, 1, 2, 3]


def test_a_scan_longer_than_the_cached_position_table_gets_every_sub_index(monkeypatch):
    # Sub-indices are sliced from a per-factor table cached at 1024 entries and grown to a power of
    # two: a 2049-block scan (one past 2048) after a short one must grow it far enough.
    monkeypatch.setattr(planning, "_POSITION_TABLES", {})
    g = GroupLayout(0, FULL, 16)
    scan_group(g, list(range(1, 9)), 0, 128, 64)  # caches the small table first
    ids = list(range(1, 2050))
    scan = scan_group(g, ids, 0, 2049 * 16, 64)
    assert scan.block_ids == ids
    assert scan.sub_indices == [i % 4 for i in range(2049)]


def test_a_scan_one_past_the_cached_position_table_gets_every_sub_index(monkeypatch):
    # The exact boundary: a table cached at 1024 entries and a scan ending at block 1025 (one past
    # it). A table kept at 1024 would slice one sub-index short, and the last pending block would
    # have no destination position in its offload block.
    monkeypatch.setattr(planning, "_POSITION_TABLES", {})
    g = GroupLayout(0, FULL, 16)
    scan_group(g, list(range(1, 9)), 0, 128, 64)  # caches the 1024-entry table
    assert len(planning._POSITION_TABLES[4]) == 1024
    ids = list(range(1, 1026))
    scan = scan_group(g, ids, 0, 1025 * 16, 64)
    assert scan.block_ids == ids
    assert scan.sub_indices == [i % 4 for i in range(1025)]
    assert scan.runs[-1] == (256, 1)
