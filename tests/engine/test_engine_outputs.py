"""The connector on the real vLLM CPU engine: loads from the host tier give the model the same KV.

For each model: round 0 runs cold and stores, the device prefix cache is reset, round 1 loads
from the host tier, round 2 runs again without a reset (what the device prefix cache gives).
"""

from __future__ import annotations

import pytest

from .conftest import BLOCK, prompts_sharing_prefixes, requires_cpu_fp8_kv
from .outputs import SHARP_ATTENTION, assert_same_outputs, outputs_moved, tokens

pytestmark = pytest.mark.engine

PROMPTS = prompts_sharing_prefixes()

MODELS = {
    "llama": dict(model="llama", attention_scale=SHARP_ATTENTION),
    "gemma3-w64": dict(model="gemma3", window=64, attention_scale=SHARP_ATTENTION),
    # window not a multiple of the block size, another layer pattern
    "gemma3-w200-sfss": dict(model="gemma3", window=200, attention_scale=SHARP_ATTENTION,
                             layer_types=["sliding_attention", "full_attention",
                                          "sliding_attention", "sliding_attention"]),
    "gptoss-w64": dict(model="gptoss", window=64, attention_scale=SHARP_ATTENTION),
}


def spec_for(name: str, **overrides) -> dict:
    return {**MODELS[name], "prompts": PROMPTS, **overrides}


@pytest.fixture(scope="module", params=list(MODELS))
def model_run(request, scenarios):
    name = request.param
    return name, scenarios.get(name, spec_for(name)), scenarios.get(name + ":baseline", spec_for(name, connector=False))


def test_groups_are_what_the_model_has(model_run):
    name, result, _ = model_run
    expected = {"full_attention"} if name == "llama" else {"full_attention", "sliding_window"}
    assert set(result["groups"]) == expected


def test_loaded_round_equals_cold_round_and_no_connector(model_run):
    name, result, baseline = model_run
    cold, loaded, _ = result["rounds"]
    assert all(c["tokens"] for c in cold)
    assert_same_outputs(cold, loaded)
    assert tokens(cold) == tokens(baseline["rounds"][0])


@pytest.mark.parametrize("name,kind,how", [
    ("gemma3-w64", "full_attention", "zero"), ("gemma3-w64", "sliding_window", "zero"),
    ("llama", "full_attention", "zero"), ("gptoss-w64", "sliding_window", "zero"),
    # the right KV at the wrong place: (rotary) positions are in the cached keys
    ("gemma3-w64", "full_attention", "swap"), ("llama", "full_attention", "swap"),
])
def test_one_wrong_loaded_block_moves_the_outputs(scenarios, name, kind, how):
    """The control for the test above: one host block of one group zeroed, or two swapped, just before a
    load copies them (that group's first load's last blocks) moves what the model computes past the
    tolerance: a single wrong block is enough to fail the equality above."""
    result = scenarios.get(f"{name}-{how}-{kind}", spec_for(name, corrupt_next_load={"kind": kind, "how": how}))
    cold, loaded, _ = result["rounds"]
    assert len(result["corrupted_slots"]) == (1 if how == "zero" else 2)
    assert outputs_moved(cold, loaded)


def test_the_runner_announces_every_step_before_binding_it(model_run):
    """The store fence that CUDA places at the next step's start under vLLM's V1 model runner (the
    CPU engine's): vLLM's own runner calls handle_preemptions before binding every step that
    follows stores, so the worker never had to fall back to fencing at once."""
    _, result, _ = model_run
    assert result["fence"]["fenced_at_step_start"] > 0 and result["fence"]["kept"]


def test_round_after_reset_really_loads_from_host_tier(model_run):
    _, result, _ = model_run
    loaded = result["counters"][1]
    assert loaded["vllm:external_prefix_cache_hits"] > 0
    assert result["kvscope"]["kvscope_hit_tokens_total"] == loaded["vllm:external_prefix_cache_hits"] + result["counters"][0]["vllm:external_prefix_cache_hits"] + result["counters"][2]["vllm:external_prefix_cache_hits"]


def test_hits_after_reset_cover_90_percent_of_device_prefix_cache(model_run):
    _, result, _ = model_run
    after_reset = result["counters"][1]
    no_reset = result["counters"][2]
    host = after_reset["vllm:prefix_cache_hits"] + after_reset["vllm:external_prefix_cache_hits"]
    device = no_reset["vllm:prefix_cache_hits"] + no_reset["vllm:external_prefix_cache_hits"]
    assert device > 0
    assert host >= 0.9 * device, (host, device)


def test_offload_blocks_of_two_device_blocks(scenarios):
    """block_size = 2 x the device block: loads address sub-blocks of host slots."""
    result = scenarios.get("gemma3-w64-b256", spec_for("gemma3-w64", extra={"cpu_bytes": 64 << 20, "block_size": 256}))
    baseline = scenarios.get("gemma3-w64:baseline", spec_for("gemma3-w64", connector=False))
    assert result["offload_block_size"] == 256 and result["block_sizes"] == [128, 128]
    for round_ in result["rounds"]:
        assert tokens(round_) == tokens(baseline["rounds"][0])
    # every hit is whole 256-token blocks, leaving at least one token to compute
    expected = sum((len(p) - 1) // 256 * 256 for p in PROMPTS)
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] == expected


