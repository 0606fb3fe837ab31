"""The planner traced through the C recorder, beside kvscope's Python tracer and the floor, against the
uninstrumented planner: engine-process CPU and wall time per request, sides alternated in one run.

    python -m bench.c_recorder.measure [--repeats N]

The C side is kvscope's planning path (`KVScopeScheduler.update_state_after_alloc`) with the load's
record (its lookup, the load and each scan: the values and ids of `span_records.LOAD_PLAN`) packed by
`record.c` and written to a pipe every 64 loads, where a helper process (`cat`, standing in for the
export helper) reads it. An experiment: no traceparent parents, no lookup-only or store records, no
sampling below 1.0, no decoding into spans (the export helper would do that in its own process).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench import planner_vs_vllm as pv
from bench.c_recorder.build import REASON_CODES, build
from connector.planning import scan_group
from connector.telemetry.tracing import KVScopeTracing

SIDES = ("bare", "on", "floor", "c")
CASES = ((1, 128), (2, 128), (4, 128), (1, 1024))


class CLookupRecords(pv.FloorLookupRecords):
    """The lookup part of a load's record as references (`CScheduler`)."""

    def span(self, tracing, state, req_id, lookup, queried, hit, miss_reason):
        return lookup, queried, miss_reason


class CScheduler(pv.FloorScheduler):
    """The traced path handing the C recorder references, not values: the lookup, the scans and their
    clock reads (`CTracing.end_load` makes the record)."""

    lookup_records_type = CLookupRecords

    def _scan_groups_traced(self, group_block_ids, local, cached, t0):
        scans, times = [], [t0]
        clock = time.time_ns  # span times are epoch ns; the scan histogram takes the same interval
        for layout, ids, log in zip(self.layouts, group_block_ids, self._scan_log):
            scan = scan_group(layout, ids, local, cached, self.block_size)
            t1 = clock()
            times.append(t1)
            log.append((t1 - t0 if t1 > t0 else 0, scan.blocks_total, scan.null_skipped))
            scans.append(scan)
            t0 = t1
        return scans, (scans, times)


class CTracing(pv.FloorTracing):
    """Tracing whose load records the C recorder packs and writes (`record.c`)."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def end_load(self, parent, start_ns, end_ns, values):
        req_id, local, external, _, (scans, times), (lookup, queried, reason) = values
        return self.recorder.record_load(req_id, local, external, start_ns, end_ns, scans, times, lookup,
                                         queried, reason)

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        self.recorder.flush()
        return True


def measure(recorder, repeats: int, min_sample_s: float = 0.1) -> list[tuple[str, dict, dict]]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    vllm_config = pv._vllm_config()
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    results = []
    for groups, blocks in CASES:
        case = pv.make_case(groups, blocks, hash_fn)
        with tempfile.TemporaryDirectory(prefix="kvscope-c-recorder-") as trace_dir:
            on_tracing = KVScopeTracing.from_config(trace_file=os.path.join(trace_dir, "t.jsonl"), sample_ratio=1.0)
            sides = {
                "bare": pv.KVScopeSide(case, KVScopeTracing.disabled(), pv.UninstrumentedScheduler),
                "on": pv.KVScopeSide(case, on_tracing),
                "floor": pv.KVScopeSide(case, pv.FloorTracing(), pv.FloorScheduler),
                "c": pv.KVScopeSide(case, CTracing(recorder), CScheduler),
            }
            try:
                for name, side in sides.items():  # the same plan on every side
                    side.call(side.prepare(1))
                    if side.planned() != case.expected_block_ids:
                        raise AssertionError(f"{case.name}: side {name} planned other blocks")
                    side.reset()
                bare = sides["bare"]
                number = max(1, min(10000, int(min_sample_s / pv._sample(bare.prepare, bare.call, bare.reset, 20))))
                wall: dict[str, list[float]] = {s: [] for s in SIDES}
                cpu: dict[str, list[float]] = {s: [] for s in SIDES}
                for r in range(repeats):
                    for name in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
                        side = sides[name]
                        w, c = pv._sample_with_cpu(side.prepare, side.call, side.reset, number)
                        wall[name].append(w)
                        cpu[name].append(c)
            finally:
                on_tracing.shutdown()
        results.append((case.name, {s: statistics.median(v) for s, v in wall.items()},
                        {s: statistics.median(v) for s, v in cpu.items()}))
        gc.collect()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvscope-c-recorder-") as build_dir:
        recorder = build(build_dir)  # loaded: the file may go
    reader = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    recorder.configure(reader.stdin.fileno(), REASON_CODES)
    try:
        results = measure(recorder, args.repeats)
    finally:
        recorder.configure(-1, REASON_CODES)
        reader.stdin.close()
        reader.wait()
    print("update_state_after_alloc per request against the uninstrumented planner (bare); "
          "on: kvscope's tracer to a trace file; floor: values as plain tuples; c: the C recorder")
    for name, wall, cpu in results:
        print(f"[{name}] bare {wall['bare'] * 1e6:.2f} µs | engine CPU: on {cpu['on'] / cpu['bare']:.3f} "
              f"floor {cpu['floor'] / cpu['bare']:.3f} c {cpu['c'] / cpu['bare']:.3f} | wall: on "
              f"{wall['on'] / wall['bare']:.3f} floor {wall['floor'] / wall['bare']:.3f} "
              f"c {wall['c'] / wall['bare']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
