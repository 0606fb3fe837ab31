"""Why a lookup served no more of a prompt, block by block past its hit.

An operator sizing the host tier asks how many looked-up tokens it missed because it was too small
(evicted) rather than because nobody had computed them before (new). Each offloaded block past the
hit that a hit could have covered is missed for a reason, asked of the host tier's index as it
stood at the lookup; the rest of the lookup, tokens no offloaded block can cover (the prompt's
partial last block, the token vLLM always computes), is `TAIL`. The reason of the first block past
the hit is the lookup's own: why its hit stopped there. Pure: the index is asked through
`why_absent`, nothing of vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from .groups import GroupKind, GroupLayout
from .lookup import hit_reach, proving_groups

# Why a key is not ready in the host tier (`HostIndex.why_absent`), or why a lookup stopped
# (`MISS_REASON_MEANINGS` says each).
NEW = "new"
EVICTED = "evicted"
DROPPED = "dropped"
RESET = "reset"
STORING = "storing"
NO_STATE = "no_state"
OTHER_BLOCKS = "other_blocks"
LOAD_FAILED = "load_failed"
NOT_TAKEN = "not_taken"
TAIL = "tail"
MISS_REASONS = (NEW, EVICTED, DROPPED, RESET, STORING, NO_STATE, OTHER_BLOCKS, LOAD_FAILED, NOT_TAKEN, TAIL)
# What each reason says of an offloaded block the tier did not serve, in one phrase: the metric's help,
# the boards and the replay app say them from here.
MISS_REASON_MEANINGS = {
    NEW: "never stored, or it left the tier longer ago than the tier remembers (as many blocks as it holds)",
    EVICTED: "evicted to make room: a larger tier would have held it",
    DROPPED: "dropped after a load from it failed",
    RESET: "forgotten by a cache reset",
    STORING: "its store had not completed on every worker (the same prefix came again within a copy)",
    NO_STATE: "the attention groups held it, but no Mamba state was stored at its end (vLLM keeps states at "
              "some block ends only; decode steps' states are stored only with mamba_decode_states true)",
    OTHER_BLOCKS: "every group held it, but the hit needed another block (a sliding window's earlier one)",
    LOAD_FAILED: "held, but an earlier load of the request failed: it recomputes, not offered a hit until vLLM "
                 "preempts it or its streaming session takes its next turn",
    NOT_TAKEN: "found, but vLLM took less of the hit (a request asking for prompt logprobs skips prefix caches)",
    TAIL: "past the last offloaded block a hit can cover (the prompt's partial last block, the last token): "
          "never served",
}


def miss_reasons_explained() -> str:
    """Every reason with its meaning, as one sentence's list: "new (never stored, ...), evicted (...), ..."."""
    return ", ".join(f"{reason} ({MISS_REASON_MEANINGS[reason]})" for reason in MISS_REASONS)


# (group index, offload block index) -> None when that block is ready in that group, else its reason
WhyAbsent = Callable[[int, int], "str | None"]


class Miss(NamedTuple):
    reason: str  # why the hit stopped: the first block past it (`TAIL` when there was none to miss)
    by_reason: tuple[tuple[str, int], ...]  # (reason, tokens) of the blocks from the hit to the reach
    tail_tokens: int  # looked-up tokens past the last offloaded block a hit can cover (at least the last token)


def miss_order(layouts: Sequence[GroupLayout]) -> list[GroupLayout]:
    """The groups in the order a block's reason is asked: attention first (a Mamba state exists at some
    block ends only, so a missing one tells less)."""
    return sorted(layouts, key=lambda layout: layout.kind is GroupKind.MAMBA)


