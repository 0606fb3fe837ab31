"""lookup_miss: why a lookup served no more, block by block past its hit, and what no block could serve."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.groups import GroupKind, GroupLayout
from connector.lookup import find_hit_tokens
from connector.miss_reasons import (
    DROPPED,
    EVICTED,
    LOAD_FAILED,
    NEW,
    NO_STATE,
    NOT_TAKEN,
    OTHER_BLOCKS,
    RESET,
    STORING,
    TAIL,
    Miss,
    barred_from_hit,
    lookup_miss,
    miss_order,
    missed_tokens_by_reason,
    past_kept_tokens,
)

B = 64  # offload block size
FULL = GroupLayout(0, GroupKind.FULL_ATTENTION, 16)
SWA = GroupLayout(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=48)
MAMBA = GroupLayout(2, GroupKind.MAMBA, 64)


def absent(table: dict, default=None):
    """why_absent from {(group, block): reason}; every other block is ready (or `default`)."""
    return lambda group, k: table.get((group, k), default)


def test_nothing_stored_misses_every_whole_block_as_new_and_the_rest_as_tail():
    # 300 tokens: 4 whole blocks (256 tokens) a hit could cover, 44 tokens past them
    assert lookup_miss([FULL], 300, 0, 0, 4, B, lambda group, k: NEW) == (NEW, ((NEW, 256),), 44)


def test_a_hit_up_to_the_last_whole_block_leaves_only_the_tail():
    assert lookup_miss([FULL, SWA], 300, 0, 256, 4, B, absent({})) == (TAIL, (), 44)


def test_the_last_token_is_always_tail_even_on_a_block_boundary():
    # 256 tokens: a hit can cover 3 blocks only (vLLM computes the last token)
    assert lookup_miss([FULL], 256, 0, 192, 4, B, absent({})) == (TAIL, (), 64)
    assert lookup_miss([FULL], 256, 0, 64, 4, B, absent({(0, 1): EVICTED, (0, 2): EVICTED})) == (
        EVICTED, ((EVICTED, 128),), 64)


def test_each_block_past_the_hit_counts_under_its_own_reason():
    # a follow-up turn: the old conversation's blocks were evicted, the new turn's were never stored
    table = {(0, 0): EVICTED, (0, 1): EVICTED, (0, 2): NEW, (0, 3): NEW}
    assert lookup_miss([FULL], 300, 0, 0, 4, B, absent(table)) == (EVICTED, ((EVICTED, 128), (NEW, 128)), 44)
    # a block every group held again after one that was missing
    table = {(0, 1): STORING}
    assert lookup_miss([FULL], 300, 0, 64, 4, B, absent(table)) == (STORING, ((STORING, 64), (OTHER_BLOCKS, 128)), 44)


def test_past_a_block_no_attention_group_ever_held_the_rest_is_new_without_asking():
    asked = []

    def why_absent(group, k):
        asked.append((group, k))
        return NEW

    layouts = miss_order([MAMBA, FULL, SWA])
    assert lookup_miss(layouts, 5000, 0, 0, 78, B, why_absent) == (NEW, ((NEW, 78 * B),), 5000 - 78 * B)
    assert {k for _, k in asked} == {0}  # a cold prompt costs one block's questions, however long
    # a block some attention group still remembers (evicted) is walked past, block by block
    table = {(0, 0): EVICTED, (0, 1): EVICTED}
    miss = lookup_miss(layouts, 5000, 0, 0, 78, B, absent(table, default=NEW))
    assert miss.by_reason == ((EVICTED, 128), (NEW, 76 * B))


def test_a_blocks_reason_is_that_of_the_first_group_lacking_it():
    table = {(1, 2): EVICTED, (0, 3): NEW, (1, 3): NEW}
    assert lookup_miss([FULL, SWA], 300, 0, 128, 4, B, absent(table)) == (EVICTED, ((EVICTED, 64), (NEW, 64)), 44)
    table = {(0, 2): STORING, (1, 2): EVICTED, (0, 3): STORING}
    assert lookup_miss([FULL, SWA], 300, 0, 128, 4, B, absent(table)).by_reason == ((STORING, 128),)


def test_a_group_that_remembers_how_the_block_left_comes_before_one_that_says_new():
    # The groups' entries leave at different times (a load refreshes only the blocks a sliding window
    # needs: its other blocks are evicted first), and the index forgets the oldest departures: a reset
    # that emptied the full-attention group is the reason, not the sliding window's forgotten eviction.
    table = {(1, 2): NEW, (0, 2): RESET, (1, 3): NEW, (0, 3): RESET}
    assert lookup_miss([SWA, FULL], 300, 0, 128, 4, B, absent(table)) == (RESET, ((RESET, 128),), 44)
    # a Mamba state that was evicted where the attention groups forgot theirs: evicted, and the walk goes on
    layouts = miss_order([MAMBA, FULL])
    table = {(0, 2): NEW, (2, 2): EVICTED, (0, 3): NEW, (2, 3): NEW}
    assert lookup_miss(layouts, 300, 0, 128, 4, B, absent(table)).by_reason == ((EVICTED, 64), (NEW, 64))


def test_a_device_hit_moves_where_the_miss_starts():
    # 100 tokens on the device: the block holding token 100 (block 1) is the first the tier would serve
    miss = lookup_miss([FULL], 300, 100, 0, 4, B, absent({}, default=EVICTED))
    assert miss == (EVICTED, ((EVICTED, 156),), 44)
    # a device hit past the last whole block: nothing left the tier could serve
    assert lookup_miss([FULL], 300, 280, 0, 4, B, lambda group, k: NEW) == (TAIL, (), 20)


def test_tokens_vllm_kept_on_the_device_leave_the_miss_from_its_front():
    """vLLM rounds its device hit down to a block for the lookup and keeps the rest when the tier does not
    reach past it: those tokens leave the miss from the front (its reason becomes the next block's),
    and the reasons still add up to what vLLM queried minus the hit."""
    miss = lookup_miss([FULL], 300, 64, 0, 4, B, absent({(0, 1): EVICTED}, default=NEW))
    assert miss == (EVICTED, ((EVICTED, 64), (NEW, 128)), 44)
    assert past_kept_tokens(miss, 0) is miss
    assert past_kept_tokens(miss, 32) == (EVICTED, ((EVICTED, 32), (NEW, 128)), 44)
    assert past_kept_tokens(miss, 64) == (NEW, ((NEW, 128),), 44)  # a segment used up: the next one's reason
    assert past_kept_tokens(miss, 100) == (NEW, ((NEW, 92),), 44)
    assert past_kept_tokens(miss, 200) == (TAIL, (), 36)  # into the tail
    assert past_kept_tokens(miss, 500) == (TAIL, (), 0)
    for kept in range(0, 237, 4):  # the looked-up tokens past the kept ones, by reason
        left = past_kept_tokens(miss, kept)
        assert sum(t for _, t in left.by_reason) + left.tail_tokens == 236 - kept


def test_a_single_token_vllm_kept_on_the_device_leaves_the_miss():
    """Only a kept count of none leaves the miss as it is: a single kept token already leaves its front."""
    miss = Miss(EVICTED, ((EVICTED, 64), (NEW, 128)), 44)
    assert past_kept_tokens(miss, 1) == (EVICTED, ((EVICTED, 63), (NEW, 128)), 44)


def test_unhashed_blocks_are_tail():
    # vLLM hashed only 2 blocks of the prompt
    assert lookup_miss([FULL], 300, 0, 0, 2, B, lambda group, k: NEW) == (NEW, ((NEW, 128),), 172)


def test_a_missing_mamba_state_where_attention_is_stored_is_no_state_unless_it_left():
    layouts = miss_order([MAMBA, FULL])
    assert [layout.kind for layout in layouts] == [GroupKind.FULL_ATTENTION, GroupKind.MAMBA]
    assert lookup_miss(layouts, 300, 0, 128, 4, B, absent({(2, 2): NEW, (2, 3): NEW})).reason == NO_STATE
    assert lookup_miss(layouts, 300, 0, 128, 4, B, absent({(2, 2): EVICTED})).reason == EVICTED
    # attention missing too: the attention group's reason
    table = {(2, 2): NEW, (0, 2): EVICTED}
    assert lookup_miss(layouts, 300, 0, 128, 4, B, absent(table)).reason == EVICTED


def test_a_model_of_mamba_groups_only_misses_new_prompts_as_new_and_asks_one_block():
    asked = []

    def why_absent(group, k):
        asked.append(k)
        return NEW

    assert lookup_miss([MAMBA], 5000, 0, 0, 78, B, why_absent) == (NEW, ((NEW, 78 * B),), 5000 - 78 * B)
    assert asked == [0]


def test_a_block_no_attention_group_held_ends_the_walk_whatever_the_mamba_state_says():
    # Only the attention groups decide that the rest chains through a never-held block: a Mamba state
    # stored at its end (another request's, say), or one that left, does not make later blocks asked.
    asked = []

    def why_absent(group, k):
        asked.append((group, k))
        if group == MAMBA.index:
            return None if k == 0 else EVICTED
        return NEW if k == 0 else EVICTED

    layouts = miss_order([MAMBA, FULL])
    assert lookup_miss(layouts, 5000, 0, 0, 78, B, why_absent) == (NEW, ((NEW, 78 * B),), 5000 - 78 * B)
    assert {k for _, k in asked} == {0}


def test_every_group_holding_the_block_means_the_hit_needed_another():
    assert lookup_miss([FULL, SWA], 300, 0, 64, 4, B, absent({})) == (OTHER_BLOCKS, ((OTHER_BLOCKS, 192),), 44)


def test_with_an_eagle_drafter_a_block_waits_for_the_next_ones_key_and_that_is_its_reason():
    eagle = frozenset({0})
    # the last hashed block only proves the one before it: a hit covers 3 of 4 whole blocks
    assert lookup_miss([FULL], 300, 0, 192, 4, B, absent({}), eagle) == (TAIL, (), 108)
    assert lookup_miss([FULL], 300, 0, 0, 4, B, lambda group, k: NEW, eagle) == (NEW, ((NEW, 192),), 108)
    # 8 blocks stored, block 5 evicted: the hit stops at 4 blocks (block 4 is 5's proof), and 4 is missed
    # because 5 was evicted, not because of "another block"
    stored = {(0, 5): EVICTED}
    is_stored = lambda group, k: (group, k) not in stored  # noqa: E731
    hit = find_hit_tokens([FULL], 600, 0, 9, B, is_stored, eagle)
    assert hit == 4 * B
    miss = lookup_miss([FULL], 600, 0, hit, 9, B, absent(stored), eagle)
    assert miss.reason == EVICTED and miss.by_reason == ((EVICTED, 128), (OTHER_BLOCKS, 128))
    # a Mamba group needs no proof
    assert lookup_miss([MAMBA], 300, 0, 256, 4, B, absent({}), frozenset({2})) == (TAIL, (), 44)


@settings(deadline=None)  # a busy 2-core machine can stall one example past 200 ms
@given(num_tokens=st.integers(1, 2000), local=st.integers(0, 2000), hashed=st.integers(0, 40),
       stored=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 40))), eagle=st.booleans(),
       reason=st.sampled_from((NEW, EVICTED, DROPPED, RESET, STORING, LOAD_FAILED)))  # how a block can be absent
def test_the_reasons_add_up_to_what_the_lookup_did_not_serve(num_tokens, local, hashed, stored, eagle, reason):
    layouts = miss_order([FULL, SWA, MAMBA])
    local = min(local, num_tokens - 1)
    proof = frozenset({0}) if eagle else frozenset()
    hit = find_hit_tokens(layouts, num_tokens, local, hashed, B, lambda g, k: (g, k) in stored, proof)
    external = max(0, hit - local)
    miss = lookup_miss(layouts, num_tokens, local, external, hashed, B,
                       lambda g, k: None if (g, k) in stored else reason, proof)
    assert sum(tokens for _, tokens in miss.by_reason) + miss.tail_tokens == num_tokens - local - external
    assert all(tokens > 0 for _, tokens in miss.by_reason) and miss.tail_tokens >= 1
    assert (miss.reason == TAIL) == (not miss.by_reason)
    assert {r for r, _ in miss.by_reason} <= {reason, NO_STATE, OTHER_BLOCKS}


def test_every_reason_has_its_meaning_said_where_operators_read_it():
    """One table of meanings feeds the metric's help, the overview board and the replay app."""
    import json
    from pathlib import Path

    from connector.miss_reasons import MISS_REASON_MEANINGS, MISS_REASONS, miss_reasons_explained
    from connector.telemetry.metrics import METRICS

    assert list(MISS_REASON_MEANINGS) == list(MISS_REASONS)
    explained = miss_reasons_explained()
    assert all(f"{reason} ({meaning})" in explained for reason, meaning in MISS_REASON_MEANINGS.items())
    (missed,) = [m for m in METRICS if m.name == "kvscope_missed_tokens_total"]
    assert explained in missed.documentation
    board = Path(__file__).resolve().parents[2] / "grafana" / "dashboards" / "kvscope-overview.json"
    assert explained in json.dumps(json.loads(board.read_text()), ensure_ascii=False)


def test_a_lookup_barred_from_its_hit_counts_that_hit_as_load_failed_before_its_own_reasons():
    miss = Miss(DROPPED, ((DROPPED, 64), (NEW, 64)), 64)
    assert barred_from_hit(miss, 128) == Miss(LOAD_FAILED, ((LOAD_FAILED, 128), (DROPPED, 64), (NEW, 64)), 64)
    assert barred_from_hit(miss, 0) is miss  # nothing held: the lookup's own reasons


def test_a_single_barred_token_counts_as_load_failed():
    """Only a hit of no tokens leaves the lookup's own reasons: a single barred token is load_failed already."""
    miss = Miss(NEW, ((NEW, 64),), 64)
    assert barred_from_hit(miss, 1) == Miss(LOAD_FAILED, ((LOAD_FAILED, 1), (NEW, 64)), 64)


def test_missed_tokens_split_what_vllm_did_not_take_then_the_blocks_past_the_hit_then_the_tail():
    miss = Miss(EVICTED, ((EVICTED, 128), (NEW, 64)), 30)
    # found 256, vLLM took 192 (its device hit ended inside a block): 64 not taken, then the blocks, the tail
    assert missed_tokens_by_reason(500, 192, 256, miss) == [(NOT_TAKEN, 64), (EVICTED, 128), (NEW, 64), (TAIL, 52)]
    # vLLM's count smaller than the lookup's: the reasons are capped by what is left, in order
    assert missed_tokens_by_reason(300, 192, 256, miss) == [(NOT_TAKEN, 64), (EVICTED, 44), (NEW, 0), (TAIL, 0)]
    assert missed_tokens_by_reason(100, 100, 0, miss) == [(NOT_TAKEN, 0), (EVICTED, 0), (NEW, 0), (TAIL, 0)]


@given(queried=st.integers(0, 5000), hit=st.integers(0, 5000), found=st.integers(0, 5000),
       blocks=st.lists(st.tuples(st.sampled_from([NEW, EVICTED, DROPPED, STORING]), st.integers(0, 2000)),
                       max_size=5))
def test_missed_tokens_always_add_up_to_queried_less_hit_none_negative(queried, hit, found, blocks):
    """`kvscope_missed_tokens_total` summed over reasons is `lookup_tokens - hit_tokens` (telemetry that
    disagrees with itself is a bug), whatever vLLM counted against what the lookup saw."""
    split = missed_tokens_by_reason(queried, hit, found, Miss(TAIL, tuple(blocks), 0))
    assert sum(tokens for _, tokens in split) == max(0, queried - hit)
    assert all(tokens >= 0 for _, tokens in split)
    assert [reason for reason, _ in split] == [NOT_TAKEN] + [reason for reason, _ in blocks] + [TAIL]
