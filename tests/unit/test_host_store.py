"""HostIndex: the scheduler-side slot bookkeeping of the host tier (pure Python, no torch)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from connector.host_store import JOURNAL_REMOVED, JOURNAL_STORED, HostIndex


def _filled(n: int, keys) -> HostIndex:
    """An index with `n` slots holding `keys` ready and unpinned, stored in that order."""
    index = HostIndex(n)
    for key in keys:
        assert index.reserve_for_store(key) is not None
        index.complete_store(key)
    return index


def _slots(index: HostIndex) -> dict:
    return {key: entry.slot for key, entry in index._entries.items()}


# --- construction -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1])
def test_needs_at_least_one_slot(n):
    with pytest.raises(ValueError, match=str(n)):
        HostIndex(n)


def test_empty_index():
    index = HostIndex(3)
    assert index.used_slots == 0
    assert not index.contains("a") and not index.is_ready("a")
    assert index.pin_for_load("a") is None
    index.unpin("a")  # unknown keys are ignored
    index.complete_store("a")
    index.abort_store("a")
    assert index.drop(["a"]) == 0
    assert index.used_slots == 0 and index.evicted_total == 0


# --- capacity and LRU -----------------------------------------------------------------------------


def test_capacity_never_exceeded_and_slots_in_range():
    index = HostIndex(4)
    for i in range(20):
        slot = index.reserve_for_store(i)
        assert slot is not None and 0 <= slot < 4
        index.complete_store(i)
        assert index.used_slots <= 4
        slots = list(_slots(index).values())
        assert len(slots) == len(set(slots))
    assert index.used_slots == 4
    assert [k for k in range(20) if index.contains(k)] == [16, 17, 18, 19]
    assert index.evicted_total == 16


def test_reserve_reuses_the_evicted_slot():
    index = _filled(2, ["a", "b"])
    slot_a = _slots(index)["a"]
    assert index.reserve_for_store("c") == slot_a
    assert not index.contains("a") and index.contains("b")


def test_lru_evicts_oldest_ready_entry():
    index = _filled(3, ["a", "b", "c"])
    index.reserve_for_store("d")
    assert not index.contains("a")
    assert all(index.contains(k) for k in "bcd")
    assert index.evicted_total == 1


def test_pin_for_load_leaves_recency_to_touch():
    index = _filled(3, ["a", "b", "c"])
    slot_a = index.pin_for_load("a")
    assert slot_a == _slots(index)["a"]
    index.unpin("a")  # unpinned again, and still the least recently used: the load touches its keys itself
    assert index.reserve_for_store("d") is not None
    assert not index.contains("a") and index.contains("b")
    index.pin_for_load("b")
    index.touch(["b"])
    index.unpin("b")
    index.complete_store("d")
    assert index.reserve_for_store("e") is not None
    assert index.contains("b") and not index.contains("c")


def test_touch_makes_the_last_key_the_most_recently_used_and_ignores_absent_ones():
    index = _filled(4, ["a", "b", "c", "d"])
    index.touch(["c", "x", "a"])  # LRU now: b, d, c, a
    evicted = []
    for new in "efg":
        index.reserve_for_store(new)
        index.complete_store(new)
        evicted.append(next(k for k in "abcd" if not index.contains(k) and k not in evicted))
    assert evicted == ["b", "d", "c"] and index.contains("a") and not index.contains("x")


def test_ready_run_counts_the_hashes_every_group_holds_ready_up_to_the_first_gap():
    index = _filled(8, [(0, "a"), (1, "a"), (0, "b"), (1, "b"), (0, "c"), (0, "d"), (1, "d")])
    index.reserve_for_store((1, "c"))  # being stored: not ready
    assert index.ready_run([0, 1], ["a", "b", "c", "d"]) == 2
    assert index.ready_run([0], ["a", "b", "c", "d", "e"]) == 4
    assert index.ready_run([1], ["b", "a"]) == 2 and index.ready_run([1], ["x", "a"]) == 0
    assert index.ready_run([], ["x", "y"]) == 2  # no group to hold them: nothing stops the run


def test_ready_run_asks_every_hash_of_all_its_groups_however_they_are_given():
    """The groups are asked again for every hash: read once (a generator), only the first hash would be
    checked and every later one counted held, marking blocks used past a gap no hit reaches."""
    index = _filled(4, [(0, "a"), (1, "a"), (0, "b")])
    assert index.ready_run((group for group in (0, 1)), ["a", "b"]) == 1


def test_is_ready_and_contains_do_not_touch_recency():
    index = _filled(2, ["a", "b"])
    assert index.is_ready("a") and index.contains("a")
    index.reserve_for_store("c")
    assert not index.contains("a")


def test_complete_store_does_not_touch_recency_of_others():
    index = _filled(2, ["a"])
    index.reserve_for_store("b")
    index.complete_store("b")
    index.reserve_for_store("c")
    assert not index.contains("a") and index.contains("b")


# --- reserve ------------------------------------------------------------------------------------


def test_reserve_on_present_key_returns_none():
    index = HostIndex(4)
    slot = index.reserve_for_store("a")
    assert slot is not None
    assert index.reserve_for_store("a") is None  # pending
    index.complete_store("a")
    assert index.reserve_for_store("a") is None  # ready
    assert index.used_slots == 1
    assert _slots(index) == {"a": slot}
    # a failed re-reserve neither pins nor touches the entry: it can still be dropped
    assert index.drop(["a"]) == 1


def test_reserve_on_present_key_does_not_touch_recency():
    index = _filled(2, ["a", "b"])
    assert index.reserve_for_store("a") is None
    index.reserve_for_store("c")
    assert not index.contains("a") and index.contains("b")


def test_pending_store_is_pinned_and_not_ready():
    index = HostIndex(1)
    index.reserve_for_store("a")
    assert index.contains("a") and not index.is_ready("a")
    assert index.pin_for_load("a") is None  # nothing to load yet
    assert index.reserve_for_store("b") is None  # the only slot is being written
    assert index.contains("a") and index.evicted_total == 0


def test_pending_stores_are_never_evicted():
    index = HostIndex(3)
    index.reserve_for_store("p")  # oldest, but pending
    index.reserve_for_store("r")
    index.complete_store("r")
    index.reserve_for_store("q")
    index.complete_store("q")
    index.reserve_for_store("x")
    assert index.contains("p") and not index.contains("r") and index.contains("q")


def test_loaded_entries_are_never_evicted():
    index = _filled(3, ["a", "b", "c"])
    index.pin_for_load("a")
    index.pin_for_load("b")
    index.pin_for_load("b")  # pins count
    index.unpin("b")
    # only c is evictable (a, b pinned); a and b were touched, so c is oldest anyway:
    assert index.reserve_for_store("d") is not None
    assert not index.contains("c")
    index.complete_store("d")
    index.pin_for_load("d")
    assert index.reserve_for_store("e") is None  # a, b, d pinned
    assert all(index.contains(k) for k in "abd") and not index.contains("e")


def test_every_slot_pinned_reserve_returns_none():
    index = _filled(2, ["a", "b"])
    index.pin_for_load("a")
    index.reserve_for_store("c")  # evicts b
    assert not index.contains("b")
    before = (_slots(index), index.used_slots, index.evicted_total)
    assert index.reserve_for_store("d") is None  # a pinned by a load, c by its store
    assert (_slots(index), index.used_slots, index.evicted_total) == before
    index.unpin("a")
    assert index.reserve_for_store("d") == before[0]["a"]


def test_pinned_oldest_skipped_evicts_next():
    index = _filled(3, ["a", "b", "c"])
    index.pin_for_load("a")
    index.pin_for_load("c")  # LRU still: a, b, c  (a, c pinned)
    index.unpin("c")
    index.reserve_for_store("d")
    assert not index.contains("b")  # a pinned: the oldest unpinned is b
    index.complete_store("d")
    index.reserve_for_store("e")  # a pinned: next oldest unpinned is c
    assert index.contains("a") and not index.contains("c")


# --- complete / abort ---------------------------------------------------------------------------


def test_complete_store_makes_ready_and_unpins():
    index = HostIndex(1)
    index.reserve_for_store("a")
    index.complete_store("a")
    assert index.is_ready("a")
    assert index.pin_for_load("a") == 0
    index.unpin("a")
    assert index.reserve_for_store("b") == 0  # a was unpinned, so evictable
    assert index.evicted_total == 1


def test_abort_store_frees_slot():
    index = HostIndex(2)
    slot = index.reserve_for_store("a")
    index.abort_store("a")
    assert not index.contains("a") and index.used_slots == 0
    assert index.evicted_total == 0
    assert index.reserve_for_store("b") == slot  # the freed slot comes back first


def test_abort_store_ignores_ready_entries():
    index = _filled(2, ["a"])
    index.abort_store("a")
    assert index.is_ready("a") and index.used_slots == 1


def test_abort_then_reserve_again():
    index = HostIndex(1)
    index.reserve_for_store("a")
    index.abort_store("a")
    assert index.reserve_for_store("a") == 0
    index.complete_store("a")
    assert index.is_ready("a")


def test_rekey_moves_a_pending_store_to_its_real_key():
    index = HostIndex(2)
    slot = index.reserve_for_store("placeholder")
    assert index.rekey("placeholder", "a")
    assert not index.contains("placeholder") and index.contains("a") and not index.is_ready("a")
    index.complete_store("a")
    assert index.is_ready("a") and index.pin_for_load("a") == slot


def test_rekey_refuses_a_present_key_and_ready_entries():
    index = _filled(3, ["a"])
    index.reserve_for_store("placeholder")
    assert not index.rekey("placeholder", "a")  # stored already: the placeholder's store is a duplicate
    assert index.contains("placeholder") and index.is_ready("a")
    assert not index.rekey("a", "b")  # a ready entry keeps its key
    assert not index.rekey("missing", "b") and not index.contains("b")


# --- drop / clear -------------------------------------------------------------------------------


def test_drop_frees_unpinned_slots_and_forgets_one_a_load_reads_once_it_is_unpinned():
    """A dropped block is lost host data: one another load still reads must not be found by a later
    lookup (the retry would load it again), though its slot stays with that load until unpinned."""
    index = _filled(4, ["a", "b", "c"])
    index.pin_for_load("b")
    index.reserve_for_store("p")  # pending: pinned, its owner completes or aborts it
    assert index.drop(["a", "b", "p", "zz"]) == 1
    assert not index.contains("a")
    assert index.contains("b") and index.contains("p") and index.contains("c")
    assert not index.is_ready("b") and index.pin_for_load("b") is None
    assert index.why_absent("b") == "dropped" and index.why_absent("p") == "storing"
    assert index.used_slots == 3
    index.unpin("b")
    assert not index.contains("b") and index.used_slots == 2 and index.why_absent("b") == "dropped"
    index.complete_store("p")
    assert index.is_ready("p")
    assert index.evicted_total == 0  # drops are not evictions


def test_drop_accepts_generators_and_duplicates():
    index = _filled(3, ["a", "b"])
    assert index.drop(k for k in ["a", "a", "b"]) == 2
    assert index.used_slots == 0


def test_dropped_slot_is_reused_before_evicting():
    index = _filled(2, ["a", "b"])
    slot_b = _slots(index)["b"]
    index.drop(["b"])
    assert index.reserve_for_store("c") == slot_b
    assert index.contains("a") and index.evicted_total == 0


def test_clear_forgets_blocks_a_load_still_reads_and_frees_them_when_unpinned():
    index = _filled(4, ["a", "b", "c"])
    slot_a = index.pin_for_load("a")
    index.reserve_for_store("p")
    index.clear()
    # "a" is read by a load: its slot stays taken, but nothing finds it again
    assert sorted(_slots(index)) == ["a", "p"] and index.used_slots == 2
    assert not index.is_ready("a") and index.pin_for_load("a") is None
    assert index.reserve_for_store("a") is None  # not stored again while the old copy is read
    index.complete_store("a")
    index.abort_store("a")
    assert not index.is_ready("a") and index.used_slots == 2  # neither makes it ready nor frees it early
    index.unpin("a")
    assert not index.contains("a") and slot_a in index._free
    index.complete_store("p")  # "p" was reserved before the clear; its owner decides (see scheduler)
    index.clear()
    assert index.used_slots == 0 and not index.contains("p")
    # every slot usable again
    assert sorted(index.reserve_for_store(k) for k in "wxyz") == [0, 1, 2, 3]


def test_a_block_two_loads_read_when_the_tier_is_cleared_keeps_its_slot_until_both_are_done():
    """A cleared block frees its slot only with its last load's unpin: freed at the first, a store
    could overwrite the slot while the other load still copies from it (wrong KV loaded)."""
    index = _filled(2, ["a"])
    slot_a = index.pin_for_load("a")
    index.pin_for_load("a")
    index.clear()
    index.unpin("a")
    assert index.contains("a") and index.used_slots == 1 and slot_a not in index._free
    index.unpin("a")
    assert not index.contains("a") and index.used_slots == 0


def test_a_cleared_block_a_load_still_reads_keeps_its_key_until_that_load_unpins_it():
    """A block a reset forgot while a load reads it is no store's placeholder: moved to another key, the
    load's unpin (under the block's own key) would find nothing, and its slot would never be free again."""
    index = _filled(2, ["a"])
    slot_a = index.pin_for_load("a")
    index.clear()
    assert not index.rekey("a", "b") and not index.contains("b")
    index.unpin("a")
    assert not index.contains("a") and slot_a in index._free


def test_evicted_total_counts_only_evictions():
    index = _filled(2, ["a", "b"])
    for i, key in enumerate("cdef", start=1):
        index.reserve_for_store(key)
        index.complete_store(key)
        assert index.evicted_total == i
    index.drop(["e"])
    index.reserve_for_store("g")  # into the dropped slot
    index.abort_store("g")
    index.clear()
    assert index.evicted_total == 4


def test_unpin_never_goes_negative():
    index = _filled(1, ["a"])
    index.unpin("a")
    index.unpin("a")
    index.pin_for_load("a")
    assert index.reserve_for_store("b") is None  # still pinned once
    index.unpin("a")
    assert index.reserve_for_store("b") == 0


def test_a_store_unpinned_before_it_completes_is_ready_unpinned_not_negatively_pinned():
    """Completing releases the store's pin once: taken already, nothing is left to release, and a
    negative count would let the next load's pin leave the entry evictable while read."""
    index = HostIndex(1)
    index.reserve_for_store("a")
    index.unpin("a")
    index.complete_store("a")
    index.pin_for_load("a")
    assert index.reserve_for_store("b") is None and index.contains("a")


