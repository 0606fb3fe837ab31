"""When a load may start beside the loads vLLM has not yet run (`connector/load_admission.py`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.groups import GroupKind, GroupLayout
from connector.load_admission import LoadAdmission, request_blocks_bound

SLIDING = GroupLayout(0, GroupKind.SLIDING_WINDOW, 32, sliding_window=128)
FULL = GroupLayout(1, GroupKind.FULL_ATTENTION, 32)
MAMBA = GroupLayout(2, GroupKind.MAMBA, 1024)
GEMMA = [SLIDING, FULL]


def test_the_bound_counts_every_block_a_request_spans_in_each_group_the_window_included():
    # vLLM's checks may count a sliding-window group up to the whole sequence: so does the bound
    assert request_blocks_bound(GEMMA, 959) == 30 + 30
    assert request_blocks_bound(GEMMA, 960) == 30 + 30
    assert request_blocks_bound(GEMMA, 961) == 31 + 31
    assert request_blocks_bound([GroupLayout(0, GroupKind.FULL_ATTENTION, 16)], 1) == 1


def test_a_sliding_window_group_counts_no_more_than_vllms_cap_for_it():
    """vLLM's `max_admission_blocks_per_request` (window plus tokens in flight): a request never holds more
    in that group, and vLLM's checks count it no higher. Full attention stays whole; no cap, whole."""
    assert request_blocks_bound(GEMMA, 4000, window_caps={0: 20}) == 20 + 125
    assert request_blocks_bound(GEMMA, 320, window_caps={0: 20}) == 10 + 10  # under the cap: what it spans
    assert request_blocks_bound(GEMMA, 4000, window_caps={1: 20}) == 125 + 125  # a cap on full attention: none
    assert request_blocks_bound(GEMMA, 4000, window_caps={}) == request_blocks_bound(GEMMA, 4000) == 250
    # drafts take slots beside the tokens in flight vLLM's cap counts: a block more for up to 32 of them
    assert request_blocks_bound(GEMMA, 4000, lookahead_tokens=3, window_caps={0: 20}) == 21 + 126


def test_the_caps_let_long_requests_load_together():
    admission = LoadAdmission(GEMMA)
    admission.window_caps = {0: 20}
    admission.admitted("a", 4000, loads=True)  # 20 + 125
    assert admission.may_start("b", 4000, usable_blocks=290)
    uncapped = LoadAdmission(GEMMA)
    uncapped.admitted("a", 4000, loads=True)  # 125 + 125
    assert not uncapped.may_start("b", 4000, usable_blocks=290)


def test_drafts_add_their_slots_and_a_mamba_state_block_each():
    assert request_blocks_bound(GEMMA, 959, lookahead_tokens=3) == 31 + 31
    assert request_blocks_bound([FULL, MAMBA], 959) == 30 + 1
    assert request_blocks_bound([FULL, MAMBA], 959, lookahead_tokens=3) == 31 + 1 + 3


@given(st.lists(st.sampled_from([SLIDING, FULL, MAMBA]), min_size=1, max_size=4),
       st.integers(1, 5000), st.integers(0, 5000), st.integers(0, 4))
def test_the_bound_grows_with_the_tokens_and_is_at_least_a_block_per_group(layouts, tokens, more, drafts):
    bound = request_blocks_bound(layouts, tokens, drafts)
    assert bound >= len(layouts)
    assert request_blocks_bound(layouts, tokens + more, drafts) >= bound
    assert request_blocks_bound(layouts, tokens, drafts + 1) >= bound


def test_with_no_load_waiting_to_run_vllm_decides_whatever_the_size():
    admission = LoadAdmission(GEMMA)
    assert admission.may_start("big", 100_000, usable_blocks=10)
    admission.admitted("done", 500, loads=True)
    admission.ran(["done"])
    assert admission.waiting_loads == 0 and admission.may_start("big", 100_000, usable_blocks=10)


def test_seed_3782_the_second_load_waits_for_the_first_to_run():
    """The real engine's stall (fuzz seed 3782): 71 usable blocks; loads of requests of 959 and 1086
    tokens admitted in one step held 70, and each needed 2 more."""
    admission = LoadAdmission(GEMMA)
    assert admission.may_start("2-0", 959, usable_blocks=71)
    admission.admitted("2-0", 959, loads=True)
    assert not admission.may_start("2-1", 1086, usable_blocks=71)  # 60 + 68 > 71
    admission.ran(["1-1"])  # another request's step: 2-0 still waits to run
    assert not admission.may_start("2-1", 1086, usable_blocks=71)
    admission.ran(["1-1", "2-0"])
    assert admission.may_start("2-1", 1086, usable_blocks=71)


