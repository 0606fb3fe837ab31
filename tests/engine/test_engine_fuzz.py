"""The real-engine fuzz (`engine_fuzz`): its plans, its comparison, and that it catches a wrong load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connector.telemetry.testing import proto_span_attributes, trace_file_spans
from tests.engine import engine_fuzz
from tests.engine.engine_fuzz import (ATTENTION_ONLY_TOLERANCE, FLOAT32_TOLERANCE, LOGPROB_TOLERANCE, admission_order,
                                     compare, execute, first_parting, in_admission_order, largest_logprob_gap,
                                     load_destination_problem, logprob_tolerance, make_plan, prompt_tokens, recheck,
                                     recompute_agrees, verdict, with_dense_retention)


def _completion(tokens, logprobs, best):
    return {"tokens": tokens, "logprobs": logprobs, "best": best}


def _run(*completions, problems=()):
    return {"rounds": [list(completions)], "problems": list(problems)}


@pytest.mark.parametrize("seed", range(40))
def test_plans_are_pure_data_that_repeat_and_continue_only_earlier_rounds(seed):
    plan = make_plan(seed)
    assert make_plan(seed) == plan
    assert not plan["rounds"][0]["reset_before"]
    for index, round_ in enumerate(plan["rounds"]):
        for prompt in round_["prompts"]:
            if "continues" in prompt:
                earlier, i = prompt["continues"]
                assert earlier < index and i < len(plan["rounds"][earlier]["prompts"])
                assert "abort_after_steps" not in plan["rounds"][earlier]["prompts"][i]  # it has a completion
            else:
                assert 1 <= prompt["cut"] <= len(plan["docs"][prompt["doc"]])


def test_no_plan_sharpens_qwen3_next():
    """Its linear attention's bf16 rounding, sharpened, parts runs that are right (seeds 1010, 2022)."""
    plans = [make_plan(seed) for seed in range(300)]
    assert all(p["attention_scale"] == 1.0 for p in plans if p["model"] == "qwen3next")
    assert any(p["attention_scale"] != 1.0 for p in plans)


def _blocks(*ids):
    return [SimpleNamespace(block_id=i) for i in ids]


def test_a_load_may_write_only_blocks_its_request_alone_holds():
    tables = {"a": _blocks(0, 3, 4), "b": _blocks(3, 7), "c": _blocks(8)}  # 0: the null block; 3: shared
    assert load_destination_problem(1, [4], tables, "a") is None
    assert load_destination_problem(1, [7], tables, "b") is None
    assert "held by {3: ['a', 'b']}" in load_destination_problem(1, [3], tables, "a")  # a block vLLM shares
    assert load_destination_problem(1, [4, 8], tables, "a") is not None  # another request's block
    assert load_destination_problem(1, [8], tables, "a") == "a's load into group 1 blocks [8]: held by {8: ['c']}"
    assert load_destination_problem(1, [9], tables, "a") is not None  # a block nobody holds: freed under the load


def test_a_continuing_prompt_is_the_earlier_prompt_its_completion_and_a_suffix():
    plan = {"docs": [[1, 2, 3, 4]], "rounds": []}
    earlier = [([[1, 2, 3]], [{"tokens": [9, 8]}])]
    assert prompt_tokens(plan, {"doc": 0, "cut": 2, "suffix": [7]}, earlier) == [1, 2, 7]
    assert prompt_tokens(plan, {"continues": [0, 0], "suffix": [5]}, earlier) == [1, 2, 3, 9, 8, 5]


def test_equal_tokens_within_the_logprob_tolerance_are_ok():
    a = _completion([5, 6], [-1.0, -2.0], [{"5": -1.0, "4": -1.5}, {"6": -2.0, "1": -2.5}])
    b = _completion([5, 6], [-1.02, -2.03], [{"5": -1.02, "4": -1.5}, {"6": -2.03, "1": -2.5}])
    assert compare(_run(a), _run(b)) == ("ok", [])


def test_aborted_requests_are_not_compared():
    a = _completion([5], [-1.0], [{"5": -1.0, "4": -1.5}])
    b = _completion([7], [-1.0], [{"7": -1.0, "4": -1.5}])
    assert compare(_run({"aborted": True}, a), _run(b, a)) == ("ok", [])


