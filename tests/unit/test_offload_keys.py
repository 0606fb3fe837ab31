"""OffloadKeys: an offloaded block's key is the hash of its last hash block."""

from __future__ import annotations

import pytest

from connector.offload_keys import OffloadKeys


def test_an_offloaded_blocks_key_is_its_last_hash_block_and_exists_once_that_does():
    keys = OffloadKeys(4)  # 4 hash blocks an offloaded block
    hashes = [f"h{i}" for i in range(10)]  # 2 whole offloaded blocks and half of a third
    assert keys.count(hashes) == 2
    assert keys.hashes(hashes) == ["h3", "h7"]
    assert [keys.hash_of(hashes, k) for k in range(3)] == ["h3", "h7", None]


def test_an_offloaded_block_spans_at_least_one_hash_block():
    with pytest.raises(ValueError, match="at least one hash block"):
        OffloadKeys(0)


def test_an_offloaded_block_of_one_hash_block_is_keyed_by_each_hash():
    keys = OffloadKeys(1)  # offload block size == hash block size: the common default
    hashes = ["h0", "h1", "h2"]
    assert keys.count(hashes) == 3
    assert keys.hashes(hashes) == hashes
    assert [keys.hash_of(hashes, k) for k in range(4)] == ["h0", "h1", "h2", None]
