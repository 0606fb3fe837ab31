"""The CUDA path of the copy engine on a real GPU (skipped without one; CI has none).

`tests/unit/test_copy_streams.py` pins the stream ordering on the CPU with recording stand-ins;
these run the same code with real streams, events, DMA and a host tier pinned by
`cudaHostRegister`, and check what the stand-ins cannot: bytes arrive exactly, the fences really
hold copies and compute apart, and copy times are device intervals on the wall clock.
`scripts/device-check` runs them on a GPU machine without vLLM installed (its Python sources only),
so they import no more of vLLM than the copy engine does (the worker's stepping and fence placement
are tested on the CPU: `tests/unit/test_copy_streams.py`, `tests/engine`).
Lines starting `INFO` (shown with `-s`) are measurements for the team, not assertions.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from connector.copy_engine import CopyEngine
from connector.vllm_layout import SlotLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NUM_BLOCKS, NUM_SLOTS = 2048, 1024
HEADS, BLOCK_TOKENS, TWO_HEAD_DIM = 8, 16, 256
PAGE = HEADS * BLOCK_TOKENS * TWO_HEAD_DIM * 2  # bf16: 64 KiB per block and layer


@pytest.fixture(scope="module")
def cuda():
    """Two KV groups of two layers each sharing two bf16 caches (as the hybrid allocator lays
    them out), and a copy engine over them with a pinned host tier of `NUM_SLOTS` slots."""
    device = torch.device("cuda")
    t0 = torch.randn((NUM_BLOCKS, HEADS, BLOCK_TOKENS, TWO_HEAD_DIM), dtype=torch.bfloat16, device=device)
    t1 = torch.randn_like(t0)
    caches = {"g0.l0": t0, "g1.l0": t0, "g0.l1": t1, "g1.l1": t1}
    layers = [[(f"g{g}.l0", 0, PAGE), (f"g{g}.l1", PAGE, PAGE)] for g in (0, 1)]
    layout = SlotLayout(slot_bytes=2 * PAGE, group_layers=layers, group_factors=[1, 1])
    engine = CopyEngine(caches, SimpleNamespace(num_blocks=NUM_BLOCKS), layout, NUM_SLOTS)
    yield SimpleNamespace(engine=engine, t0=t0, t1=t1)
    torch.cuda.synchronize()
    engine.close()


def _rows(t: torch.Tensor, blocks) -> torch.Tensor:
    """The bytes of device blocks `blocks` of one layer cache, on the host."""
    return t[list(blocks)].contiguous().view(torch.int8).cpu()


def _done(engine: CopyEngine, result, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not engine.poll(result):
        assert time.monotonic() < deadline, "a copy did not complete"
        time.sleep(0.0005)


def _store(engine, blocks, slots, group=0):
    return engine.store(group, list(slots), [0] * len(slots), list(blocks))


def _load(engine, slots, blocks, group=0):
    return engine.load(group, list(slots), [0] * len(slots), list(blocks))


def test_the_host_tier_is_pinned_by_registration(cuda):
    assert cuda.engine._host_buffer.pinned, "cudaHostRegister failed: see 'pinning the host tier failed' in the log"
    assert cuda.engine.host.is_pinned()


@pytest.mark.parametrize("n", [1, 7, 256])
def test_a_store_then_a_load_gives_the_same_bytes(cuda, n):
    engine, t0, t1 = cuda.engine, cuda.t0, cuda.t1
    blocks = list(range(100, 100 + 3 * n, 3))  # scattered device blocks
    slots = list(range(NUM_SLOTS - 1, NUM_SLOTS - 1 - n, -1))  # scattered host slots, reversed
    before = (_rows(t0, blocks), _rows(t1, blocks))
    wall_before = time.time_ns()
    stored = _store(engine, blocks, slots)
    _done(engine, stored)
    wall_after = time.time_ns()
    assert stored.nbytes == n * 2 * PAGE and stored.blocks == n
    # a device interval placed on the wall clock: inside the call's window (1 ms of calibration slack)
    assert wall_before - 1_000_000 <= stored.start_ns <= stored.end_ns <= wall_after + 1_000_000
    targets = list(range(1000, 1000 + 2 * n, 2))
    loaded = _load(engine, slots, targets)
    _done(engine, loaded)
    assert torch.equal(_rows(t0, targets), before[0]) and torch.equal(_rows(t1, targets), before[1])
    print(f"INFO round trip of {n} blocks: store {(stored.end_ns - stored.start_ns) / 1e3:.1f} us, "
          f"load {(loaded.end_ns - loaded.start_ns) / 1e3:.1f} us, batched op in use: "
          f"{engine._swap_blocks_batch is not None}")


def test_later_compute_cannot_overwrite_what_a_store_still_reads(cuda):
    """The store fence: compute enqueued after it (here: overwriting every source block) runs only
    once the store has read them. Without the fence the same overwrite races the DMA (reported)."""
    engine, t0 = cuda.engine, cuda.t0
    blocks, slots = list(range(512)), list(range(512))
    for fenced in (True, False):
        t0[: len(blocks)].normal_()
        expected = _rows(t0, blocks)
        torch.cuda.synchronize()
        stored = _store(engine, blocks, slots)
        if fenced:
            engine.fence_compute_stream()
        t0[: len(blocks)].zero_()  # the next step's writes, on the compute stream
        torch.cuda.synchronize()
        _done(engine, stored)
        host = engine.host[slots, :PAGE].clone()
        intact = torch.equal(host, expected.view(len(blocks), PAGE))
        if fenced:
            assert intact, "compute overwrote blocks before the fenced store read them"
        else:
            print(f"INFO without the fence the overwrite {'missed' if intact else 'corrupted'} the store")


def test_a_load_waits_for_compute_enqueued_before_it(cuda):
    """vLLM may still be writing (zeroing) a load's destination blocks on the compute stream."""
    engine, t0 = cuda.engine, cuda.t0
    src, dst, slots = list(range(600, 616)), list(range(1500, 1516)), list(range(600, 616))
    _done(engine, _store(engine, src, slots))
    expected = _rows(t0, src)
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy (tens of ms)
    t0[dst] = 7.0  # then write the destination blocks, on the compute stream
    loaded = _load(engine, slots, dst)
    torch.cuda.synchronize()
    _done(engine, loaded)
    assert torch.equal(_rows(t0, dst), expected), "the load ran before the compute enqueued ahead of it"