@pytest.mark.parametrize("usable, fits", [(127, False), (128, True)])
def test_loads_that_fit_together_start_together(usable, fits):
    admission = LoadAdmission(GEMMA)
    admission.admitted("a", 1024, loads=True)  # 32 + 32
    assert admission.may_start("b", 1024, usable_blocks=usable) is fits


def test_a_request_admitted_without_a_load_holds_no_place_and_its_deferral_ends():
    admission = LoadAdmission(GEMMA)
    admission.admitted("a", 1024, loads=True)
    assert not admission.may_start("b", 1024, usable_blocks=100)
    admission.admitted("b", 1024, loads=False)  # its hit was gone: vLLM took it with none
    admission.admitted("c", 32, loads=False)
    assert admission.waiting_loads == 1
    assert admission.may_start("d", 32, usable_blocks=100)  # nothing deferred before it any more


def test_a_deferred_load_is_not_overtaken_by_a_smaller_one_and_each_deferral_counts_once():
    admission = LoadAdmission(GEMMA)
    admission.admitted("a", 1024, loads=True)
    assert not admission.may_start("big", 1024, usable_blocks=100)
    assert not admission.may_start("small", 32, usable_blocks=100)  # would fit, but "big" came first
    assert not admission.may_start("big", 1024, usable_blocks=100)  # the next step
    assert admission.deferrals == 2
    admission.ran(["a"])
    assert admission.may_start("big", 1024, usable_blocks=100)
    admission.admitted("big", 1024, loads=True)
    assert admission.may_start("small", 32, usable_blocks=100)  # first deferred now, and it fits


def test_a_request_that_ends_leaves_no_load_waiting_and_no_deferral_behind():
    admission = LoadAdmission(GEMMA)
    admission.admitted("a", 1024, loads=True)
    assert not admission.may_start("big", 1024, usable_blocks=100)
    admission.ended("big")  # aborted while deferred
    admission.admitted("b", 32, loads=True)
    assert admission.may_start("small", 32, usable_blocks=100)
    admission.ended("a")
    admission.ended("b")
    assert admission.waiting_loads == 0


def test_a_request_loading_again_after_a_preemption_waits_to_run_again():
    admission = LoadAdmission(GEMMA)
    admission.admitted("a", 1024, loads=True)
    admission.ran(["a"])
    admission.admitted("a", 1100, loads=True)  # preempted, its blocks freed, loaded again
    assert admission.waiting_loads == 1
    assert not admission.may_start("b", 1024, usable_blocks=100)


def test_a_request_admitted_twice_before_it_ran_holds_one_place_at_its_latest_size():
    """A preempted request admitted with a load again before its first load ran: its place is counted
    once, at its new size (35 + 35 blocks), and freed once."""
    admission = LoadAdmission(GEMMA)
    admission.admitted("a", 1024, loads=True)
    admission.admitted("a", 1100, loads=True)
    assert admission.may_start("b", 1024, usable_blocks=70 + 64)
    assert not admission.may_start("b", 1024, usable_blocks=70 + 63)
    admission.ran(["a"])
    assert admission.waiting_loads == 0
    admission.admitted("c", 1024, loads=True)
    assert admission.may_start("b", 1024, usable_blocks=64 + 64)  # nothing of "a" left counted


def test_a_deferral_records_the_lookups_answered_not_yet_and_when_the_first_began():
    admission = LoadAdmission(GEMMA)
    admission.admitted("a", 1024, loads=True)
    assert admission.deferred == {}
    for step, now in enumerate((1_000, 2_000, 3_500)):
        assert not admission.may_start("b", 1024, usable_blocks=100, now_ns=now)
        assert (admission.deferred["b"].lookups, admission.deferred["b"].first_ns) == (step + 1, 1_000)
    admission.ran(["a"])
    assert admission.may_start("b", 1024, usable_blocks=100, now_ns=5_000)  # not counted: it starts
    assert admission.deferred["b"].lookups == 3  # read by the lookup span; gone once vLLM admits it
    admission.admitted("b", 1024, loads=True)
    assert admission.deferred == {} and admission.deferrals == 1


def test_a_deferred_load_reports_the_load_tokens_of_its_latest_lookup():
    """Its hit may grow or shrink while it waits: the deferral span tells the load it would have brought last."""
    admission = LoadAdmission([GroupLayout(0, GroupKind.FULL_ATTENTION, 16)])
    admission.admitted("a", 1024, loads=True)
    assert not admission.may_start("b", 1024, usable_blocks=100, now_ns=5, load_tokens=512)
    assert not admission.may_start("b", 1024, usable_blocks=100, now_ns=9, load_tokens=768)
    deferral = admission.deferred["b"]
    assert (deferral.lookups, deferral.first_ns, deferral.load_tokens) == (2, 5, 768)
    assert admission.ended("b") is deferral and admission.deferrals == 1
