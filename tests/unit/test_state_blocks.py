"""Which Mamba blocks a store may key by position (`connector.state_blocks`), without vLLM.

Under vLLM's scheduler (align mode, partial hash hits, checkpoints, decode states) this is tested in
tests/compat (`test_mamba_states_*`, `test_a_conversation_turn_loads_mamba_states_*`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connector.groups import GroupKind, GroupLayout
from connector.planning import NULL_BLOCK_ID
from connector.state_blocks import StateBlocks

LAYOUTS = [GroupLayout(0, GroupKind.MAMBA, 64), GroupLayout(1, GroupKind.FULL_ATTENTION, 16)]


def _block(block_id: int, keyed_tokens: int | None = None):
    return SimpleNamespace(block_id=block_id, block_hash_num_tokens=keyed_tokens,
                           block_hash=None if keyed_tokens is None else f"hash of {keyed_tokens} tokens")


def _blocks(*group_ids):
    """vLLM's blocks per group (`blocks_of`): keyed for their own ends."""
    return [[_block(block_id, None if block_id == NULL_BLOCK_ID else 64 * (i + 1)) for i, block_id in enumerate(ids)]
            for ids in group_ids]


STATES = StateBlocks(LAYOUTS, speculative=False)
PROMPT = 1000  # prompt tokens of the requests below: their forwards are prefill chunks


def test_a_block_keyed_for_its_own_end_holds_its_state():
    assert STATES.holds_own_state(_block(7, 192), 0, 2, 64, {})


def test_a_block_keyed_for_another_boundary_never_does_even_if_a_forward_ended_there():
    # a prefill checkpoint at the last 16-token hash boundary, in the block before the last
    assert not STATES.holds_own_state(_block(7, 176), 0, 2, 64, {(0, 2): 7})


def test_a_block_keyed_for_a_later_boundary_does_not_hold_its_own_ends_state():
    # A 250-token prompt's checkpoint: the state at its last hash boundary (240) goes into the block
    # before its last (block 2, ending at 192) and vLLM keys it for 240 tokens. Storing it under the
    # key of block 2's end would give a later load the state 48 tokens past where it resumes.
    assert not STATES.holds_own_state(_block(7, 240), 0, 2, 64, {})
    assert not STATES.holds_own_state(_block(7, 240), 0, 2, 64, {(0, 2): 7})
    assert not STATES.holds_own_state(_block(7, 193), 0, 2, 64, {})


def test_an_unkeyed_block_holds_its_state_only_if_a_forward_ended_in_it():
    assert STATES.holds_own_state(_block(7), 0, 2, 64, {(0, 2): 7})
    assert not STATES.holds_own_state(_block(7), 0, 2, 64, {})
    assert not STATES.holds_own_state(_block(8), 0, 2, 64, {(0, 2): 7})  # the block was given out again
    assert not STATES.holds_own_state(_block(NULL_BLOCK_ID), 0, 2, 64, {})


def test_forward_ends_are_witnessed_at_block_ends_only():
    states, witnessed, asked = StateBlocks(LAYOUTS, speculative=False), {}, []

    def blocks():
        asked.append(1)
        return _blocks([NULL_BLOCK_ID, 11, 12, NULL_BLOCK_ID], list(range(20, 36)))

    states.note_forward(witnessed, 0, 100, blocks, PROMPT)
    assert witnessed == {} and not asked  # not a state block's end: vLLM is not asked
    states.note_forward(witnessed, 100, 128, blocks, PROMPT)
    states.note_forward(witnessed, 128, 192, blocks, PROMPT)
    states.note_forward(witnessed, 192, 256, blocks, PROMPT)  # a null block there: nothing to witness
    assert witnessed == {(0, 1): 11, (0, 2): 12}


def test_a_forward_witnesses_the_block_it_ends_at_the_end_of():
    """The state after 128 tokens is in block 1: witnessed there, not in the block before it."""
    states, witnessed = StateBlocks(LAYOUTS, speculative=False), {}
    states.note_forward(witnessed, 0, 128, lambda: _blocks([10, 11], []), PROMPT)
    assert witnessed == {(0, 1): 11}


