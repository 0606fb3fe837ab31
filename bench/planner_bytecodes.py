"""Telemetry's cost on the planning thread, counted: Python bytecodes executed per load.

    python -m bench.planner_bytecodes [--quick]

`planner_vs_vllm` times the same planner with tracing off and on; on a shared two-core machine
its ratios swing by ±10% from run to run, as much as the 15% goal they are checked against. A
count does not swing: this runs each side of `planner_vs_vllm` (the same `KVScopeSide`s, cases
and requests) with CPython's opcode tracing on the planning thread, and counts the bytecodes
that `update_state_after_alloc` executes per request, by function. Same code, same inputs, same
count (up to which thread wins the span batcher's export lock, a few bytecodes a batch).

What it does not see: time spent in C (the record's `marshal`, the pipe's writes, id draws),
and that the tracer's bytecodes are slower than the planner's (run once per load, cold, where
the planner's scan loop is hot). At 1g/128, 2026-12-03: the traced path ran 14.7% more bytecodes
than the uninstrumented planner, callgrind counted 16.4% more machine instructions, and the
engine's CPU time read 1.36x.

Sides (`planner_vs_vllm`): `kvscope_bare` (the reference), `kvscope_off`, `kvscope_on_floor` (a
bound: the traced path's values kept as plain tuples), `kvscope_on_noexport` (spans recorded and
queued, batches dropped), `kvscope_on` (a trace file behind the export helper, sample ratio 1.0).
`run(quick)` returns {name, median, unit, ratio, ratio_of} records: bytecodes per request, and
each side's count against the uninstrumented planner's.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import planner_vs_vllm as pv  # noqa: E402
from bench.table import render_table  # noqa: E402
from connector.telemetry.tracing import _HELPER_BATCH_SIZE, KVScopeTracing  # noqa: E402

SIDES = ("kvscope_bare", "kvscope_off", "kvscope_on_floor", "kvscope_on_noexport", "kvscope_on")
REQUESTS = _HELPER_BATCH_SIZE  # one whole span batch: the traced sides hand it over once
SIZES = (128, 1024)  # the count per block is the scan loop's, the same at any size

Function = tuple[str, str]  # (file name, function name)


@dataclass
class Result:
    case_name: str
    per_request: dict[str, float]  # side -> bytecodes per request
    by_function: dict[str, dict[Function, float]]  # side -> function -> bytecodes per request


def count_bytecodes(run, *args) -> collections.Counter:
    """The bytecodes `run(*args)` executes on this thread, by (file, function)."""
    counts: collections.Counter = collections.Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[(os.path.basename(code.co_filename), code.co_name)] += 1
        return tracer

    sys.settrace(tracer)
    try:
        run(*args)
    finally:
        sys.settrace(None)
    return counts


def _sides(case, trace_dir: str) -> dict[str, pv.KVScopeSide]:
    on = KVScopeTracing.from_config(trace_file=os.path.join(trace_dir, "planner-bytecodes.jsonl"), sample_ratio=1.0)
    return {
        "kvscope_bare": pv.KVScopeSide(case, KVScopeTracing.disabled(), pv.UninstrumentedScheduler),
        "kvscope_off": pv.KVScopeSide(case, KVScopeTracing.disabled()),
        "kvscope_on_floor": pv.KVScopeSide(case, pv.FloorTracing(), pv.FloorScheduler),
        "kvscope_on_noexport": pv.KVScopeSide(case, pv.no_export_tracing()),
        "kvscope_on": pv.KVScopeSide(case, on),
    }


def measure(case, trace_dir: str, requests: int = REQUESTS) -> Result:
    sides = _sides(case, trace_dir)
    per_request, by_function = {}, {}
    try:
        for name, side in sides.items():
            for warm in (True, False):  # the first call of each path builds caches (types, the helper)
                reqs = side.prepare(requests)
                planned_before = len(side.sched._pending_loads)
                counts = count_bytecodes(_plan_loads, side, reqs)
                if len(side.sched._pending_loads) - planned_before != requests:
                    raise AssertionError(f"{case.name}: {name} planned "
                                         f"{len(side.sched._pending_loads) - planned_before} loads of {requests}")
                side.reset()
            per_request[name] = sum(counts.values()) / requests
            by_function[name] = {f: n / requests for f, n in counts.items()}
    finally:
        for side in sides.values():
            side.tracing.shutdown()
    return Result(case.name, per_request, by_function)


def _plan_loads(side: pv.KVScopeSide, reqs: list) -> None:
    """`KVScopeSide.call` without its flush: the planning thread's own work per load."""
    update, blocks, external = side.sched.update_state_after_alloc, side.case.kv_blocks, side.case.external
    for req in reqs:
        update(req, blocks, external)


def measure_all(quick: bool, sizes=None, groups=None, requests: int = REQUESTS) -> list[Result]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    hash_fn = get_hash_fn_by_name(pv._vllm_config().cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvscope-planner-bytecodes-") as trace_dir:
        for num_groups in groups or sorted(pv.GROUP_MIXES):
            for blocks in sizes or SIZES:
                results.append(measure(pv.make_case(num_groups, blocks, hash_fn), trace_dir, requests))
    return results


def to_records(results: list[Result]) -> list[dict]:
    """{name, median, unit, ratio, ratio_of}: bytecodes per request; kvscope's sides against the
    uninstrumented planner (`kvscope_bare`)."""
    records = []
    for r in results:
        for side in SIDES:
            reference = None if side == "kvscope_bare" else "kvscope_bare"
            records.append({
                "name": f"planner_bytecodes.{side}[{r.case_name}]",
                "median": r.per_request[side],
                "unit": "bytecodes",
                "ratio": r.per_request[side] / r.per_request[reference] if reference else None,
                "ratio_of": f"planner_bytecodes.{reference}[{r.case_name}]" if reference else None,
            })
    return records


def run(quick: bool = False) -> list[dict]:
    return to_records(measure_all(quick))


def extra_by_function(result: Result, side: str, reference: str = "kvscope_bare",
                      top: int = 12) -> list[tuple[Function, float]]:
    """The functions whose bytecodes per request differ most between `side` and `reference`."""
    a, b = result.by_function[reference], result.by_function[side]
    diff = {f: b.get(f, 0.0) - a.get(f, 0.0) for f in set(a) | set(b)}
    return sorted(((f, d) for f, d in diff.items() if abs(d) >= 0.5), key=lambda fd: -abs(fd[1]))[:top]


def format_table(results: list[Result]) -> str:
    bare = "kvscope_bare"
    rows = [("case", "bare", *(f"{s.removeprefix('kvscope_')}/bare" for s in SIDES[1:]))]
    for r in results:
        n = r.per_request
        rows.append((r.case_name, f"{n[bare]:.0f}", *(f"{n[s] / n[bare]:.3f}" for s in SIDES[1:])))
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same as without (counts need no repeats)")
    args = parser.parse_args(argv)
    results = measure_all(args.quick)
    print("Python bytecodes per update_state_after_alloc on the planning thread (bare: the uninstrumented "
          "planner); case = groups/device blocks per group")
    print(format_table(results))
    for r in results:
        print(f"\n{r.case_name}: where kvscope_on's extra bytecodes run (per request, against bare)")
        print(render_table([("file", "function", "bytecodes")]
                           + [(f[0], f[1], f"{d:+.1f}") for f, d in extra_by_function(r, "kvscope_on")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