def test_the_largest_gap_is_over_steps_sampled_alike_of_requests_not_aborted():
    a = _completion([5, 6, 1], [-1.0, -2.0, -3.0], [])
    b = _completion([5, 6, 2], [-1.01, -2.04, -9.0], [])
    aborted = _completion([5], [-1.0], [])
    assert largest_logprob_gap(_run(a, {"aborted": True}), _run(b, aborted)) == pytest.approx(0.04)


def test_a_logprob_past_the_tolerance_fails_with_equal_tokens():
    a = _completion([5], [-1.0], [{"5": -1.0, "4": -1.5}])
    b = _completion([5], [-1.2], [{"5": -1.2, "4": -1.5}])
    outcome, problems = compare(_run(a), _run(b))
    assert outcome == "failed" and "differ by 0.200" in problems[0]


@pytest.mark.parametrize("model,tolerance", [("llama", ATTENTION_ONLY_TOLERANCE), ("gemma3", ATTENTION_ONLY_TOLERANCE),
                                             ("gptoss", ATTENTION_ONLY_TOLERANCE), ("qwen3next", LOGPROB_TOLERANCE)])
def test_only_plans_beside_linear_attention_or_preempting_allow_the_wide_tolerance(model, tolerance):
    assert logprob_tolerance({"model": model, "llm_kwargs": {"block_size": 32}}) == tolerance
    small_cache = {"model": model, "llm_kwargs": {"num_gpu_blocks_override": 84}}
    assert logprob_tolerance(small_cache) == LOGPROB_TOLERANCE


@pytest.mark.parametrize("model", ["llama", "gemma3", "gptoss"])
def test_float32_plans_are_held_to_the_float32_tolerance_preempting_or_not(model):
    for llm_kwargs in ({"block_size": 32}, {"num_gpu_blocks_override": 84}):
        plan = {"model": model, "llm_kwargs": {**llm_kwargs, "dtype": "float32"}}
        assert logprob_tolerance(plan) == FLOAT32_TOLERANCE
    assert FLOAT32_TOLERANCE < ATTENTION_ONLY_TOLERANCE


def test_some_plans_run_in_float32_without_an_fp8_cache_or_qwen3_next_and_half_of_those_that_can_preempt():
    """vLLM's CPU linear attention runs only in bf16 ("CPU GDN attention requires BF16")."""
    plans = [make_plan(seed) for seed in range(300)]
    float32 = [p for p in plans if p["llm_kwargs"].get("dtype") == "float32"]
    assert 0.15 < len(float32) / len(plans) < 0.35
    assert not any("kv_cache_dtype" in p["llm_kwargs"] or p["model"] == "qwen3next" for p in float32)
    assert {p["extra"]["cpu_bytes"] for p in float32} <= {512 << 10, 2 << 20, 8 << 20, 128 << 20}  # twice bf16's
    with_blocks = [p for p in float32 if "block_size" in p["llm_kwargs"]]
    small = [p for p in with_blocks if "num_gpu_blocks_override" in p["llm_kwargs"]]
    assert 0.5 < len(small) / len(with_blocks) < 0.8  # 0.3 drawn with the bfloat16 plans' odds, then half of the rest
    for plan in small:  # long completions, prompts cut to leave them room
        assert plan["llm_kwargs"]["max_model_len"] == 1536 and plan["max_prompt_tokens"] == 1536 - 240
        assert all(round_["max_tokens"] % 20 == 0 for round_ in plan["rounds"])
        if plan["model"] != "llama":  # vLLM asked for 2.1 contexts beside a sliding window in float32
            assert plan["llm_kwargs"]["num_gpu_blocks_override"] * plan["llm_kwargs"]["block_size"] >= 2.25 * 1536


def test_a_gap_the_wide_tolerance_allows_fails_the_attention_only_tolerance():
    """0.025: what one zeroed host block among 54 moved with an unsharpened model."""
    a = _completion([5], [-1.0], [{"5": -1.0, "4": -1.5}])
    b = _completion([5], [-1.025], [{"5": -1.025, "4": -1.5}])
    assert compare(_run(a), _run(b), LOGPROB_TOLERANCE) == ("ok", [])
    assert compare(_run(a), _run(b), ATTENTION_ONLY_TOLERANCE)[0] == "failed"