def lookup_miss(
    ordered_layouts: Sequence[GroupLayout],
    num_tokens: int,
    num_local_tokens: int,
    num_external_tokens: int,
    num_hashed_blocks: int,
    offload_block_size: int,
    why_absent: WhyAbsent,
    proof_groups: frozenset[int] = frozenset(),
) -> Miss:
    """What a lookup of ``num_tokens`` tokens, ``num_local_tokens`` of them on the device, did not serve.

    ``num_external_tokens`` is its hit (`lookup.find_hit_tokens`); ``ordered_layouts`` as `miss_order`
    gives them. The tokens of ``by_reason`` and ``tail_tokens`` add up to the looked-up tokens
    (``num_tokens - num_local_tokens``) minus the hit.
    """
    proving = sorted(proving_groups(ordered_layouts, proof_groups))
    reach = hit_reach(num_tokens, num_hashed_blocks, offload_block_size, proving)  # as `find_hit_tokens` caps a hit
    reach_end = max(0, reach) * offload_block_size
    served_end = num_local_tokens + num_external_tokens
    if served_end >= reach_end:
        return Miss(TAIL, (), num_tokens - served_end)
    num_attention = sum(layout.kind is not GroupKind.MAMBA for layout in ordered_layouts)
    by_reason: list[tuple[str, int]] = []
    start = served_end
    for k in range(served_end // offload_block_size, reach):
        absences = [why_absent(layout.index, k) for layout in ordered_layouts]  # each group asked once
        reason = _block_reason(ordered_layouts, absences, num_attention, proving, k, why_absent)
        end = (k + 1) * offload_block_size
        if reason == NEW and all(a == NEW for a in absences[:num_attention]):
            # No attention group ever held it (as far as the index remembers): the blocks after it, whose
            # keys chain through it, are taken as new too; a cold prompt costs one block's questions.
            end = reach_end
        if by_reason and by_reason[-1][0] == reason:
            by_reason[-1] = (reason, by_reason[-1][1] + end - start)
        else:
            by_reason.append((reason, end - start))
        if end == reach_end:
            break
        start = end
    return Miss(by_reason[0][0], tuple(by_reason), num_tokens - reach_end)


def barred_from_hit(miss: Miss, barred_tokens: int) -> Miss:
    """The miss of a lookup offered no hit although the tier held ``barred_tokens`` past the device's
    (an earlier load of the request failed): those tokens are `LOAD_FAILED`, the rest keep their
    reasons. ``miss`` is `lookup_miss`'s answer for a hit of ``barred_tokens``; blocks the tier did not
    hold (new, evicted, dropped by the failed load...) say so, as in any lookup."""
    if barred_tokens <= 0:
        return miss
    return Miss(LOAD_FAILED, ((LOAD_FAILED, barred_tokens),) + miss.by_reason, miss.tail_tokens)


def past_kept_tokens(miss: Miss, kept_tokens: int) -> Miss:
    """``miss`` without its first ``kept_tokens`` tokens, which vLLM kept on the device after all: its
    device hit can end inside a block (hash blocks smaller than device blocks), is rounded down to a
    block for the lookup, and is kept whole when the tier's hit does not reach past it. Those tokens
    were never looked up in vLLM's count; the lookup's reason becomes that of the first block left."""
    if kept_tokens <= 0:
        return miss
    by_reason = []
    for reason, tokens in miss.by_reason:
        if kept_tokens >= tokens:
            kept_tokens -= tokens
            continue
        by_reason.append((reason, tokens - kept_tokens))
        kept_tokens = 0
    return Miss(by_reason[0][0] if by_reason else TAIL, tuple(by_reason), max(0, miss.tail_tokens - kept_tokens))


def missed_tokens_by_reason(queried: int, hit: int, found: int, miss: Miss) -> list[tuple[str, int]]:
    """How the ``queried - hit`` tokens vLLM counted as looked up and not served split by reason: what
    vLLM did not take of the ``found`` hit (`NOT_TAKEN`), then ``miss``'s blocks past it, and `TAIL` the
    rest. ``queried`` is vLLM's count when it schedules the request, which may differ from the lookup's
    (not ``miss.tail_tokens``): each reason is capped by what is left, so they always add up."""
    left = max(0, queried - hit)
    not_taken = min(left, max(0, found - hit))
    split = [(NOT_TAKEN, not_taken)]
    left -= not_taken
    for reason, tokens in miss.by_reason:
        tokens = min(tokens, left)
        split.append((reason, tokens))
        left -= tokens
    split.append((TAIL, left))
    return split


def _block_reason(ordered_layouts, absences, num_attention: int, proving, k: int, why_absent: WhyAbsent) -> str:
    """Why offloaded block ``k`` was not served: the reason of the first group lacking it (``absences``,
    one per group; a Mamba state never stored where attention groups held the block: `NO_STATE`), but
    a group that remembers how the block left comes before one that says `NEW`: the groups' entries
    leave at different times (a load refreshes only the blocks a sliding window needs), and the one
    that left first may be forgotten already (the index remembers as many keys as it has slots)."""
    first = None
    for layout, absent in zip(ordered_layouts, absences):
        if absent is None:
            continue
        if absent != NEW:
            return absent
        if first is None:
            first = NO_STATE if num_attention and layout.kind is GroupKind.MAMBA else NEW
    if first is not None:
        return first
    for group in proving:  # a drafter's KV at a block's end also needs the next block's key (its proof)
        absent = why_absent(group, k + 1)
        if absent is not None:
            return absent
    return OTHER_BLOCKS
