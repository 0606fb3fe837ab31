"""Pure multi-group load planning: which device blocks of which group receive which host block.

No vLLM import, no I/O, no clock. The scheduler adapter turns vLLM's `KVCacheBlocks` into
plain block-id lists and hands them here; the result is plain data that the adapter turns
into a transfer job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .groups import GroupLayout

NULL_BLOCK_ID = 0  # vLLM's null placeholder block (out-of-window / padding positions)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class GroupScan:
    """The null-skip scan of one group: counts for telemetry, pending blocks for the load."""

    group_index: int
    blocks_total: int = 0  # device blocks scanned (local boundary .. end of cached tokens)
    null_skipped: int = 0
    start: int = -1  # index (in the group's block list) of the first pending block, -1 if none
    # Per pending device block: destination block id, and its position inside its offload block.
    block_ids: list[int] = field(default_factory=list)
    sub_indices: list[int] = field(default_factory=list)
    # (offload block index, pending device blocks in it) per offload block read, in order: the
    # offload block of each pending block, without a list as long as the blocks.
    runs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return len(self.block_ids)


@dataclass(slots=True)
class LoadPlan:
    """One load for a request, gathered over all groups."""

    scans: list[GroupScan]
    first_offload_index: int  # offload block holding the first not-locally-computed token

    @property
    def num_blocks(self) -> int:
        return sum(s.pending for s in self.scans)

    @property
    def group_sizes(self) -> list[int]:
        return [s.pending for s in self.scans]

    @property
    def group_starts(self) -> list[int]:
        return [s.start for s in self.scans]

    @property
    def block_ids(self) -> list[int]:
        return [b for s in self.scans for b in s.block_ids]

    def keys(self) -> list[tuple[int, int]]:
        """Distinct (group index, offload block index) pairs the load reads, in plan order."""
        return [(s.group_index, k) for s in self.scans for k, _ in s.runs]


def scan_group(
    layout: GroupLayout,
    block_ids: Sequence[int],
    num_local_tokens: int,
    num_cached_tokens: int,
    offload_block_size: int,
) -> GroupScan:
    """Scan one group's allocated blocks between the local boundary and the cached end.

    Only the blocks covering the cached tokens are looked at (blocks allocated for new
    tokens are never counted). Scanning starts at the locally computed boundary, not at
    the first unhashed block: vLLM may or may not have hashed the external blocks when
    it calls us, and sliding-window / Mamba groups hold non-null unhashed blocks below it.
    """
    bs = layout.block_size
    factor = offload_block_size // bs
    end = min(cdiv(num_cached_tokens, bs), len(block_ids))
    begin = num_local_tokens // bs
    scan = GroupScan(group_index=layout.index)
    # No external tokens: an unaligned local boundary would otherwise pick its partial block.
    if end <= begin or num_cached_tokens <= num_local_tokens:
        return scan
    scan.blocks_total = end - begin
    window = block_ids[begin:end]
    if type(window) is not list:
        window = list(window)
    nulls = scan.null_skipped = window.count(NULL_BLOCK_ID)
    if nulls == 0 or window[:nulls].count(NULL_BLOCK_ID) == nulls:
        # Every null leads (a sliding window's out-of-window blocks) or there is none: the
        # pending blocks are one slice, and their indices slices of a cached table. No loop.
        if nulls == len(window):
            return scan
        first = begin + nulls
        scan.block_ids = window[nulls:] if nulls else window
        scan.sub_indices = _positions_in_offload_block(factor, end)[first:end]
        scan.runs = [(k, min(end, (k + 1) * factor) - max(first, k * factor))
                     for k in range(first // factor, (end - 1) // factor + 1)]
        scan.start = first
        return scan
    # Nulls between real blocks (Mamba padding, odd layouts): one block at a time.
    ids, subs, runs = scan.block_ids, scan.sub_indices, scan.runs
    for i in range(begin, end):
        b = block_ids[i]
        if b == NULL_BLOCK_ID:
            continue
        k = i // factor
        ids.append(b)
        subs.append(i % factor)
        if runs and runs[-1][0] == k:
            runs[-1] = (k, runs[-1][1] + 1)
        else:
            runs.append((k, 1))
    if ids:
        scan.start = begin + _count_leading_nulls(block_ids, begin)
    return scan


@dataclass(slots=True)
class GatheredLoad:
    """Every group's pending blocks of one load, gathered with the host blocks they receive."""

    keys: list[tuple]  # the (group index, offload key) pairs pinned, in plan order
    slots: list[tuple[GroupScan, list[int]]]  # per group with pending blocks: its scan, a host slot per block
    loaded: list[tuple[int, int]]  # (group index, pending blocks) per such group
    missing: bool  # a key was not in the tier (or past the request's keys): its blocks have slot -1


