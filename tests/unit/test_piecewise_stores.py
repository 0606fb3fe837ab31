"""The life of an offloaded block stored piece by piece (`PiecewiseStores`), without the scheduler.

Offloaded blocks of 4 device blocks (64 tokens of 16). How the scheduler feeds it under vLLM is
tested in test_store_planning.py and tests/compat.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.groups import GroupKind, GroupLayout
from connector.host_store import JOURNAL_STORED, HostIndex
from connector.metadata import GroupTransfer
from connector.offload_keys import OffloadKeys
from connector.piecewise_stores import PiecewiseStores
from connector.planning import NULL_BLOCK_ID

BS, B = 16, 64
FULL = GroupLayout(0, GroupKind.FULL_ATTENTION, BS)


def _stores(*layouts: GroupLayout, num_slots: int = 4, draft_tokens: int = 0) -> PiecewiseStores:
    return PiecewiseStores(HostIndex(num_slots), list(layouts), offload_block_size=B, keys=OffloadKeys(B // BS),
                           draft_tokens=draft_tokens)


def _request(rid: str, num_tokens: int, prompt: int = 0, max_tokens: int | None = None):
    return SimpleNamespace(request_id=rid, block_hashes=[f"h{i}" for i in range(num_tokens // BS)],
                           num_prompt_tokens=prompt, max_tokens=max_tokens)


def _plan(filling, pieces: int = 1) -> None:
    """What the scheduler does for a store job carrying ``pieces`` of the block."""
    filling.planned += pieces
    filling.jobs += 1


@pytest.mark.parametrize("window, ahead", [(24, True), (48, True), (49, False), (64, False)])
def test_a_window_group_stores_ahead_only_when_its_window_drops_a_blocks_first_piece(window, ahead):
    stores = _stores(FULL, GroupLayout(1, GroupKind.SLIDING_WINDOW, BS, sliding_window=window))
    assert stores.stores_ahead == [False, ahead]
    assert stores.ahead_groups == ([1] if ahead else [])


@pytest.mark.parametrize("window, drafts, ahead", [(48, 3, True), (51, 3, True), (52, 3, False), (49, 1, True),
                                                   (50, 1, False)])
def test_speculative_drafts_widen_the_windows_that_store_ahead_by_the_drafts_a_step_may_accept(window, drafts,
                                                                                                ahead):
    """A step that accepts its drafts moves that many tokens further: vLLM may free a block's first
    piece in the step that makes its key."""
    stores = _stores(FULL, GroupLayout(1, GroupKind.SLIDING_WINDOW, BS, sliding_window=window), draft_tokens=drafts)
    assert stores.stores_ahead == [False, ahead]


def test_a_block_is_ready_only_with_every_piece_written_and_reported():
    stores = _stores(FULL)
    filling = stores.start_block(_request("r", 64), 0, 0, 4, first_block_id=7, known=1)
    assert filling.key == (0, "h3") and filling.keyed
    _plan(filling, 3)
    stores.job_reported([filling], failed=False)
    assert not stores.index.is_ready((0, "h3"))  # a piece is still to come
    _plan(filling)
    assert not stores.index.is_ready((0, "h3"))  # planned, not reported
    stores.job_reported([filling], failed=False)
    assert stores.index.is_ready((0, "h3")) and stores.by_key == {}


def test_a_failed_piece_frees_the_slot_once_no_job_is_out():
    stores = _stores(FULL)
    filling = stores.start_block(_request("r", 64), 0, 0, 4, first_block_id=7, known=1)
    _plan(filling, 2)
    _plan(filling, 2)
    stores.job_reported([filling], failed=True)
    assert stores.index.used_slots == 1  # the other job still writes into the slot
    stores.job_reported([filling], failed=False)
    assert stores.index.used_slots == 0 and not stores.index.contains((0, "h3")) and stores.by_key == {}


def test_a_placeholder_gets_its_key_and_completes_even_when_its_pieces_were_written_first():
    window = GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=24)
    stores = _stores(window)
    request = _request("r", 48, prompt=40, max_tokens=100)  # block 0's last token not known yet
    filling = stores.start_block(request, 0, 0, 4, first_block_id=7, known=0)
    assert not filling.keyed and filling.key == (0, ("unkeyed", "r", 0))
    _plan(filling, 4)
    stores.job_reported([filling], failed=False)
    assert stores.index.used_slots == 1 and not stores.index.is_ready(filling.key)  # written, no key
    request.block_hashes.append("h3")  # the block's last token is sampled: its key exists
    stores.key_blocks(request, [filling], known=1)
    assert stores.index.is_ready((0, "h3")) and stores.by_key == {}


def test_every_window_group_gets_its_key_though_others_have_none_to_take():
    """Several window groups: one that skipped the block, or whose placeholder is a duplicate, must not
    keep the others' placeholders unkeyed (given up at the request's end, their pieces written for nothing)."""
    stores = _stores(*(GroupLayout(g, GroupKind.SLIDING_WINDOW, BS, sliding_window=24) for g in range(3)))
    request = _request("r", 48, prompt=40, max_tokens=100)
    duplicate, filling = (stores.start_block(request, g, 0, 4, first_block_id=7, known=0) for g in (1, 2))
    stores.index.reserve_for_store((1, "h3"))  # group 1: another request stores the block already
    request.block_hashes.append("h3")
    stores.key_blocks(request, [None, duplicate, filling], known=1)  # group 0 skipped it (no slot, say)
    assert duplicate.failed and filling.keyed and filling.key == (2, "h3") and stores.index.contains((2, "h3"))


def test_a_placeholder_whose_block_is_stored_already_is_dropped_and_the_stored_block_kept():
    window = GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=24)
    stores = _stores(window)
    request = _request("r", 48, prompt=40, max_tokens=100)
    filling = stores.start_block(request, 0, 0, 4, first_block_id=7, known=0)
    _plan(filling, 1)
    other = stores.index.reserve_for_store((0, "h3"))  # another request stored the same block
    stores.index.complete_store((0, "h3"))
    request.block_hashes.append("h3")
    stores.key_blocks(request, [filling], known=1)
    assert filling.failed and stores.index.used_slots == 2  # our job is still out
    stores.job_reported([filling], failed=False)
    assert stores.index.used_slots == 1 and stores.index.is_ready((0, "h3")) and other is not None


def test_no_placeholder_for_a_block_the_request_cannot_finish():
    window = GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=24)
    stores = _stores(window)
    # prompt 40 + at most 24 sampled tokens: the last one is never computed, so token 64 never is
    assert stores.start_block(_request("r", 48, prompt=40, max_tokens=24), 0, 0, 4, 7, known=0) is None
    assert stores.start_block(_request("s", 48, prompt=40, max_tokens=25), 0, 0, 4, 7, known=0) is not None


def test_a_request_without_a_token_limit_may_start_a_placeholder():
    """No `max_tokens` (or not an int): nothing says the block's last token is never computed."""
    window = GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=24)
    stores = _stores(window)
    assert stores.start_block(_request("r", 48, prompt=40, max_tokens=None), 0, 0, 4, 7, known=0) is not None