def test_inside_vllms_multi_connector_loads_give_the_same_outputs(scenarios):
    """kvscope as a child of vLLM's MultiConnector (how it is combined with other connectors): its
    lookups, loads, stores, stats and store fence all reach it through MultiConnector's forwarding."""
    result = scenarios.get("gemma3-w64-multi", spec_for("gemma3-w64", multi_connector=True))
    baseline = scenarios.get("gemma3-w64:baseline", spec_for("gemma3-w64", connector=False))
    cold, loaded, _ = result["rounds"]
    assert tokens(cold) == tokens(baseline["rounds"][0])
    assert_same_outputs(cold, loaded)
    external = sum(c["vllm:external_prefix_cache_hits"] for c in result["counters"])
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] > 0
    assert result["kvscope"]["kvscope_hit_tokens_total"] == external
    assert result["kvscope"]["kvscope_store_bytes_total"] > 0 and set(result["groups"]) == {"full_attention",
                                                                                         "sliding_window"}
    assert result["fence"]["fenced_at_step_start"] > 0 and result["fence"]["kept"]


ENGINE_SETTINGS = {
    # vLLM's default on GPUs: the scheduler plans the next step before this one's outputs are back
    "async-scheduling": {"async_scheduling": True},
    # chunked prefill in 128-token chunks: a load, then the rest of the prompt over several steps
    "chunks-of-128": {"max_num_batched_tokens": 128},
}


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_loads_under_common_engine_settings_give_the_outputs_without_the_connector(scenarios, setting):
    kwargs = ENGINE_SETTINGS[setting]
    result = scenarios.get(f"gemma3-w64-{setting}", spec_for("gemma3-w64", llm_kwargs=kwargs))
    baseline = scenarios.get(f"gemma3-w64-{setting}:baseline", spec_for("gemma3-w64", connector=False,
                                                                           llm_kwargs=kwargs))
    cold, loaded, cached = result["rounds"]
    assert_same_outputs(cold, loaded)
    assert tokens(cold) == tokens(cached) == tokens(baseline["rounds"][0])
    hits = [c["vllm:external_prefix_cache_hits"] for c in result["counters"]]
    # after the reset the host tier serves what the device prefix cache serves without one
    after_reset, no_reset = result["counters"][1], result["counters"][2]
    device = no_reset["vllm:prefix_cache_hits"] + no_reset["vllm:external_prefix_cache_hits"]
    assert hits[1] > 0 and hits[1] + after_reset["vllm:prefix_cache_hits"] >= 0.9 * device > 0
    assert result["kvscope"]["kvscope_hit_tokens_total"] == sum(hits)


def test_parallel_samples_load_and_sample_what_they_sample_without_the_connector(scenarios):
    """`n` > 1 (the OpenAI API's `n`): vLLM runs a child request per sample over the same prompt.
    After the reset children load the prompt's blocks from the host tier (siblings scheduled in the
    same step have no device KV to share yet), and with a fixed seed every sample is what the same
    engine samples without kvscope, in every round."""
    result = scenarios.get("gemma3-w64-n3", spec_for("gemma3-w64", n=3))
    baseline = scenarios.get("gemma3-w64-n3:baseline", spec_for("gemma3-w64", connector=False, n=3))
    cold, loaded, cached = result["rounds"]
    assert len(cold) == 3 * len(PROMPTS)
    assert_same_outputs(cold, loaded)
    assert tokens(cold) == tokens(cached) == tokens(baseline["rounds"][0])
    assert len({tuple(c["tokens"]) for c in cold[:3]}) > 1  # sampled: a prompt's children differ
    hits = [c["vllm:external_prefix_cache_hits"] for c in result["counters"]]
    # more than one child of a prompt loaded: more than one load's worth of the prompts' blocks
    one_each = sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
    assert hits[1] > one_each
    assert result["kvscope"]["kvscope_hit_tokens_total"] == sum(hits)


FP8 = {"kv_cache_dtype": "fp8"}


@requires_cpu_fp8_kv
def test_an_fp8_kv_cache_loads_what_it_stored_in_half_the_host_bytes(scenarios):
    """`--kv-cache-dtype fp8`, common on GPUs: a KV element is one byte, so a host slot is half a
    bfloat16 one, and loads still give the model the KV it stored (greedy outputs and logprobs of
    the loaded round equal the cold round's and those of the same fp8 engine without kvscope)."""
    result = scenarios.get("gemma3-w64-fp8", spec_for("gemma3-w64", llm_kwargs=FP8))
    baseline = scenarios.get("gemma3-w64-fp8:baseline", spec_for("gemma3-w64", connector=False, llm_kwargs=FP8))
    bf16 = scenarios.get("gemma3-w64", spec_for("gemma3-w64"))
    assert result["slot_bytes"] * 2 == bf16["slot_bytes"]
    cold, loaded, _ = result["rounds"]
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] > 0
    assert_same_outputs(cold, loaded)
    assert tokens(cold) == tokens(baseline["rounds"][0])
    # fp8 is in effect: the model computes something else than with bfloat16 KV
    assert [c["logprobs"] for c in cold] != [c["logprobs"] for c in bf16["rounds"][0]]


