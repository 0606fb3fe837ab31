"""The host tier's buffer: page aligned, and registered for DMA in chunks (`host_memory`).

The registration itself (`cudaHostRegister`) needs CUDA; here it is a recording stand-in, and the
chunking it is given is checked for every size."""

from __future__ import annotations

import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector import host_memory
from connector.host_memory import PAGE_BYTES, HostBuffer, register_chunks

PAGE = 4096


@settings(deadline=None)  # a busy 2-core machine can stall one example past 200 ms
@given(total=st.integers(0, 1 << 24), row=st.integers(1, 1 << 16), max_chunk=st.integers(PAGE, 1 << 22))
def test_chunks_cover_the_buffer_within_the_limit_ending_on_pages(total, row, max_chunk):
    max_chunk = max_chunk // PAGE * PAGE
    chunks = register_chunks(total, row, page=PAGE, max_chunk=max_chunk)
    assert sum(size for _, size in chunks) == total
    offset = 0
    for start, size in chunks:
        assert start == offset and 0 < size <= max_chunk
        offset += size
    if len(chunks) > 1:
        assert all(start % PAGE == 0 for start, _ in chunks)  # two registrations never share a page
        if math.lcm(row, PAGE) <= max_chunk:
            assert all(start % row == 0 for start, _ in chunks)  # no block copy spans two registrations


def test_a_buffer_within_the_limit_is_one_registration():
    assert register_chunks(10 * PAGE + 3, 7, page=PAGE, max_chunk=64 * PAGE) == [(0, 10 * PAGE + 3)]
    assert register_chunks(0, 7) == []
    # 13 rows fit the limit, though a chunk ending on rows and pages would hold 12: still one
    assert register_chunks(13 * 6144, 6144, page=PAGE, max_chunk=20 * PAGE) == [(0, 13 * 6144)]
    # at the limit itself too, though chunks ending on rows and pages (12 KiB) would cut it in two
    assert register_chunks(20 * PAGE, 6144, page=PAGE, max_chunk=20 * PAGE) == [(0, 20 * PAGE)]


def test_one_registration_holds_at_most_vllms_64_gib():
    """vLLM's bound for one `cudaHostRegister` (the driver's): a larger tier is registered in chunks of 64 GiB."""
    assert register_chunks(64 << 30, PAGE) == [(0, 64 << 30)]
    assert register_chunks((64 << 30) + PAGE, PAGE) == [(0, 64 << 30), (64 << 30, PAGE)]


def test_the_buffer_is_page_aligned_and_not_registered_unless_pinned():
    calls = []
    buffer = HostBuffer(5, 3000, pin=False, register=lambda a, n: calls.append((a, n)) or True,
                        unregister=calls.append)
    assert buffer.tensor.shape == (5, 3000) and buffer.tensor.data_ptr() % PAGE_BYTES == 0
    buffer.tensor[4, 2999] = 7  # the whole range is ours
    assert calls == [] and not buffer.pinned


def test_a_pinned_buffer_is_registered_in_chunks_and_released():
    registered, released = [], []
    buffer = HostBuffer(64, 3 * PAGE_BYTES, pin=True, register=lambda a, n: registered.append((a, n)) or True,
                        unregister=released.append, max_chunk=16 * PAGE_BYTES)
    base = buffer.tensor.data_ptr()
    assert buffer.pinned
    assert [(a - base, n) for a, n in registered] == register_chunks(64 * 3 * PAGE_BYTES, 3 * PAGE_BYTES,
                                                                     max_chunk=16 * PAGE_BYTES)
    assert len(registered) > 1
    buffer.release()
    assert sorted(released) == sorted(a for a, _ in registered) and not buffer.pinned


