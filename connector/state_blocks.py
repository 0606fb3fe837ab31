"""Which Mamba state blocks hold the state at their own end: the only ones a store may key by position.

In vLLM's align mode, block ``i`` of a Mamba group stands for the state after ``(i + 1) *
block_size`` tokens, but its position alone does not say what it holds:
- a prompt's last chunk saves a checkpoint into the block before its last one, holding the state at
  the last hash boundary before the prompt's end: not that block's end once hash blocks are finer
  than state blocks (vLLM's partial hash hits), or when EAGLE drops a block;
- a block that no forward ended in holds no state, or a stale one.

Two witnesses say a block holds its own end's state. vLLM's prefix cache keys it for exactly that
many tokens (`block_hash_num_tokens`, set when vLLM schedules the step that writes the block, and
re-keyed for a checkpoint). Or a forward of the request ended exactly there, so vLLM's runner wrote
the state after that step into it: decode states past the prompt, which vLLM does not key. A block
keyed for another number of tokens is never stored, nor one a forward started inside and ran past:
it keeps the state at that start (a partial prefix-cache hit's private copy), even where vLLM,
keeping every state (`prefix_cache_retention_interval` None or periodic), keys it for its end. That
holds for every request: another one may find such a block in vLLM's prefix cache under that key, so
the fact is kept per device block (with vLLM's key of it) until vLLM gives the block out anew.

A request that resumes at such a block's end (vLLM gives it as a prefix hit: its align mix-up) computes
every later state from the wrong one: none of its states from there on is stored, and its blocks from
there on are kept as wrong too, for other requests that reach them through vLLM's prefix cache. Not
with drafts: a decode step starts inside a block and leaves it while vLLM's postprocess copies the right
state into it, and the next step starts at its end reading the running column, not that block (marking
those would refuse correct states). Nor for a partial hit inside a block (a private copy of another).

A decode state is right but not recompute's: a decode step runs the recurrent kernel, one token at a
time, where a prefill of the same tokens runs the chunked one, and in bf16 they part. So by default
(`mamba_decode_states` false) only states a forward within the prompt left are witnessed by their
ends (vLLM keys the rest it keeps): kvscope stores the Mamba states vLLM's own prefix cache would
serve, and no others. With it true, decode states too: a conversation's next turn loads through the
previous reply.
"""

from __future__ import annotations

from .groups import GroupKind, GroupLayout
from .planning import NULL_BLOCK_ID

_UNSEEN = -1  # no forward ended or started in the block: not a block id
_WRONG_FROM = "wrong from"  # witnessed[(_WRONG_FROM, group)]: the block index from which its states are wrong


class StateBlocks:
    """The Mamba groups of a layout, and the exact forward ends each request's blocks witnessed."""

    def __init__(self, layouts: list[GroupLayout], speculative: bool, decode_states: bool = False):
        self.groups = [(layout.index, layout.block_size) for layout in layouts if layout.kind is GroupKind.MAMBA]
        # With drafts a forward's end is not where its state is kept (the accepted draft decides), and
        # under async scheduling vLLM counts drafts as computed before it knows: only keys witness.
        self.forward_ends_witness = not speculative
        # whether a forward past the prompt (a decode step, or a resumed prefill vLLM keys) witnesses
        # the state it ends at (`mamba_decode_states`)
        self.decode_states = decode_states
        # device block id -> vLLM's key of it, for keyed blocks holding another state than that key's: a
        # forward started inside and left them, or computed them from such a state (for every request:
        # others reach them through vLLM's prefix cache); until given out anew
        self._wrong_states: dict[int, object] = {}

    def note_forward(self, witnessed: dict, start: int, end: int, blocks_of, prompt_tokens: int) -> None:
        """A forward of the request (of ``prompt_tokens`` prompt tokens) computes tokens [start, end).
        The block holding its last position then holds the state after ``end``; a block it started
        inside and left holds the state at ``start`` for good (``witnessed``: (group, block index) ->
        block id, or None for such a block; per request). ``blocks_of()`` gives vLLM's blocks of the
        request per group, asked for only at a block's end or one a forward leaves."""
        group_blocks = None
        tracks_wrong = self.forward_ends_witness and bool(self._wrong_states)
        ends_witness = self.forward_ends_witness and (self.decode_states or start < prompt_tokens)
        for g, size in self.groups:
            if tracks_wrong and start and not start % size and (_WRONG_FROM, g) not in witnessed:
                # resumes from the state in the block ending at `start`: a wrong one taints the rest
                group_blocks = group_blocks or blocks_of()
                index = start // size - 1
                if index < len(group_blocks[g]) and self._is_wrong(group_blocks[g][index]):
                    witnessed[(_WRONG_FROM, g)] = index + 1
            if start % size and end > (start // size + 1) * size:
                index = start // size
                witnessed[(g, index)] = None
                group_blocks = group_blocks or blocks_of()
                if index < len(group_blocks[g]):
                    self._mark_wrong(group_blocks[g][index])
            wrong_from = witnessed.get((_WRONG_FROM, g)) if tracks_wrong else None
            if wrong_from is not None and end > 0:
                # every block it wrote from there on (its ends, its prompt's checkpoint) is wrong too,
                # under the keys vLLM gives them now (a checkpoint is keyed late: marked again each forward)
                group_blocks = group_blocks or blocks_of()
                for block in group_blocks[g][wrong_from:(end - 1) // size + 1]:
                    self._mark_wrong(block)
            if not ends_witness or end <= 0 or end % size:
                continue
            group_blocks = group_blocks or blocks_of()
            index, blocks = end // size - 1, group_blocks[g]
            if index < len(blocks) and blocks[index].block_id != NULL_BLOCK_ID:
                witnessed[(g, index)] = blocks[index].block_id

    def given_out_anew(self, block_ids) -> None:
        """vLLM allocates these device blocks afresh (not found in its prefix cache): whatever a forward
        left in them before is gone."""
        wrong_states = self._wrong_states
        if wrong_states:
            for block_id in block_ids:
                wrong_states.pop(block_id, None)

    def holds_own_state(self, block, g: int, index: int, size: int, witnessed: dict) -> bool:
        """Whether vLLM's block ``block``, at ``index`` of group ``g``, holds the state after
        ``(index + 1) * size`` tokens."""
        seen = witnessed.get((g, index), _UNSEEN)
        if seen is None:
            return False  # a forward started inside it and went on: it keeps the state at that start
        wrong_from = witnessed.get((_WRONG_FROM, g))
        if wrong_from is not None and index >= wrong_from:
            return False  # computed from a wrong state the request resumed from
        keyed_tokens = block.block_hash_num_tokens
        if keyed_tokens is not None:
            if self._is_wrong(block):
                return False  # another request's forward started inside it and went on, under this key
            return keyed_tokens == (index + 1) * size
        return seen == block.block_id

    def _mark_wrong(self, block) -> None:
        if block.block_id != NULL_BLOCK_ID and block.block_hash is not None:
            self._wrong_states[block.block_id] = block.block_hash

    def _is_wrong(self, block) -> bool:
        return block.block_hash is not None and self._wrong_states.get(block.block_id) == block.block_hash
