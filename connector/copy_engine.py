"""Block copies between the device KV cache and the host tier, for any vLLM KV layout.

Every layer's cache is viewed as raw bytes, one row per device block: `(num_blocks, page)`
with the engine's own block stride (vLLM's kernel-block grouping resolves the layout).
Attention pages and raw Mamba pages (int8, padded, strided) are copied byte-exactly the
same way. A host slot holds, for each layer of one group, `factor` consecutive pages.

CPU backend: plain synchronous tensor copies. CUDA: pinned host memory (`host_memory`), a stream
for loads and one for stores, events for completion and timing (`event_clock`), no device-wide
synchronisation, and a group's blocks (every layer of it) in one call of vLLM's own
`swap_blocks_batch` (cuMemcpyBatchAsync on CUDA 12.8+), one call per group of a job, instead of a
`copy_` per block and layer, several microseconds of host time each.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.v1.kv_cache_interface import KVCacheConfig, group_kernel_blocks

from .event_clock import EventClock
from .host_memory import HostBuffer
from .telemetry.failures import telemetry_failed
from .vllm_layout import SlotLayout

logger = logging.getLogger(__name__)


class CopyError(RuntimeError):
    """A copy that did not (or must not) happen; the load is failed and vLLM recomputes."""


def page_view(cache: torch.Tensor | list | tuple, num_blocks: int, page_bytes: int) -> torch.Tensor:
    """`(num_blocks, page_bytes)` int8 view of one layer's cache with blocks as rows."""
    states = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    refs = [group_kernel_blocks(t, num_blocks) for t in states]
    ref = refs[0]
    storage = ref.untyped_storage()
    stride = ref.stride(0) * ref.element_size()
    # Mamba: several state tensors (conv, ssm) view one raw page per block; the page starts at
    # the lowest of their offsets and every state must lie inside it, or we would copy bytes of
    # a neighbouring block.
    offset = min(r.storage_offset() * r.element_size() for r in refs)
    for r in refs:
        start = r.storage_offset() * r.element_size() - offset
        if r.untyped_storage().data_ptr() != storage.data_ptr() or r.stride(0) * r.element_size() != stride:
            raise CopyError("state tensors of one layer do not share one paged storage")
        end = start + _span_bytes(r[0])
        if end > page_bytes:
            raise CopyError(f"a state reaching {end} B into the block exceeds the page ({page_bytes} B)")
    if stride < page_bytes and num_blocks > 1:
        raise CopyError(f"block stride {stride} B is smaller than the page ({page_bytes} B)")
    if offset + (num_blocks - 1) * stride + page_bytes > storage.nbytes():
        raise CopyError("KV cache page view would run past its storage; layout not understood")
    view = torch.tensor([], dtype=torch.int8, device=ref.device)
    return view.set_(storage, offset, (num_blocks, page_bytes), (stride, 1))


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first to its last element, following its strides (gaps included)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


@dataclass(slots=True)
class CopyResult:
    nbytes: int
    blocks: int
    start_ns: int | None  # wall clock (time.time_ns) of the measured copy interval; None: not measured
    end_ns: int | None
    # CUDA: its (start, end) events while the copy may run (times are 0 until `poll` reads them); None once
    # complete, and on the CPU backend from the start
    pending_events: object | None = None
    keep_alive: object | None = None  # what the device reads until the copy is done (pointer arrays)


@dataclass
class _Region:
    view: torch.Tensor  # (num_blocks, page) int8 on the device
    host: torch.Tensor  # (num_slots, factor, page) int8 on the host
    page: int
    # host[:, sub] per sub-block, made once: one `select` per copied block instead of `host[slot, sub]`'s
    # two, about a microsecond each (the fixed cost that bounds single-block copies)
    host_by_sub: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        self.host_by_sub = [self.host[:, sub] for sub in range(self.host.shape[1])]


def own_stream(device, taken: list) -> torch.cuda.Stream:
    """A CUDA stream none of ``taken`` is. torch hands out streams from a pool (32 per device and
    priority, round robin) and vLLM's compute stream may be one of them: a copy stream that is the
    compute stream would hold the next forward up behind loads (the design has it never wait for
    them), a calibration stream that is a copy stream would wait behind copies."""
    handles = {stream.cuda_stream for stream in taken}
    for _ in range(64):  # two rounds of the pool
        stream = torch.cuda.Stream(device=device)
        if stream.cuda_stream not in handles:
            return stream
    raise CopyError(f"no CUDA stream on {device} apart from {len(handles)} in use: torch's stream pool is exhausted")


