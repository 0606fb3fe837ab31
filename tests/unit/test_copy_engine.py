"""CopyEngine on the CPU: byte-exact block copies between hand-built KV caches and host slots.

The KV caches mimic what vLLM registers: attention tensors shared by layers of different groups
(hybrid allocator), kernel-block split tensors, and raw Mamba pages viewed by several strided
state tensors of different dtypes with padding at the end of each page.
"""

from __future__ import annotations

import logging

from types import SimpleNamespace

import pytest
import torch

from connector import copy_engine as copy_module
from connector.copy_engine import CopyEngine, CopyError, CopyResult, page_view
from connector.vllm_layout import SlotLayout

GEN = torch.Generator().manual_seed(1234)


def _random_bytes(n: int) -> torch.Tensor:
    return torch.randint(-128, 128, (n,), dtype=torch.int8, generator=GEN)


def _fill_random(t: torch.Tensor) -> torch.Tensor:
    """Overwrite every byte of `t`'s whole storage with random bits (also padding, also NaN patterns)."""
    storage = t.untyped_storage()
    raw = torch.tensor([], dtype=torch.int8).set_(storage, 0, (storage.nbytes(),), (1,))
    raw.copy_(_random_bytes(storage.nbytes()))
    return t


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of `t`'s storage."""
    storage = t.untyped_storage()
    return torch.tensor([], dtype=torch.int8).set_(storage, 0, (storage.nbytes(),), (1,)).clone()


def _config(num_blocks: int):
    return SimpleNamespace(num_blocks=num_blocks)  # CopyEngine reads only num_blocks


def _bf16_cache(num_blocks, heads, block_size, two_head_dim):
    return _fill_random(torch.empty((num_blocks, heads, block_size, two_head_dim), dtype=torch.bfloat16))


# --- (a) attention, hybrid groups sharing tensors -----------------------------------------------

NB, HEADS, BS, TWO_HD = 12, 2, 4, 8
PAGE = HEADS * BS * TWO_HD * 2  # bf16


def _shared_attention_engine(num_slots=4, factor0=1, factor1=1):
    """Two groups, two layers each; layer i of group 0 and layer i of group 1 share one tensor."""
    t0 = _bf16_cache(NB, HEADS, BS, TWO_HD)
    t1 = _bf16_cache(NB, HEADS, BS, TWO_HD)
    kv_caches = {"g0.l0": t0, "g1.l0": t0, "g0.l1": t1, "g1.l1": t1}
    assert kv_caches["g0.l0"].untyped_storage().data_ptr() == kv_caches["g1.l0"].untyped_storage().data_ptr()
    g0 = [("g0.l0", 0, PAGE), ("g0.l1", factor0 * PAGE, PAGE)]
    g1 = [("g1.l0", 0, PAGE), ("g1.l1", factor1 * PAGE, PAGE)]
    layout = SlotLayout(
        slot_bytes=2 * PAGE * max(factor0, factor1),
        group_layers=[g0, g1],
        group_factors=[factor0, factor1],
    )
    engine = CopyEngine(kv_caches, _config(NB), layout, num_slots)
    return engine, t0, t1


def _block_bytes(t: torch.Tensor, block: int) -> torch.Tensor:
    return t[block].contiguous().view(torch.int8).flatten().clone()


def test_page_view_of_attention_cache_is_block_rows():
    t = _bf16_cache(NB, HEADS, BS, TWO_HD)
    view = page_view(t, NB, PAGE)
    assert view.shape == (NB, PAGE) and view.dtype == torch.int8
    assert view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    for b in (0, 5, NB - 1):
        assert torch.equal(view[b], _block_bytes(t, b))


def test_page_view_of_a_cache_starting_inside_its_storage_starts_at_its_first_block():
    """A layer's cache may be a view some bytes into a larger buffer: its block 0 is there, not at the
    storage's start (copying from there would move another layer's or padding bytes)."""
    base = _bf16_cache(NB + 1, HEADS, BS, TWO_HD)
    t = base[1:]
    view = page_view(t, NB, PAGE)
    for b in (0, NB - 1):
        assert torch.equal(view[b], _block_bytes(t, b))


def test_shared_tensor_two_groups_round_trip():
    engine, t0, t1 = _shared_attention_engine()
    assert engine.group_block_bytes(0) == engine.group_block_bytes(1) == 2 * PAGE
    before = (_storage_bytes(t0), _storage_bytes(t1))
    src0 = {b: (_block_bytes(t0, b), _block_bytes(t1, b)) for b in (1, 2)}
    src1 = {b: (_block_bytes(t0, b), _block_bytes(t1, b)) for b in (3,)}

    engine.store(0, slots=[0, 2], subs=[0, 0], block_ids=[1, 2])
    engine.store(1, slots=[1], subs=[0], block_ids=[3])
    # stores never write the device
    assert torch.equal(_storage_bytes(t0), before[0]) and torch.equal(_storage_bytes(t1), before[1])
    # slot layout: layer l of a group at its offset
    assert torch.equal(engine.host[0, :PAGE], src0[1][0]) and torch.equal(engine.host[0, PAGE : 2 * PAGE], src0[1][1])
    assert torch.equal(engine.host[1, :PAGE], src1[3][0]) and torch.equal(engine.host[1, PAGE : 2 * PAGE], src1[3][1])

    # load into other blocks: group 0 slots 0, 2 -> blocks 7, 0; group 1 slot 1 -> block 11
    engine.load(0, slots=[0, 2], subs=[0, 0], block_ids=[7, 0])
    engine.load(1, slots=[1], subs=[0], block_ids=[11])
    expected0, expected1 = before[0].view(NB, PAGE).clone(), before[1].view(NB, PAGE).clone()
    for dst, src in ((7, src0[1]), (0, src0[2]), (11, src1[3])):
        expected0[dst], expected1[dst] = src
    assert torch.equal(_storage_bytes(t0).view(NB, PAGE), expected0)
    assert torch.equal(_storage_bytes(t1).view(NB, PAGE), expected1)


def test_a_first_layer_holding_its_one_state_in_a_list_round_trips():
    """A layer may hand vLLM its states as a list of one (a short-conv layer's conv state alone); the engine
    takes its device from that state."""
    t = _bf16_cache(NB, HEADS, BS, TWO_HD)
    layout = SlotLayout(slot_bytes=PAGE, group_layers=[[("conv", 0, PAGE)]], group_factors=[1])
    engine = CopyEngine({"conv": [t]}, _config(NB), layout, 2)
    before = _block_bytes(t, 3)
    engine.store(0, [1], [0], [3])
    engine.load(0, [1], [0], [5])
    assert torch.equal(_block_bytes(t, 5), before)


def test_untouched_host_slots_stay_untouched():
    engine, _, _ = _shared_attention_engine(num_slots=3)
    engine.host.copy_(_random_bytes(engine.host.numel()).view_as(engine.host))
    host_before = engine.host.clone()
    engine.store(0, [1], [0], [4])
    changed = (engine.host != host_before).any(dim=1)
    assert not changed[0] and not changed[2]
    engine.store(1, [2], [0], [4])
    assert torch.equal(engine.host[1], engine.host[2])  # same device block, same layout for both groups


