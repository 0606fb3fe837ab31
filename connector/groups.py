"""KV-group description shared by the pure planning code and the vLLM adapters."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GroupKind(str, enum.Enum):
    """What a KV group holds; the value is the `kvscope.group.kind` attribute and metric label."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One KV cache group as the planner needs it: no vLLM types."""

    index: int
    kind: GroupKind
    block_size: int  # tokens per device block of this group
    # SLIDING_WINDOW only: tokens vLLM keeps behind the next one, the window plus the trailing
    # tokens multi-module MTP may prefill again (vLLM's `extra_retained_tokens`)
    sliding_window: int | None = None

    def blocks_per_offload_block(self, offload_block_size: int) -> int:
        return offload_block_size // self.block_size

    def first_retained_token(self, num_computed_tokens: int) -> int:
        """First token whose KV the engine keeps once `num_computed_tokens` are computed.

        Mirrors vLLM's `get_num_skipped_tokens`: a sliding window of W keeps the last
        W - 1 tokens; Mamba keeps only the state at the last computed token.
        """
        if self.kind is GroupKind.SLIDING_WINDOW:
            assert self.sliding_window is not None
            return max(0, num_computed_tokens - self.sliding_window + 1)
        if self.kind is GroupKind.MAMBA:
            return max(0, num_computed_tokens - 1)
        return 0