def test_the_journal_records_what_becomes_ready_and_what_leaves_the_tier_in_order():
    index = HostIndex(2)
    assert index.journal is None  # off unless asked for: nothing recorded
    index.journal = journal = []
    index.reserve_for_store("a")
    index.complete_store("a", "described a")
    index.reserve_for_store("b")
    index.abort_store("b")  # never ready: nothing to announce
    index.reserve_for_store("c")
    index.complete_store("c", None)
    index.reserve_for_store("d")  # evicts "a"
    index.complete_store("d")
    index.pin_for_load("c")
    index.drop(["d", "c"])  # "c" is pinned: stays
    index.clear()  # "c" leaves the tier now, though its slot waits for the load
    index.unpin("c")
    assert journal == [(JOURNAL_STORED, "a", "described a"), (JOURNAL_STORED, "c", None),
                       (JOURNAL_REMOVED, "a", None), (JOURNAL_STORED, "d", None),
                       (JOURNAL_REMOVED, "d", None), (JOURNAL_REMOVED, "c", None)]


# --- stateful: random operation sequences against a model ---------------------------------------


def test_why_absent_tells_how_a_key_left_and_forgets_the_oldest_past_as_many_as_slots():
    index = _filled(2, ["a", "b"])
    assert index.why_absent("a") is None and index.why_absent("x") == "new"
    index.reserve_for_store("c")  # evicts a
    assert index.why_absent("a") == "evicted" and index.why_absent("c") == "storing"
    index.complete_store("c")
    index.drop(["b"])
    assert index.why_absent("b") == "dropped"
    assert index.pin_for_load("c") is not None
    index.clear()
    assert index.why_absent("c") == "reset"  # still read by a load: stale
    index.unpin("c")
    assert index.why_absent("c") == "reset" and index.why_absent("b") == "dropped"
    assert index.why_absent("a") == "new"  # the third to leave a 2-slot tier: forgotten
    index.reserve_for_store("b")
    assert index.why_absent("b") == "storing"
    index.abort_store("b")
    assert index.why_absent("b") == "dropped"  # a store given up: still how it last left
    index.reserve_for_store("b")
    index.complete_store("b")
    index.drop(["b"], "reset")
    assert index.why_absent("b") == "reset"
    index.reserve_for_store("d")
    index.complete_store("d")
    index.clear()  # no load reads "d": it leaves at once, forgotten by the reset (not dropped)
    assert index.why_absent("d") == "reset" and not index.contains("d")


