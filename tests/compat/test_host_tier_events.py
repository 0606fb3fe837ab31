"""The host tier's KV cache events (`connector/host_tier_events.py`) under vLLM's own scheduler, as a
KV-aware router receives them: vLLM publishes them with its device blocks' events."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from connector.host_store import JOURNAL_REMOVED, JOURNAL_STORED
from connector.host_tier_events import Announcement, HostTierEvents
from connector.tiny_models import build_model
from tests.compat.kv_event_views import announced_blocks, host_blocks_unlike_device, router_view, tier_blocks
from tests.compat.model_free import ModelFreeEngine

WINDOW = 64


@pytest.fixture(scope="module")
def model_path() -> str:
    return build_model("gemma3", window=WINDOW)


def _prompts(n: int = 4, offset: int = 0) -> list[list[int]]:
    shared = [(31 * i + 3) % 509 + 1 for i in range(300)]
    return [shared + [(17 * i + 11 * j + 5) % 509 + 1 for i in range(150 + 97 * j)] for j in range(offset, offset + n)]


def _run(engine: ModelFreeEngine, prompts, tag: str, max_tokens: int = 20, salts=None) -> None:
    for j, prompt in enumerate(prompts):
        engine.add(f"{tag}-{j}", prompt, max_tokens, cache_salt=salts[j] if salts else None)
    engine.run()


def _tier(engine: ModelFreeEngine) -> set:
    return tier_blocks(engine.scheduler.get_kv_connector()._scheduler.index)


@pytest.mark.parametrize("block_size, max_num_batched_tokens", [(64, 2048), (64, 100), (128, 64)])
def test_host_blocks_are_announced_as_vllm_announces_the_device_blocks_of_the_same_tokens(
        model_path, block_size, max_num_batched_tokens):
    """A router matches the host tier's blocks with the device's: every hash the tier announces is one
    vLLM announced for a device block, with the same parent and token ids (prompt and output tokens,
    chunked prefills included), each offloaded block as its device-sized blocks, in its own group."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": block_size}, window=WINDOW,
                             max_num_batched_tokens=max_num_batched_tokens, kv_events=True)
    try:
        # blocks completed by output tokens get their key late; a tenant's salt is in its first block's key
        _run(engine, _prompts() * 2, "r0", max_tokens=100, salts=[None] * 4 + ["tenant"] * 4)
        events = engine.published_events
        host = [e for e in events if getattr(e, "medium", None) == "CPU"]
        assert host and all(isinstance(e, BlockStored) for e in host)
        kinds = {0: ("sliding_window", WINDOW), 1: ("full_attention", None)}
        for event in host:
            assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == kinds[event.group_idx]
            assert event.block_size == 16 and len(event.block_hashes) == block_size // 16
            assert len(event.token_ids) == block_size
        checked, unlike = host_blocks_unlike_device(events)
        assert checked == len(host) * block_size // 16 and unlike == []
        assert {e.group_idx for e in host} == {0, 1}
        salted = [e for e in host if e.extra_keys and e.extra_keys[0] == ("tenant",)]
        assert salted and all(e.parent_block_hash is None for e in salted)  # the salt keys a prompt's first block
        assert {(g, hashes[-1]) for g, hashes in
                ((e.group_idx, e.block_hashes) for e in host)} == _tier(engine)
    finally:
        engine.shutdown()