@pytest.mark.parametrize("factor", [2, 3])
def test_factor_packs_consecutive_device_blocks(factor):
    engine, t0, t1 = _shared_attention_engine(num_slots=3, factor0=factor, factor1=1)
    assert engine.host.shape == (3, 2 * factor * PAGE)
    before = (_storage_bytes(t0).view(NB, PAGE), _storage_bytes(t1).view(NB, PAGE))
    devices = [5, 2, 9][:factor]  # one offload block = `factor` device blocks, in any block ids
    engine.store(0, [1] * factor, list(range(factor)), devices)
    for sub, b in enumerate(devices):
        assert torch.equal(engine.host[1, sub * PAGE : (sub + 1) * PAGE], before[0][b])
        off = factor * PAGE + sub * PAGE
        assert torch.equal(engine.host[1, off : off + PAGE], before[1][b])

    targets = [0, 11, 6][:factor]
    engine.load(0, [1] * factor, list(range(factor)), targets)
    after = (_storage_bytes(t0).view(NB, PAGE), _storage_bytes(t1).view(NB, PAGE))
    for layer in (0, 1):
        expected = before[layer].clone()
        for src, dst in zip(devices, targets):
            expected[dst] = before[layer][src]
        assert torch.equal(after[layer], expected)

    # subs are independent: loading only sub 1 writes one block per layer
    engine.load(0, [1], [1], [3])
    assert torch.equal(_storage_bytes(t0).view(NB, PAGE)[3], before[0][devices[1]])
    assert torch.equal(_storage_bytes(t1).view(NB, PAGE)[3], before[1][devices[1]])


