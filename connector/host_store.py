"""Scheduler-side index of the host tier: which key lives in which host slot.

Pure bookkeeping (no torch, no vLLM): a fixed number of slots (the `cpu_bytes` capacity),
least-recently-used eviction of ready, unpinned entries, and pins that keep a slot alive
while a store is being written or a load is reading it. The scheduler marks a prefix used
tail first (`touch`): what a load reads when it plans it, and a request's whole prefix when it
finishes, so from then on its head is the last of it to go (a hit needs every block from the
first, and a prefix evicted from its head would strand the rest in slots no lookup reaches).
While a request runs, the blocks it stores are newer than the ones it loaded. The bytes themselves live in
the workers' host buffers, addressed by slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from .miss_reasons import DROPPED, EVICTED, NEW, RESET, STORING

Key = Hashable  # (group index, block hash)
# `HostIndex.journal` entries: (JOURNAL_STORED, key, announcement) or (JOURNAL_REMOVED, key, None)
JOURNAL_STORED = True
JOURNAL_REMOVED = False


@dataclass(slots=True)
class _Entry:
    slot: int
    ready: bool = False  # the store that fills the slot has completed on every worker
    pins: int = 0
    # forgotten (`drop`, `clear`) while a load still read it, and why (a `miss_reasons` reason):
    # never ready again, freed when unpinned
    stale: str | None = None


class HostIndex:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # Least recently used first; held entries an eviction walked past go last (`_evict_one`)
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.evicted_total = 0
        # With KV cache events on, a list: each entry made ready, and each ready entry that leaves
        # (evicted, dropped, cleared), in order (`host_tier_events`). None: nothing is recorded.
        self.journal: list | None = None
        # Keys that left the tier, oldest first, with why (a `miss_reasons` reason): a lookup that misses
        # one tells it was evicted, not new. As many as the tier has slots, at most 2^20; a key is
        # forgotten here once it is ready again.
        self._gone: OrderedDict[Key, str] = OrderedDict()
        self._gone_limit = min(num_slots, 1 << 20)
        # Entries made ready or unpinned so far; `_evict_one` skips its walk while none was since one found
        # nothing to evict (a tier all held: every reservation walked all of it)
        self._releases = 0
        self._none_evictable_at: int | None = None

    # -- queries (no side effects) --
    def is_ready(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def ready_run(self, groups: Iterable[int], hashes: Iterable) -> int:
        """How many of ``hashes``, from the first, are ready in every one of ``groups``."""
        get = self._entries.get
        groups = tuple(groups)
        run = 0
        for key_hash in hashes:
            for group in groups:
                entry = get((group, key_hash))
                if entry is None or not entry.ready:
                    return run
            run += 1
        return run

    def why_absent(self, key: Key) -> str | None:
        """None when `key` is ready; else why not (`miss_reasons`): being stored, or how it left."""
        entry = self._entries.get(key)
        if entry is None:
            return self._gone.get(key, NEW)
        if entry.ready:
            return None
        return entry.stale or STORING

    def contains(self, key: Key) -> bool:
        return key in self._entries

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    # -- loads --
    def pin_for_load(self, key: Key) -> int | None:
        """Pin a ready entry for a load; None if not ready. Recency is the caller's (`touch`): a load
        marks its keys used tail first, after pinning them all."""
        entry = self._entries.get(key)
        if entry is None or not entry.ready:
            return None
        entry.pins += 1
        return entry.slot

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark the present entries among ``keys`` used, the last one most recently."""
        entries = self._entries
        move = entries.move_to_end
        for key in keys:
            if key in entries:
                move(key)

    def unpin(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1
            self._releases += 1
            if entry.stale and entry.pins == 0:
                del self._entries[key]
                self._free.append(entry.slot)
                self._remember_gone(key, entry.stale)

    # -- stores --
    def reserve_for_store(self, key: Key) -> int | None:
        """A pinned, not-yet-ready slot for `key`; None when present already or all pinned."""
        if key in self._entries:
            return None
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            return None
        self._entries[key] = _Entry(slot=slot, pins=1)
        return slot

    def rekey(self, old: Key, new: Key) -> bool:
        """Give a not-yet-ready entry reserved under a placeholder its real key (a block stored
        before its key existed); False, changing nothing, when `new` is present already."""
        entry = self._entries.get(old)
        if new in self._entries or entry is None or entry.ready or entry.stale:
            return False
        del self._entries[old]
        self._entries[new] = entry
        return True

    def complete_store(self, key: Key, announcement=None) -> None:
        """The store that fills `key`'s slot has completed on every worker (`announcement`: what the
        journal records of it)."""
        entry = self._entries.get(key)
        if entry is not None and not entry.ready and not entry.stale:  # the store's own pin, released once
            entry.ready = True
            entry.pins = max(0, entry.pins - 1)
            self._releases += 1
            self._gone.pop(key, None)  # back: a store given up before this would have kept how it left
            if self.journal is not None:
                self.journal.append((JOURNAL_STORED, key, announcement))

    def abort_store(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is not None and not entry.ready and not entry.stale:
            del self._entries[key]
            self._free.append(entry.slot)

    def drop(self, keys: Iterable[Key], reason: str = DROPPED) -> int:
        """Forget stored entries (lost host data); returns how many were freed now. One a load still
        reads is never found again and frees its slot once unpinned. Slots reserved for stores stay
        with them: their owners complete or abort them."""
        dropped = 0
        for key in list(keys):
            entry = self._entries.get(key)
            if entry is None:
                continue
            if entry.pins == 0:
                del self._entries[key]
                self._free.append(entry.slot)
                dropped += 1
                if entry.ready:
                    self._removed(key, reason)
            elif entry.ready:  # read by a load: not found again, its slot freed by the last unpin
                entry.ready, entry.stale = False, reason
                self._removed(key, None)  # still here, stale (`why_absent`); remembered once freed
        return dropped

    def clear(self) -> None:
        """Forget every stored block (vLLM resets its caches, e.g. after a weight update)."""
        self.drop(list(self._entries), RESET)

    def _evict_one(self) -> int | None:
        if self._none_evictable_at == self._releases:
            return None  # nothing became ready or unpinned since a walk found no entry to evict
        skipped = []
        for key, entry in self._entries.items():
            if entry.ready and entry.pins == 0:
                break
            skipped.append(key)
        else:
            self._none_evictable_at = self._releases
            return None
        # What a store fills or a load reads goes behind the rest, so that the next eviction does not
        # walk past it again (it was O(entries held) a reservation); a load's keys are used now anyway.
        move = self._entries.move_to_end
        for held in skipped:
            move(held)
        del self._entries[key]
        self.evicted_total += 1
        self._removed(key, EVICTED)
        return entry.slot

    def _removed(self, key: Key, reason: str | None) -> None:
        """A ready entry left the tier (``reason``: why, None while it is still kept stale)."""
        if reason is not None:
            self._remember_gone(key, reason)
        if self.journal is not None:
            self.journal.append((JOURNAL_REMOVED, key, None))

    def _remember_gone(self, key: Key, reason: str) -> None:
        gone = self._gone
        gone[key] = reason
        if len(gone) > self._gone_limit:
            gone.popitem(last=False)
