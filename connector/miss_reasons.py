"""Why a lookup served no more of a prompt: the reason its first offloaded block past the hit was missing.

An operator sizing the host tier asks how many looked-up tokens it missed because it was too small
(evicted) rather than because nobody had computed them before (new). One reason per lookup, that of
the offloaded block right after what was served (the first block the hit could not include), and
the looked-up tokens the tier could have served from there on; the rest of the lookup, tokens no
offloaded block can cover (the prompt's partial last block, the token vLLM always computes), is
`TAIL`. Pure: the host tier's index is asked through `why_absent`, nothing of vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from .groups import GroupKind, GroupLayout

# Why a key is not ready in the host tier (`HostIndex.why_absent`), or why a lookup stopped.
NEW = "new"  # never stored, or it left the tier longer ago than the tier remembers (as many keys as slots)
EVICTED = "evicted"  # evicted (least recently used) to make room: a larger tier would have held it
DROPPED = "dropped"  # dropped after a copy from or to it failed
RESET = "reset"  # forgotten by a cache reset (reset_prefix_cache with the connector's tier)
STORING = "storing"  # being stored: its copy had not completed on every worker yet
# the attention groups held the block, but no Mamba state at its end was ever stored (vLLM keeps
# Mamba states at some block ends only: kvscope stores those)
NO_STATE = "no_state"
# the block was ready in every group; the hit needed another one (a sliding window's earlier block,
# a Mamba state further on, EAGLE's proof block)
OTHER_BLOCKS = "other_blocks"
LOAD_FAILED = "load_failed"  # a load of this request failed before: it recomputes, never loads again
TAIL = "tail"  # past the last offloaded block a hit can cover: nothing the tier could have served
MISS_REASONS = (NEW, EVICTED, DROPPED, RESET, STORING, NO_STATE, OTHER_BLOCKS, LOAD_FAILED, TAIL)

# (group index, offload block index) -> None when that block is ready in that group, else its reason
WhyAbsent = Callable[[int, int], "str | None"]


class Miss(NamedTuple):
    reason: str  # why the first block past the hit was missing (`TAIL` when there was none to miss)
    tokens: int  # looked-up tokens from the end of the hit to the last offloaded block a hit can cover
    tail_tokens: int  # looked-up tokens past that block (always at least the last token)


def lookup_miss(
    layouts: Sequence[GroupLayout],
    num_tokens: int,
    num_local_tokens: int,
    num_external_tokens: int,
    num_hashed_blocks: int,
    offload_block_size: int,
    why_absent: WhyAbsent,
    proof_groups: frozenset[int] = frozenset(),
) -> Miss:
    """What a lookup of ``num_tokens`` tokens, ``num_local_tokens`` of them on the device, did not serve.

    ``num_external_tokens`` is its hit (`lookup.find_hit_tokens`). ``tokens + tail_tokens`` always
    equals the looked-up tokens (``num_tokens - num_local_tokens``) minus the hit.
    """
    proving = proof_groups and any(
        layout.index in proof_groups and layout.kind is not GroupKind.MAMBA for layout in layouts)
    # as `find_hit_tokens` caps a hit: one token left to compute, whole hashed blocks, EAGLE's proof block
    reach = min((num_tokens - 1) // offload_block_size, num_hashed_blocks - (1 if proving else 0))
    reach_end = max(0, reach) * offload_block_size
    served_end = num_local_tokens + num_external_tokens
    unserved = num_tokens - served_end
    if served_end >= reach_end:
        return Miss(TAIL, 0, unserved)
    block = served_end // offload_block_size  # the block holding the first token not served
    reason = OTHER_BLOCKS
    for layout in sorted(layouts, key=_mamba_last):  # attention first: a Mamba state exists at some block ends only
        absent = why_absent(layout.index, block)
        if absent is not None:
            reason = NO_STATE if absent == NEW and layout.kind is GroupKind.MAMBA else absent
            break
    return Miss(reason, reach_end - served_end, num_tokens - reach_end)


def _mamba_last(layout: GroupLayout) -> bool:
    return layout.kind is GroupKind.MAMBA