def test_a_near_tie_whose_logprobs_moved_past_the_tolerance_is_no_tie():
    a = _completion([6], [-2.0], [{"6": -2.0, "7": -2.01}])
    b = _completion([7], [-2.02], [{"7": -2.02, "6": -2.03}])
    assert compare(_run(a), _run(b), LOGPROB_TOLERANCE)[0] == "tie"
    assert compare(_run(a), _run(b), ATTENTION_ONLY_TOLERANCE)[0] == "failed"


def test_tokens_parting_where_both_runs_saw_the_same_near_tie_are_a_tie():
    a = _completion([5, 6], [-1.0, -2.0], [{"5": -1.0, "4": -1.5}, {"6": -2.0, "7": -2.01}])
    b = _completion([5, 7], [-1.0, -2.0], [{"5": -1.0, "4": -1.5}, {"7": -2.0, "6": -2.01}])
    assert compare(_run(a), _run(b)) == ("tie", ["tie at round 0 prompt 0 step 1"])


def test_a_near_tie_of_three_tokens_is_a_tie_when_each_run_saw_both_picks_near_the_top():
    """Seed 2060's step: ours picked 165 over 94; theirs tied 94 with 255 and picked 94, 165 just below."""
    a = _completion([165], [-5.652], [{"165": -5.652, "94": -5.6755, "255": -5.68, "7": -5.9}])
    b = _completion([94], [-5.6555], [{"94": -5.6555, "255": -5.6555, "165": -5.66, "7": -5.9}])
    assert compare(_run(a), _run(b), LOGPROB_TOLERANCE) == ("tie", ["tie at round 0 prompt 0 step 0"])
    assert compare(_run(a), _run(b), ATTENTION_ONLY_TOLERANCE)[0] == "failed"  # 94 moved by 0.02
    lost = _completion([94], [-5.6555], [{"94": -5.6555, "255": -5.6555, "7": -5.9}])  # ours' pick not among theirs
    assert compare(_run(a), _run(lost), LOGPROB_TOLERANCE)[0] == "failed"


@pytest.mark.parametrize("theirs", [
    {"7": -2.0, "6": -2.2},  # the same two best tokens, but their logprobs moved past the tolerance
    {"7": -2.0, "3": -2.01},  # another second token: not the same near-tie
])
def test_tokens_parting_at_a_near_tie_of_other_logprobs_fail(theirs):
    a = _completion([6], [-2.0], [{"6": -2.0, "7": -2.01}])
    b = _completion([7], [-2.0], [theirs])
    outcome, problems = compare(_run(a), _run(b))
    assert outcome == "failed" and problems[0].startswith("tokens part at round 0 prompt 0 step 0")


def test_tokens_parting_at_a_clear_choice_fail():
    a = _completion([6], [-1.0], [{"6": -1.0, "7": -3.0}])
    b = _completion([7], [-1.0], [{"7": -1.0, "6": -3.0}])
    assert compare(_run(a), _run(b))[0] == "failed"


def test_the_connectors_own_problems_fail_a_seed_even_at_a_tie():
    a = _completion([6], [-2.0], [{"6": -2.0, "7": -2.01}])
    b = _completion([7], [-2.0], [{"7": -2.0, "6": -2.01}])
    outcome, problems = compare(_run(a, problems=["leak: job 3"]), _run(b))
    assert outcome == "failed" and problems[0] == "leak: job 3"


def test_the_first_parting_skips_aborted_requests_and_equal_completions():
    same, other = _completion([5, 6], [-1.0, -1.0], []), _completion([5, 7], [-1.0, -1.0], [])
    ours = {"rounds": [[same, {"aborted": True}], [same, same]]}
    theirs = {"rounds": [[same, other], [same, other]]}
    assert first_parting(ours, theirs) == (1, 1)
    assert first_parting(ours, ours) is None