def test_a_placeholder_whose_key_does_not_exist_yet_keeps_its_placeholder():
    """``known`` blocks have a key: a block at or past it has none to take yet (its hash is not there)."""
    window = GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=24)
    stores = _stores(window)
    request = _request("r", 48, prompt=40, max_tokens=100)
    filling = stores.start_block(request, 0, 0, 4, first_block_id=7, known=0)
    placeholder = filling.key
    stores.key_blocks(request, [filling], known=0)
    assert not filling.keyed and filling.key == placeholder and stores.by_key == {placeholder: filling}
    assert not filling.failed


def test_a_finished_request_keeps_a_keyed_block_with_every_piece_and_gives_up_an_unkeyed_one():
    """Its end gives up only what can no longer complete: a keyed block whose pieces are all planned
    completes as its jobs report; one whose key never came (the request ended first) frees its slot."""
    window = GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=24)
    stores = _stores(window)
    request = _request("r", 64, prompt=40, max_tokens=100)
    keyed = stores.start_block(request, 0, 0, 4, first_block_id=7, known=1)
    unkeyed = stores.start_block(request, 0, 1, 4, first_block_id=11, known=1)
    _plan(keyed, 4)
    _plan(unkeyed, 4)
    stores.request_finished(request, [keyed, unkeyed])
    assert not keyed.failed and unkeyed.failed
    stores.job_reported([keyed, unkeyed], failed=False)
    assert stores.index.is_ready((0, "h3")) and stores.index.used_slots == 1 and stores.by_key == {}


