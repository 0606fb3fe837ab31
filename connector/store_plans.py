"""Which of a request's device blocks a step stores, read from vLLM's block lists.

The vLLM-facing half of store planning: `StorePlanner.plan` decides from the request's computed
tokens and known keys how far each group may store, reads vLLM's `KVCacheBlock`s of the blocks new
since the last store (a Mamba block that does not hold its own end's state counts as null), and hands
their ids to `piecewise_stores.PiecewiseStores.plan_pieces`, which puts them into host slots. The
scheduler (`scheduler.py`) turns the pieces into a store job.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .groups import GroupKind, GroupLayout
from .metadata import GroupTransfer
from .offload_keys import OffloadKeys
from .piecewise_stores import Filling, PiecewiseStores
from .planning import NULL_BLOCK_ID
from .state_blocks import StateBlocks

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreProgress:
    """How far a request's stores have gone in each group, and until when its steps store nothing."""

    stored_blocks: list[int]  # device blocks already considered for storing
    filling: list  # the offloaded block being filled (a `Filling`; None: none, or the current one is skipped)
    # `plan` found nothing to store with this many keys known, and will not below this many computed
    # tokens (`next_store_tokens`; stores since only raise that bound); -1: decide in full
    idle_known: int = -1
    idle_until: float = 0


class StorePlanner:
    """Each step's store of a request, from its progress (`StoreProgress`) and vLLM's block lists."""

    def __init__(self, layouts: list[GroupLayout], offload_block_size: int, keys: OffloadKeys,
                 stores: PiecewiseStores, states: StateBlocks):
        self.layouts = layouts
        self.block_size = offload_block_size
        self.keys = keys
        self.stores = stores
        self.states = states
        self._foreign_state_logged = False

    def start(self) -> StoreProgress:
        """A request's progress before its first store (or after a cache reset)."""
        return StoreProgress([0] * len(self.layouts), [None] * len(self.layouts))

    def plan(self, request, progress: StoreProgress, computed_tokens: int, witnessed_states: dict,
             group_blocks: Callable[[], Sequence]) -> tuple[list[GroupTransfer], list[Filling]]:
        """The pieces of this step's store for one request, and the fillings they feed: every device
        block computed since the last step goes to its offloaded block's host slot now, before a
        sliding window can drop it. In an offloaded block whose key is known (its tokens are all
        known: the prompt's are from the start); in a group that stores ahead
        (`PiecewiseStores.stores_ahead`), in any block, under a placeholder key until the real one
        exists. ``group_blocks``: vLLM's block lists of the request, asked only when a group may store
        past what it has (its blocks may still all be skipped); ``witnessed_states``: its Mamba blocks
        a forward ended in (`StateBlocks`)."""
        layouts = self.layouts
        known = self.keys.count(request.block_hashes)  # offloaded blocks whose key exists
        stores = self.stores
        if stores.ahead_groups:
            stores.key_blocks(request, progress.filling, known)
        limits = [computed_tokens // layout.block_size if ahead else
                  min(computed_tokens // layout.block_size, known * layout.blocks_per_offload_block(self.block_size))
                  for layout, ahead in zip(layouts, stores.stores_ahead)]
        # Decide before asking vLLM for block ids.
        if all(limit <= done for limit, done in zip(limits, progress.stored_blocks)):
            # Idle until a new key exists or a group's next device block is computed: most decode steps
            # (the scheduler checks `idle_until` before calling here again)
            progress.idle_known, progress.idle_until = known, self.next_store_tokens(progress.stored_blocks, known)
            return [], []
        # vLLM's own lists of the request's blocks, not copies: only the blocks new since the last store
        # are read (`get_block_ids` built every group's whole id list, O(context) a store)
        blocks_by_group = group_blocks()
        parts: list[GroupTransfer] = []
        fillings: list[Filling] = []
        for layout, blocks, limit in zip(layouts, blocks_by_group, limits):
            g = layout.index
            filling = progress.filling[g]
            if filling is not None and filling.keyed and not self._key_still_holds(request, filling):
                stores.give_up(filling)  # its pieces so far belong to tokens the request no longer has
                progress.filling[g] = None
            first, end = progress.stored_blocks[g], min(limit, len(blocks))
            part = GroupTransfer(g, [], [], [])
            progress.filling[g] = stores.plan_pieces(
                request, part, first, self._storable_block_ids(layout, blocks, first, end, witnessed_states),
                layout.blocks_per_offload_block(self.block_size), known, progress.filling[g], fillings)
            progress.stored_blocks[g] = max(first, end)
            if part.block_ids:
                parts.append(part)
        return parts, fillings

    def next_store_tokens(self, stored_blocks: list[int], known: int) -> float:
        """The computed tokens from which a request with ``known`` keys and ``stored_blocks`` per group
        has a block to store (`plan`'s limits, solved for the token count): a group's next device
        block, once computed, where a key exists for it or the group stores ahead; never (inf) without a new key."""
        until = math.inf
        for layout, ahead, done in zip(self.layouts, self.stores.stores_ahead, stored_blocks):
            if ahead or known * layout.blocks_per_offload_block(self.block_size) > done:
                until = min(until, (done + 1) * layout.block_size)
        return until

    def _storable_block_ids(self, layout: GroupLayout, blocks, first: int, end: int,
                            witnessed_states: dict) -> list[int]:
        """The ids of vLLM's blocks ``first`` to ``end`` of a group, to store; null for a Mamba block that does
        not hold its own end's state (another state, or none: never stored under this block's key)."""
        if end <= first:
            return []  # (a slice would count a negative end from the list's end)
        if layout.kind is not GroupKind.MAMBA:
            return [block.block_id for block in blocks[first:end]]
        ids = []
        for i in range(first, end):
            block = blocks[i]
            if block.block_id != NULL_BLOCK_ID and not self.states.holds_own_state(
                    block, layout.index, i, layout.block_size, witnessed_states):
                self._log_foreign_state(block, (i + 1) * layout.block_size)
                ids.append(NULL_BLOCK_ID)
            else:
                ids.append(block.block_id)
        return ids

    def _key_still_holds(self, request, filling) -> bool:
        """Whether the request's tokens still give the offloaded block it is filling that block's key.
        A request's tokens past its computed ones can change under it (a streaming-input session's
        next turn drops the last sampled token and appends new input): the rest of the block would
        then hold KV of other tokens than its key's."""
        key_hash = self.keys.hash_of(request.block_hashes, filling.block_index)
        return key_hash is not None and key_hash == filling.key[1]

    def _log_foreign_state(self, block, block_end: int) -> None:
        """Say once why a model's Mamba states are stored less often than its blocks end."""
        keyed_tokens = block.block_hash_num_tokens
        if self._foreign_state_logged or keyed_tokens in (None, block_end):
            return
        self._foreign_state_logged = True
        logger.info("kvscope: a Mamba block ending at token %d holds vLLM's state at token %d (a prefill "
                    "checkpoint at a finer hash boundary, or EAGLE's dropped block): such blocks are not "
                    "stored, so fewer Mamba states reach the host tier", block_end, keyed_tokens)
