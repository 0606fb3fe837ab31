"""Smoke test of the finish benchmark: it runs on tiny cases with well-formed records, both sides mark
the same keys, and the reference loop leaves the tier in the order `_touch_prefix` does."""

from __future__ import annotations

import json

import pytest

from bench import finish_bench, run_all
from bench.finish_bench import MIXES, Case, _scheduler_holding_the_prefix, reference_touch


def test_tiny_run_gives_well_formed_records():
    results = finish_bench.measure_all(quick=True, sizes=((1024, 16), (2048, 64)), repeats=1)
    records = finish_bench.to_records(results)
    run_all.check_records(records)
    json.dumps(records)
    cases = {f"{mix}/{tokens // 1024}k/B{block}" for mix in MIXES for tokens, block in ((1024, 16), (2048, 64))}
    assert {r["name"] for r in records} == ({f"finish.touch_prefix[{c}]" for c in cases}
                                            | {f"finish.reference_loop[{c}]" for c in cases})
    by_name = {r["name"]: r for r in records}
    for r in records:
        assert r["median"] > 0 and run_all.goal_of(r) is None  # a measurement, not a goal
        if r["ratio_of"]:
            assert r["ratio"] == pytest.approx(r["median"] / by_name[r["ratio_of"]]["median"])
    assert "_touch_prefix ms" in finish_bench.format_table(results)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_the_reference_leaves_the_tier_in_the_order_touch_prefix_does(mix):
    orders = []
    for touch in (lambda s, h: s._touch_prefix(h, []), lambda s, h: reference_touch(s, h, [])):
        sched, hashes = _scheduler_holding_the_prefix(Case(mix, 4096, 16))
        sched.index.touch([(0, hashes[5]), (0, hashes[-1])])  # an order of its own first
        touch(sched, hashes[:100])  # a request that used part of it
        orders.append(list(sched.index._entries))
    assert orders[0] == orders[1]
    assert orders[0][-1][1] == hashes[0]  # the head last: evicted after the rest