def test_kernel_block_split_cache():
    """vLLM splits a manager block into kernel blocks: cache dim 0 is num_blocks * ratio."""
    nb, ratio = 6, 2
    t = _bf16_cache(nb * ratio, HEADS, BS // ratio, TWO_HD)
    page = ratio * HEADS * (BS // ratio) * TWO_HD * 2
    layout = SlotLayout(slot_bytes=page, group_layers=[[("l", 0, page)]], group_factors=[1])
    engine = CopyEngine({"l": t}, _config(nb), layout, 2)
    before = _storage_bytes(t).view(nb, page)
    engine.store(0, [0], [0], [4])
    assert torch.equal(engine.host[0], before[4])
    engine.load(0, [0], [0], [1])
    expected = before.clone()
    expected[1] = before[4]
    assert torch.equal(_storage_bytes(t).view(nb, page), expected)
    assert torch.equal(t[2:4].view(torch.int16), t[8:10].view(torch.int16))  # kernel blocks 2, 3 == manager block 1 == old 4


# --- (b) Mamba raw pages ------------------------------------------------------------------------

M_NB = 7
CONV_SHAPE, CONV_DTYPE = (3, 8), torch.float32  # 96 B at offset 0
SSM_SHAPE, SSM_DTYPE = (4, 6), torch.bfloat16  # 48 B at offset 96
M_PAGE = 160  # 16 B padding at the end of every page


def _mamba_layer(num_blocks=M_NB, page=M_PAGE, storage_bytes=None):
    raw = torch.empty(storage_bytes if storage_bytes is not None else num_blocks * page, dtype=torch.int8)
    _fill_random(raw)
    conv = torch.as_strided(
        raw.view(CONV_DTYPE), (num_blocks, *CONV_SHAPE), (page // 4, CONV_SHAPE[1], 1), 0
    )
    ssm = torch.as_strided(
        raw.view(SSM_DTYPE), (num_blocks, *SSM_SHAPE), (page // 2, SSM_SHAPE[1], 1), 96 // 2
    )
    return raw, conv, ssm


def test_page_view_of_mamba_states():
    raw, conv, ssm = _mamba_layer()
    for states in ([conv, ssm], [ssm, conv], (conv, ssm)):  # order must not matter
        view = page_view(states, M_NB, M_PAGE)
        assert view.shape == (M_NB, M_PAGE)
        assert torch.equal(view, raw.view(M_NB, M_PAGE))


def _mamba_engine(num_slots=3):
    raw_a, conv_a, ssm_a = _mamba_layer()
    raw_b, conv_b, ssm_b = _mamba_layer()
    kv_caches = {"m0": [conv_a, ssm_a], "m1": [ssm_b, conv_b]}
    layout = SlotLayout(
        slot_bytes=2 * M_PAGE,
        group_layers=[[("m0", 0, M_PAGE), ("m1", M_PAGE, M_PAGE)]],
        group_factors=[1],
    )
    return CopyEngine(kv_caches, _config(M_NB), layout, num_slots), raw_a, raw_b, (conv_a, ssm_a)


def test_mamba_round_trip_byte_exact_with_padding():
    engine, raw_a, raw_b, (conv_a, ssm_a) = _mamba_engine()
    before_a, before_b = raw_a.clone().view(M_NB, M_PAGE), raw_b.clone().view(M_NB, M_PAGE)
    conv_3, ssm_3 = conv_a[3].clone(), ssm_a[3].clone()

    result = engine.store(0, [2, 0], [0, 0], [3, 6])
    assert torch.equal(raw_a.view(M_NB, M_PAGE), before_a)  # store leaves the device alone
    assert torch.equal(engine.host[2], torch.cat([before_a[3], before_b[3]]))  # padding included
    assert torch.equal(engine.host[0], torch.cat([before_a[6], before_b[6]]))
    assert result.nbytes == 2 * 2 * M_PAGE and result.blocks == 2

    _fill_random(raw_a)  # the device blocks are reused by other requests
    _fill_random(raw_b)
    mid_a, mid_b = raw_a.clone().view(M_NB, M_PAGE), raw_b.clone().view(M_NB, M_PAGE)
    engine.load(0, [2, 0], [0, 0], [4, 0])
    for raw, mid, before in ((raw_a, mid_a, before_a), (raw_b, mid_b, before_b)):
        expected = mid.clone()
        expected[4], expected[0] = before[3], before[6]
        # byte-exact including the loaded pages' padding, and neighbours (3, 5, 1) untouched
        assert torch.equal(raw.view(M_NB, M_PAGE), expected)
    # the typed states see the stored values (float32 / bf16 compare bitwise via int views)
    assert torch.equal(conv_a[4].view(torch.int32), conv_3.view(torch.int32))
    assert torch.equal(ssm_a[4].view(torch.int16), ssm_3.view(torch.int16))


def test_mamba_last_block_padding_and_neighbour():
    engine, raw_a, raw_b, _ = _mamba_engine(num_slots=1)
    before = raw_a.clone()
    engine.store(0, [0], [0], [0])
    _fill_random(raw_a)
    mid = raw_a.clone()
    engine.load(0, [0], [0], [M_NB - 1])  # last block: its padding is the storage's last bytes
    assert torch.equal(raw_a[-M_PAGE:], before[:M_PAGE])
    assert torch.equal(raw_a[: -M_PAGE], mid[: -M_PAGE])


def test_hybrid_attention_and_mamba_groups():
    t = _bf16_cache(M_NB, HEADS, BS, TWO_HD)
    raw, conv, ssm = _mamba_layer()
    kv_caches = {"mamba": [conv, ssm], "attn": t}  # first value is a list: device read from it
    layout = SlotLayout(
        slot_bytes=max(PAGE, M_PAGE),
        group_layers=[[("mamba", 0, M_PAGE)], [("attn", 0, PAGE)]],
        group_factors=[1, 1],
    )
    engine = CopyEngine(kv_caches, _config(M_NB), layout, 2)
    assert engine.device.type == "cpu" and not engine.is_cuda
    assert engine.group_block_bytes(0) == M_PAGE and engine.group_block_bytes(1) == PAGE
    raw_before, t_before = raw.clone().view(M_NB, M_PAGE), _storage_bytes(t).view(M_NB, PAGE)
    engine.store(0, [0], [0], [2])
    engine.store(1, [1], [0], [2])
    engine.load(0, [0], [0], [5])
    engine.load(1, [1], [0], [6])
    exp_raw, exp_t = raw_before.clone(), t_before.clone()
    exp_raw[5], exp_t[6] = raw_before[2], t_before[2]
    assert torch.equal(raw.view(M_NB, M_PAGE), exp_raw)
    assert torch.equal(_storage_bytes(t).view(M_NB, PAGE), exp_t)


# --- (c) page_view refuses layouts it does not understand ---------------------------------------


def test_state_larger_than_page():
    _, conv, ssm = _mamba_layer()
    with pytest.raises(CopyError, match="exceeds the page"):
        page_view([conv, ssm], M_NB, 140)  # ssm ends at 144
    with pytest.raises(CopyError, match="exceeds the page"):
        page_view([conv], M_NB, 95)  # conv is 96 B
    assert page_view([conv, ssm], M_NB, 144).shape == (M_NB, 144)  # padding may be left out


@pytest.mark.parametrize("num_blocks", [NB, 2])  # two blocks are enough to overlap
def test_attention_page_larger_than_block_stride(num_blocks):
    t = _bf16_cache(num_blocks, HEADS, BS, TWO_HD)
    with pytest.raises(CopyError, match="smaller than the page"):
        page_view(t, num_blocks, PAGE + 2)


def test_a_one_block_cache_is_accepted_whatever_its_block_stride():
    """A single block's stride says nothing (torch may give a size-1 dimension any stride)."""
    raw = torch.arange(64, dtype=torch.int8)
    view = page_view(torch.as_strided(raw, (1, 64), (1, 1)), 1, 64)
    assert torch.equal(view[0], raw)


def test_states_of_different_storages():
    _, conv_a, _ = _mamba_layer()
    _, _, ssm_b = _mamba_layer()
    with pytest.raises(CopyError, match="one paged storage"):
        page_view([conv_a, ssm_b], M_NB, M_PAGE)


def test_states_with_different_block_strides():
    raw, conv, _ = _mamba_layer()
    other = torch.as_strided(raw.view(SSM_DTYPE), (M_NB // 2, *SSM_SHAPE), (M_PAGE, SSM_SHAPE[1], 1), 48)
    with pytest.raises(CopyError, match="one paged storage"):
        page_view([conv[: M_NB // 2], other], M_NB // 2, M_PAGE)


def test_page_view_running_past_storage():
    # the last page is cut short: its padding is missing from the storage
    _, conv, ssm = _mamba_layer(storage_bytes=M_NB * M_PAGE - 8)
    with pytest.raises(CopyError, match="past its storage"):
        page_view([conv, ssm], M_NB, M_PAGE)
    assert page_view([conv, ssm], M_NB, M_PAGE - 8).shape == (M_NB, M_PAGE - 8)


def test_transposed_state_view_is_accepted():
    """A permuted (dense) state spans numel bytes: inside its page."""
    raw, conv, ssm = _mamba_layer()
    view = page_view([conv.transpose(-1, -2), ssm], M_NB, M_PAGE)
    assert torch.equal(view, raw.view(M_NB, M_PAGE))


def test_non_dense_state_running_past_page():
    """A state whose rows are strided spans more bytes than numel: rows 2..3 of a (2, 4) int8 state
    with row stride 8 end at byte 12, past a 10-byte page (overlapping the next block)."""
    nb, page = 4, 10
    raw = torch.zeros(nb * page + 8, dtype=torch.int8)
    state = torch.as_strided(raw, (nb, 2, 4), (page, 8, 1))
    with pytest.raises(CopyError):
        page_view([state], nb, page)


def test_a_state_spans_its_one_element_and_an_empty_state_spans_none():
    """The page holds every byte a state spans: a one-element state in the next block's first byte is refused
    (copied, the neighbour's byte would be lost); an empty state (a conv state of kernel width 1) spans no
    byte, so it fits even at the page's very end."""
    nb, page = 4, 10
    raw = torch.zeros(nb * page + 8, dtype=torch.int8)
    body = torch.as_strided(raw, (nb, page), (page, 1))
    one = torch.as_strided(raw, (nb, 1), (page, 1), page)
    with pytest.raises(CopyError, match="exceeds the page"):
        page_view([body, one], nb, page)
    empty = torch.as_strided(raw, (nb, 3, 0), (page, 1, 1), page)
    assert torch.equal(page_view([body, empty], nb, page), body)


def test_missing_layer_is_a_copy_error():
    t = _bf16_cache(NB, HEADS, BS, TWO_HD)
    layout = SlotLayout(slot_bytes=PAGE, group_layers=[[("absent", 0, PAGE)]], group_factors=[1])
    with pytest.raises(CopyError, match="absent"):
        CopyEngine({"present": t}, _config(NB), layout, 1)


# --- (d) CopyResult -----------------------------------------------------------------------------


def test_copy_result_counts():
    engine, _, _ = _shared_attention_engine(num_slots=4, factor0=2, factor1=1)
    assert engine.group_block_bytes(0) == engine.group_block_bytes(1) == 2 * PAGE
    result = engine.store(0, [0, 0, 3, 3], [0, 1, 0, 1], [1, 2, 3, 4])
    assert isinstance(result, CopyResult)
    assert result.blocks == 4  # device blocks, not offload blocks
    assert result.nbytes == 4 * 2 * PAGE  # per device block: every layer's page
    assert result.pending_events is None and engine.poll(result)
    assert 0 < result.start_ns <= result.end_ns

    result = engine.load(1, [2], [0], [5])
    assert (result.blocks, result.nbytes) == (1, 2 * PAGE)
    assert engine.poll(result)

    empty = engine.load(0, [], [], [])
    assert (empty.blocks, empty.nbytes) == (0, 0)
    engine.fence_compute_stream()  # no-op on the CPU


# --- (d) the CUDA path's batched copy descriptors -------------------------------------------------


def memmove_batch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor) -> None:
    """What vLLM's `swap_blocks_batch` does with its three arrays, done on the CPU."""
    import ctypes

    for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        ctypes.memmove(dst, src, size)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A writable int8 view of `t`'s whole storage."""
    storage = t.untyped_storage()
    return torch.tensor([], dtype=torch.int8).set_(storage, 0, (storage.nbytes(),), (1,))


def _engines_with_their_storages():
    engine, t0, t1 = _shared_attention_engine(num_slots=4, factor0=2, factor1=1)
    yield "shared attention, factors 2 and 1", engine, [t0, t1]
    nb, ratio = 6, 2
    t = _bf16_cache(nb * ratio, HEADS, BS // ratio, TWO_HD)
    page = ratio * HEADS * (BS // ratio) * TWO_HD * 2
    layout = SlotLayout(slot_bytes=page, group_layers=[[("l", 0, page)]], group_factors=[1])
    yield "kernel-block split", CopyEngine({"l": t}, _config(nb), layout, 2), [t]
    engine, raw_a, raw_b, _ = _mamba_engine()
    yield "mamba pages", engine, [raw_a, raw_b]
    # vLLM's layer-interleaved allocation: one tensor, each block row holds every layer's page
    nb, layers, page = 5, 3, 48
    raw = _fill_random(torch.empty(nb * layers * page, dtype=torch.int8))
    caches = {f"l{i}": torch.as_strided(raw, (nb, page), (layers * page, 1), i * page) for i in range(layers)}
    layout = SlotLayout(slot_bytes=2 * layers * page, group_factors=[2],
                        group_layers=[[(f"l{i}", 2 * i * page, page) for i in range(layers)]])
    yield "interleaved layers", CopyEngine(caches, _config(nb), layout, 3), [raw]


JOBS = {  # (group, slots, subs, device blocks) per layout: a store, then loads to other blocks
    "shared attention, factors 2 and 1": [("store", 0, [1, 1, 3], [0, 1, 0], [2, 7, 11]),
                                          ("store", 1, [0, 2], [0, 0], [5, 0]),
                                          ("load", 0, [1, 3], [1, 0], [4, 9]), ("load", 1, [2], [0], [11])],
    "kernel-block split": [("store", 0, [1], [0], [5]), ("load", 0, [1], [0], [0])],
    "mamba pages": [("store", 0, [2, 0], [0, 0], [3, 6]), ("load", 0, [2, 0], [0, 0], [4, 0])],
    "interleaved layers": [("store", 0, [2, 2, 0], [0, 1, 1], [1, 4, 0]), ("load", 0, [2, 0], [1, 1], [3, 2])],
}


def test_copy_descriptors_move_exactly_the_bytes_the_block_copies_move():
    """The pointer triples the CUDA path hands to vLLM's `swap_blocks_batch`, executed with
    memmove, leave every device and host byte as the per-block copies do."""
    for name, engine, storages in _engines_with_their_storages():
        raws = [_raw(t) for t in storages] + [_raw(engine.host)]
        for direction, group, slots, subs, blocks in JOBS[name]:
            before = [r.clone() for r in raws]
            getattr(engine, direction)(group, slots, subs, blocks)  # the CPU path: a copy_ per block
            expected = [r.clone() for r in raws]
            for r, b in zip(raws, before):
                r.copy_(b)
            arrays = [torch.from_numpy(a) for a in copy_module.copy_descriptors(
                engine.groups[group], slots, subs, blocks, to_device=direction == "load")]
            assert len(arrays[0]) == len(blocks) * len(engine.groups[group])
            memmove_batch(*arrays)
            for r, e in zip(raws, expected):
                assert torch.equal(r, e), f"{name}: {direction} {blocks} moved other bytes"
            assert any(not torch.equal(b, e) for b, e in zip(before, expected))  # the job changed something


def test_a_job_addressing_slots_past_the_host_buffer_fails_without_copying(caplog):
    """A scheduler that sized its slots differently from this worker must never make it copy past
    its host buffer (on CUDA a raw address): the job fails, so a load is recomputed."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry.tracing import KVScopeTracing
    from connector.worker import KVScopeWorker

    engine, t0, _ = _shared_attention_engine(num_slots=4)
    worker = KVScopeWorker(None, engine.layout, engine.num_slots, ["full_attention", "full_attention"], 0,
                           KVScopeTracing.disabled())
    worker.engine = engine
    copied = []  # every copy the worker asked for: none of a refused job (on CUDA each is a raw address)
    for direction in ("load", "store"):
        copy = getattr(engine, direction)
        setattr(engine, direction, lambda group, slots, subs, blocks, copy=copy, **options: (
            copied.append((group, list(blocks))), copy(group, slots, subs, blocks, **options))[1])
    before = _block_bytes(t0, 2).clone()
    with caplog.at_level("ERROR", logger="connector.worker"):
        worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "a", STORE, [GroupTransfer(0, [3], [4], [0])])]))
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(2, "b", LOAD, [GroupTransfer(0, [2], [9], [0])])]))
        worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(3, "c", STORE, [GroupTransfer(0, [3], [3], [0])])]))
        # a negative slot or block would silently be the last one to a Python index
        worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(4, "d", STORE, [GroupTransfer(0, [2], [-1], [0])])]))
        worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(5, "e", STORE, [GroupTransfer(0, [-1], [2], [0])])]))
        # a piece past its slot's device blocks, a block past the cache
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(6, "f", LOAD, [GroupTransfer(0, [2], [3], [1])])]))
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(7, "g", LOAD, [GroupTransfer(0, [NB], [3], [0])])]))
        # more blocks than slots (the CPU path's zip would copy two of three and report success),
        # no pieces at all, a group this worker does not have
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(8, "h", LOAD, [GroupTransfer(0, [2, 3, 4], [1, 1], [0, 1])])]))
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(9, "i", LOAD, [GroupTransfer(0, [2], [1], [])])]))
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(10, "j", LOAD, [GroupTransfer(5, [2], [1], [0])])]))
        # two copies to one place: a device block (one block pool serves both groups), a slot piece
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(11, "k", LOAD, [GroupTransfer(0, [5], [3], [0]),
                                                                                 GroupTransfer(1, [5], [3], [0])])]))
        worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(12, "l", STORE, [GroupTransfer(0, [5, 6], [3, 3], [0, 0])])]))
        # one host slot in two groups (a slot holds one group's block): a load gives one group the
        # other's KV, a store writes both into it
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(13, "m", LOAD, [GroupTransfer(0, [5], [3], [0]),
                                                                                 GroupTransfer(1, [6], [3], [0])])]))
        worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(16, "p", STORE, [GroupTransfer(0, [5], [2], [0]),
                                                                                   GroupTransfer(1, [6], [2], [0])])]))
        # distinct slots in the two groups: well formed
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(17, "q", LOAD, [GroupTransfer(0, [5], [3], [0]),
                                                                                 GroupTransfer(1, [6], [1], [0])])]))
        # a load the scheduler failed at planning, well formed or not: never copied
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(14, "n", LOAD, [GroupTransfer(0, [7], [3], [0])],
                                                                failed_at_plan=True)]))
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(15, "o", LOAD, [], failed_at_plan=True)]))
    meta = worker.build_worker_meta()
    assert meta.failed_jobs == {1: 1, 2: 1, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1, 9: 1, 10: 1, 11: 1, 12: 1, 13: 1, 14: 1,
                                15: 1, 16: 1}
    assert meta.completed_jobs == {3: 1, 17: 1}
    failed_loads = {"b", "f", "g", "h", "i", "j", "k", "m", "n", "o"}
    assert worker.transfer_results() == (failed_loads | {"q"}, failed_loads)
    assert copied == [(0, [3]), (0, [5]), (1, [6])]  # jobs 3 and 17 only
    assert torch.equal(_block_bytes(t0, 2), before)
    assert sum("outside this worker's (4 slots" in r.getMessage() for r in caplog.records) == 1  # said once


def test_copy_streams_are_never_vllms_compute_stream_nor_each_other(monkeypatch):
    """torch's Stream() hands out pooled streams round robin: the compute stream can come back."""
    class _PoolStream:
        def __init__(self, handle):
            self.cuda_stream = handle

    pool = iter([7, 7, 8, 7, 8, 9])  # the compute stream (7) first, then the load stream (8) again
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _PoolStream(next(pool)))
    compute = _PoolStream(7)
    load = copy_module.own_stream("cuda:0", [compute])
    store = copy_module.own_stream("cuda:0", [compute, load])
    assert (load.cuda_stream, store.cuda_stream) == (8, 9)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _PoolStream(7))
    with pytest.raises(CopyError, match="stream pool is exhausted"):
        copy_module.own_stream("cuda:0", [compute])


def test_a_failed_job_is_traced_as_failed_copies_even_when_it_names_an_unknown_group():
    """With tracing on, a failed job records one ERROR copy span per group it names that this worker
    has (the unknown one has no kind to name); nothing escapes into the engine."""
    from opentelemetry.trace import StatusCode

    from connector.metadata import LOAD, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry.testing import in_memory_tracing
    from connector.worker import KVScopeWorker

    tracing, exporter = in_memory_tracing()
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = KVScopeWorker(None, engine.layout, engine.num_slots, ["full_attention", "sliding_window"], 1, tracing)
    worker.engine = engine
    carrier = (0xABC, 0xDEF, None)
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(1, [2], [1], [0]), GroupTransfer(5, [2], [1], [0])], trace_carrier=carrier)]))
    assert worker.build_worker_meta().failed_jobs == {1: 1}
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvscope.group.copy" and span.status.status_code is StatusCode.ERROR
    assert span.parent.span_id == 0xDEF and span.context.trace_id == 0xABC
    assert dict(span.attributes) == {"kvscope.group.index": 1, "kvscope.group.kind": "sliding_window",
                                     "kvscope.copy.direction": "load", "kvscope.copy.blocks": 0,
                                     "kvscope.copy.bytes": 0, "kvscope.worker.rank": 1, "kvscope.request.id": "a"}


def test_a_telemetry_error_neither_loses_a_job_nor_reaches_the_engine(caplog, monkeypatch):
    """Stats and spans are recorded after a job is reported: if recording raised, the job (and any
    finished after it) would stay unreported and the exception would stop the engine."""
    from connector.metadata import LOAD, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry.tracing import KVScopeTracing
    from connector.worker import KVScopeWorker

    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = KVScopeWorker(None, engine.layout, engine.num_slots, ["full_attention", "full_attention"], 0,
                           KVScopeTracing.disabled())
    worker.engine = engine

    def broken(*args, **kwargs):
        raise RuntimeError("a stats bug")

    from connector.telemetry import failures

    monkeypatch.setattr(failures, "_logged", set())
    monkeypatch.setattr(worker._stats, "record_copy", broken)
    with caplog.at_level("ERROR", logger="connector.telemetry.failures"):
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [GroupTransfer(0, [2], [1], [0])]),
                                                    TransferJob(2, "b", LOAD, [GroupTransfer(0, [3], [2], [0])])]))
    assert worker.build_worker_meta().completed_jobs == {1: 1, 2: 1}
    assert worker.transfer_results() == ({"a", "b"}, set())
    # logged once, with what it cost (not a job): a stats bug would log at every copy
    assert sum("telemetry failed in a copy's stats or spans" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("failing", ["poll", "poll and drain", "copy and drain"])
def test_a_device_error_asking_after_copies_fails_the_job_without_reaching_the_engine(caplog, monkeypatch, failing):
    """On CUDA, asking whether a copy is done (an event query, its timing) or waiting for copies
    can raise: the job fails and is reported (a load is recomputed, not left waiting for ever), the
    engine never sees the exception, and the next job goes on."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine, "poll" if "poll" in failing else "load", broken)
    if "drain" in failing:
        monkeypatch.setattr(engine, "drain", broken)
    with caplog.at_level("ERROR", logger="connector.worker"):
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [GroupTransfer(0, [2], [1], [0])])]))
        worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(2, "s", STORE, [GroupTransfer(0, [3], [2], [0])])]))
        assert worker.transfer_results() == ({"a"}, {"a"})
        monkeypatch.undo()  # the device works again
        worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(3, "b", LOAD, [GroupTransfer(0, [4], [3], [0])])]))
    meta = worker.build_worker_meta()
    assert meta.failed_jobs == ({1: 1, 2: 1} if "poll" in failing else {1: 1})
    assert meta.completed_jobs == ({3: 1} if "poll" in failing else {2: 1, 3: 1})
    assert worker.transfer_results() == ({"b"}, set())
    assert worker._in_flight == []
    assert any("CUDA error" in (r.exc_text or "") or (r.exc_info and "CUDA error" in str(r.exc_info[1]))
               for r in caplog.records)


# --- found by the mutation campaign of worker.py --------------------------------------------------


def _plain_worker(engine, rank=0, tracing=None):
    from connector.telemetry.tracing import KVScopeTracing
    from connector.worker import KVScopeWorker

    worker = KVScopeWorker(None, engine.layout, engine.num_slots, ["full_attention", "full_attention"], rank,
                           tracing or KVScopeTracing.disabled())
    worker.engine = engine
    return worker


def test_a_load_reading_a_lost_host_slot_fails_until_a_store_writes_that_slot_again():
    """Host data known to be gone must never be loaded (that KV is not there): such a load fails and is
    recomputed; a store to the slot makes it loadable again."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    def job(job_id, request_id, kind, block_id, slot):
        return TransferJob(job_id, request_id, kind, [GroupTransfer(0, block_ids=[block_id], slots=[slot], subs=[0])])

    worker.lost_slots = {2}
    worker.start_load_kv(KVScopeMetadata(loads=[job(1, "lost", LOAD, 1, 2), job(2, "kept", LOAD, 2, 3)]))
    assert worker.transfer_results() == ({"lost", "kept"}, {"lost"})
    worker.wait_for_save(KVScopeMetadata(stores=[job(3, "s", STORE, 5, 2)]))
    assert worker.lost_slots == set()
    worker.start_load_kv(KVScopeMetadata(loads=[job(4, "again", LOAD, 1, 2)]))
    assert worker.transfer_results() == ({"again"}, set())
    assert worker.build_worker_meta().failed_jobs == {1: 1}


@pytest.mark.parametrize("value, rank, fails", [("1", 1, True), (" 1 ", 1, True), ("1", 0, False), ("", 0, False)])
def test_the_fault_injection_variable_fails_the_loads_of_its_rank_only(monkeypatch, caplog, value, rank, fails):
    engine, _, _ = _shared_attention_engine(num_slots=4)
    monkeypatch.setenv("KVSCOPE_TEST_FAIL_LOADS_ON_RANK", value)
    with caplog.at_level(logging.WARNING, logger="connector.worker"):
        assert _plain_worker(engine, rank=rank).fail_all_loads is fails
    assert ("every load on worker rank" in caplog.text) is fails


def test_the_fault_injection_fails_every_load_of_the_worker_without_copying_and_leaves_its_stores_alone(monkeypatch):
    """KVSCOPE_TEST_FAIL_LOADS_ON_RANK stands for loads that fail on that worker (each is recomputed): none
    copies anything into the KV cache; stores still copy and complete."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob

    monkeypatch.setenv("KVSCOPE_TEST_FAIL_LOADS_ON_RANK", "0")
    engine, t0, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [GroupTransfer(0, [3], [1], [0])])]))
    before = _block_bytes(t0, 5)
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(2, "a", LOAD, [GroupTransfer(0, [5], [1], [0])])]))
    assert worker.transfer_results() == ({"a"}, {"a"})
    meta = worker.build_worker_meta()
    assert (meta.completed_jobs, meta.failed_jobs) == ({1: 1}, {2: 1})
    assert torch.equal(_block_bytes(t0, 5), before)


def test_a_step_without_finished_jobs_has_no_worker_metadata_but_still_hands_its_spans_over(monkeypatch):
    """vLLM sends worker metadata only when there is some; the step's spans leave at every step end."""
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    ended = []
    monkeypatch.setattr(worker.tracing, "end_step", lambda: ended.append(1))
    assert worker.build_worker_meta() is None
    assert worker.build_worker_meta() is None
    assert ended == [1, 1]


def test_shutdown_releases_the_pinned_host_tier():
    from connector.host_memory import PAGE_BYTES, HostBuffer

    engine, _, _ = _shared_attention_engine(num_slots=4)
    registered, released = [], []
    engine._host_buffer = HostBuffer(2, PAGE_BYTES, pin=True, register=lambda a, n: registered.append(a) or True,
                                     unregister=released.append)
    worker = _plain_worker(engine)
    worker.shutdown()
    assert registered and sorted(released) == sorted(registered)


@pytest.mark.parametrize("subs", [[0, -1], [-1, 0], [0, 1], [1, 0]],
                         ids=["neg-last", "neg-first", "big-last", "big-first"])
def test_a_job_with_one_slot_piece_out_of_range_among_good_ones_fails_without_copying(subs):
    """Every piece of a job is checked, not only the first or the largest: a negative one would be
    another slot's last piece to a Python index (on CUDA: an address before the slot)."""
    from connector.metadata import STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, _, _ = _shared_attention_engine(num_slots=4)  # one piece per slot in group 0
    worker = _plain_worker(engine)
    host_before = engine.host.clone()
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "a", STORE, [
        GroupTransfer(0, block_ids=[3, 4], slots=[1, 2], subs=subs)])]))
    assert worker.build_worker_meta().failed_jobs == {1: 1}
    assert torch.equal(engine.host, host_before)


