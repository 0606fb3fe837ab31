"""Smoke test of the scheduler step benchmark: real vLLM schedulers with no connector, vLLM's
OffloadingConnector and kvscope serve the same tiny rounds; both connectors store every prompt and
load it back in the reload round (the benchmark asserts it), and the records are well formed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from bench import run_all, step_bench  # noqa: E402


def test_tiny_run_gives_well_formed_records():
    results = step_bench.measure_all(groups=(1, 2), requests=(3,), rounds=1)
    records = step_bench.to_records(results)
    run_all.check_records(records)
    json.dumps(records)
    names = {r["name"] for r in records}
    for workload in step_bench.WORKLOADS:
        for case in ("1g/3", "2g/3"):
            assert {f"step.{workload}.{side}[{case}]" for side in step_bench.SIDES} <= names
    by_name = {r["name"]: r for r in records}
    for r in records:
        assert r["median"] > 0 and run_all.goal_of(r) is None  # a measurement, not a goal
        if r["ratio_of"]:
            assert r["ratio"] == pytest.approx(r["median"] / by_name[r["ratio_of"]]["median"])
    assert "kvscope_off / vllm" in step_bench.format_table(results)


def test_a_connector_that_loads_nothing_is_caught(monkeypatch):
    """The reload round must load every prompt from the host tier: a side that recomputes instead
    would be timed on other work, so the benchmark refuses it."""
    monkeypatch.setattr(step_bench, "HOST_BYTES", 1 << 16)  # a tier too small to keep a prompt
    with pytest.raises(AssertionError, match="loaded their prompt"):
        step_bench.measure(1, 2, rounds=0)
