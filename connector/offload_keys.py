"""Host keys of offloaded blocks: ``(group index, hash)``, the hash being vLLM's block hash of the
offloaded block's last hash block.

vLLM hashes a request's tokens every ``hash_block_size`` tokens (`request.block_hashes`, each chained
through all before it); an offloaded block spans ``hashes_per_block`` of them, so its last one names
the whole prefix up to the block's end, and exists once the block's last token is known.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class OffloadKeys:
    """Where an offloaded block's key hash is among a request's block hashes."""

    def __init__(self, hashes_per_block: int):
        if hashes_per_block <= 0:
            raise ValueError(f"an offloaded block spans at least one hash block, got {hashes_per_block}")
        self.hashes_per_block = hashes_per_block

    def count(self, block_hashes: Sequence) -> int:
        """Offloaded blocks whose key exists (their last token is known)."""
        return len(block_hashes) // self.hashes_per_block

    def hash_of(self, block_hashes: Sequence, k: int) -> Hashable | None:
        """The key hash of offloaded block ``k``; None while it does not exist yet."""
        i = (k + 1) * self.hashes_per_block - 1
        return block_hashes[i] if i < len(block_hashes) else None

    def hashes(self, block_hashes: Sequence) -> list:
        """The key hash of every offloaded block whose key exists, in order."""
        step = self.hashes_per_block
        return [block_hashes[i] for i in range(step - 1, len(block_hashes), step)]