class CopyEngine:
    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        kv_cache_config: KVCacheConfig,
        layout: SlotLayout,
        num_slots: int,
    ):
        first = next(iter(kv_caches.values()))
        first = first[0] if isinstance(first, (list, tuple)) else first
        self.device = first.device
        self.is_cuda = self.device.type == "cuda"
        self.layout = layout
        self.num_slots = num_slots
        self.num_blocks = kv_cache_config.num_blocks
        # Every layer's page view and the copy streams first: a refused layout must not leave the host
        # tier pinned (registering tens of GB takes seconds, and nothing would unregister it).
        group_views = []
        for layers in layout.group_layers:
            views = []
            for name, offset, page in layers:
                if name not in kv_caches:
                    raise CopyError(f"layer {name} has no registered KV cache")
                views.append((offset, page, page_view(kv_caches[name], kv_cache_config.num_blocks, page)))
            group_views.append(views)
        # Loads and stores on streams of their own: later compute must wait for stores (the blocks
        # they read may be reused), never for loads, and a store need not queue behind a large load.
        self.load_stream = self.store_stream = None
        if self.is_cuda:
            compute = torch.cuda.current_stream(self.device)
            self.load_stream = own_stream(self.device, [compute])
            self.store_stream = own_stream(self.device, [compute, self.load_stream])
        self._host_buffer = HostBuffer(num_slots, layout.slot_bytes, pin=self.is_cuda)
        self.host = self._host_buffer.tensor
        self.groups: list[list[_Region]] = [
            [_Region(view=view, host=self.host[:, offset:offset + factor * page].view(num_slots, factor, page),
                     page=page) for offset, page, view in views]
            for views, factor in zip(group_views, layout.group_factors)]
        self._group_block_bytes = [sum(r.page for r in regions) for regions in self.groups]
        self._swap_blocks_batch = _batched_copy_op() if self.is_cuda else None
        self._clock: EventClock | None = None  # made on the first completed CUDA copy
        self._stream_clash_logged = False

    def group_block_bytes(self, group: int) -> int:
        return self._group_block_bytes[group]

    # -- copies --
    def load(self, group: int, slots: list[int], subs: list[int], block_ids: list[int],
             waits_for_stores: bool = True) -> CopyResult:
        """``waits_for_stores``: a destination block may be one a store in flight still reads
        (`TransferJob.waits_for_stores`); the load then starts after the stores enqueued so far."""
        return self._copy(group, slots, subs, block_ids, to_device=True, waits_for_stores=waits_for_stores)

    def store(self, group: int, slots: list[int], subs: list[int], block_ids: list[int]) -> CopyResult:
        return self._copy(group, slots, subs, block_ids, to_device=False)

    def _copy(self, group, slots, subs, block_ids, to_device: bool, waits_for_stores: bool = False) -> CopyResult:
        regions = self.groups[group]
        nbytes = len(block_ids) * self.group_block_bytes(group)
        if self.is_cuda:
            return self._copy_cuda(regions, slots, subs, block_ids, to_device, nbytes, waits_for_stores)
        start = time.time_ns()
        for region in regions:
            view, host_by_sub = region.view, region.host_by_sub
            if to_device:
                for slot, sub, block in zip(slots, subs, block_ids):
                    view[block].copy_(host_by_sub[sub][slot])
            else:
                for slot, sub, block in zip(slots, subs, block_ids):
                    host_by_sub[sub][slot].copy_(view[block])
        return CopyResult(nbytes, len(block_ids), start, time.time_ns())

    def _copy_cuda(self, regions, slots, subs, block_ids, to_device, nbytes, waits_for_stores) -> CopyResult:
        stream = self.load_stream if to_device else self.store_stream
        compute = torch.cuda.current_stream(self.device)
        if compute.cuda_stream == stream.cuda_stream and not self._stream_clash_logged:
            self._log_stream_clash()
        # Stores read what this step's forward wrote; a load's destination blocks may still be
        # zeroed by compute vLLM queued earlier: both come after the compute stream's work so far.
        stream.wait_stream(compute)
        if waits_for_stores:
            # A destination block is one an in-flight store still reads (freed when its request
            # finished, allocated again for this load).
            stream.wait_stream(self.store_stream)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            keep_alive = self._enqueue(regions, slots, subs, block_ids, to_device)
            end.record(stream)
        return CopyResult(nbytes, len(block_ids), 0, 0, pending_events=(start, end), keep_alive=keep_alive)

    def _log_stream_clash(self) -> None:
        """vLLM computes on a stream it took from torch's pool after this engine took its own (`own_stream`),
        and the pool's round robin gave it a copy stream: still correct (one stream orders more), but the
        forward then waits behind loads and the stores behind the forward. Said once."""
        self._stream_clash_logged = True
        logger.error("kvscope: vLLM's compute stream is one of kvscope's copy streams (torch's stream pool handed "
                     "it out again): copies and the forward now wait for each other. Please report the model "
                     "and vLLM version")

    def _enqueue(self, regions, slots, subs, block_ids, to_device):
        """Enqueue a copy on the current stream: one batched call when vLLM's op is there, else (or
        once it failed: logged, never again) a `copy_` per block and layer. Returns what must stay
        alive until the copy is done."""
        op = self._swap_blocks_batch
        if op is not None and block_ids:
            try:
                arrays = tuple(torch.from_numpy(a) for a in copy_descriptors(regions, slots, subs, block_ids, to_device))
                # Loads read ready host slots, which nothing writes while they are pinned for the load:
                # the DMA engine may read them in any order (as vLLM's offloading worker lets it).
                op(*arrays, to_device)
                return arrays
            except Exception:
                logger.exception("kvscope: vLLM's swap_blocks_batch failed; copying block by block from now on")
                self._swap_blocks_batch = None
        for region in regions:
            view, host_by_sub = region.view, region.host_by_sub
            for slot, sub, block in zip(slots, subs, block_ids):
                if to_device:
                    view[block].copy_(host_by_sub[sub][slot], non_blocking=True)
                else:
                    host_by_sub[sub][slot].copy_(view[block], non_blocking=True)
        return None

    # -- CUDA completion --
    def poll(self, result: CopyResult) -> bool:
        """True once the copy is complete; fills the wall-clock interval from device events."""
        if result.pending_events is None:
            return True
        start, end = result.pending_events
        if not end.query():
            return False
        try:
            if self._clock is None:  # calibration events go on a stream of their own, never behind copies
                self._clock = EventClock(lambda: torch.cuda.Event(enable_timing=True), own_stream(
                    self.device, [torch.cuda.current_stream(self.device), self.load_stream, self.store_stream]))
            result.start_ns, result.end_ns = self._clock.interval(start, end)
        except Exception:  # the copy is done: a clock that fails costs its interval, never the transfer
            telemetry_failed("a copy's device-event interval")
            result.start_ns = result.end_ns = None
        result.pending_events = result.keep_alive = None
        return True

    def fence_compute_stream(self) -> None:
        """Make later compute wait for pending stores: vLLM may reuse the blocks they read once their
        request finishes. Not for loads: vLLM keeps a loading request's blocks until the load is
        reported done (even when the request is aborted), so a load in flight never holds up the
        next forward."""
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.store_stream)

    def drain(self) -> None:
        """Wait until every copy enqueued so far is done. After a copy failed part way through
        enqueueing (no event marks its end), its job may release its host slots and device blocks
        only once nothing reads or writes them any more."""
        if self.is_cuda:
            self.load_stream.synchronize()
            self.store_stream.synchronize()

    def close(self) -> None:
        """Unpin the host tier (after every copy is done)."""
        self._host_buffer.release()