def test_a_key_stored_again_leaves_the_past_and_is_remembered_as_its_latest_departure():
    """Once stored again a key is forgotten by the miss reasons (`why_absent`); when it leaves again it
    is the newest departure, not kept at its first one's place and forgotten before older keys."""
    index = _filled(2, ["a", "b"])
    index.reserve_for_store("c")  # evicts a
    index.complete_store("c")
    index.reserve_for_store("a")  # evicts b; a is back
    index.complete_store("a")
    index.drop(["a"])  # leaves again: after b
    for key in "de":  # d into a's slot, e evicts c: the third to leave a 2-slot tier, b (the oldest) forgotten
        index.reserve_for_store(key)
        index.complete_store(key)
    assert index.why_absent("a") == "dropped" and index.why_absent("c") == "evicted"
    assert index.why_absent("b") == "new"


class HostIndexMachine(RuleBasedStateMachine):
    """Model: key -> (slot, ready, pins) plus LRU order (oldest first)."""

    keys = Bundle("keys")

    def __init__(self):
        super().__init__()
        self.n = 0
        self.index: HostIndex | None = None
        self.model: dict = {}  # key -> [slot, ready, pins, stale: why it left while a load read it, or None]
        self.order: list = []  # LRU, oldest first
        self.evicted = 0
        self.ever_completed: set = set()
        self.gone: dict = {}  # key -> why it left the tier (oldest first, as many as slots)

    @precondition(lambda self: self.index is None)
    @rule(n=st.integers(1, 5))
    def start(self, n):
        self.n = n
        self.index = HostIndex(n)
        self.index.journal = []  # KV cache events on: the journal must replay to the ready entries
        self.announced: set = set()

    @rule(target=keys, key=st.integers(0, 9))
    def new_key(self, key):
        return key

    def _left(self, key, reason):
        self.gone[key] = reason
        if len(self.gone) > self.n:
            del self.gone[next(iter(self.gone))]

    def _pinned(self):
        return {k for k, (_, _, pins, _) in self.model.items() if pins > 0}

    @precondition(lambda self: self.index is not None)
    @rule(key=keys)
    def reserve(self, key):
        pinned_before = {k: self.model[k][0] for k in self._pinned()}
        slot = self.index.reserve_for_store(key)
        if key in self.model:
            assert slot is None
            return
        if len(self.model) < self.n:
            assert slot is not None
            assert slot not in {s for s, _, _, _ in self.model.values()}
        else:
            victims = [k for k in self.order if self.model[k][1] and self.model[k][2] == 0]
            if not victims:
                assert slot is None
                return
            victim = victims[0]
            assert slot == self.model[victim][0]
            del self.model[victim]
            # the held entries the eviction walked past go behind the rest, in their order
            walked_past = self.order[: self.order.index(victim)]
            self.order = self.order[len(walked_past) + 1 :] + walked_past
            self.evicted += 1
            self._left(victim, "evicted")
        assert 0 <= slot < self.n
        self.model[key] = [slot, False, 1, None]
        self.order.append(key)
        for k, s in pinned_before.items():  # pinned entries survive, in their slots
            assert self.index.contains(k) and k in self.model and self.model[k][0] == s

    @precondition(lambda self: self.index is not None)
    @rule(key=keys)
    def complete(self, key):
        self.index.complete_store(key)
        if key in self.model and not self.model[key][1] and not self.model[key][3]:  # the store's pin, once
            entry = self.model[key]
            entry[1] = True
            entry[2] = max(0, entry[2] - 1)
            self.ever_completed.add(key)
            self.gone.pop(key, None)

    @precondition(lambda self: self.index is not None)
    @rule(key=keys)
    def abort(self, key):
        self.index.abort_store(key)
        if key in self.model and not self.model[key][1] and not self.model[key][3]:
            del self.model[key]
            self.order.remove(key)

    @precondition(lambda self: self.index is not None)
    @rule(old=keys, new=keys)
    def rekey(self, old, new):
        moved = self.index.rekey(old, new)
        expected = old in self.model and not self.model[old][1] and not self.model[old][3] and new not in self.model
        assert moved == expected
        if moved:  # the entry keeps its slot and pins, and becomes the most recent
            self.model[new] = self.model.pop(old)
            self.order.remove(old)
            self.order.append(new)

    @precondition(lambda self: self.index is not None)
    @rule(key=keys)
    def pin(self, key):
        slot = self.index.pin_for_load(key)
        if key in self.model and self.model[key][1]:
            assert slot == self.model[key][0]
            self.model[key][2] += 1
        else:
            assert slot is None

    @precondition(lambda self: self.index is not None)
    @rule(ks=st.lists(keys, max_size=4))
    def touch(self, ks):
        self.index.touch(ks)
        for k in ks:  # present entries, in the order given: the last is the most recent
            if k in self.model:
                self.order.remove(k)
                self.order.append(k)

    @precondition(lambda self: self.index is not None)
    @rule(key=keys)
    def unpin(self, key):
        self.index.unpin(key)
        if key in self.model and self.model[key][2] > 0:
            self.model[key][2] -= 1
            if self.model[key][3] and self.model[key][2] == 0:  # forgotten by a drop or clear: freed now
                self._left(key, self.model[key][3])
                del self.model[key]
                self.order.remove(key)

    @precondition(lambda self: self.index is not None)
    @rule(ks=st.lists(keys, max_size=4))
    def drop(self, ks):
        dropped = self.index.drop(ks)
        expected = 0
        for k in ks:
            if k in self.model and self.model[k][2] == 0:
                if self.model[k][1]:
                    self._left(k, "dropped")
                del self.model[k]
                self.order.remove(k)
                expected += 1
            elif k in self.model and self.model[k][1]:  # read by a load: forgotten, its slot kept until unpinned
                self.model[k][1], self.model[k][3] = False, "dropped"
        assert dropped == expected

    @precondition(lambda self: self.index is not None)
    @rule()
    def clear(self):
        pinned = self._pinned()
        self.index.clear()
        for k in list(self.model):
            if k not in pinned:
                if self.model[k][1]:
                    self._left(k, "reset")
                del self.model[k]
                self.order.remove(k)
            elif self.model[k][1]:  # read by a load: forgotten, its slot kept until unpinned
                self.model[k][1], self.model[k][3] = False, "reset"
        assert all(self.index.contains(k) for k in pinned)
        assert not any(self.index.is_ready(k) for k in pinned)

    @invariant()
    def matches_model(self):
        if self.index is None:
            return
        index = self.index
        assert index.used_slots <= index.num_slots
        assert len(index._free) + index.used_slots == index.num_slots
        assert index.used_slots == len(self.model)
        slots = [e.slot for e in index._entries.values()]
        assert len(slots) == len(set(slots))
        assert set(slots).isdisjoint(index._free)
        assert set(slots) | set(index._free) == set(range(index.num_slots))
        assert list(index._entries) == self.order
        for k, (slot, ready, pins, stale) in self.model.items():
            entry = index._entries[k]
            assert (entry.slot, entry.ready, entry.pins, entry.stale) == (slot, ready, pins, stale)
            assert index.is_ready(k) == ready
            if ready:
                assert k in self.ever_completed
        assert index.evicted_total == self.evicted
        for k in range(10):  # what a lookup missing the key is told (`miss_reasons`)
            if k in self.model:
                _, ready, _, stale = self.model[k]
                expected = None if ready else stale or "storing"
            else:
                expected = self.gone.get(k, "new")
            assert index.why_absent(k) == expected, k
        for kind, key, _ in index.journal:  # what a router replaying the tier's events would hold
            if kind is JOURNAL_STORED:
                assert key not in self.announced
                self.announced.add(key)
            else:
                assert kind is JOURNAL_REMOVED
                self.announced.remove(key)
        index.journal.clear()
        assert self.announced == {k for k, (_, ready, _, _) in self.model.items() if ready}