def test_a_job_naming_vllms_null_block_fails_without_copying():
    """Block 0 is vLLM's null block, the placeholder of every skipped position: a load into it would write
    KV every sliding-window and Mamba group reads as padding, a store from it would offload padding under a
    real key. The planner never names it (it skips nulls); the worker, the last guard, refuses it too."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, t0, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    device_before, host_before = _block_bytes(t0, 0).clone(), engine.host.clone()
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(0, block_ids=[3, 0], slots=[1, 2], subs=[0, 0])])]))
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(2, "s", STORE, [
        GroupTransfer(0, block_ids=[0, 4], slots=[1, 2], subs=[0, 0])])]))
    assert worker.build_worker_meta().failed_jobs == {1: 1, 2: 1}
    assert torch.equal(_block_bytes(t0, 0), device_before) and torch.equal(engine.host, host_before)


@pytest.mark.parametrize("refusal", ["missing layer", "page too large"])
def test_a_refused_layout_is_refused_before_the_host_tier_is_allocated_or_pinned(monkeypatch, refusal):
    """Pinning registers the whole host tier (seconds for tens of GB); a layout refused after it left
    the registration behind, for the freed buffer's addresses."""
    from connector import copy_engine as copy_engine_module

    made = []
    monkeypatch.setattr(copy_engine_module, "HostBuffer", lambda *args, **kwargs: made.append(args))
    t0 = _bf16_cache(NB, HEADS, BS, TWO_HD)
    page = PAGE if refusal == "missing layer" else 2 * PAGE
    layout = SlotLayout(slot_bytes=2 * page, group_layers=[[("l0", 0, page), ("l1", page, page)]],
                        group_factors=[1])
    with pytest.raises(CopyError):
        CopyEngine({"l0": t0, "l1": t0} if refusal != "missing layer" else {"l0": t0}, _config(NB), layout, 4)
    assert made == []


