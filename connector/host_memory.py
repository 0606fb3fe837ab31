"""The host tier's memory: one buffer of slots, pinned for DMA on CUDA.

Not `torch.empty(..., pin_memory=True)`: torch's caching host allocator rounds every pinned
allocation up to a power of two (`CachingHostAllocator`, `pinned_max_round_threshold` unbounded by
default), so a 20 GiB tier would pin 32 GiB of RAM on every worker. As vLLM's own offloading does,
the buffer is allocated pageable, page aligned, and registered with the driver (vLLM's
`host_register`: `cudaHostRegister`) in chunks of at most 64 GiB that end on page and slot
boundaries. If registration fails, copies still work from pageable memory, only slower (logged).
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
# vLLM's bound for one registration (`gpu_worker.MAX_HOST_REGISTER_CHUNK_BYTES`): driver limits.
MAX_REGISTER_CHUNK_BYTES = 64 << 30


def register_chunks(total: int, row_bytes: int, page: int = PAGE_BYTES,
                    max_chunk: int = MAX_REGISTER_CHUNK_BYTES) -> list[tuple[int, int]]:
    """``(offset, size)`` of the registrations covering ``total`` bytes of rows of ``row_bytes``.

    Every chunk but the last ends on a page boundary (two registrations never share a page) and,
    where a chunk of whole rows fits the limit, on a row boundary (no block copy spans two)."""
    if total <= max_chunk:
        return [(0, total)] if total > 0 else []
    unit = math.lcm(row_bytes, page)
    if unit > max_chunk:  # rows too large and oddly sized to end chunks on them: pages only
        unit = page
    size = max_chunk // unit * unit
    return [(offset, min(size, total - offset)) for offset in range(0, total, size)]


class HostBuffer:
    """``num_slots`` rows of ``slot_bytes`` in host memory (`tensor`), page aligned; with ``pin``,
    registered for DMA through ``register(address, size) -> bool`` (vLLM's `host_register` when
    None), undone by `release` through ``unregister(address)``."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool,
                 register: Callable[[int, int], bool] | None = None,
                 unregister: Callable[[int], None] | None = None, max_chunk: int = MAX_REGISTER_CHUNK_BYTES):
        nbytes = num_slots * slot_bytes
        self._raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.int8)
        start = -self._raw.data_ptr() % PAGE_BYTES
        self.tensor = self._raw[start:start + nbytes].view(num_slots, slot_bytes)
        self._registered: list[int] = []
        self._unregister = unregister
        if pin and nbytes:
            if register is None or unregister is None:
                register, self._unregister = _vllm_host_register()
            self._register(register, nbytes, slot_bytes, max_chunk)

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def _register(self, register, nbytes: int, slot_bytes: int, max_chunk: int) -> None:
        base = self.tensor.data_ptr()
        for offset, size in register_chunks(nbytes, slot_bytes, max_chunk=max_chunk):
            if register(base + offset, size):
                self._registered.append(base + offset)
                continue
            logger.warning("kvscope: pinning the host tier failed at %.2f of %.2f GB; it stays pageable: "
                           "copies still work, but each copy to or from pageable memory returns only once done, "
                           "so every step that loads or stores waits for its forward and those copies (lower "
                           "cpu_bytes if this host cannot pin that much)", offset / 1e9, nbytes / 1e9)
            self.release()
            return

    def release(self) -> None:
        """Unregister what was registered (the memory itself goes with the tensor)."""
        while self._registered:
            self._unregister(self._registered.pop())


def _vllm_host_register():
    try:
        from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister
    except ImportError:  # not in this vLLM: the tier stays pageable (`_register` logs it)
        return (lambda address, size: False), (lambda address: None)
    return host_register, host_unregister