HostIndexMachine.TestCase.settings = settings(
    max_examples=600, stateful_step_count=40, deadline=None
)
test_host_index_stateful = HostIndexMachine.TestCase


class _CountingEntries(OrderedDict):
    """The index's entries, counting how many an eviction's walk visits."""

    visited = 0

    def items(self):
        for item in super().items():
            self.visited += 1
            yield item


def _counting(index: HostIndex) -> _CountingEntries:
    index._entries = _CountingEntries(index._entries)
    return index._entries


def test_evictions_do_not_walk_again_past_the_entries_stores_and_loads_hold():
    """1,000 long-running fillings at the head of a full tier: every reservation walked past all of
    them (O(held) each); they now go behind the rest once walked past."""
    index = HostIndex(2000)
    for i in range(1000):
        index.reserve_for_store(("filling", i))
    for i in range(1000):
        index.reserve_for_store(("old", i))
        index.complete_store(("old", i))
    entries = _counting(index)
    for i in range(100):
        assert index.reserve_for_store(("new", i)) is not None
    assert entries.visited < 1000 + 2 * 100
    assert [k for k in entries if k[0] == "old"][:3] == [("old", 100), ("old", 101), ("old", 102)]  # LRU kept
    assert all(("filling", i) in entries for i in range(1000))


