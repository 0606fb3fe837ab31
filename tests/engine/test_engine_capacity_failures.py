"""Host-tier capacity and failed loads on the real engine: never wrong KV, never a crash."""

from __future__ import annotations

import pytest

from .conftest import prompts_sharing_prefixes
from .outputs import SHARP_ATTENTION, tokens

pytestmark = pytest.mark.engine

PROMPTS = prompts_sharing_prefixes()
GEMMA = dict(model="gemma3", window=64, attention_scale=SHARP_ATTENTION, prompts=PROMPTS)
# One slot of this gemma3 holds 2 layers x 32 KiB; 24 slots hold far less than the workload.
SMALL_HOST = {"cpu_bytes": 24 * 2 * 32768}


@pytest.fixture(scope="module")
def baseline(scenarios):
    return scenarios.get("gemma3-w64:baseline", {**GEMMA, "connector": False})


def test_workload_larger_than_cpu_bytes_evicts_and_stays_within_capacity(scenarios, baseline):
    result = scenarios.get("gemma3-small-host", {**GEMMA, "extra": SMALL_HOST})
    host, kv = result["host"], result["kvscope"]
    assert host["evicted"] > 0
    assert host["used_slots"] <= host["num_slots"] == 24
    assert kv["kvscope_evicted_blocks_total"] == host["evicted"]
    assert kv["kvscope_host_used_bytes"] <= kv["kvscope_host_capacity_bytes"] <= SMALL_HOST["cpu_bytes"]
    # what the tier did not serve adds up (its evictions here took no block a later hit needed: the
    # evicted reason is shown under vLLM's scheduler in tests/compat/test_miss_reasons.py)
    missed = result["kvscope_by_reason"]["kvscope_missed_tokens_total"]
    assert missed["new"] > 0, missed
    assert sum(missed.values()) == kv["kvscope_lookup_tokens_total"] - kv["kvscope_hit_tokens_total"]
    for round_ in result["rounds"]:
        assert tokens(round_) == tokens(baseline["rounds"][0])


def test_host_blocks_dropped_after_lookup_are_recomputed_and_counted(scenarios, baseline):
    result = scenarios.get("gemma3-dropped", {**GEMMA, "drop_host_blocks": True})
    assert result["kvscope"]["kvscope_load_failures_total"] > 0
    # vLLM still counted the planned external hits, then recomputed them
    assert result["counters"][1]["vllm:external_prefix_cache_hits"] > 0
    # looked up again after the failure, they recompute: the blocks the failed loads read count as
    # dropped (load_failed counts only what the tier still held), not as new
    missed = result["kvscope_by_reason"]["kvscope_missed_tokens_total"]
    assert missed["dropped"] > 0, missed
    for round_ in result["rounds"]:
        assert tokens(round_) == tokens(baseline["rounds"][0])


@pytest.mark.parametrize("extra, expected", [
    ({"cpu_bytes": 0}, "kv_connector_extra_config.cpu_bytes=0 is not accepted"),
    ({"cpu_bytes": 1 << 20, "block_size": 100}, "must be a multiple of every KV group's device block size"),
    ({"cpu_bytes": 1 << 20, "colour": "red"}, "unknown key(s) colour='red'"),
])
def test_bad_extra_config_stops_engine_start_with_a_clear_message(extra, expected):
    from .conftest import run_scenario_process

    proc = run_scenario_process({**GEMMA, "prompts": PROMPTS[:1], "extra": extra}, timeout=300)
    assert proc.returncode != 0
    assert expected in proc.stderr
