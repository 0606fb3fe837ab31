"""What a KV-aware router learns from vLLM's KV cache events (the device's and the host tier's)."""

from __future__ import annotations

from collections import Counter

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash


def device_blocks(events) -> dict:
    """hash -> (parent hash, token ids, extra keys, LoRA) of every device block vLLM announced. A block's
    hash is a function of its prefix alone, the same in every group; vLLM's events of a sliding-window
    group skip the blocks already out of the window but keep their tokens (one hash over several blocks'
    tokens), so only events whose tokens line up with their hashes are read."""
    blocks = {}
    for event in events:
        if not (isinstance(event, BlockStored) and event.medium == "GPU"):
            continue
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            continue
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            blocks[block_hash] = _described(event, i, parent)
            parent = block_hash
    return blocks


def _described(event: BlockStored, i: int, parent) -> tuple:
    """What an event says of its `i`-th block: parent hash, token ids, extra keys (cache salt, LoRA, media)."""
    tokens = tuple(event.token_ids[i * event.block_size:(i + 1) * event.block_size])
    extra_keys = event.extra_keys[i] if event.extra_keys else None
    return parent, tokens, extra_keys, event.lora_name


def router_view(events) -> Counter:
    """What a router learns of the host tier from the events: (group, hash) of every device-sized block it
    holds (a count: a block announced twice is removed twice)."""
    view: Counter = Counter()
    for event in events:
        if getattr(event, "medium", None) != "CPU":  # vLLM's device events, its AllBlocksCleared
            continue
        for block_hash in event.block_hashes:
            if isinstance(event, BlockStored):
                view[(event.group_idx, block_hash)] += 1
            else:
                assert view[(event.group_idx, block_hash)] > 0, "a removal of a block never announced"
                view[(event.group_idx, block_hash)] -= 1
    return +view


def tier_blocks(index) -> set:
    """(group, last hash as events carry it) of every offloaded block ready in the host index (`HostIndex`)."""
    return {(group, maybe_convert_block_hash(block_hash))
            for (group, block_hash), entry in index._entries.items() if entry.ready}


def announced_blocks(events, hashes_per_block: list[int]) -> set:
    """(group, last hash) of each offloaded block the host tier's events leave announced (`hashes_per_block`:
    device-sized blocks per offloaded block, by group; a removal lists its blocks' hashes one block after
    the other). Raises AssertionError when a block is announced twice or removed unannounced."""
    blocks: Counter = Counter()
    for event in events:
        if getattr(event, "medium", None) != "CPU":
            continue
        step = hashes_per_block[event.group_idx]
        for end in event.block_hashes[step - 1::step]:
            blocks[(event.group_idx, end)] += 1 if isinstance(event, BlockStored) else -1
            assert blocks[(event.group_idx, end)] in (0, 1), f"block {(event.group_idx, end)} announced wrong"
    return {block for block, count in blocks.items() if count}


def host_blocks_unlike_device(events) -> tuple[int, list[str]]:
    """(device-sized blocks the host tier announced, those of them unlike what vLLM announced for its device
    blocks: a hash it never announced, or another parent, token ids, extra keys or LoRA)."""
    device = device_blocks(events)
    checked, unlike = 0, []
    for event in events:
        if not (isinstance(event, BlockStored) and event.medium == "CPU"):
            continue
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            checked += 1
            if device.get(block_hash) != _described(event, i, parent):
                unlike.append(f"group {event.group_idx} block {i} of {event}")
            parent = block_hash
    return checked, unlike
