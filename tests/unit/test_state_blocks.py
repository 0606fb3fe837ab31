"""Which Mamba blocks a store may key by position (`connector.state_blocks`), without vLLM.

Under vLLM's scheduler (align mode, partial hash hits, checkpoints, decode states) this is tested in
tests/compat (`test_mamba_states_*`, `test_a_conversation_turn_loads_mamba_states_*`)."""

from __future__ import annotations

from types import SimpleNamespace

from connector.groups import GroupKind, GroupLayout
from connector.planning import NULL_BLOCK_ID
from connector.state_blocks import StateBlocks

LAYOUTS = [GroupLayout(0, GroupKind.MAMBA, 64), GroupLayout(1, GroupKind.FULL_ATTENTION, 16)]


def _block(block_id: int, keyed_tokens: int | None = None):
    return SimpleNamespace(block_id=block_id, block_hash_num_tokens=keyed_tokens)


def test_a_block_keyed_for_its_own_end_holds_its_state():
    assert StateBlocks.holds_own_state(_block(7, 192), 0, 2, 64, {})


def test_a_block_keyed_for_another_boundary_never_does_even_if_a_forward_ended_there():
    # a prefill checkpoint at the last 16-token hash boundary, in the block before the last
    assert not StateBlocks.holds_own_state(_block(7, 176), 0, 2, 64, {(0, 2): 7})


def test_an_unkeyed_block_holds_its_state_only_if_a_forward_ended_in_it():
    assert StateBlocks.holds_own_state(_block(7), 0, 2, 64, {(0, 2): 7})
    assert not StateBlocks.holds_own_state(_block(7), 0, 2, 64, {})
    assert not StateBlocks.holds_own_state(_block(8), 0, 2, 64, {(0, 2): 7})  # the block was given out again
    assert not StateBlocks.holds_own_state(_block(NULL_BLOCK_ID), 0, 2, 64, {})


def test_forward_ends_are_witnessed_at_block_ends_only():
    states, witnessed, asked = StateBlocks(LAYOUTS, speculative=False), {}, []

    def block_ids():
        asked.append(1)
        return [[NULL_BLOCK_ID, 11, 12, NULL_BLOCK_ID], list(range(20, 36))]

    states.note_forward(witnessed, 0, 100, block_ids)
    assert witnessed == {} and not asked  # not a state block's end: vLLM is not asked
    states.note_forward(witnessed, 100, 128, block_ids)
    states.note_forward(witnessed, 128, 192, block_ids)
    states.note_forward(witnessed, 192, 256, block_ids)  # a null block there: nothing to witness
    assert witnessed == {(0, 1): 11, (0, 2): 12}


def test_a_block_a_forward_started_inside_and_left_keeps_that_state_whatever_its_key():
    states, witnessed = StateBlocks(LAYOUTS, speculative=True), {}
    states.note_forward(witnessed, 80, 128, lambda: [[0, 11], []])  # ends at the block's end: not left
    assert witnessed == {}
    states.note_forward(witnessed, 80, 300, lambda: [[0, 11, 12, 13, 14], []])  # a partial hit at 80, then on
    assert witnessed == {(0, 1): None}
    assert not StateBlocks.holds_own_state(_block(11, 128), 0, 1, 64, witnessed)


def test_with_speculative_decoding_only_keys_witness():
    states, witnessed = StateBlocks(LAYOUTS, speculative=True), {}
    states.note_forward(witnessed, 64, 128, lambda: [[0, 11], []])
    assert witnessed == {}


def test_no_state_groups_nothing_to_witness():
    states = StateBlocks([GroupLayout(0, GroupKind.FULL_ATTENTION, 16)], speculative=False)
    assert states.groups == []