def test_the_events_track_the_host_tier_through_evictions_and_a_reset(model_path):
    """With a tier of 12 offloaded blocks, later prompts evict earlier blocks: the router's view built
    from the events alone is the tier after every round; a reset of the tier (vLLM's
    `reset_prefix_cache(reset_connector=True)`) removes all of it, published with the next step (an idle
    engine stays idle)."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 12 * 32768, "block_size": 64}, window=WINDOW,
                             kv_events=True)
    sched = engine.scheduler.get_kv_connector()._scheduler
    try:
        for round_ in range(3):
            _run(engine, _prompts(2, offset=2 * round_), f"r{round_}")
            assert announced_blocks(engine.published_events, [4, 4]) == _tier(engine)
            view = router_view(engine.published_events)
            assert sum(view.values()) == 4 * len(_tier(engine)), "each offloaded block is 4 device blocks"
        assert sched.index.evicted_total > 0
        assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in engine.published_events)
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        before = len(engine.published_events)
        assert not engine.scheduler.has_requests(), "an idle engine stays idle (vLLM can release its memory)"
        engine.step_once()  # the next request's first step publishes them
        assert router_view(engine.published_events) == Counter() and not _tier(engine)
        removals = [e for e in engine.published_events[before:] if getattr(e, "medium", None) == "CPU"]
        assert all(isinstance(e, BlockRemoved) for e in removals)
        assert sorted(e.group_idx for e in removals) == [0, 1], "a reset removes the tier in one event per group"
    finally:
        engine.shutdown()


def test_without_kv_events_nothing_is_described_or_recorded(model_path):
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW)
    connector = engine.scheduler.get_kv_connector()
    try:
        _run(engine, _prompts(2), "r0")
        sched = connector._scheduler
        assert sched.host_events is None and sched.index.journal is None and sched.stores.describe is None
        assert sched.index.used_slots > 0 and list(connector.take_events()) == []
    finally:
        engine.shutdown()


# ---- `HostTierEvents.take` on journals no workload above makes in one step ----

def _events_of(journal) -> tuple[list, HostTierEvents]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    from connector.groups import GroupKind, GroupLayout

    specs = [SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=64),
             FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)]
    layouts = [GroupLayout(0, GroupKind.SLIDING_WINDOW, 16, 64), GroupLayout(1, GroupKind.FULL_ATTENTION, 16, None)]
    events = HostTierEvents(layouts, [KVCacheGroupSpec([f"l{g}"], spec) for g, spec in enumerate(specs)], 32, 16)
    return events.take(journal), events


def _announcement(group: int, name: str) -> Announcement:
    return Announcement(group=group, block_hashes=[f"{name}0", f"{name}1"], parent_block_hash=None,
                        token_ids=list(range(32)), block_size=16, lora_id=None, lora_name=None, extra_keys=None,
                        session_id=None)


def _summary(events) -> list[tuple]:
    return [(type(e).__name__, e.group_idx, tuple(e.block_hashes)) for e in events]


def test_a_block_stored_and_removed_in_one_step_is_announced_in_that_order():
    journal = [(JOURNAL_REMOVED, (1, "x"), None),  # never announced: no event
               (JOURNAL_STORED, (1, "a"), _announcement(1, "a")), (JOURNAL_REMOVED, (1, "a"), None),
               (JOURNAL_STORED, (1, "a"), _announcement(1, "a"))]
    events, tracker = _events_of(journal)
    assert _summary(events) == [("BlockStored", 1, ("a0", "a1")), ("BlockRemoved", 1, ("a0", "a1")),
                                ("BlockStored", 1, ("a0", "a1"))]
    assert events[0].medium == "CPU" and events[0].kv_cache_spec_kind == "full_attention"
    assert journal == [] and tracker.take([(JOURNAL_REMOVED, (1, "a"), None)])  # still announced: removable


def test_removals_merge_per_group_until_a_store_comes_between():
    blocks = ((0, "a"), (1, "b"), (0, "c"), (1, "d"))
    stored = [(JOURNAL_STORED, (g, name), _announcement(g, name)) for g, name in blocks]
    journal = [*stored, (JOURNAL_REMOVED, (0, "a"), None), (JOURNAL_REMOVED, (1, "b"), None),
               (JOURNAL_REMOVED, (0, "c"), None), (JOURNAL_STORED, (0, "e"), _announcement(0, "e")),
               (JOURNAL_REMOVED, (1, "d"), None)]
    events, _ = _events_of(journal)
    assert _summary(events)[4:] == [("BlockRemoved", 0, ("a0", "a1", "c0", "c1")), ("BlockRemoved", 1, ("b0", "b1")),
                                    ("BlockStored", 0, ("e0", "e1")), ("BlockRemoved", 1, ("d0", "d1"))]


def test_a_block_stored_undescribed_is_neither_announced_nor_removed():
    events, _ = _events_of([(JOURNAL_STORED, (0, "u"), None), (JOURNAL_REMOVED, (0, "u"), None)])
    assert events == []


def test_a_block_that_cannot_be_described_is_stored_unannounced_and_logged_once(caplog):
    """Describing is for routers: a failure must cost neither the store nor the engine's step."""
    _, tracker = _events_of([])
    assert tracker.describe(object(), 0, 0) is None and tracker.describe(object(), 1, 0) is None
    assert caplog.text.count("could not describe an offloaded block") == 1


def test_a_block_holding_images_is_announced_with_their_extra_keys_per_device_block():
    """As vLLM keys its device blocks: each image in the block it overlaps, at its offset from that
    block's start (a router keys the same tokens with another image apart by them)."""
    images = [SimpleNamespace(identifier=name, mm_position=SimpleNamespace(offset=offset, length=length))
              for name, offset, length in [("A", 4, 4), ("B", 20, 20)]]
    request = SimpleNamespace(block_hashes=[b"h%d" % i for i in range(4)], all_token_ids=list(range(64)),
                              mm_features=images, lora_request=None, cache_salt=None, prompt_embeds=None)
    _, tracker = _events_of([])
    assert tracker.describe(request, 1, 0).extra_keys == [(("A", 4),), (("B", 4),)]
    assert tracker.describe(request, 1, 1).extra_keys == [(("B", -12),), None]


def test_a_block_stored_undescribed_leaves_the_later_entries_announced():
    """A block whose description failed is skipped, not the end of the journal: the rest still goes out."""
    events, _ = _events_of([(JOURNAL_STORED, (0, "u"), None), (JOURNAL_STORED, (0, "a"), _announcement(0, "a"))])
    assert _summary(events) == [("BlockStored", 0, ("a0", "a1"))]


def test_a_removed_block_is_forgotten_once_its_removal_is_out():
    """A block's hashes are kept only until its removal event: kept after it, they would grow with every
    block the tier ever held, and a later removal of the same key would be announced again."""
    journal = [(JOURNAL_STORED, (0, "a"), _announcement(0, "a")), (JOURNAL_REMOVED, (0, "a"), None)]
    events, tracker = _events_of(journal)
    assert _summary(events) == [("BlockStored", 0, ("a0", "a1")), ("BlockRemoved", 0, ("a0", "a1"))]
    assert tracker.take([(JOURNAL_REMOVED, (0, "a"), None)]) == []


def test_a_lora_requests_block_is_announced_with_its_adapter_and_session_as_vllm_announces_device_blocks():
    """vLLM puts the request's adapter (id and name) and streaming session on each device block's event: a
    router that keys blocks by them must find the host copy of the same tokens under the same ones."""
    lora = SimpleNamespace(adapter_id=3, name="sql", lora_name="sql", lora_path="sql-adapter")
    request = SimpleNamespace(block_hashes=[b"h%d" % i for i in range(4)], all_token_ids=list(range(64)),
                              mm_features=[], lora_request=lora, cache_salt=None, prompt_embeds=None,
                              session_id="chat-1")
    _, tracker = _events_of([])
    (event,) = tracker.take([(JOURNAL_STORED, (1, b"h1"), tracker.describe(request, 1, 0))])
    assert (event.lora_id, event.lora_name, event.session_id) == (3, "sql", "chat-1")