@pytest.mark.parametrize("start, end, left", [(16, 70, 0), (80, 150, 1), (128, 320, None)])
def test_a_forward_leaves_the_block_it_starts_inside_however_little_it_runs_past(start, end, left):
    """Block 0 too (a partial hit inside it), and a few tokens past it; a forward starting at a block's
    start leaves none (refusing those would lose every chunked prefill's states)."""
    states, witnessed = StateBlocks(LAYOUTS, speculative=False), {}
    states.note_forward(witnessed, start, end, lambda: _blocks([10, 11, 12, 13, 14], []), PROMPT)
    assert [key for key, block_id in witnessed.items() if block_id is None] == ([] if left is None else [(0, left)])


def test_a_block_a_forward_started_inside_and_left_keeps_that_state_whatever_its_key():
    states, witnessed = StateBlocks(LAYOUTS, speculative=True), {}
    states.note_forward(witnessed, 80, 128, lambda: _blocks([0, 11], []), PROMPT)  # ends at the block's end: not left
    assert witnessed == {}
    # a partial hit at 80, then on
    states.note_forward(witnessed, 80, 300, lambda: _blocks([0, 11, 12, 13, 14], []), PROMPT)
    assert witnessed == {(0, 1): None}
    assert not states.holds_own_state(_block(11, 128), 0, 1, 64, witnessed)


def test_so_does_it_for_a_request_that_finds_it_in_vllms_prefix_cache_until_vllm_gives_it_out_anew():
    """Another request reaching that block through vLLM's prefix cache (its own forwards never touched it)
    must not take it for its end's state either; once vLLM allocates the block afresh, that is over."""
    states = StateBlocks(LAYOUTS, speculative=False)
    states.note_forward({}, 80, 300, lambda: _blocks([0, 11, 12, 13, 14], []), PROMPT)
    assert not states.holds_own_state(_block(11, 128), 0, 1, 64, {})  # another request, same key
    assert states.holds_own_state(_block(12, 192), 0, 2, 64, {})  # the blocks after it are not concerned
    rekeyed = SimpleNamespace(block_id=11, block_hash_num_tokens=128, block_hash="another prefix's 128 tokens")
    assert states.holds_own_state(rekeyed, 0, 1, 64, {})  # the same block id under another key: other content
    states.given_out_anew([30, 11])
    assert states.holds_own_state(_block(11, 128), 0, 1, 64, {})


def test_a_request_resuming_at_such_a_blocks_end_computes_wrong_states_and_they_stay_wrong_for_others():
    """vLLM's align mix-up: it gives block 11 (keyed for 128 tokens, holding the state at 80) as a prefix
    hit of 128 tokens. The request resuming there computes every later state from it: none is stored,
    and the blocks it ends in stay wrong for requests that find them in vLLM's prefix cache."""
    states = StateBlocks(LAYOUTS, speculative=False)
    states.note_forward({}, 80, 300, lambda: _blocks([0, 11, 12, 13, 14], []), PROMPT)  # another request left 11
    witnessed = {}
    blocks = _blocks([0, 11, 22, 23, 24, 25], [])
    states.note_forward(witnessed, 128, 256, lambda: blocks, PROMPT)  # resumes from 11, ends in 23
    assert states.holds_own_state(_block(0, 64), 0, 0, 64, witnessed)  # before it: not concerned
    assert not states.holds_own_state(_block(23, 256), 0, 3, 64, witnessed)
    states.note_forward(witnessed, 256, 320, lambda: blocks, PROMPT)  # its next chunk: still from the wrong state
    assert not states.holds_own_state(_block(24, 320), 0, 4, 64, witnessed)
    assert not states.holds_own_state(_block(23, 256), 0, 3, 64, {})  # another request, same key
    assert not states.holds_own_state(_block(24, 320), 0, 4, 64, {})
    fresh = {}  # a request resuming from a block that holds its state is not concerned
    states.note_forward(fresh, 192, 256, lambda: _blocks([0, 31, 32, 33], []), PROMPT)
    assert states.holds_own_state(_block(33, 256), 0, 3, 64, fresh)