def gather_load(scans: Sequence[GroupScan], offload_keys: Sequence, pin) -> GatheredLoad:
    """The host slot of each pending device block of ``scans``, and the keys pinned for them.

    ``offload_keys[k]`` is the key of the request's ``k``-th offload block in every group; ``pin(key)``
    pins a ready host block for the load and gives its slot, None when it is not there. One pin per
    offload block, its slot repeated for each of its pending device blocks. A load with a missing key
    must fail (vLLM recomputes): its other blocks are still pinned and listed, so the caller unpins them.
    """
    keys: list[tuple] = []
    gathered: list[tuple[GroupScan, list[int]]] = []
    loaded: list[tuple[int, int]] = []
    missing = False
    num_keys = len(offload_keys)
    for scan in scans:
        if not scan.pending:
            continue
        slots: list[int] = []
        for k, count in scan.runs:
            key = (scan.group_index, offload_keys[k]) if k < num_keys else None
            slot = pin(key) if key is not None else None
            if slot is None:
                missing = True
                slot = -1
            else:
                keys.append(key)
            slots += [slot] * count
        gathered.append((scan, slots))
        loaded.append((scan.group_index, scan.pending))
    return GatheredLoad(keys, gathered, loaded, missing)


def _count_leading_nulls(block_ids: Sequence[int], begin: int) -> int:
    n = 0
    while block_ids[begin + n] == NULL_BLOCK_ID:
        n += 1
    return n


# factor -> [i % factor] for i below the list length, grown by doubling: slicing it costs less
# than computing the positions of a long run of blocks.
_POSITION_TABLES: dict[int, list[int]] = {}


def _positions_in_offload_block(factor: int, size: int) -> list[int]:
    table = _POSITION_TABLES.get(factor)
    if table is None or len(table) < size:
        n = max(1024, 1 << (size - 1).bit_length())
        table = _POSITION_TABLES[factor] = [i % factor for i in range(n)]
    return table


def plan_load(
    layouts: Sequence[GroupLayout],
    group_block_ids: Sequence[Sequence[int]],
    num_local_tokens: int,
    num_external_tokens: int,
    offload_block_size: int,
) -> LoadPlan:
    """Plan the load of `num_external_tokens` after `num_local_tokens` for every group.

    The whole pure plan, as tests and `bench/planner_bench.py` check it. The scheduler runs the same
    `scan_group` per group itself (`KVScopeScheduler._plan_load`), to time each group's scan apart, then
    `gather_load`."""
    if len(layouts) != len(group_block_ids):
        raise ValueError(f"{len(layouts)} groups but {len(group_block_ids)} block lists")
    cached = num_local_tokens + num_external_tokens
    scans = [
        scan_group(layout, ids, num_local_tokens, cached, offload_block_size)
        for layout, ids in zip(layouts, group_block_ids)
    ]
    # The first offload key: the locally computed device blocks over the block-size factor,
    # (local // bs) // (B // bs) == local // B for every group since B is a multiple of bs.
    first = num_local_tokens // offload_block_size
    return LoadPlan(scans=scans, first_offload_index=first)