@pytest.mark.parametrize("recomputed, agrees", [
    ({"tokens": [5, 7], "logprobs": [-1.0, -1.01], "prompt": "p1"}, True),
    ({"tokens": [5, 7], "logprobs": [-1.0, -1.01], "prompt": "p2"}, False),  # another prompt (a parted turn)
    ({"tokens": [5, 6], "logprobs": [-1.0, -1.0], "prompt": "p1"}, False),  # the baseline's tokens
    ({"tokens": [5, 7], "logprobs": [-1.0, -1.2], "prompt": "p1"}, False),  # a logprob past the tolerance
    ({"aborted": True}, False),
])
def test_a_parted_completion_is_vllms_cache_only_where_a_recompute_of_the_same_prompt_gives_it(recomputed, agrees):
    ours = {"rounds": [[{"tokens": [5, 7], "logprobs": [-1.0, -1.0], "prompt": "p1"}]]}
    assert recompute_agrees(ours, {"rounds": [[recomputed]]}, (0, 0)) is agrees


def test_the_admission_order_is_each_round_s_prompts_as_first_scheduled_those_never_scheduled_last():
    admitted = ["0-1-5f0e", "0-0-a1b2", "1-11-77aa", "1-0-0c0c", "1-3-9d9d", "1-0-0c0c", "1-2-e4e4"]  # 1-0 resumed
    assert admission_order(admitted, 0, 3) == [1, 0, 2]  # 0-2 was aborted while it waited
    assert admission_order(admitted, 1, 12) == [11, 0, 3, 2, 1, 4, 5, 6, 7, 8, 9, 10]
    assert admission_order([], 2, 2) == [0, 1]


def test_a_plan_in_admission_order_submits_each_round_s_prompts_in_it_unless_they_are_listed_so():
    plan = {"seed": 1, "rounds": [{"prompts": [{}, {}]}, {"prompts": [{}, {}, {}]}]}
    assert in_admission_order(plan, [[0, 1], [0, 1, 2]]) is None
    reordered = in_admission_order(plan, [[0, 1], [2, 0, 1]])
    assert [r["order"] for r in reordered["rounds"]] == [[0, 1], [2, 0, 1]]
    assert "order" not in plan["rounds"][1]  # the plan itself is left as it was


# Seed 3245's shape: kvscope's engine admitted prompt 1 before prompt 0, and prompt 1 parted from the baseline.
_PLAN = {"model": "gptoss", "llm_kwargs": {}, "rounds": [{"prompts": [{}, {}]}]}


def _prompt_b(second_token, second_logprob):
    best = [{"5": -1.0}, {"7": -2.0, "6": -2.4} if second_token == 7 else {"6": second_logprob, "7": -2.6}]
    return _completion([5, second_token], [-1.0, second_logprob], best) | {"prompt": "b"}


_PROMPT_A = _completion([5], [-1.0], [{"5": -1.0}]) | {"prompt": "a"}
_OURS = {"rounds": [[_PROMPT_A, _prompt_b(7, -2.0)]], "problems": [], "admission_orders": [[1, 0]]}
_BASELINE = {"rounds": [[_PROMPT_A, _prompt_b(6, -2.4)]]}


def _fake_engines(monkeypatch, reordered_run=_BASELINE, dense_run=_BASELINE, prefill_states_run=None):
    """`execute` answering with a recompute that agrees with the baseline, ``reordered_run`` for a plan given
    an admission order (vLLM in kvscope's order), ``dense_run`` for vLLM keeping every sliding-window block
    and Mamba state, and ``prefill_states_run`` for kvscope's engine run again with `mamba_decode_states`
    false; the plans it was asked for go into the returned list."""
    asked = []

    def execute(plan, roles):
        asked.append((plan, roles))
        (role,) = roles
        if role == "baseline":
            return {"baseline": reordered_run if "order" in plan["rounds"][0] else _BASELINE}
        return {role: {"recompute": _BASELINE, "dense": dense_run, "kvscope": prefill_states_run}[role]}

    monkeypatch.setattr(engine_fuzz, "execute", execute)
    return asked


