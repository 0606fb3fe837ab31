"""Offloaded blocks stored piece by piece, and the host slots they fill.

A store writes each device block in the step that computes it, before a sliding window can drop
it, into its offloaded block's host slot. A `Filling` is one offloaded block on its way into the
host tier; `PiecewiseStores` starts them, gives placeholder-keyed ones their key, and completes or
aborts them as store jobs report; `plan_pieces` puts a step's device blocks of one group into their
slots. `store_plans.py` decides which device blocks a step stores and hands their ids over, the
scheduler (`scheduler.py`) builds the jobs; the host entries themselves live in `host_store.HostIndex`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .groups import GroupKind, GroupLayout
from .host_store import HostIndex
from .offload_keys import OffloadKeys
from .planning import NULL_BLOCK_ID

if TYPE_CHECKING:  # not at run time: metadata.py imports vLLM, this module does not
    from .metadata import GroupTransfer


@dataclass(slots=True)
class Filling:
    """An offloaded block stored piece by piece. Ready once every piece is planned, its key is known
    and every store job carrying a piece has been reported; aborted (slot freed) once a piece fails
    or cannot be stored, or its key turns out stored already.

    A block holding output tokens (or the prompt's last tokens) has no key until its last token is
    known; in a group whose window is shorter than the block, its first pieces would leave the
    window before then, so they are stored under a placeholder key that the real one replaces."""

    key: tuple  # (group index, block hash or placeholder): the host index entry
    slot: int
    needed: int  # device blocks per offloaded block in its group
    block_index: int = 0  # which offloaded block of its request
    keyed: bool = True  # False while `key` is a placeholder
    planned: int = 0
    jobs: int = 0  # store jobs with a piece of it, not yet reported
    failed: bool = False  # a piece failed or will never come: abort when no job is left
    announcement: object = None  # with KV cache events on, its description once keyed (`describe`)


class PiecewiseStores:
    """The offloaded blocks being filled, by host key, and the rules of their life."""

    def __init__(self, index: HostIndex, layouts: list[GroupLayout], offload_block_size: int,
                 keys: OffloadKeys, draft_tokens: int = 0):
        self.index = index
        self.block_size = offload_block_size
        self.keys = keys
        # Groups whose sliding window drops an offloaded block's first pieces before its last is
        # computed (window <= offloaded block - device block, as vLLM frees window blocks; a step
        # that accepts `draft_tokens` speculative drafts moves that many tokens further at once):
        # they store pieces of blocks whose key does not exist yet, under a placeholder.
        self.stores_ahead = [layout.kind is GroupKind.SLIDING_WINDOW
                             and layout.sliding_window <= offload_block_size - layout.block_size + draft_tokens
                             for layout in layouts]
        self.ahead_groups = [layout.index for layout, ahead in zip(layouts, self.stores_ahead) if ahead]
        self.by_key: dict[tuple, Filling] = {}  # unsettled fillings
        # With KV cache events on, `describe(request, group, block index)` describes a block once it
        # has its key, while its request is at hand (`host_tier_events`); None: events are off.
        self.describe = None

    def start_block(self, request, g: int, k: int, needed: int, first_block_id: int, known: int) -> Filling | None:
        """The filling of the request's offloaded block `k` in group `g`, whose first device block is
        computed: under its key once that exists (`known` blocks have one), else under a placeholder
        no block hash equals, until `key_blocks` gives it the key; None when skipped."""
        if k < known:
            key = (g, self.keys.hash_of(request.block_hashes, k))
            filling = self._start(key, needed, first_block_id, k, keyed=True)
            if filling is not None and self.describe is not None:
                filling.announcement = self.describe(request, g, k)
            return filling
        if not self._may_complete(request, k):
            return None  # the request ends before the block does: no slot for it
        return self._start((g, ("unkeyed", request.request_id, k)), needed, first_block_id, k, keyed=False)

    def plan_pieces(self, request, part: GroupTransfer, first: int, block_ids: list[int], needed: int, known: int,
                    filling: Filling | None, fed: list[Filling]) -> Filling | None:
        """Plan a step's pieces of one group into ``part``: its device blocks ``first``, ``first + 1``, ...
        (``block_ids``; null where a block holds nothing to store), each into its offloaded block's slot
        (``needed`` device blocks to an offloaded block). An offloaded block's first piece starts its
        filling (`start_block`: reserves the slot in the host index); a null piece, or a piece of a
        failed filling, gives the filling up (its slot freed once no job carries a piece of it).
        ``filling``: the one the group had in progress, else None. The fillings fed go onto ``fed``,
        the job's list over all its groups (each once, its job counted). Returns the group's filling
        in progress after the last block (None: none). No vLLM object, clock or I/O."""
        g = part.group_index
        for i, block_id in enumerate(block_ids, first):
            k, sub = divmod(i, needed)
            if sub == 0:
                filling = self.start_block(request, g, k, needed, block_id, known)
            if filling is None:
                continue  # skipped: stored already, no free slot, or out of the window from its start
            if block_id == NULL_BLOCK_ID or filling.failed:
                # Out-of-window / padding position, or a piece already failed: never complete.
                self.give_up(filling)
                filling = None
                continue
            part.block_ids.append(block_id)
            part.slots.append(filling.slot)
            part.subs.append(sub)
            filling.planned += 1
            if not fed or fed[-1] is not filling:
                fed.append(filling)
                filling.jobs += 1
        return filling

    def _start(self, key, needed: int, first_block_id: int, block_index: int, keyed: bool) -> Filling | None:
        """Reserve `key`'s host slot for an offloaded block whose first device block is computed;
        None when the block is skipped (stored already or being stored, no free slot, out of window)."""
        if first_block_id == NULL_BLOCK_ID:
            return None
        slot = self.index.reserve_for_store(key)
        if slot is None:
            return None  # a later miss, never an error
        filling = self.by_key[key] = Filling(key=key, slot=slot, needed=needed, block_index=block_index,
                                             keyed=keyed)
        return filling

    def _may_complete(self, request, block_index: int) -> bool:
        """Whether the request may still compute the offloaded block's last token: the last token
        it samples is never computed, so its final, partial block would only hold a slot."""
        max_tokens = getattr(request, "max_tokens", None)
        if not isinstance(max_tokens, int):
            return True
        return (block_index + 1) * self.block_size <= request.num_prompt_tokens + max_tokens - 1

    def key_blocks(self, request, fillings: list, known: int) -> None:
        """Give the request's placeholder-keyed blocks (``fillings``: the one per group it is filling)
        whose key now exists (their last token is known, ``known`` blocks have one) that key; a block
        stored or being stored under it already makes ours a duplicate."""
        hashes = request.block_hashes
        for g in self.ahead_groups:
            filling = fillings[g]
            if filling is None or filling.keyed or filling.failed or filling.block_index >= known:
                continue
            placeholder, key = filling.key, (g, self.keys.hash_of(hashes, filling.block_index))
            if not self.index.rekey(placeholder, key):
                self.give_up(filling)
                continue
            del self.by_key[placeholder]
            self.by_key[key] = filling
            filling.key, filling.keyed = key, True
            if self.describe is not None:
                filling.announcement = self.describe(request, g, filling.block_index)
            # with async scheduling its last piece can be planned (even written) before its key exists
            self.settle(filling)

    def job_reported(self, fillings, failed: bool) -> None:
        """A store job carrying pieces of ``fillings`` has been reported by every worker."""
        for filling in fillings:
            filling.jobs -= 1
            filling.failed |= failed
            self.settle(filling)

    def request_finished(self, request, fillings: list) -> None:
        """The request ends: blocks it was filling get their key if it exists now; the ones whose
        remaining pieces (or key) will never come are given up."""
        if self.ahead_groups:
            self.key_blocks(request, fillings, self.keys.count(request.block_hashes))
        for filling in fillings:
            if filling is not None and (filling.planned < filling.needed or not filling.keyed):
                self.give_up(filling)

    def give_up(self, filling: Filling) -> None:
        filling.failed = True
        self.settle(filling)

    def settle(self, filling: Filling) -> None:
        """Complete or abort a filling once no store job with a piece of it is outstanding. Settled
        fillings leave the registry; a request may still hold one (then marked failed: skipped)."""
        if filling.jobs or self.by_key.get(filling.key) is not filling:
            return
        if filling.failed:
            del self.by_key[filling.key]
            self.index.abort_store(filling.key)
        elif filling.planned == filling.needed and filling.keyed:
            del self.by_key[filling.key]
            self.index.complete_store(filling.key, filling.announcement)