@requires_cpu_fp8_kv
def test_one_wrong_loaded_fp8_block_moves_the_outputs(scenarios):
    """The control for the test above: one full-attention fp8 block zeroed just before a load copies
    it moves what the model computes past the tolerance."""
    result = scenarios.get("gemma3-w64-fp8-zero-one", spec_for(
        "gemma3-w64", llm_kwargs=FP8, corrupt_next_load={"kind": "full_attention", "how": "zero"}))
    cold, loaded, _ = result["rounds"]
    assert len(result["corrupted_slots"]) == 1
    assert outputs_moved(cold, loaded)


def test_a_conversation_turn_loads_the_previous_turns_output(scenarios):
    """Turn 2 sends turn 1's prompt, its 300 generated tokens and a new message. With offloaded
    blocks of two device blocks (256 tokens) and a 64-token window, the window drops a block's first
    device block before the block's last token is sampled, so the blocks of turn 1's output are
    stored before their key exists (`piecewise_stores.Filling`). Every whole block turn 1 computed loads, and turn 2's
    greedy outputs equal an engine's without the connector that kept turn 1 in its device prefix cache."""
    conversation = {"first_turn_tokens": 300, "new_tokens": 50}
    result = scenarios.get("gemma3-w64-b256-conversation", spec_for(
        "gemma3-w64", extra={"cpu_bytes": 64 << 20, "block_size": 256}, conversation=conversation))
    baseline = scenarios.get("gemma3-w64-conversation:baseline", spec_for(
        "gemma3-w64", connector=False, conversation=conversation))
    first, second, _ = result["rounds"]
    assert tokens(first) == tokens(baseline["rounds"][0])
    assert all(len(c["tokens"]) == 300 for c in first)
    # turn 1's tokens but the last sampled one, whose KV no forward computed, in whole blocks
    expected = sum((len(p) - conversation["new_tokens"] - 1) // 256 * 256 for p in result["prompts"])
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] == expected
    assert_same_outputs(second, baseline["rounds"][1])
    # the V1 runner saves after the draft model here (in sample_tokens): still before the next step
    assert result["fence"]["fenced_at_step_start"] > 0 and result["fence"]["kept"]


def test_a_conversation_under_speculative_decoding(scenarios):
    """The same conversation with n-gram speculative decoding: steps carry draft tokens that vLLM
    may reject, and only verified tokens' blocks may be stored (ahead of their key, in the window
    group). Turn 2 still hits every whole block of turn 1, with the outputs of an engine without
    the connector (speculating alike)."""
    conversation = {"first_turn_tokens": 300, "new_tokens": 50}
    speculative = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
    result = scenarios.get("gemma3-w64-b256-conversation-ngram", spec_for(
        "gemma3-w64", extra={"cpu_bytes": 64 << 20, "block_size": 256}, conversation=conversation,
        llm_kwargs=speculative))
    baseline = scenarios.get("gemma3-w64-conversation-ngram:baseline", spec_for(
        "gemma3-w64", connector=False, conversation=conversation, llm_kwargs=speculative))
    first, second, _ = result["rounds"]
    turn1 = result["counters"][0]
    assert turn1["vllm:spec_decode_num_draft_tokens"] > turn1["vllm:spec_decode_num_accepted_tokens"] > 0
    assert tokens(first) == tokens(baseline["rounds"][0])
    expected = sum((len(p) - conversation["new_tokens"] - 1) // 256 * 256 for p in result["prompts"])
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] == expected
    assert tokens(second) == tokens(baseline["rounds"][1])
    # the V1 runner saves after the draft model here (in sample_tokens): still before the next step
    assert result["fence"]["fenced_at_step_start"] > 0 and result["fence"]["kept"]


def test_the_host_tier_serves_an_engine_with_its_prefix_cache_off(scenarios):
    """`--no-enable-prefix-caching`: vLLM still hashes blocks for the connector, so the host tier is
    the only prefix cache: every round after the first loads from it, with the same outputs."""
    result = scenarios.get("gemma3-w64-no-prefix-cache",
                           spec_for("gemma3-w64", llm_kwargs={"enable_prefix_caching": False}))
    baseline = scenarios.get("gemma3-w64:baseline", spec_for("gemma3-w64", connector=False))
    for round_ in result["rounds"]:
        assert tokens(round_) == tokens(baseline["rounds"][0])
    for counters in result["counters"][1:]:  # no reset needed: nothing is cached on the device
        assert counters["vllm:prefix_cache_queries"] == 0
        assert counters["vllm:external_prefix_cache_hits"] > 0
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] == result["counters"][2]["vllm:external_prefix_cache_hits"]