def test_a_load_into_a_block_a_store_still_reads_waits_for_the_store(cuda):
    """A finished request's block, freed with its store in flight, allocated again for a load."""
    engine, t0 = cuda.engine, cuda.t0
    blocks, store_slots = list(range(256)), list(range(256))
    other_slots = list(range(300, 556))
    _done(engine, _store(engine, list(range(1700, 1956)), other_slots))  # what the load brings
    incoming = _rows(t0, range(1700, 1956))
    outgoing = _rows(t0, blocks)
    stored = _store(engine, blocks, store_slots)
    loaded = _load(engine, other_slots, blocks)  # same device blocks, right after
    torch.cuda.synchronize()
    _done(engine, stored)
    _done(engine, loaded)
    assert torch.equal(engine.host[store_slots, :PAGE], outgoing.view(256, PAGE)), "the load overwrote a store's source"
    assert torch.equal(_rows(t0, blocks), incoming)


def test_copy_times_are_the_device_interval(cuda):
    """Durations from the copy's own events: non-zero, and a plausible bandwidth for a 64 MiB store."""
    engine = cuda.engine
    blocks = list(range(512))
    stored = _store(engine, blocks, list(range(512)))
    _done(engine, stored)
    seconds = (stored.end_ns - stored.start_ns) / 1e9
    assert seconds > 0
    gbps = stored.nbytes / seconds / 1e9
    print(f"INFO store of {stored.nbytes >> 20} MiB in {seconds * 1e3:.3f} ms: {gbps:.1f} GB/s")
    assert 1 < gbps < 2000


def test_mamba_pages_round_trip_byte_exact(cuda):
    """Raw Mamba pages on the device (a float32 conv state and a bf16 SSM state viewing one int8
    page per block, with padding at its end), copied whole: padding included, neighbours untouched."""
    num_blocks, page = 64, 160
    raw = torch.randint(-128, 128, (num_blocks * page,), dtype=torch.int8, device="cuda")
    conv = torch.as_strided(raw.view(torch.float32), (num_blocks, 3, 8), (page // 4, 8, 1), 0)
    ssm = torch.as_strided(raw.view(torch.bfloat16), (num_blocks, 4, 6), (page // 2, 6, 1), 96 // 2)
    layout = SlotLayout(slot_bytes=page, group_layers=[[("mamba", 0, page)]], group_factors=[1])
    engine = CopyEngine({"mamba": [conv, ssm]}, SimpleNamespace(num_blocks=num_blocks), layout, 8)
    try:
        before = raw.view(num_blocks, page).to("cpu", copy=True)
        _done(engine, engine.store(0, [5, 2], [0, 0], [3, num_blocks - 1]))
        raw.random_(-128, 128)
        mid = raw.view(num_blocks, page).to("cpu", copy=True)
        _done(engine, engine.load(0, [5, 2], [0, 0], [10, 0]))
        expected = mid.clone()
        expected[10], expected[0] = before[3], before[num_blocks - 1]
        assert torch.equal(raw.view(num_blocks, page).cpu(), expected)
    finally:
        torch.cuda.synchronize()
        engine.close()
