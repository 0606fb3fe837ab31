"""Why the host tier missed (`connector/miss_reasons.py`), under vLLM's own scheduler: a small tier evicts
earlier prompts, a reset forgets everything, and the lookups and metrics say so."""

from __future__ import annotations

from collections import Counter

import pytest

from connector.telemetry.metrics import KVScopeStats
from connector.tiny_models import build_model
from tests.compat.model_free import ModelFreeEngine

WINDOW = 64


@pytest.fixture(scope="module")
def model_path() -> str:
    return build_model("gemma3", window=WINDOW)


def _prompts(first: int, n: int = 2) -> list[list[int]]:
    return [[(17 * i + 11 * j + 5) % 509 + 1 for i in range(300)] for j in range(first, first + n)]


def test_lookups_tell_evicted_from_new_and_reset_and_the_metrics_add_up(model_path):
    # 12 offloaded blocks: each 300-token prompt stores 4 per group, so a round of two fills the tier
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 12 * 32768, "block_size": 64}, window=WINDOW)
    sched = engine.scheduler.get_kv_connector()._scheduler
    reasons: dict[str, str] = {}
    stats = KVScopeStats()
    update, take = sched.update_state_after_alloc, sched.take_stats

    def update_recording(request, blocks, num_external_tokens):
        lookup = sched._lookups.get(request.request_id)
        if lookup is not None and request.request_id not in reasons:
            reasons[request.request_id] = lookup.miss.reason
        return update(request, blocks, num_external_tokens)

    def take_accumulating():
        taken = take()
        if taken is not None:
            stats.aggregate(KVScopeStats(data={k: v.copy() if hasattr(v, "copy") else v
                                               for k, v in taken.data.items()}))
        return taken

    sched.update_state_after_alloc, sched.take_stats = update_recording, take_accumulating

    def run(tag: str, prompts) -> None:
        for j, prompt in enumerate(prompts):
            engine.add(f"{tag}-{j}", prompt, 4)
        engine.run()
        engine.reset_device_prefix_cache()  # the next round finds nothing on the device

    try:
        run("a", _prompts(0))  # cold
        run("b", _prompts(2))  # stores evict a's blocks
        run("c", _prompts(0))  # a's prompts again: evicted
        assert sched.index.evicted_total > 0
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        engine.run()
        run("d", _prompts(0))  # stored again by c, then forgotten by the reset
        run("e", _prompts(4))  # never seen
    finally:
        engine.shutdown()
    assert reasons == {"a-0": "new", "a-1": "new", "b-0": "new", "b-1": "new", "c-0": "evicted",
                       "c-1": "evicted", "d-0": "reset", "d-1": "reset", "e-0": "new", "e-1": "new"}, reasons
    data = stats.data
    missed = data["missed_tokens"]
    assert sum(missed.values()) == data["lookup_tokens"] - data.get("hit_tokens", 0)
    # each 300-token prompt: 4 whole 64-token blocks a hit could cover (256 tokens), 44 past them
    assert missed == {"new": 6 * 256, "evicted": 2 * 256, "reset": 2 * 256, "tail": 10 * 44}, missed
    assert Counter(reasons.values()) == {"new": 6, "evicted": 2, "reset": 2}


@pytest.mark.parametrize("with_drafts", [False, True], ids=["plain", "ngram-drafts"])
def test_looked_up_tokens_equal_vllms_queries_when_its_device_hit_ends_inside_a_block(model_path, with_drafts):
    """Hash blocks (16) finer than Mamba blocks (64), vLLM's align mode: `b` extends `a` (366 tokens) and
    hits vLLM's prefix cache up to 352 tokens, inside a block; vLLM asks the connector from 320 (its hit
    rounded down to a block) and, the tier finding nothing past it, keeps its 352. kvscope counts the
    lookup from 352 too, as vLLM counts its queries (fuzz seed 12 of `mamba-spec`: 32 tokens more), and
    the lookup span says so; the missed tokens by reason still add up to the looked-up ones."""
    from connector.telemetry.testing import in_memory_tracing
    from tests.compat.model_free import MambaAlign

    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 256}, window=WINDOW,
                             mamba=MambaAlign(64, 16, retention=None), spec_tokens=2 if with_drafts else 0)
    sched = engine.scheduler.get_kv_connector()._scheduler
    assert sched._device_hits_may_end_mid_block
    sched.tracing, exporter = in_memory_tracing()
    first = [(31 * i + 3) % 509 + 1 for i in range(366)]
    try:
        engine.add("a", first, max_tokens=2)
        engine.run()
        engine.add("b", first + [(17 * i + 5) % 509 + 1 for i in range(15)], max_tokens=2)
        engine.run()
        assert engine.host_tier_leaks() == [] and not sched.lookup_records.unsettled
    finally:
        engine.shutdown()
    data = engine.stats.connector.data
    assert data["lookup_tokens"] == engine.stats.external_queried_tokens == 366 + 381 - 352
    assert sum(data["missed_tokens"].values()) == data["lookup_tokens"] - data.get("hit_tokens", 0)
    lookups = {s.attributes["kvscope.request.id"]: s.attributes for s in exporter.get_finished_spans()
               if s.name == "kvscope.lookup"}
    assert lookups.keys() == {"a", "b"}
    assert (lookups["b"]["kvscope.tokens.local"], lookups["b"]["kvscope.tokens.queried"],
            lookups["b"]["kvscope.tokens.hit"]) == (352, 29, 0)
    assert engine.telemetry_mismatches() == []