def test_a_failed_registration_leaves_the_buffer_pageable_and_nothing_registered(caplog):
    registered, released = [], []

    def register(address, size):
        if len(registered) == 2:
            return False
        registered.append(address)
        return True

    buffer = HostBuffer(64, 3 * PAGE_BYTES, pin=True, register=register, unregister=released.append,
                        max_chunk=16 * PAGE_BYTES)
    assert not buffer.pinned and sorted(released) == sorted(registered)
    assert "stays pageable" in caplog.text
    buffer.tensor.fill_(1)  # still usable


def test_after_a_failed_registration_no_later_chunk_is_registered():
    """The first failure leaves the whole buffer pageable: a later chunk the driver would accept must
    not stay pinned behind a buffer that reports itself pageable."""
    calls, registered = [], []

    def register(address, size):
        calls.append(address)
        if len(calls) == 2:
            return False
        registered.append(address)
        return True

    buffer = HostBuffer(64, 3 * PAGE_BYTES, pin=True, register=register, unregister=registered.remove,
                        max_chunk=16 * PAGE_BYTES)
    assert len(calls) == 2 and registered == [] and not buffer.pinned


def test_without_a_register_function_the_buffer_is_pinned_through_vllms_host_register(monkeypatch):
    """The production path (`CopyEngine` passes neither function): vLLM's `host_register`/`host_unregister`."""
    registered, released = [], []
    monkeypatch.setattr(host_memory, "_vllm_host_register",
                        lambda: (lambda a, n: registered.append((a, n)) or True, released.append))
    buffer = HostBuffer(4, PAGE_BYTES, pin=True)
    assert buffer.pinned and registered == [(buffer.tensor.data_ptr(), 4 * PAGE_BYTES)]
    buffer.release()
    assert released == [buffer.tensor.data_ptr()] and not buffer.pinned


def test_a_buffer_given_one_of_register_and_unregister_pins_through_vllms_pair(monkeypatch):
    """Registration and release go through one pair of functions: with only a register given, `release`
    would have nothing to undo it with (a failure where the engine frees the tier); with only an
    unregister, nothing to register with."""
    registered, released, own = [], [], []
    monkeypatch.setattr(host_memory, "_vllm_host_register",
                        lambda: (lambda a, n: registered.append(a) or True, released.append))
    for one_of_the_pair in ({"register": lambda a, n: own.append(a) or True}, {"unregister": own.append}):
        buffer = HostBuffer(4, PAGE_BYTES, pin=True, **one_of_the_pair)
        buffer.release()
        assert registered[-1] == released[-1] == buffer.tensor.data_ptr() and not buffer.pinned
    assert own == [] and len(registered) == len(released) == 2


def test_the_buffer_is_pinned_through_vllms_own_host_register_where_vllm_has_it():
    vllm_host_register = pytest.importorskip("vllm.v1.kv_offload.cpu.host_register")
    assert host_memory._vllm_host_register() == (vllm_host_register.host_register,
                                                 vllm_host_register.host_unregister)


def test_a_vllm_without_host_register_leaves_the_buffer_pageable_and_says_so(monkeypatch, caplog):
    """Registering then 'fails' at once: the tier is not reported pinned while it is not, and the log says why
    copies are slower."""
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.cpu.host_register", None)  # its import fails
    buffer = HostBuffer(4, PAGE_BYTES, pin=True)
    assert not buffer.pinned and "stays pageable" in caplog.text
    buffer.release()


@pytest.mark.parametrize("row", [PAGE, 3 * PAGE, 1000])
def test_chunks_end_on_rows_where_a_chunk_of_whole_rows_fits(row):
    chunks = register_chunks(5000 * row, row, page=PAGE, max_chunk=512 * PAGE)
    assert len(chunks) > 1
    for start, _ in chunks:
        assert start % row == 0 and start % PAGE == 0


def test_rows_too_large_to_end_chunks_on_end_them_on_pages():
    row = 4097  # lcm with the page: 16 MiB, over the limit
    chunks = register_chunks(1000 * row, row, page=PAGE, max_chunk=512 * PAGE)
    assert len(chunks) > 1 and all(start % PAGE == 0 for start, _ in chunks)
