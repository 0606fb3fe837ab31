"""Which host-tier keys a finished request marks used, in the order to mark them (pure).

A finished request's prefix is marked used block by block from its last, so the tier's LRU evicts
it from its tail and what stays is still a hit (as vLLM's own offloading orders a request's blocks
when it finishes). Marked: the first ``reachable`` offloaded blocks of every full-attention group
(the run a hit can reach); in the other groups only the blocks a hit at that run's end needs and
the ones the request loaded. Within one offloaded block, groups go in layout order.

Built in segments rather than block by block and group by group: at 128k tokens and 16-token
blocks a finish walks 8k blocks, and the other groups need only a window's or a state's few.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import repeat

from .groups import GroupKind, GroupLayout
from .lookup import needed_offload_blocks


def finished_prefix_keys(
    layouts: Sequence[GroupLayout],
    hashes: Sequence,
    reachable: int,
    offload_block_size: int,
    loaded: Collection,
) -> list[tuple]:
    """The ``(group, hash)`` keys to mark used, least recent first: tail first, so the head is marked last.

    ``hashes``: the request's offload-block key hashes; ``reachable``: how many of them, from the
    first, every full-attention group holds; ``loaded``: the keys of the request's last load.
    """
    if reachable <= 0:
        return []
    full = {layout.index for layout in layouts if layout.kind is GroupKind.FULL_ATTENTION}
    end = reachable * offload_block_size
    # The other groups' blocks a hit at the run's end needs: one range each (a window's, a state's)
    needed = {layout.index: needed_offload_blocks(layout, 0, end, offload_block_size)
              for layout in layouts if layout.index not in full}
    loaded_at: dict[int, set[int]] = {}  # block -> the groups besides full attention that loaded it
    loaded_elsewhere: dict = {}  # hash -> those groups
    for group, key_hash in loaded:
        if group not in full:
            loaded_elsewhere.setdefault(key_hash, set()).add(group)
    if loaded_elsewhere:
        for k in range(reachable):
            groups = loaded_elsewhere.get(hashes[k])
            if groups is not None:
                loaded_at[k] = groups
    # Pieces of blocks that mark the same groups: cut where a range or a loaded block starts or ends
    cuts = {0, reachable}
    for blocks in needed.values():
        cuts.update(cut for cut in (blocks.start, blocks.stop) if 0 < cut < reachable)
    for k in loaded_at:
        cuts.update((k, k + 1))
    cuts = sorted(cuts, reverse=True)
    keys: list[tuple] = []
    piece_groups, piece_end = None, reachable  # the piece being gathered: its groups, its end
    for high, low in zip(cuts, cuts[1:]):
        groups = tuple(layout.index for layout in layouts
                       if layout.index in full or low in needed[layout.index] or layout.index in loaded_at.get(low, ()))
        if groups != piece_groups:
            if piece_groups:
                keys += _keys_of(piece_groups, hashes[high:piece_end])
            piece_groups, piece_end = groups, high
    if piece_groups:
        keys += _keys_of(piece_groups, hashes[0:piece_end])
    return keys


def _keys_of(groups: tuple[int, ...], hashes: Sequence) -> list[tuple]:
    """Each of ``groups``' key of each of ``hashes``, the last block first, groups in their order."""
    if len(groups) == 1:
        return list(zip(repeat(groups[0]), reversed(hashes)))  # the common case, its tuples made in C
    return [(group, key_hash) for key_hash in reversed(hashes) for group in groups]
