"""KV cache events of the host tier, for KV-aware routers (vLLM's `--kv-events-config`).

vLLM publishes its device blocks' events (medium "GPU"). With events on, the connector's
`take_events` adds the host tier's (medium "CPU"), on the same stream: a `BlockStored` once an
offloaded block is stored on every worker, a `BlockRemoved` once it leaves the tier (evicted,
dropped after a failed copy, a cache reset). A router can then tell a prefix this engine loads
from host memory from one it must compute.

Each offloaded block is described as vLLM describes the device blocks it spans: their hashes at
the group's device block size, the parent hash, their token ids, the block size, LoRA and extra
keys, and the group with its kind (as vLLM's own offloading connector announces its CPU blocks),
so a router matches them with the device events of the same prefix. The description is taken
while the request is at hand (when the block gets its key, `describe`); its token ids are kept
only until the store event is out, its hashes until the removal event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from .groups import GroupLayout
from .host_store import JOURNAL_STORED

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Announcement:
    """A stored offloaded block as its `BlockStored` event will describe it."""

    group: int
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list | None
    session_id: str | None


class HostTierEvents:
    """Describes offloaded blocks while their request is at hand, and turns the host index's journal
    (`HostIndex.journal`) into vLLM's KV cache events."""

    def __init__(self, layouts: list[GroupLayout], kv_cache_groups, offload_block_size: int, hash_block_size: int):
        self.layouts = layouts
        self.offload_block_size = offload_block_size
        self.hash_block_size = hash_block_size
        # per group: (kind, sliding window), as vLLM's offloading connector puts them on its events
        self.group_specs = [(get_kv_cache_spec_kind(group.kv_cache_spec).value,
                             get_kv_cache_spec_sliding_window(group.kv_cache_spec)) for group in kv_cache_groups]
        self._announced: dict = {}  # host key -> (group, block hashes) of a block announced stored
        self._failure_logged = False

    def describe(self, request, group: int, block_index: int) -> Announcement | None:
        """The description of the request's offloaded block `block_index` in `group` (its key exists);
        None if it cannot be described (logged once): the block is then stored unannounced."""
        try:
            return self._describe(request, group, block_index)
        except Exception:  # a router missing one block must never cost a store, let alone the engine
            if not self._failure_logged:
                self._failure_logged = True
                logger.exception("kvscope: could not describe an offloaded block for KV cache events; such "
                                 "blocks are stored unannounced (further failures are not logged)")
            return None

    def _describe(self, request, group: int, block_index: int) -> Announcement:
        block_size = self.layouts[group].block_size
        per_block = self.offload_block_size // block_size
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        first = block_index * per_block
        block_hashes = [maybe_convert_block_hash(hashes[i]) for i in range(first, first + per_block)]
        parent = maybe_convert_block_hash(hashes[first - 1]) if first else None
        extra_keys, mm_index = [], 0
        for i in range(first, first + per_block):
            keys, mm_index = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_index)
            extra_keys.append(keys)
        start = block_index * self.offload_block_size
        lora = request.lora_request
        return Announcement(
            group=group,
            block_hashes=block_hashes,
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[start:start + self.offload_block_size]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            session_id=getattr(request, "session_id", None),
        )

    def take(self, journal: list) -> list[KVCacheEvent]:
        """The events of the journal's entries, in order (the journal is emptied). A removal follows
        only a block announced stored. Removals of one group with no store between them make one
        event (a reset removes the whole tier); a store ends them, so a block removed and stored
        again is announced in that order."""
        events: list[KVCacheEvent] = []
        announced = self._announced
        removals: dict[int, list] = {}  # group -> the hashes of its open removal event
        for stored, key, announcement in journal:
            if stored is JOURNAL_STORED:
                if announcement is None:
                    continue
                removals.clear()
                kind, window = self.group_specs[announcement.group]
                events.append(BlockStored(
                    block_hashes=announcement.block_hashes,
                    parent_block_hash=announcement.parent_block_hash,
                    token_ids=announcement.token_ids,
                    block_size=announcement.block_size,
                    lora_id=announcement.lora_id,
                    medium=MEDIUM_CPU,
                    lora_name=announcement.lora_name,
                    extra_keys=announcement.extra_keys,
                    group_idx=announcement.group,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                    session_id=announcement.session_id,
                ))
                announced[key] = (announcement.group, announcement.block_hashes)
                continue
            entry = announced.pop(key, None)
            if entry is None:
                continue
            group, hashes = entry
            open_event = removals.get(group)
            if open_event is not None:
                open_event.extend(hashes)  # the list of that event: it grows in place
            else:
                removals[group] = open_event = list(hashes)
                events.append(BlockRemoved(block_hashes=open_event, medium=MEDIUM_CPU, group_idx=group))
        journal.clear()
        return events
