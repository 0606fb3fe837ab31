"""Smoke test of the load admission benchmark: real vLLM schedulers with kvscope, load admission on (its
bound capped by vLLM's per-group window cap, and not) and off, serve the same rounds; with room for every
load at once admission changes nothing, under device-KV pressure it defers loads, the cap defers fewer
of long prompts, and the records are well formed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from bench import admission_bench, run_all  # noqa: E402

SHORT, LONG = admission_bench.PROMPT_TOKENS, admission_bench.LONG_PROMPT_TOKENS


def test_admission_defers_only_under_pressure_and_changes_nothing_with_room():
    tight, roomy = admission_bench.measure_all(cases=((2, 600, SHORT), (2, 2100, SHORT)), load_steps=(2,))
    assert tight.deferrals["admission"] > 0 and roomy.deferrals == {"admission": 0, "uncapped": 0}
    for result in tight, roomy:
        for side in admission_bench.SIDES:
            served = result.reload[side]
            assert not served.stalled and len(served.first_token_step) == admission_bench.REQUESTS
    assert roomy.reload["admission"].first_token_step == roomy.reload["unadmitted"].first_token_step
    # deferred loads start later: no request's first token comes sooner than with every load at once
    assert tight.mean_first_token("admission") > tight.mean_first_token("unadmitted")
    records = admission_bench.to_records([tight, roomy])
    run_all.check_records(records)
    json.dumps(records)
    by_name = {r["name"]: r for r in records}
    ratio = by_name["admission.first_token_steps.admission[2g/2100/2048/L2]"]
    assert ratio["ratio"] == 1.0 and ratio["ratio_of"] == "admission.first_token_steps.unadmitted[2g/2100/2048/L2]"
    assert "2g/600/2048/L2" in admission_bench.format_table([tight, roomy])


def test_vllms_window_cap_defers_fewer_loads_of_prompts_longer_than_the_window():
    """6144-token prompts beside a 1024-token window: capped, a request counts 384 + 193 blocks, not 2 x 384."""
    (result,) = admission_bench.measure_all(cases=((2, 4700, LONG),), load_steps=(4,))
    assert result.deferrals == {"admission": 0, "uncapped": 2}
    assert result.mean_first_token("admission") == result.mean_first_token("unadmitted")
    assert result.mean_first_token("uncapped") > result.mean_first_token("admission")


def test_a_round_that_loads_nothing_is_caught(monkeypatch):
    """The reload round must load every prompt from the host tier, or it measures something else."""
    monkeypatch.setattr(admission_bench, "HOST_BYTES", 1 << 16)  # a tier too small to keep a prompt
    with pytest.raises(AssertionError, match="loaded their prompt"):
        admission_bench.measure(2, 2100, requests=2)