def test_a_seed_whose_run_vllm_gives_with_kvscope_s_admission_order_is_vllm_order(monkeypatch):
    asked = _fake_engines(monkeypatch, reordered_run=_OURS)
    results = {"kvscope": _OURS, "baseline": _BASELINE}
    outcome, problems = recheck(_PLAN, results, *verdict(results))
    assert outcome == "vllm_order", problems
    assert problems[-1].endswith("the order kvscope's engine first scheduled them: [[1, 0]]")
    assert problems[0].startswith("tokens part at round 0 prompt 1 step 1")
    # the recompute, vLLM keeping every sliding-window block (parting from kvscope too), then kvscope's order
    assert [roles for _, roles in asked] == [("recompute",), ("dense",), ("baseline",)]
    assert asked[2][0]["rounds"][0]["order"] == [1, 0]


def test_a_seed_whose_run_vllm_in_kvscope_s_admission_order_gives_up_to_a_tie_is_vllm_order(monkeypatch):
    """After a near-tie both runs saw nothing is compared (`compare`), as between kvscope and the baseline."""
    near_tie = [{"5": -1.0}, {"7": -2.0, "6": -2.01}]
    ours = _completion([5, 7], [-1.0, -2.0], near_tie) | {"prompt": "b"}
    tied = _completion([5, 6], [-1.0, -2.01], near_tie) | {"prompt": "b"}
    _fake_engines(monkeypatch, reordered_run={"rounds": [[_PROMPT_A, tied]]})
    results = {"kvscope": _OURS | {"rounds": [[_PROMPT_A, ours]]}, "baseline": _BASELINE}
    outcome, problems = recheck(_PLAN, results, *verdict(results))
    assert outcome == "vllm_order" and problems[-1] == "tie at round 0 prompt 1 step 1", problems


@pytest.mark.parametrize("reordered_run", [
    _BASELINE,  # vLLM in kvscope's order still parts from kvscope
    {"rounds": [[_PROMPT_A, _prompt_b(7, -2.02)]]},  # a logprob past the 0.01 tolerance
    {"error": "exit 1", "stderr": ""},
])
def test_a_seed_stays_failed_unless_vllm_in_kvscope_s_admission_order_agrees_with_kvscope_s_whole_run(
        monkeypatch, reordered_run):
    _fake_engines(monkeypatch, reordered_run)
    results = {"kvscope": _OURS, "baseline": _BASELINE}
    assert recheck(_PLAN, results, *verdict(results))[0] == "failed"


def test_no_reordered_run_where_kvscope_s_engine_admitted_the_prompts_as_listed_or_found_its_own_problem(monkeypatch):
    asked = _fake_engines(monkeypatch, reordered_run=_OURS)
    as_listed = _OURS | {"admission_orders": [[0, 1]]}
    results = {"kvscope": as_listed, "baseline": _BASELINE}
    assert recheck(_PLAN, results, *verdict(results))[0] == "failed"
    assert [roles for _, roles in asked] == [("recompute",), ("dense",)]
    leaking = _OURS | {"problems": ["leak: job 3"]}
    results = {"kvscope": leaking, "baseline": _BASELINE}
    assert recheck(_PLAN, results, *verdict(results))[0] == "failed"
    assert len(asked) == 2


# Seed 4099's shape (gpt-oss-like): equal tokens, one logprob parted past the tolerance, prompts admitted as listed.
_PARTED_LOGPROB = _completion([5, 7], [-1.0, -5.62], [{"5": -1.0}, {"7": -5.62}]) | {"prompt": "b"}
_OURS_4099 = {"rounds": [[_PROMPT_A, _PARTED_LOGPROB]], "problems": [], "admission_orders": [[0, 1]]}
_BASELINE_4099 = {"rounds": [[_PROMPT_A, _completion([5, 7], [-1.0, -5.51], [{"5": -1.0}, {"7": -5.51}])]]}


def test_a_seed_whose_run_vllm_keeping_every_window_block_gives_is_vllm_dense(monkeypatch):
    asked = _fake_engines(monkeypatch, dense_run=_OURS_4099)
    results = {"kvscope": _OURS_4099, "baseline": _BASELINE_4099}
    assert verdict(results)[0] == "failed"
    outcome, problems = recheck(_PLAN, results, *verdict(results))
    assert outcome == "vllm_dense", problems
    assert problems[0] == "logprobs at round 0 prompt 1 differ by 0.110"
    assert problems[-1].endswith("(prefix_cache_retention_interval None)")
    assert [roles for _, roles in asked] == [("dense",)]  # the tokens do not part: no recompute


