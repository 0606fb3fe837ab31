"""Pure hybrid prefix lookup: the longest prefix that every KV group can serve from the host tier."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .groups import GroupKind, GroupLayout

# is_stored(group_index, offload_block_index) -> whether the host tier holds that block.
IsStored = Callable[[int, int], bool]


def needed_offload_blocks(
    layout: GroupLayout, num_local_tokens: int, num_hit_tokens: int, offload_block_size: int
) -> range:
    """Offload blocks of one group that a load of tokens [local, hit) must read.

    Full attention needs every block; a sliding window only the blocks the engine keeps
    at the hit boundary; Mamba only the state at the boundary (the last block).
    """
    first_token = max(num_local_tokens, layout.first_retained_token(num_hit_tokens))
    return range(first_token // offload_block_size, num_hit_tokens // offload_block_size)


def proving_groups(layouts: Sequence[GroupLayout], proof_groups: frozenset[int]) -> set[int] | tuple:
    """The groups whose hits must prove their next token (EAGLE drafters' attention KV; a state needs no proof)."""
    if not proof_groups:
        return ()
    return {layout.index for layout in layouts if layout.index in proof_groups and layout.kind is not GroupKind.MAMBA}


def hit_reach(num_tokens: int, num_hashed_blocks: int, offload_block_size: int, proving) -> int:
    """The most offloaded blocks a hit can cover: one token is left to compute, only whole hashed blocks
    have keys, and a proving group's hit needs the key of the block after it."""
    return min((num_tokens - 1) // offload_block_size, num_hashed_blocks - (1 if proving else 0))


def find_hit_tokens(
    layouts: Sequence[GroupLayout],
    num_tokens: int,
    num_local_tokens: int,
    num_hashed_blocks: int,
    offload_block_size: int,
    is_stored: IsStored,
    proof_groups: frozenset[int] = frozenset(),
) -> int:
    """Tokens (a multiple of the offload block size) that every group can serve; 0 for none.

    At least one token is always left to compute, as vLLM requires. `num_hashed_blocks`
    caps the prefix at the offload blocks whose keys exist.

    `proof_groups` (attention groups holding EAGLE drafter layers): a drafter's KV at a block's
    last position was computed from the token after it, which the block's key does not cover.
    A hit of n blocks then also needs block n stored in those groups (its key proves that next
    token), and block n is left to compute, as vLLM's prefix cache and offloading connector do.
    """
    proving = proving_groups(layouts, proof_groups)
    max_blocks = hit_reach(num_tokens, num_hashed_blocks, offload_block_size, proving)
    # Full attention needs a contiguous run from the local boundary: it bounds the search.
    first_needed = num_local_tokens // offload_block_size
    if max_blocks <= first_needed:  # no hit can reach past the local one (and no key past the last is asked for)
        return 0
    for layout in layouts:
        if layout.kind is GroupKind.FULL_ATTENTION:
            proof = 1 if proving and layout.index in proving else 0  # the run reaches one block past the hit
            limit = max_blocks + proof
            k = first_needed
            while k < limit and is_stored(layout.index, k):
                k += 1
            max_blocks = min(max_blocks, k - proof)  # never past the cap: a later group's limit builds on it
    proving_windows = [layout.index for layout in layouts
                       if layout.index in proving and layout.kind is GroupKind.SLIDING_WINDOW] if proving else ()
    windowed = [layout for layout in layouts if layout.kind is not GroupKind.FULL_ATTENTION]
    n = max_blocks
    while n > 0:
        hit = n * offload_block_size
        if hit <= num_local_tokens:
            return 0
        missing = _last_missing(windowed, num_local_tokens, hit, offload_block_size, is_stored)
        if missing is not None:
            # Every shorter hit past the missing block needs it too (a group's first needed block only
            # moves forward with the hit): the next that can do without it ends there
            n = missing
        elif not proving_windows or all(is_stored(group, n) for group in proving_windows):
            return hit
        else:
            n -= 1
    return 0


def _last_missing(layouts: Sequence[GroupLayout], num_local_tokens: int, hit: int, offload_block_size: int,
                  is_stored: IsStored) -> int | None:
    """The last offload block that a hit of ``hit`` tokens needs in one of ``layouts`` and that is not
    stored; None when all are."""
    last = None
    for layout in layouts:
        needed = needed_offload_blocks(layout, num_local_tokens, hit, offload_block_size)
        for k in range(needed.stop - 1, max(needed.start, -1 if last is None else last + 1) - 1, -1):
            if not is_stored(layout.index, k):
                last = k
                break
    return last