def test_leaving_a_block_vllm_has_not_keyed_records_no_wrong_state():
    """Only a keyed block can reach another request under a wrong key: a forward leaving an unkeyed block
    records nothing, so a later forward resuming at a block's end past the prompt does not ask vLLM
    for the request's blocks."""
    states = StateBlocks(LAYOUTS, speculative=False)
    states.note_forward({}, 80, 300, lambda: [[_block(NULL_BLOCK_ID), _block(11), _block(12)], []], PROMPT)
    asked = []

    def blocks():
        asked.append(1)
        return _blocks([10, 11, 12], [])

    states.note_forward({}, 128, 129, blocks, 100)
    assert not asked


def test_blocks_past_a_groups_list_are_neither_witnessed_nor_left_nor_resumed_from():
    """Where vLLM lists fewer blocks of a group than a forward reaches, the blocks it lacks are passed over."""
    states, witnessed = StateBlocks(LAYOUTS, speculative=False), {}
    states.note_forward(witnessed, 0, 128, lambda: _blocks([10], []), PROMPT)  # ends at block 1's end
    assert witnessed == {}
    states.note_forward(witnessed, 80, 200, lambda: _blocks([10], []), PROMPT)  # leaves block 1
    assert witnessed == {(0, 1): None}
    states.note_forward({}, 80, 300, lambda: _blocks([0, 11, 12, 13, 14], []), PROMPT)  # a wrong state exists
    resumed = {}
    states.note_forward(resumed, 128, 150, lambda: _blocks([0], []), PROMPT)  # resumes at block 1's end
    assert resumed == {}


def test_a_block_a_forward_left_before_vllm_keyed_it_keeps_that_state_once_keyed():
    """The request's own witness decides: keyed later, the block is in no list of wrong states."""
    states, witnessed = StateBlocks(LAYOUTS, speculative=False), {}
    states.note_forward(witnessed, 80, 300, lambda: [[_block(0, 64), *map(_block, (11, 12, 13, 14))], []], PROMPT)
    assert not states.holds_own_state(_block(11, 128), 0, 1, 64, witnessed)


def test_a_decode_state_computed_from_a_wrong_one_is_not_taken_for_its_end():
    """vLLM keys no decode state: a forward ending at its block's end witnesses it, yet computed from the
    wrong state the request resumed from it is wrong too (stored, another request would load it)."""
    states = StateBlocks(LAYOUTS, speculative=False)
    states.note_forward({}, 80, 300, lambda: _blocks([0, 11, 12, 13, 14], []), PROMPT)  # another request left 11
    witnessed = {}
    states.note_forward(witnessed, 128, 192, lambda: [[_block(0, 64), _block(11, 128), _block(22)], []], PROMPT)
    assert witnessed[(0, 2)] == 22 and not states.holds_own_state(_block(22), 0, 2, 64, witnessed)


def test_resuming_at_the_end_of_an_unkeyed_block_taints_nothing():
    """Decode steps resume at unkeyed blocks' ends all the time: no key, so never a wrong state's."""
    states = StateBlocks(LAYOUTS, speculative=False)
    states.note_forward({}, 80, 300, lambda: _blocks([0, 11, 12, 13, 14], []), PROMPT)  # a wrong state exists
    witnessed, blocks = {}, [[_block(0, 64), _block(21), _block(22)], []]
    states.note_forward(witnessed, 100, 128, lambda: blocks, PROMPT)
    states.note_forward(witnessed, 128, 192, lambda: blocks, PROMPT)
    assert states.holds_own_state(_block(22), 0, 2, 64, witnessed)


