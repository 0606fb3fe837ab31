"""The keys a finished request marks used (`finished_prefix_keys`), against a per-block reference loop."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.finish_bench import reference_keys
from connector.groups import GroupKind, GroupLayout
from connector.prefix_recency import finished_prefix_keys

from .strategies import hybrid_layouts

FULL, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


@st.composite
def finishes(draw):
    layouts, offload_block_size = draw(hybrid_layouts())
    layouts = draw(st.permutations(layouts))  # layout order, not group index, orders a block's groups
    # few distinct hashes: the same block content at several positions of one prompt
    hashes = draw(st.lists(st.integers(0, 9), max_size=40))
    reachable = draw(st.integers(0, len(hashes)))
    groups = [layout.index for layout in layouts]
    loaded = []
    if hashes:
        # runs of loaded blocks, as a load reads them, and strays
        for group in draw(st.lists(st.sampled_from(groups), max_size=4)):
            start = draw(st.integers(0, len(hashes) - 1))
            stop = draw(st.integers(start + 1, min(len(hashes), start + 8)))
            loaded += [(group, hashes[k]) for k in range(start, stop)]
        loaded += draw(st.lists(st.tuples(st.sampled_from(groups), st.sampled_from(hashes)), max_size=3))
    return layouts, hashes, reachable, offload_block_size, loaded


@settings(max_examples=2000, deadline=None)
@given(finishes())
def test_the_keys_and_their_order_are_the_reference_loops(finish):
    assert finished_prefix_keys(*finish) == reference_keys(*finish)


def test_a_window_marks_the_blocks_a_hit_at_the_runs_end_needs_and_what_it_loaded_tail_first():
    layouts = [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 16, 20)]  # at 64 tokens the window needs blocks 2 and 3
    hashes = ["a", "b", "c", "d", "e"]
    keys = finished_prefix_keys(layouts, hashes, 4, 16, loaded=[(1, "a"), (0, "b"), (1, "e")])
    assert keys == [(0, "d"), (1, "d"), (0, "c"), (1, "c"), (0, "b"), (0, "a"), (1, "a")]


def test_nothing_reachable_marks_nothing():
    assert finished_prefix_keys([GroupLayout(0, FULL, 16), GroupLayout(1, MAMBA, 16)], ["a"], 0, 16, [(1, "a")]) == []
