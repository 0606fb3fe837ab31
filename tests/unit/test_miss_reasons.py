"""lookup_miss: why a lookup served no more, and how many tokens the tier could have served past its hit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from connector.groups import GroupKind, GroupLayout
from connector.miss_reasons import (
    EVICTED,
    MISS_REASONS,
    NEW,
    NO_STATE,
    OTHER_BLOCKS,
    STORING,
    TAIL,
    lookup_miss,
)

B = 64  # offload block size
FULL = GroupLayout(0, GroupKind.FULL_ATTENTION, 16)
SWA = GroupLayout(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=48)
MAMBA = GroupLayout(2, GroupKind.MAMBA, 64)


def absent(table: dict):
    """why_absent from {(group, block): reason}; every other block is ready."""
    return lambda group, k: table.get((group, k))


def test_nothing_stored_misses_every_whole_block_as_new_and_the_rest_as_tail():
    # 300 tokens: 4 whole blocks (256 tokens) a hit could cover, 44 tokens past them
    miss = lookup_miss([FULL], 300, 0, 0, 4, B, lambda group, k: NEW)
    assert miss == (NEW, 256, 44)


def test_a_hit_up_to_the_last_whole_block_leaves_only_the_tail():
    assert lookup_miss([FULL, SWA], 300, 0, 256, 4, B, absent({})) == (TAIL, 0, 44)


def test_the_last_token_is_always_tail_even_on_a_block_boundary():
    # 256 tokens: a hit can cover 3 blocks only (vLLM computes the last token)
    assert lookup_miss([FULL], 256, 0, 192, 4, B, absent({})) == (TAIL, 0, 64)
    assert lookup_miss([FULL], 256, 0, 64, 4, B, absent({(0, 1): EVICTED})) == (EVICTED, 128, 64)


def test_the_reason_is_that_of_the_first_block_past_the_hit_in_the_first_group_lacking_it():
    table = {(1, 2): EVICTED, (0, 3): NEW, (1, 3): NEW}
    assert lookup_miss([FULL, SWA], 300, 0, 128, 4, B, absent(table)) == (EVICTED, 128, 44)
    table = {(0, 2): STORING, (1, 2): EVICTED}
    assert lookup_miss([FULL, SWA], 300, 0, 128, 4, B, absent(table)).reason == STORING


def test_a_device_hit_moves_where_the_miss_starts():
    # 100 tokens on the device: the block holding token 100 (block 1) is the first the tier would serve
    miss = lookup_miss([FULL], 300, 100, 0, 4, B, absent({(0, 1): EVICTED}))
    assert miss == (EVICTED, 156, 44)
    # a device hit past the last whole block: nothing left the tier could serve
    assert lookup_miss([FULL], 300, 280, 0, 4, B, lambda group, k: NEW) == (TAIL, 0, 20)


def test_unhashed_blocks_are_tail():
    # vLLM hashed only 2 blocks of the prompt (a hash block size above the prompt's tail, say)
    assert lookup_miss([FULL], 300, 0, 0, 2, B, lambda group, k: NEW) == (NEW, 128, 172)


def test_a_missing_mamba_state_where_attention_is_stored_is_no_state_unless_it_left():
    assert lookup_miss([MAMBA, FULL], 300, 0, 128, 4, B, absent({(2, 2): NEW})).reason == NO_STATE
    assert lookup_miss([MAMBA, FULL], 300, 0, 128, 4, B, absent({(2, 2): EVICTED})).reason == EVICTED
    # attention missing too: the attention group's reason (Mamba states exist at some block ends only)
    assert lookup_miss([MAMBA, FULL], 300, 0, 128, 4, B, absent({(2, 2): NEW, (0, 2): EVICTED})).reason == EVICTED


def test_every_group_holding_the_block_means_the_hit_needed_another():
    assert lookup_miss([FULL, SWA], 300, 0, 64, 4, B, absent({})) == (OTHER_BLOCKS, 192, 44)


def test_an_eagle_proof_block_is_never_served():
    # the last hashed block only proves the one before it: a hit covers 3 of 4 whole blocks
    eagle = frozenset({0})
    assert lookup_miss([FULL], 300, 0, 192, 4, B, absent({}), eagle) == (TAIL, 0, 108)
    assert lookup_miss([FULL], 300, 0, 0, 4, B, lambda group, k: NEW, eagle) == (NEW, 192, 108)
    # a Mamba group needs no proof
    assert lookup_miss([MAMBA], 300, 0, 256, 4, B, absent({}), frozenset({2})) == (TAIL, 0, 44)


@given(num_tokens=st.integers(1, 2000), local=st.integers(0, 2000), hit_blocks=st.integers(0, 40),
       hashed=st.integers(0, 40), reason=st.sampled_from(MISS_REASONS[:-1]))
def test_missed_and_tail_tokens_add_up_to_what_the_lookup_did_not_serve(num_tokens, local, hit_blocks, hashed,
                                                                       reason):
    local = min(local, num_tokens - 1)
    reach = min((num_tokens - 1) // B, hashed)
    served = max(local, min(hit_blocks, reach) * B)  # a hit ends on a block edge past the device hit, or is 0
    external = served - local
    miss = lookup_miss([FULL, SWA], num_tokens, local, external, hashed, B, lambda group, k: reason)
    assert miss.tokens + miss.tail_tokens == num_tokens - local - external
    assert miss.tokens >= 0 and miss.tail_tokens >= 1
    assert (miss.reason == TAIL) == (miss.tokens == 0)
    assert miss.reason in (reason, TAIL)
