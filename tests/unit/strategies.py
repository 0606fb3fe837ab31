"""Hypothesis strategies for hybrid KV layouts, vLLM-like block allocations and host-tier contents.

Shared by the planning and lookup tests. Everything here is plain data: no vLLM import.
"""

from __future__ import annotations

import math
import random

from hypothesis import strategies as st

from connector.groups import GroupKind, GroupLayout
from connector.planning import NULL_BLOCK_ID, cdiv

DEVICE_BLOCK_SIZES = (16, 32, 64, 128)
NULL_PATTERNS = ("none", "leading", "random", "vllm")


@st.composite
def hybrid_layouts(draw, max_groups: int = 4) -> tuple[list[GroupLayout], int]:
    """1..max_groups groups of any kind and device block size, plus an offload block size B.

    B is a multiple of every group's block size; windows include non-multiples of both.
    """
    sizes = draw(st.lists(st.sampled_from(DEVICE_BLOCK_SIZES), min_size=1, max_size=max_groups))
    offload_block_size = math.lcm(*sizes) * draw(st.sampled_from((1, 2, 3, 4)))
    layouts = []
    for index, bs in enumerate(sizes):
        kind = draw(st.sampled_from(list(GroupKind)))
        window = None
        if kind is GroupKind.SLIDING_WINDOW:
            b = offload_block_size
            window = draw(
                st.integers(1, 4 * b)
                | st.sampled_from((1, 2, bs - 1, bs, bs + 1, b - 1, b, b + 1, 2 * b + 1))
            )
        layouts.append(GroupLayout(index, kind, bs, window))
    return layouts, offload_block_size


@st.composite
def token_counts(draw, offload_block_size: int, max_offload_blocks: int = 12) -> tuple[int, int, int]:
    """(local, external, new) token counts; local is often but not always block-aligned."""
    b = offload_block_size
    upper = max_offload_blocks * b
    local = draw(st.integers(0, upper) | st.integers(0, max_offload_blocks).map(lambda n: n * b))
    external = draw(st.integers(0, upper) | st.integers(0, max_offload_blocks).map(lambda n: n * b))
    new = draw(st.integers(0, 3 * b))
    return local, external, new


def vllm_null_mask(layout: GroupLayout, num_blocks: int, num_computed_tokens: int) -> list[bool]:
    """Which device blocks vLLM leaves null once `num_computed_tokens` are computed.

    Sliding window: the blocks wholly before the first retained token (vLLM's
    `remove_skipped_blocks`). Mamba: every computed block but the one holding the state at the
    last computed token. Full attention: none. Blocks past the computed tokens are real.
    """
    bs = layout.block_size
    computed_blocks = cdiv(num_computed_tokens, bs)
    if layout.kind is GroupKind.SLIDING_WINDOW:
        first_kept = layout.first_retained_token(num_computed_tokens) // bs
        return [i < first_kept for i in range(num_blocks)]
    if layout.kind is GroupKind.MAMBA:
        return [i < computed_blocks - 1 for i in range(num_blocks)]
    return [False] * num_blocks


@st.composite
def block_lists(
    draw, layouts: list[GroupLayout], num_allocated_tokens: int, num_computed_tokens: int
) -> list[list[int]]:
    """One block-id list per group covering `num_allocated_tokens`, with a drawn null pattern.

    Non-null ids are distinct across groups (like one shared block pool). Occasionally a list
    is shorter than the allocation, to check the planner never indexes past it.
    """
    next_id = 1
    out = []
    for layout in layouts:
        n = cdiv(num_allocated_tokens, layout.block_size)
        if draw(st.integers(0, 9)) == 0:
            n = draw(st.integers(0, n))
        pattern = draw(st.sampled_from(NULL_PATTERNS))
        if pattern == "none":
            nulls = [False] * n
        elif pattern == "leading":
            k = draw(st.integers(0, n))
            nulls = [i < k for i in range(n)]
        elif pattern == "random":
            p = draw(st.sampled_from((0.1, 0.5, 0.9)))
            rng = random.Random(draw(st.integers(0, 2**32 - 1)))
            nulls = [rng.random() < p for _ in range(n)]
        else:
            nulls = vllm_null_mask(layout, n, num_computed_tokens)
        ids = []
        for is_null in nulls:
            if is_null:
                ids.append(NULL_BLOCK_ID)
            else:
                ids.append(next_id)
                next_id += 1
        out.append(ids)
    return out


@st.composite
def stored_keys(draw, layouts: list[GroupLayout], num_offload_blocks: int) -> set[tuple[int, int]]:
    """Which (group index, offload block index) pairs the host tier holds."""
    stored = set()
    for layout in layouts:
        pattern = draw(st.sampled_from(("all", "none", "prefix", "suffix", "random")))
        k = draw(st.integers(0, num_offload_blocks))
        if pattern == "all":
            held = range(num_offload_blocks)
        elif pattern == "none":
            held = range(0)
        elif pattern == "prefix":
            held = range(k)
        elif pattern == "suffix":
            held = range(k, num_offload_blocks)
        else:
            p = draw(st.sampled_from((0.3, 0.7, 0.95)))
            rng = random.Random(draw(st.integers(0, 2**32 - 1)))
            held = [i for i in range(num_offload_blocks) if rng.random() < p]
        stored.update((layout.index, i) for i in held)
    return stored