@pytest.mark.parametrize("dense_run", [
    _BASELINE_4099,  # vLLM's dense cache parts from kvscope too
    {"rounds": [[_PROMPT_A, _completion([5, 7], [-1.0, -5.60], [{"5": -1.0}, {"7": -5.60}])]]},  # 0.02 off
    {"error": "exit 1", "stderr": ""},
])
def test_a_seed_stays_failed_unless_vllm_keeping_every_window_block_agrees_with_kvscope_s_whole_run(
        monkeypatch, dense_run):
    _fake_engines(monkeypatch, dense_run=dense_run)
    results = {"kvscope": _OURS_4099, "baseline": _BASELINE_4099}
    assert recheck(_PLAN, results, *verdict(results))[0] == "failed"


def test_no_dense_cache_run_for_a_full_attention_model_or_a_plan_that_sets_the_retention(monkeypatch):
    asked = _fake_engines(monkeypatch, dense_run=_OURS_4099)
    results = {"kvscope": _OURS_4099, "baseline": _BASELINE_4099}
    for plan in (_PLAN | {"model": "llama"}, _PLAN | {"llm_kwargs": {"prefix_cache_retention_interval": None}}):
        assert recheck(plan, results, *verdict(results))[0] == "failed"
    assert asked == []


_QWEN_PLAN = {"model": "qwen3next", "extra": {"cpu_bytes": 1 << 20, "mamba_decode_states": True}, "llm_kwargs": {},
              "rounds": [{"prompts": [{}, {}]}]}


def test_a_qwen3_next_seed_that_agrees_once_decode_states_are_not_stored_is_decode_state(monkeypatch):
    asked = _fake_engines(monkeypatch, prefill_states_run=_BASELINE | {"problems": []})
    results = {"kvscope": _OURS, "baseline": _BASELINE}
    outcome, problems = recheck(_QWEN_PLAN, results, *verdict(results, tolerance=0.05))
    assert outcome == "decode_state", problems
    assert problems[-1].endswith("(mamba_decode_states false)")
    assert [roles for _, roles in asked] == [("recompute",), ("kvscope",)]
    assert asked[1][0]["extra"] == {"cpu_bytes": 1 << 20, "mamba_decode_states": False}
    assert _QWEN_PLAN["extra"]["mamba_decode_states"] is True  # the seed's own plan is left as it was


@pytest.mark.parametrize("prefill_states_run", [
    _OURS,  # parts from vLLM without decode states too
    _BASELINE | {"problems": ["leak: job 3"]},  # agrees, but kvscope found a problem in itself
    {"error": "exit 1", "stderr": ""},
])
def test_a_qwen3_next_seed_stays_failed_unless_its_run_without_decode_states_agrees_cleanly(
        monkeypatch, prefill_states_run):
    asked = _fake_engines(monkeypatch, prefill_states_run=prefill_states_run)
    results = {"kvscope": _OURS, "baseline": _BASELINE}
    assert recheck(_QWEN_PLAN, results, *verdict(results, tolerance=0.05))[0] == "failed"
    assert ("kvscope",) in [roles for _, roles in asked]


def test_no_run_without_decode_states_where_the_plan_stores_none_or_has_no_mamba_group(monkeypatch):
    asked = _fake_engines(monkeypatch, prefill_states_run=_BASELINE | {"problems": []})
    results = {"kvscope": _OURS, "baseline": _BASELINE}
    prefill_only = _QWEN_PLAN | {"extra": {"cpu_bytes": 1 << 20, "mamba_decode_states": False}}
    by_default = _QWEN_PLAN | {"extra": {"cpu_bytes": 1 << 20}}
    for plan in (prefill_only, by_default, _PLAN):
        assert recheck(plan, results, *verdict(results))[0] == "failed"
    assert ("kvscope",) not in [roles for _, roles in asked]


