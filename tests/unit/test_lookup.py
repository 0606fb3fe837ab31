"""The pure hybrid prefix lookup: needed_offload_blocks and find_hit_tokens.

Property tests compare against `reference_hit_tokens`, which tries every prefix and asks, token by
token, what each group keeps; and check that a load planned for the hit reads only stored keys.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.groups import GroupKind, GroupLayout
from connector.lookup import find_hit_tokens, needed_offload_blocks
from connector.planning import NULL_BLOCK_ID, cdiv, plan_load

from .strategies import hybrid_layouts, stored_keys, token_counts, vllm_null_mask

FULL, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


# --- reference -------------------------------------------------------------------------------


def kept_tokens(layout: GroupLayout, num_computed_tokens: int) -> list[int]:
    """Tokens whose KV (or state) the engine still needs after computing `num_computed_tokens`."""
    tokens = range(num_computed_tokens)
    if layout.kind is GroupKind.SLIDING_WINDOW:
        # The next token attends to itself and the W - 1 tokens before it.
        return [t for t in tokens if num_computed_tokens - t < layout.sliding_window]
    if layout.kind is GroupKind.MAMBA:
        return [t for t in tokens if t == num_computed_tokens - 1]
    return list(tokens)


def reference_needed(layout, num_local_tokens, num_hit_tokens, b) -> set[int]:
    return {t // b for t in kept_tokens(layout, num_hit_tokens) if t >= num_local_tokens}


def reference_hit_tokens(layouts, num_tokens, num_local_tokens, num_hashed_blocks, b, stored,
                         proof_groups=frozenset()):
    """The longest hit every group can serve; with `proof_groups` (EAGLE), the block after the hit
    must also be hashed and stored in each of those attention groups."""
    best = 0
    for n in range(1, num_hashed_blocks + 1):
        hit = n * b
        if hit >= num_tokens or hit <= num_local_tokens:
            continue
        proving = [g.index for g in layouts if g.index in proof_groups and g.kind is not MAMBA]
        if proving and (n >= num_hashed_blocks or any((g, n) not in stored for g in proving)):
            continue
        if all(
            (g.index, k) in stored
            for g in layouts
            for k in reference_needed(g, num_local_tokens, hit, b)
        ):
            best = hit
    return best


class Store:
    """The host tier as a set, recording every key asked about."""

    def __init__(self, keys):
        self.keys = set(keys)
        self.asked: list[tuple[int, int]] = []

    def __call__(self, group_index: int, offload_block_index: int) -> bool:
        self.asked.append((group_index, offload_block_index))
        return (group_index, offload_block_index) in self.keys


def every_key(layouts, num_offload_blocks):
    return {(g.index, k) for g in layouts for k in range(num_offload_blocks)}


# --- needed_offload_blocks ---------------------------------------------------------------------


def test_full_attention_needs_every_block_from_the_local_boundary():
    g = GroupLayout(0, FULL, 16)
    assert needed_offload_blocks(g, 0, 256, 64) == range(0, 4)
    assert needed_offload_blocks(g, 128, 256, 64) == range(2, 4)
    assert needed_offload_blocks(g, 96, 256, 64) == range(1, 4)  # block 1 is half local


def test_sliding_window_needs_only_the_retained_blocks():
    # Hit 256, B 64: W keeps tokens 257 - W .. 255.
    def needed(w, local=0):
        return needed_offload_blocks(GroupLayout(0, SWA, 16, w), local, 256, 64)

    assert needed(64) == range(3, 4)  # tokens 193..255
    assert needed(65) == range(3, 4)  # tokens 192..255
    assert needed(66) == range(2, 4)  # tokens 191..255
    assert needed(100) == range(2, 4)  # tokens 157..255, not a multiple of anything
    assert needed(1000) == range(0, 4)
    assert needed(1000, local=128) == range(2, 4)  # never below the local boundary


def test_mamba_needs_only_the_last_block():
    g = GroupLayout(0, MAMBA, 64)
    assert needed_offload_blocks(g, 0, 256, 64) == range(3, 4)
    assert needed_offload_blocks(g, 192, 256, 64) == range(3, 4)


def test_full_attention_keeps_every_token_and_mamba_only_the_last_state():
    full, mamba = GroupLayout(0, FULL, 16), GroupLayout(1, MAMBA, 64)
    assert [full.first_retained_token(n) for n in (0, 1, 2, 1000)] == [0, 0, 0, 0]
    assert [mamba.first_retained_token(n) for n in (0, 1, 2, 1000)] == [0, 0, 1, 999]
    # with 1-token blocks the first token is itself a block the load must read
    assert needed_offload_blocks(GroupLayout(0, FULL, 1), 0, 1, 1) == range(0, 1)
    assert needed_offload_blocks(GroupLayout(0, MAMBA, 1), 0, 1, 1) == range(0, 1)


# --- find_hit_tokens examples ------------------------------------------------------------------


def test_full_attention_longest_contiguous_prefix():
    g = GroupLayout(0, FULL, 16)
    store = Store({(0, 0), (0, 1), (0, 2), (0, 4)})
    assert find_hit_tokens([g], 1000, 0, 10, 64, store) == 192


def test_at_least_one_token_is_left_to_compute():
    g = GroupLayout(0, FULL, 16)
    stored = every_key([g], 10)
    assert find_hit_tokens([g], 320, 0, 10, 64, Store(stored)) == 256
    assert find_hit_tokens([g], 321, 0, 10, 64, Store(stored)) == 320


def test_hashed_blocks_cap_the_hit():
    g = GroupLayout(0, FULL, 16)
    assert find_hit_tokens([g], 1000, 0, 3, 64, Store(every_key([g], 10))) == 192
    assert find_hit_tokens([g], 1000, 0, 0, 64, Store(every_key([g], 10))) == 0


def test_hit_must_extend_past_the_local_prefix():
    g = GroupLayout(0, FULL, 16)
    # Blocks 0, 1 are on the device; the host needs to hold only 2.. for a hit.
    assert find_hit_tokens([g], 1000, 128, 10, 64, Store({(0, 2), (0, 3)})) == 256
    assert find_hit_tokens([g], 1000, 128, 10, 64, Store({(0, 0), (0, 1)})) == 0
    assert find_hit_tokens([g], 1000, 256, 4, 64, Store(every_key([g], 10))) == 0
    # Local ends inside offload block 2: that block must be stored too.
    assert find_hit_tokens([g], 1000, 160, 10, 64, Store({(0, 3)})) == 0
    assert find_hit_tokens([g], 1000, 160, 10, 64, Store({(0, 2), (0, 3)})) == 256


def test_nothing_to_compute():
    g = GroupLayout(0, FULL, 16)
    assert find_hit_tokens([g], 0, 0, 10, 64, Store(every_key([g], 10))) == 0
    assert find_hit_tokens([g], 1, 0, 10, 64, Store(every_key([g], 10))) == 0


def test_sliding_window_ignores_evicted_blocks_outside_the_window():
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 16, 100)]
    stored = every_key(layouts[:1], 10) | {(1, 2), (1, 3)}  # window blocks 0, 1 evicted
    assert find_hit_tokens(layouts, 1000, 0, 10, 64, Store(stored)) == 256


def test_sliding_window_longest_hit_is_not_the_first_gap():
    # Window block 1 missing: hit 128 fails, but 320 (needs 3, 4) holds. The search is not monotone.
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 16, 64)]
    stored = every_key(layouts[:1], 5) | {(1, 0), (1, 2), (1, 3), (1, 4)}
    assert find_hit_tokens(layouts, 1000, 0, 10, 64, Store(stored)) == 320
    assert find_hit_tokens(layouts, 1000, 0, 2, 64, Store(stored)) == 64


def test_mamba_needs_the_state_at_the_hit_boundary():
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, MAMBA, 64)]
    full = every_key(layouts[:1], 6)
    assert find_hit_tokens(layouts, 1000, 0, 10, 64, Store(full | {(1, 3)})) == 256
    assert find_hit_tokens(layouts, 1000, 0, 10, 64, Store(full | {(1, 1), (1, 3)})) == 256
    assert find_hit_tokens(layouts, 1000, 0, 10, 64, Store(full | {(1, 1)})) == 128
    assert find_hit_tokens(layouts, 1000, 0, 10, 64, Store(full)) == 0


def test_hybrid_three_kinds():
    # B 128: full bs 16, sliding W 200 bs 32, mamba bs 64; host holds every full block 0..5,
    # window blocks 3..5 (W 200 at hit 768 reaches back to token 569: block 4) and states 2, 4.
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 32, 200), GroupLayout(2, MAMBA, 64)]
    stored = every_key(layouts[:1], 6) | {(1, 3), (1, 4), (1, 5), (2, 2), (2, 4)}
    assert find_hit_tokens(layouts, 10_000, 0, 20, 128, Store(stored)) == 5 * 128
    stored.add((2, 5))
    assert find_hit_tokens(layouts, 10_000, 0, 20, 128, Store(stored)) == 6 * 128


def test_eagle_leaves_the_last_stored_block_to_compute():
    # Blocks 0..3 stored: the drafter's KV at block 3's last position came from a token no key
    # proves, so the hit stops at 3 blocks (block 3 proves block 2's next token).
    full = GroupLayout(0, FULL, 16)
    stored = every_key([full], 4)
    assert find_hit_tokens([full], 10_000, 0, 20, 64, Store(stored)) == 4 * 64
    assert find_hit_tokens([full], 10_000, 0, 20, 64, Store(stored), proof_groups=frozenset({0})) == 3 * 64
    # the proof block needs a key: 4 hashed blocks, all stored, prove a hit of 3 at most
    assert find_hit_tokens([full], 10_000, 0, 4, 64, Store(stored), proof_groups=frozenset({0})) == 3 * 64
    assert find_hit_tokens([full], 10_000, 0, 3, 64, Store(stored), proof_groups=frozenset({0})) == 2 * 64


def test_eagle_sliding_window_needs_the_block_after_the_hit():
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 16, 64)]
    stored = every_key(layouts[:1], 6) | {(1, 3), (1, 4)}
    eagle = frozenset({0, 1})
    assert find_hit_tokens(layouts, 10_000, 0, 20, 64, Store(stored)) == 5 * 64
    # a hit of 5 needs window block 5, a hit of 4 has block 4 as its proof
    assert find_hit_tokens(layouts, 10_000, 0, 20, 64, Store(stored), proof_groups=eagle) == 4 * 64
    # a group without drafter layers needs no proof
    assert find_hit_tokens(layouts, 10_000, 0, 20, 64, Store(stored), proof_groups=frozenset({0})) == 5 * 64


def test_eagle_needs_the_proof_block_in_every_drafter_window():
    """Each drafter window's KV at the hit's last position was computed from the token after it: every
    one of them must hold the block whose key proves that token, one holding it proves nothing of the
    other (whose KV may come from another continuation: loaded, the drafter reads wrong KV)."""
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 16, 64), GroupLayout(2, SWA, 16, 64)]
    stored = every_key(layouts[:1], 6) | {(1, 2), (1, 3), (1, 4), (2, 2), (2, 3)}
    eagle = frozenset({1, 2})
    assert find_hit_tokens(layouts, 10_000, 0, 20, 64, Store(stored)) == 4 * 64
    # a hit of 4 blocks has block 4 as its proof: window 2 lacks it, so the hit stops at 3
    assert find_hit_tokens(layouts, 10_000, 0, 20, 64, Store(stored), proof_groups=eagle) == 3 * 64
    assert reference_hit_tokens(layouts, 10_000, 0, 20, 64, stored, eagle) == 3 * 64


# --- properties ------------------------------------------------------------------------------


@st.composite
def lookups(draw):
    layouts, b = draw(hybrid_layouts())
    local, external, new = draw(token_counts(b))
    num_tokens = local + external + new
    num_hashed = draw(st.integers(0, num_tokens // b + 1))
    stored = draw(stored_keys(layouts, num_tokens // b + 2))
    return layouts, num_tokens, local, num_hashed, b, stored


@st.composite
def lookups_near_a_hit(draw):
    """Every group holds the blocks up to a drawn point, less a few: most lookups hit (with
    `lookups` alone most find nothing, and a hit-or-nothing comparison is then mostly 0 == 0)."""
    layouts, b = draw(hybrid_layouts())
    local = draw(st.integers(0, 6 * b) | st.integers(0, 6).map(lambda n: n * b))
    num_tokens = local + draw(st.integers(b, 8 * b)) + draw(st.integers(1, 2 * b))
    num_hashed = num_tokens // b - draw(st.sampled_from((0, 0, 0, 1, 2)))
    top = draw(st.integers(local // b + 1, num_tokens // b + 1))
    stored = {(g.index, k) for g in layouts for k in range(top)}
    dropped = draw(st.sets(st.sampled_from(sorted(stored)), max_size=2) | st.just(set()))
    return layouts, num_tokens, local, num_hashed, b, stored - dropped


ANY_LOOKUP = st.one_of(lookups(), lookups_near_a_hit())


@settings(max_examples=400, deadline=None)
@given(ANY_LOOKUP)
def test_hit_matches_reference(case):
    layouts, num_tokens, local, num_hashed, b, stored = case
    got = find_hit_tokens(layouts, num_tokens, local, num_hashed, b, Store(stored))
    assert got == reference_hit_tokens(layouts, num_tokens, local, num_hashed, b, stored)


@settings(max_examples=400, deadline=None)
@given(ANY_LOOKUP, st.data())
def test_eagle_hit_matches_reference(case, data):
    layouts, num_tokens, local, num_hashed, b, stored = case
    proof = frozenset(data.draw(st.sets(st.sampled_from([g.index for g in layouts]), min_size=1)))
    got = find_hit_tokens(layouts, num_tokens, local, num_hashed, b, Store(stored), proof_groups=proof)
    assert got == reference_hit_tokens(layouts, num_tokens, local, num_hashed, b, stored, proof)
    assert got <= find_hit_tokens(layouts, num_tokens, local, num_hashed, b, Store(stored))


@settings(max_examples=300, deadline=None)
@given(ANY_LOOKUP)
def test_hit_bounds_and_keys_asked(case):
    layouts, num_tokens, local, num_hashed, b, stored = case
    store = Store(stored)
    hit = find_hit_tokens(layouts, num_tokens, local, num_hashed, b, store)
    assert hit % b == 0
    if hit:
        assert local < hit <= num_tokens - 1
        assert hit // b <= num_hashed
    # Only keys that have a hash, and none for blocks the device already holds.
    indices = {g.index for g in layouts}
    for g, k in store.asked:
        assert g in indices
        assert local // b <= k < num_hashed


@settings(max_examples=300, deadline=None)
@given(ANY_LOOKUP, st.data())
def test_eagle_lookups_ask_only_for_keys_that_exist(case, data):
    """A proof group's run reaches one block past the hit: never past the last key (the scheduler
    indexes its hashes with it)."""
    layouts, num_tokens, local, num_hashed, b, stored = case
    proof = frozenset(data.draw(st.sets(st.sampled_from([g.index for g in layouts]), min_size=1)))
    store = Store(stored)
    find_hit_tokens(layouts, num_tokens, local, num_hashed, b, store, proof_groups=proof)
    assert all(local // b <= k < num_hashed for _, k in store.asked), store.asked


def test_a_drafter_group_after_a_target_group_never_asks_past_the_last_key():
    """The target group's run ends at the local hit (nothing past it can hit); the drafter's proof
    run used to start from there and ask for the key after the last one (an IndexError in the scheduler)."""
    layouts = [GroupLayout(0, GroupKind.FULL_ATTENTION, 16), GroupLayout(1, GroupKind.FULL_ATTENTION, 16)]
    asked = []

    def is_stored(group, k):
        asked.append((group, k))
        return k < 2

    assert find_hit_tokens(layouts, num_tokens=81, num_local_tokens=64, num_hashed_blocks=2, offload_block_size=32,
                           is_stored=is_stored, proof_groups=frozenset({1})) == 0
    assert all(k < 2 for _, k in asked), asked


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_needed_blocks_match_kept_tokens(data):
    layouts, b = data.draw(hybrid_layouts(max_groups=1))
    (g,) = layouts
    n = data.draw(st.integers(1, 16))
    local = data.draw(st.integers(0, n * b - 1))
    assert set(needed_offload_blocks(g, local, n * b, b)) == reference_needed(g, local, n * b, b)


@settings(max_examples=300, deadline=None)
@given(ANY_LOOKUP)
def test_load_for_the_hit_reads_only_stored_keys(case):
    # End to end: vLLM allocates for the hit (nulls where it keeps nothing), the planner plans the
    # load, and every key the load reads is one the lookup found stored.
    layouts, num_tokens, local, num_hashed, b, stored = case
    hit = find_hit_tokens(layouts, num_tokens, local, num_hashed, b, Store(stored))
    if not hit:
        return
    group_ids = []
    for g in layouts:
        n = cdiv(num_tokens, g.block_size)
        nulls = vllm_null_mask(g, n, hit)
        group_ids.append([NULL_BLOCK_ID if null else i + 1 for i, null in enumerate(nulls)])
    plan = plan_load(layouts, group_ids, local, hit - local, b)
    assert set(plan.keys()) <= stored
    assert plan.first_offload_index == local // b
    for g, scan in zip(layouts, plan.scans):
        assert {k for gi, k in plan.keys() if gi == g.index} == set(
            needed_offload_blocks(g, local, hit, b)
        )


def test_a_window_with_gaps_is_not_checked_again_for_every_shorter_hit():
    """A 1024-token window over 2,000 blocks of 16 with one block in 64 missing from it: each shorter
    hit was checked whole (65,415 keys asked); every hit past a missing block needs it, so the search
    goes straight to it (one look at each key, about)."""
    layouts = [GroupLayout(0, GroupKind.SLIDING_WINDOW, 16, sliding_window=1024),
               GroupLayout(1, GroupKind.FULL_ATTENTION, 16)]
    asked = []

    def is_stored(group, k):
        asked.append((group, k))
        return group == 1 or k % 64 != 63

    assert find_hit_tokens(layouts, 2000 * 16 + 1, 0, 2000, 16, is_stored) == 63 * 16
    assert len(asked) <= 2 * 2000