def test_a_finished_request_gives_up_what_it_can_no_longer_complete():
    stores = _stores(FULL)
    request = _request("r", 128)
    done = stores.start_block(request, 0, 0, 4, first_block_id=7, known=2)
    half = stores.start_block(request, 0, 1, 4, first_block_id=11, known=2)
    _plan(done, 4)
    _plan(half, 2)
    stores.request_finished(request, [half])
    stores.job_reported([done, half], failed=False)
    assert stores.index.is_ready((0, "h3")) and not stores.index.contains((0, "h7"))
    assert stores.index.used_slots == 1 and stores.by_key == {}


def test_a_block_whose_first_device_block_is_null_takes_no_slot():
    """Out of the window from its start (or a Mamba block not holding its own state): never stored, so
    it must not evict a stored block for a slot it would give back at once."""
    stores = _stores(FULL, num_slots=1)
    stores.index.reserve_for_store((0, "old"))
    stores.index.complete_store((0, "old"))
    assert stores.start_block(_request("r", 64), 0, 0, 4, first_block_id=NULL_BLOCK_ID, known=1) is None
    assert stores.index.is_ready((0, "old")) and stores.by_key == {}


def test_a_block_another_request_is_storing_is_skipped_and_theirs_completes():
    """Two requests computing the same prefix: the second gets no filling (nor a description), and the
    first's stays registered, so its jobs still complete the block instead of pinning its slot for good."""
    stores = _stores(FULL)
    stores.describe = lambda request, g, k: (request.request_id, g, k)
    first = stores.start_block(_request("r", 64), 0, 0, 4, first_block_id=7, known=1)
    assert stores.start_block(_request("s", 64), 0, 0, 4, first_block_id=9, known=1) is None
    _plan(first, 4)
    stores.job_reported([first], failed=False)
    assert stores.index.is_ready((0, "h3")) and first.announcement == ("r", 0, 0) and stores.by_key == {}


def test_a_placeholder_whose_key_exists_when_its_request_ends_is_stored_under_it():
    """The request's last sampled token gives the block its key: every piece is written, so it is
    kept under that key rather than given up with the placeholder, and announced as keyed blocks are."""
    window = GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=24)
    stores = _stores(window)
    stores.describe = lambda request, g, k: (request.request_id, g, k)
    stores.index.journal = []
    request = _request("r", 48, prompt=40, max_tokens=100)
    filling = stores.start_block(request, 0, 0, 4, first_block_id=7, known=0)
    _plan(filling, 4)
    stores.job_reported([filling], failed=False)
    request.block_hashes.append("h3")
    stores.request_finished(request, [filling])
    assert stores.index.is_ready((0, "h3")) and stores.index.used_slots == 1 and stores.by_key == {}
    assert stores.index.journal == [(JOURNAL_STORED, (0, "h3"), ("r", 0, 0))]


def test_a_block_given_up_after_it_was_aborted_leaves_another_requests_filling_of_its_key_alone():
    """A request keeps the filling of a block aborted under it (a failed piece) and gives it up again
    when it finishes; meanwhile another request may store the same block under the same key: that
    filling must stay, or its slot is freed while its store still writes into it."""
    stores = _stores(FULL)
    aborted = stores.start_block(_request("r", 64), 0, 0, 4, first_block_id=7, known=1)
    _plan(aborted, 2)
    stores.job_reported([aborted], failed=True)
    assert not stores.index.contains((0, "h3"))
    theirs = stores.start_block(_request("s", 64), 0, 0, 4, first_block_id=9, known=1)
    assert theirs is not None
    stores.request_finished(_request("r", 64), [aborted])
    _plan(theirs, 4)
    stores.job_reported([theirs], failed=False)
    assert stores.index.is_ready((0, "h3")) and stores.index.used_slots == 1 and stores.by_key == {}