def test_every_state_group_witnesses_a_forward():
    """A model with several Mamba groups: each group's block is left by the forward, not only the first's."""
    states, witnessed = StateBlocks([GroupLayout(0, GroupKind.MAMBA, 64), GroupLayout(1, GroupKind.MAMBA, 64)],
                                    speculative=False), {}
    states.note_forward(witnessed, 80, 300, lambda: _blocks([0, 11, 12, 13, 14], [0, 21, 22, 23, 24]), PROMPT)
    assert witnessed == {(0, 1): None, (1, 1): None}


def test_with_drafts_a_request_is_never_tainted():
    """With drafts a step starts inside a block and leaves it while vLLM's postprocess copies the right
    state into it, and the next step reads the running column: the taint would refuse correct states."""
    states = StateBlocks(LAYOUTS, speculative=True)
    states.note_forward({}, 80, 300, lambda: _blocks([0, 11, 12, 13, 14], []), PROMPT)
    witnessed = {}
    states.note_forward(witnessed, 128, 256, lambda: _blocks([0, 11, 22, 23, 24], []), PROMPT)
    assert states.holds_own_state(_block(23, 256), 0, 3, 64, witnessed)


def test_with_speculative_decoding_only_keys_witness():
    states, witnessed = StateBlocks(LAYOUTS, speculative=True), {}
    states.note_forward(witnessed, 64, 128, lambda: _blocks([0, 11], []), PROMPT)
    assert witnessed == {}


def test_no_state_groups_nothing_to_witness():
    states = StateBlocks([GroupLayout(0, GroupKind.FULL_ATTENTION, 16)], speculative=False)
    assert states.groups == []


@pytest.mark.parametrize("decode_states", [True, False])
def test_a_decode_step_witnesses_its_end_only_where_decode_states_are_stored(decode_states):
    """A 100-token prompt, then decode steps one token each: the step computing token 127 ends at block
    1's end and leaves the state there (the recurrent kernel's, where a prefill would run the chunked
    one). `mamba_decode_states` false: such a state is not taken for its end."""
    states, witnessed = StateBlocks(LAYOUTS, speculative=False, decode_states=decode_states), {}
    blocks = lambda: _blocks([10, 11, 12], [])  # noqa: E731
    states.note_forward(witnessed, 0, 64, blocks, 100)  # prefill chunks: within the prompt
    states.note_forward(witnessed, 64, 100, blocks, 100)
    for start in range(100, 128):
        states.note_forward(witnessed, start, start + 1, blocks, 100)
    assert witnessed.get((0, 0)) == 10  # the prefill's state is witnessed either way
    assert (witnessed.get((0, 1)) == 11) is decode_states
    assert states.holds_own_state(_block(11), 0, 1, 64, witnessed) is decode_states


def test_a_decode_step_starting_at_the_prompts_end_is_not_a_prompt_forward():
    """A 127-token prompt: its first decode step computes token 127, starting exactly where the prompt
    ends, and ends at block 1's end. It is a decode step: with `mamba_decode_states` false its state is
    not taken for its end."""
    states, witnessed = StateBlocks(LAYOUTS, speculative=False, decode_states=False), {}
    blocks = lambda: _blocks([10, 11], [])  # noqa: E731
    states.note_forward(witnessed, 0, 127, blocks, 127)
    states.note_forward(witnessed, 127, 128, blocks, 127)
    assert witnessed == {}
    assert not states.holds_own_state(_block(11), 0, 1, 64, witnessed)


def test_with_decode_states_off_keys_still_witness_and_so_does_a_prompts_last_chunk():
    """vLLM keys the states it keeps (the prompt's, a resumed request's re-prefill): those hold. And
    a prompt's last chunk that ends at a block's end witnesses it (its start is within the prompt)."""
    states, witnessed = StateBlocks(LAYOUTS, speculative=False, decode_states=False), {}
    states.note_forward(witnessed, 200, 256, lambda: _blocks([0, 11, 12, 13], []), 256)
    assert witnessed == {(0, 3): 13}
    assert states.holds_own_state(_block(23, 320), 0, 4, 64, {})  # keyed for its end: past the prompt or not
