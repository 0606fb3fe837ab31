"""A telemetry call that raises inside one of vLLM's connector hooks costs a span or a stat, never the
engine, a transfer, or a host slot: vLLM's own scheduler drives the connector (`ModelFreeEngine`, whose
forwards check every KV block they read) while one recording call raises once.

The export path catches its own failures; these faults stand for a bug in recording itself. Before,
each of them escaped vLLM's `schedule` or `update_from_output` (killing the engine core) and left
pinned host entries or jobs no worker ever got.
"""

from __future__ import annotations

import pytest

from connector.telemetry.span_records import STORE_SPAN
from connector.tiny_models import build_model
from tests.compat.model_free import ModelFreeEngine

WINDOW = 64


class InjectedFault(RuntimeError):
    pass


def _raising_once(original, at: int = 1):
    """``original``, raising at its ``at``-th call only."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) == at:
            raise InjectedFault("injected telemetry fault")
        return original(*args, **kwargs)

    wrapped.calls = calls
    return wrapped


def _raising_on_store_span(original):
    calls = []

    def end_span(kind, *args):
        if kind is STORE_SPAN:
            calls.append(args)
            if len(calls) == 1:
                raise InjectedFault("injected telemetry fault")
        return original(kind, *args)

    end_span.calls = calls
    return end_span


# (side, object the fault goes on ("": the side's own object), its attribute, wrapper)
FAULTS = {
    "lookup span": ("scheduler", "lookup_records", "span", _raising_once),
    "load span": ("scheduler", "tracing", "end_load", _raising_once),
    "store span": ("scheduler", "tracing", "end_span", _raising_on_store_span),
    "scheduler end of step": ("scheduler", "tracing", "end_step", _raising_once),
    "job report stats": ("scheduler", "_stats", "record_request_load", _raising_once),
    # part way through a step's lookups: the ones recorded before must not be counted again
    "lookup stats": ("scheduler", "_stats", "record_lookup", lambda original: _raising_once(original, at=2)),
    "scheduler lost span count": ("scheduler", "tracing", "take_lost_records", _raising_once),
    "worker end of step": ("worker", "tracing", "end_step", _raising_once),
    "worker lost span count": ("worker", "tracing", "take_lost_records", _raising_once),
    "copy span": ("worker", "tracing", "record", _raising_once),
    "copy spans' parent": ("worker", "tracing", "parent_from_carrier", _raising_once),
}
# Span records each fault loses, counted in kvscope_dropped_trace_records_total{reason="record_failed"}
# (a job's copy spans without their parent: one per group it copied, 1 or 2 here)
RECORDS_LOST = {"lookup span": {1}, "load span": {1}, "store span": {1}, "copy span": {1}, "copy spans' parent": {1, 2}}


@pytest.fixture(scope="module")
def model_path() -> str:
    return build_model("gemma3", window=WINDOW)


def _prompts() -> list[list[int]]:
    shared = [(31 * i + 3) % 509 + 1 for i in range(300)]
    return [shared + [(17 * i + 11 * j + 5) % 509 + 1 for i in range(150 + 97 * j)] for j in range(4)]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_telemetry_fault_in_a_hook_costs_telemetry_only(model_path, tmp_path, monkeypatch, caplog, fault):
    from connector.telemetry import failures

    monkeypatch.setattr(failures, "_logged", set())  # logged once per place and process: this test's to see
    monkeypatch.setenv("KVSCOPE_TRACE_EXPORT", "thread")
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 32,
                                          "trace_file": str(tmp_path / "t.jsonl")}, window=WINDOW)
    side, owner, attribute, wrap = FAULTS[fault]
    try:
        if side == "scheduler":
            scheduler = engine.scheduler.get_kv_connector()._scheduler
            target = getattr(scheduler, owner) if owner else scheduler
        else:
            target = getattr(engine.workers[0]._worker, owner)
        prompts = _prompts()
        for j, prompt in enumerate(prompts):  # round 0 stores, round 1 loads what it stored
            engine.add(f"r0-{j}", prompt, 2)
        engine.run()
        engine.reset_device_prefix_cache()
        faulty = wrap(getattr(target, attribute))
        monkeypatch.setattr(target, attribute, faulty)
        for j, prompt in enumerate(prompts):  # a turn further: loads the prefix, stores the rest
            engine.add(f"r1-{j}", prompt + [(13 * i + j) % 509 + 1 for i in range(96)], 2)
        engine.run()  # the fault does not escape vLLM's schedule / update_from_output
        assert faulty.calls, f"the fault at {fault} was never reached"
        assert engine.host_tier_leaks() == []
        assert engine.stats.external_hit_tokens > 0 and engine.stats.checked_loaded_blocks > 0
        assert not engine.stats.violations
        assert "kvscope: telemetry failed in" in caplog.text and "injected telemetry fault" in caplog.text
        counted = engine.stats.connector.data if engine.stats.connector is not None else {}
        assert counted.get("hit_tokens", 0) <= engine.stats.external_hit_tokens  # a step's stats lost, none twice
        lost = counted.get("dropped_trace_records", {})
        assert lost.get("record_failed", 0) in RECORDS_LOST.get(fault, {0}), lost
    finally:
        engine.shutdown()


def test_a_worker_shutdown_that_fails_still_exports_the_queued_spans(model_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVSCOPE_TRACE_EXPORT", "thread")
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 32,
                                          "trace_file": str(tmp_path / "t.jsonl")}, window=WINDOW)
    connector = engine.workers[0]
    shut = []
    monkeypatch.setattr(connector._worker, "shutdown", lambda: (_ for _ in ()).throw(InjectedFault("unregister")))
    monkeypatch.setattr(connector.tracing, "shutdown", lambda: shut.append(True))
    connector.shutdown()  # does not raise into vLLM's worker shutdown
    assert shut == [True] and "the worker's shutdown failed" in caplog.text
    monkeypatch.undo()
    engine.shutdown()


def test_a_fault_in_the_host_tiers_bookkeeping_is_not_taken_for_telemetry(model_path, monkeypatch):
    """Only recording is guarded: a bug that leaves the tier's pins inconsistent must surface, not be
    logged once as lost telemetry while slots stay pinned for good."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 32}, window=WINDOW)
    try:
        prompts = _prompts()
        for j, prompt in enumerate(prompts):
            engine.add(f"r0-{j}", prompt, 2)
        engine.run()
        engine.reset_device_prefix_cache()
        index = engine.scheduler.get_kv_connector()._scheduler.index
        monkeypatch.setattr(index, "unpin", _raising_once(index.unpin))
        for j, prompt in enumerate(prompts):
            engine.add(f"r1-{j}", prompt, 2)
        with pytest.raises(InjectedFault):
            engine.run()
    finally:
        monkeypatch.undo()
        engine.shutdown()