def test_a_placeholder_given_up_never_takes_its_key_from_a_request_that_can_store_the_block():
    """A placeholder-keyed block that failed (its slot is freed once its jobs report) must not move to
    the real key when that appears: the key would stay reserved by a block that is never stored, and
    another request computing the same block could not store it."""
    window = GroupLayout(0, GroupKind.SLIDING_WINDOW, BS, sliding_window=24)
    stores = _stores(window)
    request = _request("r", 48, prompt=40, max_tokens=100)
    filling = stores.start_block(request, 0, 0, 4, first_block_id=7, known=0)
    _plan(filling, 1)
    stores.give_up(filling)  # a piece cannot be stored; its job is still out
    request.block_hashes.append("h3")
    stores.key_blocks(request, [filling], known=1)
    assert not filling.keyed and not stores.index.contains((0, "h3"))
    theirs = stores.start_block(_request("s", 64), 0, 0, 4, first_block_id=9, known=1)
    assert theirs is not None and theirs.key == (0, "h3")
    stores.job_reported([filling], failed=False)
    _plan(theirs, 4)
    stores.job_reported([theirs], failed=False)
    assert stores.index.is_ready((0, "h3")) and stores.index.used_slots == 1 and stores.by_key == {}


def _pieces(stores, request, first: int, block_ids: list[int], filling=None, known: int = 8, fed=None):
    """One step's `plan_pieces` of group 0: (its part, the fillings it fed, the group's filling after it)."""
    part, fed = GroupTransfer(0, [], [], []), [] if fed is None else fed
    after = stores.plan_pieces(request, part, first, block_ids, 4, known, filling, fed)
    return part, fed, after


def test_a_steps_pieces_go_to_their_offloaded_blocks_slots_each_filling_fed_once():
    """Device blocks 2..9: the rest of offloaded block 0 (in progress), all of block 1, half of block 2."""
    stores = _stores(FULL)
    request = _request("r", 192)
    started = stores.start_block(request, 0, 0, 4, first_block_id=10, known=3)
    _plan(started, 2)
    part, fed, after = _pieces(stores, request, 2, [12, 13, 14, 15, 16, 17, 18, 19], filling=started, known=3)
    block_1, block_2 = stores.by_key[(0, "h7")], stores.by_key[(0, "h11")]
    assert part.block_ids == [12, 13, 14, 15, 16, 17, 18, 19]
    assert part.subs == [2, 3, 0, 1, 2, 3, 0, 1]
    assert part.slots == [started.slot] * 2 + [block_1.slot] * 4 + [block_2.slot] * 2
    assert fed == [started, block_1, block_2] and after is block_2
    assert (started.planned, started.jobs, block_1.planned, block_1.jobs, block_2.planned, block_2.jobs) == (
        4, 2, 4, 1, 2, 1)
    stores.job_reported([started], failed=False)  # the first step's job
    stores.job_reported(fed, failed=False)
    assert stores.index.is_ready((0, "h3")) and stores.index.is_ready((0, "h7"))
    assert not stores.index.is_ready((0, "h11")) and stores.by_key == {(0, "h11"): block_2}


def test_a_null_piece_gives_its_block_up_and_the_rest_of_that_block_is_not_stored():
    """A null piece (out of the window, Mamba padding) leaves a hole: the block can never complete, so
    its slot goes back and its later pieces are not copied; the next block starts afresh."""
    stores = _stores(FULL)
    request = _request("r", 128)
    part, fed, after = _pieces(stores, request, 0, [10, NULL_BLOCK_ID, 12, 13, 14, 15, 16, 17])
    block_1 = stores.by_key[(0, "h7")]
    assert part.block_ids == [10, 14, 15, 16, 17] and part.subs == [0, 0, 1, 2, 3]
    assert fed[0].key == (0, "h3") and fed[0].failed and after is block_1  # h3: freed once its job reports
    stores.job_reported(fed, failed=False)
    assert not stores.index.contains((0, "h3")) and stores.index.is_ready((0, "h7")) and block_1.planned == 4
    assert stores.index.used_slots == 1


