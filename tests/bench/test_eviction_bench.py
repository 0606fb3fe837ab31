"""Smoke test of the eviction benchmark: it runs on a tiny workload with well-formed records, and on a case
where the orderings must differ, evicting a prefix from its tail keeps its head a hit where evicting it
from its head (the old order) strands it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from bench import eviction_bench, run_all  # noqa: E402
from bench.eviction_bench import BLOCK, LAYOUTS, OFFLOAD_BLOCK, ORDERINGS, _request, new_scheduler, serve  # noqa: E402


def test_tiny_run_gives_well_formed_records():
    workload = eviction_bench.make_workload(num_prefixes=12, num_requests=48, seed=3)
    results = eviction_bench.measure_all(workload=workload, capacities=(0.5,), in_flight=(1, 4))
    records = eviction_bench.to_records(results)
    run_all.check_records(records)
    json.dumps(records)
    assert {r["name"] for r in records} == {f"eviction.{o}[{g}/50%/{f}]" for o in ORDERINGS for g in LAYOUTS
                                           for f in (1, 4)}
    for r in records:
        assert 0 < r["median"] <= 100 and run_all.goal_of(r) is None  # a measurement, not a goal
        if r["ratio_of"]:
            old = next(o for o in records if o["name"] == r["ratio_of"])
            assert r["ratio"] == pytest.approx(r["median"] / old["median"])
    assert "tail / head" in eviction_bench.format_table(results)


def _prefix_request(rid: int, prefix: int, blocks: int, suffix_tokens: int):
    tokens = blocks * OFFLOAD_BLOCK
    return _request(rid, prefix, tokens, suffix_tokens, [("p", prefix, i) for i in range(tokens // BLOCK)])


@pytest.mark.parametrize("groups", list(LAYOUTS))
def test_tail_first_keeps_a_loaded_prefix_head_where_head_first_strands_it(groups):
    """A 4-block prefix fills the tier, a second request loads it whole, then one other block is stored:
    head first evicts the prefix's first block (the rest is stranded: nothing hits); tail first, its last."""
    layouts = LAYOUTS[groups]
    hits = {}
    for ordering in ORDERINGS:
        sched = new_scheduler(ordering, layouts, num_slots=4 * len(layouts))
        assert serve(sched, [_prefix_request(0, 0, 4, 1)]) == [0]  # computed and stored: the tier is full
        assert serve(sched, [_prefix_request(1, 0, 4, 1)]) == [4 * OFFLOAD_BLOCK]  # loaded whole
        assert serve(sched, [_prefix_request(2, 1, 1, 1)]) == [0]  # another block stored: one evicted
        hits[ordering] = sched.get_num_new_matched_tokens(_prefix_request(3, 0, 4, 1), 0)[0]
    assert hits == {"tail_first": 3 * OFFLOAD_BLOCK, "head_first": 0}
