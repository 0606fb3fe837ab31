"""Mamba state groups (Qwen3-Next-like) and tensor parallelism on the real CPU engine."""

from __future__ import annotations

import pytest

from .conftest import prompts_sharing_prefixes
from .outputs import SHARP_ATTENTION, assert_same_outputs, outputs_moved, tokens

pytestmark = pytest.mark.engine

PROMPTS = prompts_sharing_prefixes()
QWEN = dict(model="qwen3next", prompts=PROMPTS, attention_scale=SHARP_ATTENTION)
# Two CPU workers on one NUMA node need explicit thread binding, one core each.
TP2 = dict(model="gemma3", window=64, prompts=PROMPTS, attention_scale=SHARP_ATTENTION,
           llm_kwargs={"tensor_parallel_size": 2}, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def _assert_equal_and_hits(result, baseline):
    cold, loaded, _ = result["rounds"]
    assert_same_outputs(cold, loaded)
    assert tokens(cold) == tokens(baseline["rounds"][0])
    after_reset, no_reset = result["counters"][1], result["counters"][2]
    host = after_reset["vllm:prefix_cache_hits"] + after_reset["vllm:external_prefix_cache_hits"]
    device = no_reset["vllm:prefix_cache_hits"] + no_reset["vllm:external_prefix_cache_hits"]
    assert after_reset["vllm:external_prefix_cache_hits"] > 0
    assert device > 0 and host >= 0.9 * device, (host, device)


@pytest.fixture(scope="module")
def qwen_baseline(scenarios):
    return scenarios.get("qwen3next:baseline", {**QWEN, "connector": False})


@pytest.fixture(scope="module")
def gemma_tp2_baseline(scenarios):
    """The same two-worker engine without kvscope: one worker sums in another order, and this random
    model's near-tied greedy tokens flip with the CPU's bf16 kernels (on one machine's CPU, the
    90-token prompt that loads nothing)."""
    return scenarios.get("gemma3-tp2:baseline", {**TP2, "connector": False})


def test_mamba_model_loads_state_and_attention_with_equal_outputs(scenarios, qwen_baseline):
    result = scenarios.get("qwen3next", QWEN)
    assert set(result["groups"]) == {"mamba", "full_attention"}
    _assert_equal_and_hits(result, qwen_baseline)
    by_kind = result["kvscope_by_kind"]
    assert by_kind["kvscope_scan_blocks_total"]["mamba"] > 0
    assert by_kind["kvscope_loaded_blocks_total"]["mamba"] > 0
    assert by_kind["kvscope_null_blocks_skipped_total"]["mamba"] > 0  # padding / superseded states


@pytest.mark.parametrize("kind", ["mamba", "full_attention"])
def test_one_wrong_loaded_block_moves_the_outputs(scenarios, qwen_baseline, kind):
    """The control for the test above: one block zeroed just before a load copies it (the first
    load's last block of that group: a request's whole state, for Mamba) moves the outputs past the
    tolerance. Unsharpened, a zeroed state moved a logprob by only 0.02 and parted no token."""
    result = scenarios.get(f"qwen3next-zero-{kind}", {**QWEN, "corrupt_next_load": {"kind": kind, "how": "zero"}})
    cold, loaded, _ = result["rounds"]
    assert tokens(cold) == tokens(qwen_baseline["rounds"][0])
    assert len(result["corrupted_slots"]) == 1
    assert outputs_moved(cold, loaded)


def test_mamba_loads_under_async_scheduling_give_the_outputs_without_the_connector(scenarios):
    """vLLM's default on GPUs: the scheduler plans the next step before this one's outputs are back.
    (Chunked prefill below the Mamba block size is not tested on this model: its chunks then differ
    between a cold run and one resuming from any hit, and vLLM's own device prefix cache flips this
    random model's near-tied greedy tokens there too, by 1e-4 in log-probability.)"""
    kwargs = {"async_scheduling": True}
    result = scenarios.get("qwen3next-async", {**QWEN, "llm_kwargs": kwargs})
    baseline = scenarios.get("qwen3next-async:baseline", {**QWEN, "connector": False, "llm_kwargs": kwargs})
    _assert_equal_and_hits(result, baseline)
    assert result["kvscope_by_kind"]["kvscope_loaded_blocks_total"]["mamba"] > 0


def test_tensor_parallel_two_workers_equal_outputs_and_hits(scenarios, gemma_tp2_baseline):
    result = scenarios.get("gemma3-tp2", TP2)
    _assert_equal_and_hits(result, gemma_tp2_baseline)
    # every worker moves its own shard: bytes count both
    kv = result["kvscope"]
    assert kv["kvscope_load_bytes_total"] > 0


def test_tensor_parallel_two_workers_load_their_shards_of_the_mamba_state(scenarios):
    """Tensor parallelism splits the linear-attention heads, so each worker's Mamba state is its own
    shard and each worker stores and loads it. The baseline is the same two-worker engine without
    kvscope (one worker sums in another order: this random model's near-tied tokens may flip)."""
    tp2 = {**QWEN, "model": "qwen3next-tp2", "llm_kwargs": {"tensor_parallel_size": 2}, "env": TP2["env"]}
    result = scenarios.get("qwen3next-tp2", tp2)
    baseline = scenarios.get("qwen3next-tp2:baseline", {**tp2, "connector": False})
    _assert_equal_and_hits(result, baseline)
    assert result["kvscope_by_kind"]["kvscope_loaded_blocks_total"]["mamba"] > 0


def test_failure_on_one_worker_fails_the_whole_load_and_recomputes(scenarios, gemma_tp2_baseline):
    spec = {**TP2, "env": {**TP2["env"], "KVSCOPE_TEST_FAIL_LOADS_ON_RANK": "1"}}
    result = scenarios.get("gemma3-tp2-rank1-fails", spec)
    assert result["kvscope"]["kvscope_load_failures_total"] > 0
    assert result["kvscope"].get("kvscope_loaded_blocks_total", 0) == 0  # never half-loaded
    # bytes count where they move: rank 0's copies ran (as its copy spans say) though unused
    assert result["kvscope"]["kvscope_load_bytes_total"] > 0
    for round_ in result["rounds"]:
        assert tokens(round_) == tokens(gemma_tp2_baseline["rounds"][0])


def test_a_conversation_turn_loads_mamba_states_from_the_previous_turns_output(scenarios):
    """`mamba_decode_states` true. Turn 2 sends turn 1's prompt, its 300 generated tokens and a new
    message: the Mamba states at the block boundaries of turn 1's output (computed by decode steps)
    load with the attention blocks, so every whole block of turn 1 is a hit (vLLM's own prefix cache
    keeps only the prompt's boundaries). The CPU GDN kernels run in bf16 only, and a state reached by decode steps
    differs from one recomputed by a prefill in the last bits, so greedy tokens of this random
    model (near-uniform logits) may flip at near-ties; the first token's log-probability is within
    bf16 rounding of the baseline's (loading zeros for the states instead moves it by up to 0.09).
    The model's attention is not sharpened here: sharpened, that rounding moved it by 0.035."""
    conversation = {"first_turn_tokens": 300, "new_tokens": 50}
    qwen = {**QWEN, "attention_scale": 1.0, "conversation": conversation, "max_tokens": 4,
            "extra": {"cpu_bytes": 64 << 20, "mamba_decode_states": True}}
    result = scenarios.get("qwen3next-conversation", qwen)
    baseline = scenarios.get("qwen3next-conversation:baseline", {**qwen, "connector": False})
    first, second, _ = result["rounds"]
    assert tokens(first) == tokens(baseline["rounds"][0])
    block = result["offload_block_size"]
    expected = sum((len(p) - conversation["new_tokens"] - 1) // block * block for p in result["prompts"])
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] == expected
    ours, vllm_alone = ([c["num_cached_tokens"] for c in r] for r in (second, baseline["rounds"][1]))
    assert all(a >= b for a, b in zip(ours, vllm_alone)) and sum(ours) > sum(vllm_alone), (ours, vllm_alone)
    for ours, theirs in zip(second, baseline["rounds"][1]):
        assert abs(ours["logprobs"][0] - theirs["logprobs"][0]) <= 0.01


def test_by_default_a_mamba_conversation_turn_gives_the_outputs_without_the_connector(scenarios):
    """`mamba_decode_states` false (the default): turn 2 loads only states a prefill computed (turn 1's prompt's), the
    kind vLLM's own prefix cache keeps, none a decode step left. Its outputs are then those of the same
    engine without kvscope (turn 2 over vLLM's device prefix cache), attention sharpened, which the test
    above cannot ask: there a decode step's state (the recurrent kernel's, one token at a time) parts
    from a prefill's (the chunked kernel's) in bf16."""
    conversation = {"first_turn_tokens": 300, "new_tokens": 50}
    qwen = {**QWEN, "conversation": conversation, "max_tokens": 8}
    result = scenarios.get("qwen3next-conversation-prefill-states", qwen)
    baseline = scenarios.get("qwen3next-conversation-sharp:baseline", {**qwen, "connector": False})
    first, second, _ = result["rounds"]
    assert tokens(first) == tokens(baseline["rounds"][0])
    block = result["offload_block_size"]
    turn1_prompts = [len(p) - conversation["first_turn_tokens"] - conversation["new_tokens"] for p in result["prompts"]]
    hits, vllm_alone = ([c["num_cached_tokens"] for c in r] for r in (second, baseline["rounds"][1]))
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] > 0
    # no further than turn 1's prompts' whole blocks (the replies' states are not stored), and no less
    # than vLLM's own prefix cache (on one machine: 256, 512, 512, 512, 512, 0 against 256, 512, 512,
    # 512, 256, 0; the 512-token prompt's state at its end is witnessed by its last chunk ending there)
    assert all(hit <= prompt // block * block for hit, prompt in zip(hits, turn1_prompts)), (hits, turn1_prompts)
    assert all(ours >= theirs for ours, theirs in zip(hits, vllm_alone)), (hits, vllm_alone)
    assert_same_outputs(second, baseline["rounds"][1])