# --- found by the mutation campaign of the worker side (worker, copy engine) ----------------------


def test_a_job_naming_the_group_just_past_the_last_fails_without_raising():
    """The number of groups is itself past the last group: a job naming it, with pieces to check, must
    fail (a load is recomputed), not raise an IndexError into vLLM's engine looking up its factor."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, _, _ = _shared_attention_engine(num_slots=4)  # groups 0 and 1
    worker = _plain_worker(engine)
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(2, block_ids=[0], slots=[2], subs=[0])])]))
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(2, "s", STORE, [
        GroupTransfer(2, block_ids=[1], slots=[3], subs=[0])])]))
    assert worker.build_worker_meta().failed_jobs == {1: 1, 2: 1}
    assert worker.transfer_results() == ({"a"}, {"a"})


def test_a_load_writing_one_device_block_twice_from_distinct_slots_fails_without_copying():
    """One block pool serves every group: a load whose two groups, or two pieces of one group, write
    the same device block leaves whichever copy landed last there (wrong KV), even from distinct slots."""
    from connector.metadata import LOAD, GroupTransfer, KVScopeMetadata, TransferJob

    engine, t0, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    before = [_block_bytes(t0, b) for b in (4, 5)]
    worker.start_load_kv(KVScopeMetadata(loads=[
        TransferJob(1, "two groups", LOAD, [GroupTransfer(0, block_ids=[4], slots=[1], subs=[0]),
                                            GroupTransfer(1, block_ids=[4], slots=[2], subs=[0])]),
        TransferJob(2, "one group", LOAD, [GroupTransfer(0, block_ids=[5, 5], slots=[1, 2], subs=[0, 0])])]))
    assert worker.build_worker_meta().failed_jobs == {1: 1, 2: 1}
    assert worker.transfer_results() == ({"two groups", "one group"}, {"two groups", "one group"})
    assert all(torch.equal(_block_bytes(t0, b), was) for b, was in zip((4, 5), before))


def test_a_load_reading_one_lost_host_slot_among_kept_ones_fails():
    """One block of a load whose host data is gone makes the whole load wrong KV: it fails (and is
    recomputed) though its other slots are intact."""
    from connector.metadata import LOAD, GroupTransfer, KVScopeMetadata, TransferJob

    engine, t0, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    worker.lost_slots = {2}
    before = [_block_bytes(t0, b) for b in (4, 5)]
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(0, block_ids=[4, 5], slots=[1, 2], subs=[0, 0])])]))
    assert worker.transfer_results() == ({"a"}, {"a"})
    assert all(torch.equal(_block_bytes(t0, b), was) for b, was in zip((4, 5), before))


def test_a_failed_job_naming_a_negative_group_records_no_copy_span_for_it():
    """A negative group index is no group of this worker (it fails the job), though to a Python index
    it is the last group: its ERROR copy span would name that group's kind and index -1."""
    from connector.metadata import LOAD, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry.testing import in_memory_tracing

    tracing, exporter = in_memory_tracing()
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine, tracing=tracing)
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(-1, block_ids=[0], slots=[2], subs=[0])], trace_carrier=(0xABC, 0xDEF, None))]))
    assert worker.build_worker_meta().failed_jobs == {1: 1}
    assert exporter.get_finished_spans() == ()