def test_dense_retention_is_asked_of_models_with_window_or_mamba_groups_only_and_leaves_the_plan_as_it_was():
    plans = {p["model"]: p for p in (make_plan(seed) for seed in range(40))}
    for model, plan in plans.items():
        dense = with_dense_retention(plan)
        assert "prefix_cache_retention_interval" not in plan["llm_kwargs"]
        if model == "llama":
            assert dense == plan
        else:
            assert dense == {**plan, "llm_kwargs": {**plan["llm_kwargs"], "prefix_cache_retention_interval": None}}
    assert set(plans) == {"llama", "gemma3", "gptoss", "qwen3next"}


def test_qwen3_next_plans_say_whether_they_store_decode_states_some_do_some_not_no_other_plan_says():
    plans = [make_plan(seed) for seed in range(300)]
    assert all(("mamba_decode_states" in p["extra"]) == (p["model"] == "qwen3next") for p in plans)
    assert {p["extra"].get("mamba_decode_states") for p in plans if p["model"] == "qwen3next"} == {True, False}
    assert make_plan(4048)["extra"]["mamba_decode_states"] is True  # the seed that parted (`decode_state`)


def test_a_baseline_that_cannot_start_is_refused_and_a_kvscope_engine_that_cannot_fails():
    broken = {"error": "exit 1", "stderr": "ValueError: No common block size"}
    ok = {"rounds": [], "problems": []}
    assert verdict({"kvscope": ok, "baseline": broken})[0] == "refused"
    assert verdict({"kvscope": broken, "baseline": ok})[0] == "failed"


def test_kvscope_refusing_a_host_block_size_vllm_made_wrong_is_refused_not_failed():
    message = ("connector.config.ConfigError: kv_connector_extra_config.block_size=16 is not accepted: it must be "
               "a multiple of every KV group's device block size [32] (e.g. 32, 64, ...)")
    refused = {"error": "exit 1", "stderr": "Traceback ...\n[rank0]: " + message + "\n"}
    ok = {"rounds": [], "problems": []}
    assert verdict({"kvscope": refused, "baseline": ok}) == ("refused", [message.removeprefix("connector.config.")])
    other = {"error": "exit 1", "stderr": "connector.config.ConfigError: cpu_bytes=0 is not accepted"}
    assert verdict({"kvscope": other, "baseline": ok})[0] == "failed"


# Two documents longer than the 64-token window, looked up again after a device prefix-cache reset.
LOADING_PLAN = {
    "seed": -1, "model": "gemma3", "window": 64, "attention_scale": 6.0,
    "llm_kwargs": {"async_scheduling": True, "max_num_seqs": 4, "block_size": 16},
    "extra": {"cpu_bytes": 64 << 20},
    "docs": [[(7 * i) % 499 + 1 for i in range(600)], [(11 * i) % 487 + 1 for i in range(300)]],
    "rounds": [
        {"reset_before": False, "reset_connector": False, "max_tokens": 4,
         "prompts": [{"doc": 0, "cut": 600, "suffix": []}, {"doc": 1, "cut": 300, "suffix": [3]}]},
        {"reset_before": True, "reset_connector": False, "max_tokens": 4, "order": [1, 0],
         "prompts": [{"doc": 0, "cut": 600, "suffix": [9]}, {"continues": [0, 1], "suffix": [4]}]},
    ],
}


# The same in float32, attention not sharpened: there the zeroed block moved a logprob by 0.023, which only
# the float32 tolerance sees (a bf16 plan's 0.05 would not).
FLOAT32_LOADING_PLAN = {**LOADING_PLAN, "attention_scale": 1.0,
                        "llm_kwargs": {**LOADING_PLAN["llm_kwargs"], "dtype": "float32"}}