def test_a_tier_all_held_is_not_walked_again_until_something_is_released():
    index = HostIndex(500)
    for i in range(500):
        index.reserve_for_store(("filling", i))
    entries = _counting(index)
    assert index.reserve_for_store("a") is None
    assert index.reserve_for_store("b") is None
    assert entries.visited == 500  # one walk
    index.complete_store(("filling", 7))
    assert index.reserve_for_store("c") is not None and not index.contains(("filling", 7))


def test_a_tier_found_all_held_evicts_again_once_a_load_unpins_and_a_store_completes():
    """Both releases after a walk that found nothing to evict count: if one undid the other, the tier would
    refuse every store though two of its entries are evictable."""
    index = _filled(2, ["a"])
    index.pin_for_load("a")
    index.reserve_for_store("b")  # the tier is all held: a load reads "a", a store fills "b"
    assert index.reserve_for_store("c") is None
    index.unpin("a")
    index.complete_store("b")
    assert index.reserve_for_store("c") is not None and not index.contains("a")


def test_held_entries_an_eviction_walks_past_go_behind_the_rest_before_the_new_entry():
    """The order CI's stateful run found the model lacked: a filling entry walked past moves behind
    the ready ones, and the new reservation is the most recent."""
    index = HostIndex(3)
    index.reserve_for_store(0)
    index.complete_store(0)
    index.reserve_for_store(1)  # filling: held
    index.touch([0])
    index.reserve_for_store(3)
    assert list(index._entries) == [1, 0, 3]
    index.reserve_for_store(2)  # evicts 0, walking past 1
    assert list(index._entries) == [3, 1, 2]


def test_a_block_dropped_while_a_load_reads_it_takes_no_place_among_the_departed_until_it_is_freed():
    """The tier remembers as many departed keys as it has slots: a stale entry still held by a load is not gone
    yet, and remembering it early pushed the oldest departure out (its next lookup said "new", not "evicted")."""
    index = HostIndex(1)  # remembers 1 departed key
    assert index.reserve_for_store("x") == 0
    index.complete_store("x")
    assert index.reserve_for_store("a") == 0  # evicts x
    index.complete_store("a")
    assert index.pin_for_load("a") == 0
    assert index.drop(["a"]) == 0  # read by a load: stale, not yet gone
    assert index.why_absent("x") == "evicted"
    assert index.why_absent("a") == "dropped"
    index.unpin("a")
    assert index.why_absent("a") == "dropped" and index.why_absent("x") == "new"