def test_a_parent_that_cannot_be_made_counts_every_copy_span_of_the_job_lost(monkeypatch):
    """Without their parent none of a job's copy spans is recorded: each is a record lost (one per
    group it copied) in kvscope_dropped_trace_records_total, not one for the whole job."""
    from connector.metadata import STORE, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry import failures
    from connector.telemetry.testing import in_memory_tracing

    monkeypatch.setattr(failures, "_logged", set())
    tracing, exporter = in_memory_tracing()
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine, tracing=tracing)

    def broken(carrier):
        raise RuntimeError("a carrier bug")

    monkeypatch.setattr(tracing, "parent_from_carrier", broken)
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [
        GroupTransfer(0, block_ids=[4], slots=[1], subs=[0]), GroupTransfer(1, block_ids=[5], slots=[2], subs=[0])],
        trace_carrier=(0xABC, 0xDEF, None))]))
    assert worker.build_worker_meta().completed_jobs == {1: 1}
    assert exporter.get_finished_spans() == ()
    assert worker.take_stats().data["dropped_trace_records"] == {"record_failed": 2}


def test_a_copy_span_that_fails_to_record_is_counted_lost_and_the_others_recorded(monkeypatch):
    """A fault recording one copy span of a job costs that span (counted lost), never its sibling's."""
    from connector.metadata import STORE, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry import failures
    from connector.telemetry.testing import in_memory_tracing

    monkeypatch.setattr(failures, "_logged", set())
    tracing, exporter = in_memory_tracing()
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine, tracing=tracing)
    record, calls = tracing.record, []

    def failing_first(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a span bug")
        return record(*args)

    monkeypatch.setattr(tracing, "record", failing_first)
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [
        GroupTransfer(0, block_ids=[4], slots=[1], subs=[0]), GroupTransfer(1, block_ids=[5], slots=[2], subs=[0])],
        trace_carrier=(0xABC, 0xDEF, None))]))
    assert worker.build_worker_meta().completed_jobs == {1: 1}
    (span,) = exporter.get_finished_spans()
    assert span.attributes["kvscope.group.index"] == 1
    assert worker.take_stats().data["dropped_trace_records"] == {"record_failed": 1}