@pytest.mark.engine
@pytest.mark.parametrize("plan", [LOADING_PLAN, FLOAT32_LOADING_PLAN], ids=["bf16-sharpened", "float32"])
def test_the_fuzz_passes_real_loads_and_fails_one_host_block_zeroed_before_they_load(plan):
    """The same plan on three engines at once: kvscope's, kvscope's with one host block of those it holds
    (its newest) zeroed before the second round, and none; the second round's prompts are submitted in
    reverse. The first loads and agrees; the second loads the zeros and must fail (bf16 with attention
    sharpened: with the random weights that block moved a logprob 0.025)."""
    results = execute(plan, ("kvscope", "corrupted", "baseline"))
    assert results["kvscope"]["external_hit_tokens"] > 0, results["kvscope"]
    assert results["baseline"]["admission_orders"] == [[0, 1], [1, 0]]  # the second round submitted in "order"
    tolerance = logprob_tolerance(plan)
    assert verdict(results, tolerance=tolerance) == ("ok", [])
    assert results["corrupted"]["external_hit_tokens"] > 0
    outcome, problems = verdict(results, ours="corrupted", tolerance=tolerance)
    assert outcome == "failed", problems


@pytest.mark.engine
def test_seed_3782_runs_through_where_vllms_admission_alone_stalls(tmp_path):
    """Fuzz seed 3782 (bf16 Gemma-3-like, async scheduling, a 72-block device cache): vLLM admitted two
    loads in one step, of 928 and 1056 tokens, which held all but one free block while each needed two
    more; with nothing running kvscope's engine stepped for ever (`load_admission`). kvscope defers the
    second load until the first one's request runs: its run equals vLLM's, and each deferred load's wait
    is in the trace (on the lookup span vLLM admitted the request on; on the load span of a request
    resumed after preemption, half of them here). Its engine starting every load at once stalls, and
    the fuzz says so within `STALL_STEPS` steps."""
    plan = {**make_plan(3782), "trace_dir": str(tmp_path)}
    results = execute(plan, ("kvscope", "unadmitted", "baseline"))
    assert results["kvscope"]["external_hit_tokens"] > 0
    assert results["kvscope"]["deferred_loads"] >= 1  # kvscope_deferred_loads_total
    spans = [(span.name, proto_span_attributes(span)) for span in trace_file_spans(tmp_path / "kvscope.jsonl")]
    waits = [(name, told) for name, told in spans if "kvscope.deferred.lookups" in told]
    # every deferred request was admitted in the end (none aborted while it waited): each wait is told once,
    # in the trace and in kvscope_load_deferral_wait_seconds, which agree on it (the load spans' waits
    # run on to the load's start: a little longer)
    assert len(waits) == results["kvscope"]["deferred_loads"] == results["kvscope"]["deferral_waits"]
    traced_wait_s = sum(told["kvscope.deferred.wait_us"] for _, told in waits) / 1e6
    assert results["kvscope"]["deferral_wait_s"] <= traced_wait_s + 1e-6 * len(waits)
    assert results["kvscope"]["deferral_wait_s"] >= 0.9 * traced_wait_s
    assert {name for name, _ in waits} == {"kvscope.lookup", "kvscope.load"}
    for _, told in waits:
        assert told["kvscope.deferred.lookups"] >= 1 and told["kvscope.deferred.wait_us"] > 0
    assert verdict(results, tolerance=logprob_tolerance(plan)) == ("ok", [])
    outcome, problems = verdict(results, ours="unadmitted")
    assert outcome == "failed" and "RuntimeError: stalled: 500 steps without a running request" in problems[1]
    assert "free blocks; 0 loads deferred by kvscope" in problems[1]


@pytest.mark.engine
def test_seed_4099_loads_what_vllms_own_cache_serves_once_it_keeps_every_window_block():
    """Fuzz seed 4099 (gpt-oss-like: sliding window and sinks, a 1 MiB host tier): a conversation continued
    without a device reset loads its reply's blocks, KV that decode steps computed, from the host tier. vLLM's
    prefix cache keeps sliding-window blocks only at prompt ends by default (`prefix_cache_retention_interval`
    0), so the default baseline recomputed the reply by prefill (its full-attention KV then differs by bf16
    rounding), and a logprob parted by 0.110 at one decode step of 180. vLLM keeping every window block (None)
    serves the same blocks from its device cache and gives kvscope's run (bit for bit on the CPU engine):
    `vllm_dense`."""
    plan = make_plan(4099)
    results = execute(plan, ("kvscope", "dense"))
    assert results["kvscope"]["external_hit_tokens"] > 0, results["kvscope"]
    assert compare(results["kvscope"], results["dense"], logprob_tolerance(plan)) == ("ok", [])