def test_a_piece_of_a_failed_block_is_not_copied():
    stores = _stores(FULL)
    request = _request("r", 64)
    _, fed, filling = _pieces(stores, request, 0, [10, 11])
    filling.failed = True  # a piece of its first job failed on a worker
    part, more, after = _pieces(stores, request, 2, [12, 13], filling=filling)
    assert part.block_ids == [] and more == [] and after is None
    stores.job_reported(fed, failed=True)
    assert stores.index.used_slots == 0 and stores.by_key == {}


def test_a_step_with_no_block_keeps_the_filling_in_progress():
    stores = _stores(FULL)
    request = _request("r", 64)
    _, _, filling = _pieces(stores, request, 0, [10])
    part, fed, after = _pieces(stores, request, 1, [], filling=filling)
    assert after is filling and part.block_ids == [] and fed == []


def test_the_fillings_fed_by_one_job_across_groups_are_each_counted_once():
    """`fed` is the job's list over all its groups: each group's filling goes on it once and counts
    the job once, though the groups' blocks share their keys' hashes."""
    stores = _stores(FULL, GroupLayout(1, GroupKind.FULL_ATTENTION, BS))
    request = _request("r", 64)
    fed = []
    for g in (0, 1):
        stores.plan_pieces(request, GroupTransfer(g, [], [], []), 0, [10 + g, 20 + g], 4, 1, None, fed)
    assert [f.key for f in fed] == [(0, "h3"), (1, "h3")] and [f.jobs for f in fed] == [1, 1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=24), st.data())
def test_a_block_is_stored_exactly_when_all_its_pieces_are_real_however_the_steps_cut_them(real, data):
    """Device blocks computed over any number of steps, some null: an offloaded block ends up stored
    iff all 4 of its pieces are real; each real piece before its block's first hole is copied once,
    to its block's slot at its place; no slot stays taken by a block that did not complete."""
    stores = _stores(FULL, num_slots=8)
    block_ids = [100 + i if is_real else NULL_BLOCK_ID for i, is_real in enumerate(real)]
    blocks = (len(block_ids) + 3) // 4  # the last one possibly partial: the request ends inside it
    request = _request("r", 64 * blocks)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(block_ids)), max_size=4)))
    filling, copied = None, []
    for start, end in zip([0, *cuts], [*cuts, len(block_ids)]):
        part, fed, filling = _pieces(stores, request, start, block_ids[start:end], filling=filling, known=blocks)
        copied += [(block_id, slot, sub) for block_id, slot, sub in zip(part.block_ids, part.slots, part.subs)]
        stores.job_reported(fed, failed=False)
    stores.request_finished(request, [filling])
    whole = [k for k in range(len(block_ids) // 4) if all(real[4 * k:4 * k + 4])]
    assert [key for key in stores.index._entries if stores.index.is_ready(key)] == [(0, f"h{4 * k + 3}")
                                                                                    for k in whole]
    assert stores.index.used_slots == len(whole) and stores.by_key == {}
    expected = []
    for k in range(blocks):
        pieces = real[4 * k:4 * k + 4]
        if pieces[0]:  # a null first piece starts no filling; else copied up to its first hole
            expected += [100 + 4 * k + sub for sub in range(pieces.index(False) if False in pieces else len(pieces))]
    assert [block_id for block_id, _, _ in copied] == expected
    assert all(sub == (block_id - 100) % 4 for block_id, _, sub in copied)
    slots = {}
    for block_id, slot, _ in copied:
        assert slots.setdefault((block_id - 100) // 4, slot) == slot  # one slot per offloaded block