def test_a_cpu_copy_is_timed_from_before_its_first_block_to_after_its_last(monkeypatch):
    """Copy durations (kvscope_copy_duration_seconds, copy spans) are the wall clock around the copies."""
    engine, _, _ = _shared_attention_engine(num_slots=4)
    ticks = iter(range(1_000, 1_000_000, 4_000))
    monkeypatch.setattr(copy_module.time, "time_ns", lambda: next(ticks))
    result = engine.store(0, [1, 2], [0, 0], [3, 4])
    assert (result.start_ns, result.end_ns) == (1_000, 5_000)


def test_a_jobs_report_leaves_with_one_steps_worker_metadata_only():
    """The scheduler counts a job's reports until every worker has sent one: a worker reporting a job
    again at later steps would stand for another worker, and with tensor parallelism a job would be
    taken for done (its host slots and blocks released) while another worker still copies it."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [GroupTransfer(0, [2], [1], [0])])]))
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(2, "s", STORE, [GroupTransfer(0, [3], [1], [0])])]))
    meta = worker.build_worker_meta()
    assert (meta.completed_jobs, meta.failed_jobs) == ({1: 1, 2: 1}, {})
    assert worker.build_worker_meta() is None
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(3, "t", STORE, [GroupTransfer(0, [4], [2], [0])])]))
    assert worker.build_worker_meta().completed_jobs == {3: 1}


def test_the_reports_of_one_job_from_several_workers_add_up():
    """vLLM aggregates the workers' metadata of a step: a job is reported by each worker that finished
    it, and the scheduler waits for all of them before it releases the job's slots and blocks."""
    from connector.metadata import KVScopeWorkerMetadata

    first = KVScopeWorkerMetadata(completed_jobs={1: 1, 2: 1}, failed_jobs={3: 1})
    second = KVScopeWorkerMetadata(completed_jobs={1: 1}, failed_jobs={3: 1, 4: 1})
    total = first.aggregate(second).aggregate(KVScopeWorkerMetadata(completed_jobs={1: 1}, failed_jobs={3: 1}))
    assert (total.completed_jobs, total.failed_jobs) == ({1: 3, 2: 1}, {3: 3, 4: 1})
    assert (first.completed_jobs, first.failed_jobs) == ({1: 1, 2: 1}, {3: 1})  # left as it was


def test_a_job_naming_more_device_blocks_than_host_slots_fails_without_copying():
    """Every device block of a job needs its own slot and piece: a load of two blocks from one slot
    would fill one of them and report both loaded (the other keeps stale KV); it fails instead."""
    from connector.metadata import LOAD, GroupTransfer, KVScopeMetadata, TransferJob

    engine, t0, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    before = [_block_bytes(t0, b) for b in (4, 5)]
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(0, block_ids=[4, 5], slots=[1], subs=[0])])]))
    assert worker.transfer_results() == ({"a"}, {"a"})
    assert all(torch.equal(_block_bytes(t0, b), was) for b, was in zip((4, 5), before))


def test_a_job_whose_group_has_nothing_to_copy_copies_its_other_groups():
    """A group with no blocks in a job is nothing to check or copy, not an error: the job completes
    with the other group's blocks stored."""
    from connector.metadata import STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, t0, t1 = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [
        GroupTransfer(0, block_ids=[], slots=[], subs=[]), GroupTransfer(1, block_ids=[6], slots=[2], subs=[0])])]))
    assert worker.build_worker_meta().completed_jobs == {1: 1}
    assert torch.equal(engine.host[2, :PAGE], _block_bytes(t0, 6))
    assert torch.equal(engine.host[2, PAGE : 2 * PAGE], _block_bytes(t1, 6))