def copy_descriptors(regions, slots, subs, block_ids, to_device: bool):
    """One group's copy as raw pointers, one entry per (layer, block): ``(sources, destinations,
    sizes)``, int64 arrays as vLLM's `swap_blocks_batch` takes them. A device block is one
    contiguous page (its row of `page_view`), and so is a host slot's sub-block ``(slot, sub)``."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    slot_index = np.asarray(slots, dtype=np.int64)
    sub_index = np.asarray(subs, dtype=np.int64)
    device, host = [], []
    for region in regions:
        view, slots_view = region.view, region.host
        device.append(view.data_ptr() + blocks * view.stride(0))
        host.append(slots_view.data_ptr() + slot_index * slots_view.stride(0) + sub_index * slots_view.stride(1))
    sizes = np.repeat(np.asarray([region.page for region in regions], dtype=np.int64), len(blocks))
    device, host = np.concatenate(device), np.concatenate(host)
    return (host, device, sizes) if to_device else (device, host, sizes)


def _batched_copy_op():
    """vLLM's batched block copy (`_custom_ops.swap_blocks_batch`), or None where this build lacks it."""
    try:
        from vllm import _custom_ops

        return _custom_ops.swap_blocks_batch
    except Exception:  # an older or a CPU build: copies go block by block
        return None