def test_a_store_to_lost_slots_of_several_groups_makes_every_one_of_them_loadable_again():
    """A store writes each of its slots anew, in every group it copies: none of them is lost any more,
    so later loads from them are hits, not failures recomputed."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    worker.lost_slots = {1, 2}
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [
        GroupTransfer(0, block_ids=[4], slots=[1], subs=[0]), GroupTransfer(1, block_ids=[5], slots=[2], subs=[0])])]))
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(2, "a", LOAD, [GroupTransfer(0, [7], [1], [0])]),
                                                TransferJob(3, "b", LOAD, [GroupTransfer(1, [8], [2], [0])])]))
    assert worker.transfer_results() == ({"a", "b"}, set())


def test_a_store_of_several_device_blocks_into_the_pieces_of_one_slot_round_trips():
    """With offloaded blocks of several device blocks, a job writes one slot's pieces, one per device
    block: the same slot with distinct pieces is no double write, and a load gives the blocks back."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob

    engine, t0, t1 = _shared_attention_engine(num_slots=4, factor0=2)
    worker = _plain_worker(engine)
    stored = [(_block_bytes(t0, b), _block_bytes(t1, b)) for b in (4, 5)]
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [
        GroupTransfer(0, block_ids=[4, 5], slots=[1, 1], subs=[0, 1])])]))
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(2, "a", LOAD, [
        GroupTransfer(0, block_ids=[8, 9], slots=[1, 1], subs=[0, 1])])]))
    assert worker.transfer_results() == ({"a"}, set())
    assert worker.build_worker_meta().completed_jobs == {1: 1, 2: 1}
    for block, (was0, was1) in zip((8, 9), stored):
        assert torch.equal(_block_bytes(t0, block), was0) and torch.equal(_block_bytes(t1, block), was1)


def test_a_job_whose_second_group_addresses_past_the_host_buffer_fails_before_its_first_group_copies():
    """Every group of a job is checked before any copies: a load failing only at its second group would
    already have written the first group's device blocks (on CUDA the bad one is a raw address)."""
    from connector.metadata import LOAD, GroupTransfer, KVScopeMetadata, TransferJob

    engine, t0, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)
    before = _block_bytes(t0, 4)
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(0, block_ids=[4], slots=[1], subs=[0]), GroupTransfer(1, block_ids=[5], slots=[4], subs=[0])])]))
    assert worker.transfer_results() == ({"a"}, {"a"})
    assert torch.equal(_block_bytes(t0, 4), before)


def test_a_copy_span_names_its_group_blocks_bytes_worker_and_request_and_lasts_the_copy(monkeypatch):
    """A traced job's copy span per group says what moved (blocks, bytes, direction), where (group,
    kind, worker rank) and for whom, from the copy's first block to its last; the copy duration metric
    (kvscope_copy_duration_seconds) has that length in seconds."""
    from itertools import count

    from connector.metadata import STORE, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry.testing import in_memory_tracing

    tracing, exporter = in_memory_tracing()
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine, rank=1, tracing=tracing)
    ticks = count(1_000, 4_000)
    monkeypatch.setattr(copy_module.time, "time_ns", lambda: next(ticks))
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [
        GroupTransfer(0, block_ids=[4, 5], slots=[1, 2], subs=[0, 0])], trace_carrier=(0xABC, 0xDEF, None))]))
    (span,) = exporter.get_finished_spans()
    assert dict(span.attributes) == {"kvscope.group.index": 0, "kvscope.group.kind": "full_attention",
                                     "kvscope.copy.direction": "store", "kvscope.copy.blocks": 2,
                                     "kvscope.copy.bytes": 2 * engine.group_block_bytes(0),
                                     "kvscope.worker.rank": 1, "kvscope.request.id": "s"}
    assert span.end_time - span.start_time == 4_000
    assert list(worker.take_stats().data["copy_duration_s"].values()) == [[pytest.approx(4e-6)]]


def test_a_failing_end_of_step_in_tracing_still_reports_the_steps_jobs(monkeypatch):
    """The step's job reports must reach the scheduler whatever tracing does: a job never reported
    keeps its request waiting (a load) or its slots and blocks held (a store) for ever."""
    from connector.metadata import STORE, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry import failures

    monkeypatch.setattr(failures, "_logged", set())
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)

    def broken():
        raise RuntimeError("an exporter bug")

    monkeypatch.setattr(worker.tracing, "end_step", broken)
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [GroupTransfer(0, [4], [1], [0])])]))
    assert worker.build_worker_meta().completed_jobs == {1: 1}


def test_a_failing_count_of_lost_span_records_still_hands_over_the_copy_stats(monkeypatch):
    """The worker's stats (copied blocks and bytes) reach vLLM's metrics even when tracing cannot say
    how many span records it lost."""
    from connector.metadata import STORE, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry import failures

    monkeypatch.setattr(failures, "_logged", set())
    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = _plain_worker(engine)

    def broken():
        raise RuntimeError("a tracing bug")

    monkeypatch.setattr(worker.tracing, "take_lost_records", broken)
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [
        GroupTransfer(0, [4, 5], [1, 2], [0, 0])])]))
    assert sum(worker.take_stats().data["copy_blocks"].values()) == 2


def test_a_failed_job_naming_the_group_just_past_the_last_still_traces_its_known_groups(monkeypatch):
    """The number of groups is no group of this worker: the failed job's ERROR copy span for a group
    it does have is recorded, stamped when the failure is reported, not lost with the unknown one."""
    from connector import worker as worker_module
    from connector.metadata import LOAD, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry.testing import in_memory_tracing

    tracing, exporter = in_memory_tracing()
    engine, _, _ = _shared_attention_engine(num_slots=4)  # groups 0 and 1
    worker = _plain_worker(engine, tracing=tracing)
    monkeypatch.setattr(worker_module.time, "time_ns", lambda: 1_764_500_000_000_000_000)
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(1, block_ids=[4], slots=[1], subs=[0]), GroupTransfer(2, block_ids=[5], slots=[2], subs=[0])],
        trace_carrier=(0xABC, 0xDEF, None))]))
    assert worker.build_worker_meta().failed_jobs == {1: 1}
    (span,) = exporter.get_finished_spans()
    assert span.attributes["kvscope.group.index"] == 1
    assert span.start_time == span.end_time == 1_764_500_000_000_000_000


def test_copy_stats_are_labelled_with_each_copys_own_group_kind_and_direction():
    """kvscope_copy_* metrics are per group, group kind and direction: a job's copies of two groups,
    stored then loaded, count under their own labels, not under the first group's or as stores."""
    from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob
    from connector.telemetry.metrics import copy_key
    from connector.telemetry.tracing import KVScopeTracing
    from connector.worker import KVScopeWorker

    engine, _, _ = _shared_attention_engine(num_slots=4)
    worker = KVScopeWorker(None, engine.layout, engine.num_slots, ["full_attention", "sliding_window"], 0,
                           KVScopeTracing.disabled())
    worker.engine = engine
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "s", STORE, [
        GroupTransfer(0, block_ids=[4], slots=[1], subs=[0]),
        GroupTransfer(1, block_ids=[5, 6], slots=[2, 3], subs=[0, 0])])]))
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(2, "a", LOAD, [
        GroupTransfer(1, block_ids=[7, 8], slots=[2, 3], subs=[0, 0])])]))
    assert worker.take_stats().data["copy_blocks"] == {copy_key(0, "full_attention", "store"): 1,
                                                       copy_key(1, "sliding_window", "store"): 2,
                                                       copy_key(1, "sliding_window", "load"): 2}
